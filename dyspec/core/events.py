"""Events of a generation: plain data, emitted to hooks and yielded by `dyspec.stream`.

Views (widgets, the app, the bench report) are built from these alone, never from the engine.
Token texts are included so that a view needs no tokenizer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TreeExpanded:
    """Nodes added to this step's tree by one expansion (one batched draft forward or one pick),
    in growth order, so a view can replay how the tree grew. Node ids index the step's tree."""

    step: int
    node_ids: list[int]
    parents: list[int]
    tokens: list[int]
    texts: list[str]  # each token alone; one that holds part of a character as its bytes, <e4 bd>
    draft_probs: list[float]
    values: list[float]  # cumulative path value: product of draft probabilities from the root


@dataclass
class StepVerified:
    """One target forward: the whole tree, what the target thought of it, what was accepted."""

    step: int
    tokens: list[int]  # node 0 is the root (the last committed token)
    texts: list[str]  # as TreeExpanded's
    parents: list[int]
    depths: list[int]
    draft_probs: list[float]
    values: list[float]
    target_probs: list[float]  # target probability of each node's token after its parent (T = 1 when T = 0)
    accepted: list[int]  # accepted node ids along one root path
    emitted: list[int]  # tokens committed this step: the accepted ones, then `next_token`
    emitted_texts: list[str]  # the text each adds: a character split over tokens comes whole with its last
    next_token: int  # the bonus token (at a leaf) or the correction after a rejection
    draft_s: float  # time in draft forwards
    target_s: float  # the target forward
    overhead_s: float  # everything else: tree building, masks, verification, cache commits, events
    tree_build_s: float  # the policy's own Python work, part of overhead_s
    draft_forwards: int
    extra: dict = field(default_factory=dict)  # policy-specific data, e.g. predicted acceptance
    copied_after: int = 0  # the step's nodes were copied from the context after a match this long (lookup)
    budget: int | str | None = None  # the settings the step ran with (they may change during a run: `Knobs`)
    temperature: float | None = None

    @property
    def accepted_len(self) -> int:
        return len(self.accepted)


@dataclass
class GenerationFinished:
    text: str
    token_ids: list[int]
    new_tokens: int
    target_forwards: int  # decoding steps; the prefill forward is not counted
    draft_forwards: int
    tokens_per_forward: float
    wall_s: float
    prefill_s: float
    tokens_per_s: float
    policy: str
    budget: int | str  # or "auto"
    temperature: float
    seed: int
    options: dict
    stop_reason: str  # "eos", "max_new_tokens" or "stopped"

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens/s while decoding, prefill excluded: the rate the views compare against ar."""
        return self.new_tokens / max(self.wall_s - self.prefill_s, 1e-9)

    def to_dict(self) -> dict:
        return asdict(self)


Event = TreeExpanded | StepVerified | GenerationFinished
