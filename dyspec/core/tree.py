"""Token trees: pure data, no model code.

Node 0 is the root: the last committed token, whose KV is not cached yet. Nodes are kept in
topological order (parent id < child id), and siblings in the order they were drawn, which is the
order verification tries them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dyspec.core.vocab import DraftVocab

# How the children of a node were drawn from its draft distribution q; decides the verifier.
SAMPLINGS = ("iid", "without_replacement", "deterministic")


@dataclass
class Tree:
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    draft_probs: list[float] = field(default_factory=lambda: [1.0])  # q(token) when it was drawn
    values: list[float] = field(default_factory=lambda: [1.0])  # product of draft_probs on the root path
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> distribution its children come from
    # node -> distribution it was drawn from, where that is not q[parent]: another draft's (specinfer)
    child_q: dict[int, torch.Tensor] = field(default_factory=dict)
    # node -> sum of q^2 over the distribution it was drawn from (the chance that two draws of it agree),
    # where the tree came with it (a step on the device reads it with the tree): then nothing reads q for it
    agreement: dict[int, float] = field(default_factory=dict)
    sampling: str = "iid"
    growth: list[int] = field(default_factory=list)  # tree size after each expansion, for replay
    # the policy's own data for the views (events' `extra`); a list in it holds one entry per drafted node
    extra: dict = field(default_factory=dict)
    copied_after: int = 0  # nodes copied from the context (`lookup`): the length of the match they follow
    vocab: DraftVocab | None = None  # the columns of the q's, where they span a draft's reduced vocabulary

    @classmethod
    def root(cls, token: int, sampling: str = "iid", vocab: DraftVocab | None = None) -> Tree:
        assert sampling in SAMPLINGS, sampling
        return cls(tokens=[token], sampling=sampling, vocab=vocab)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def size(self) -> int:
        """Number of drafted nodes (the root is not drafted)."""
        return len(self.tokens) - 1

    def add(self, parent: int, token: int | float, draft_prob: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.draft_probs.append(draft_prob)
        self.values.append(self.values[parent] * draft_prob)
        return len(self.tokens) - 1

    def end_expansion(self) -> None:
        """Mark the nodes added since the last call as one expansion (one `TreeExpanded` event)."""
        if not self.growth or self.growth[-1] != len(self):
            self.growth.append(len(self))

    def proposal(self, node: int) -> torch.Tensor:
        """The distribution `node`'s token was drawn from."""
        return self.child_q[node] if node in self.child_q else self.q[self.parents[node]]

    def candidates(
        self, columns: torch.Tensor, probs: torch.Tensor, width: int, *extra: torch.Tensor
    ) -> list[list[list[float]]]:
        """Children candidates [rows, k] as Python lists, in one host read (on a GPU each read waits for
        every kernel queued before it): their target token ids (of `columns` of draft distributions
        `width` wide), their probabilities, and any `extra` [rows, k] beside them. Token ids come back
        as floats, exact below 2^53, which `add` takes."""
        ids = columns if self.vocab is None else self.vocab.tokens(columns, width)
        return torch.stack([t.to(torch.float64) for t in (ids, probs, *extra)]).tolist()

    def token_id(self, column: int, width: int) -> int:
        """The target token id of column `column` of a draft distribution `width` wide."""
        return column if self.vocab is None else self.vocab.token(column, width)

    def widened(self, q: torch.Tensor) -> torch.Tensor:
        """A q of this tree over the target's whole vocabulary (zero outside the draft's)."""
        return q if self.vocab is None else self.vocab.widen(q)

    def prob(self, q: torch.Tensor, token: int) -> float:
        """q's probability of target token `token`."""
        column = token if self.vocab is None else self.vocab.column(token, q.shape[-1])
        return float(q[column]) if column >= 0 else 0.0

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self)) if self.parents[i] == node]

    def path(self, node: int) -> list[int]:
        """Node ids from the root's first child down to `node` (the root itself excluded)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def subtree(self, keep: list[int]) -> tuple[Tree, list[int]]:
        """The tree of the root and the nodes `keep` (ascending, closed under ancestors), renumbered,
        with its growth steps preserved; and the old id of each new node."""
        old_ids = [0, *keep]
        new_id = {old: new for new, old in enumerate(old_ids)}
        out = Tree.root(self.tokens[0], self.sampling, self.vocab)
        for old in keep:
            out.add(new_id[self.parents[old]], self.tokens[old], self.draft_probs[old])
        out.q = {new_id[u]: q for u, q in self.q.items() if u in new_id}
        out.child_q = {new_id[u]: q for u, q in self.child_q.items() if u in new_id}
        out.agreement = {new_id[u]: a for u, a in self.agreement.items() if u in new_id}
        out.growth = sorted({sum(1 for n in old_ids if n < g) for g in self.growth})
        out.extra = {k: [v[old - 1] for old in keep] if isinstance(v, list) else v for k, v in self.extra.items()}
        out.copied_after = self.copied_after if keep else 0
        return out, old_ids

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [n, n]: entry (i, j) is True when j is i itself or one of its ancestors."""
        n = len(self)
        mask = np.eye(n, dtype=bool)  # numpy: a row op on a small array costs a fraction of torch's
        for i in range(1, n):  # parents come first, so a parent's row is complete
            mask[i] |= mask[self.parents[i]]
        return torch.from_numpy(mask)
