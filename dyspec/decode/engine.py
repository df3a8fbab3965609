"""The decoding loop: prefill, then speculative steps (dyspec.decode.step) until the answer ends,
with an event per tree expansion and step for the views, and one when the generation ends."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from dyspec.auto.budget import AUTO_CAP, AutoState
from dyspec.auto.controller import budget_controller
from dyspec.core import entries
from dyspec.core.contract import Budget, Policy
from dyspec.core.draft import DraftSession
from dyspec.core.events import Event, GenerationFinished, StepVerified, TreeExpanded
from dyspec.core.kv import BUCKETS, FINAL, bucket, sync
from dyspec.decode.step import Decoding, Step, speculative_step
from dyspec.decode.text import stream_texts, token_labels
from dyspec.defaults import settings
from dyspec.errors import DyspecError
from dyspec.forward.choose import compiles_programs
from dyspec.forward.thread import forward_thread
from dyspec.load import ModelPair
from dyspec.policies import check_options, get_policy

MAX_BUDGET = 256
MAX_TEMPERATURE = 5.0

Hook = Callable[[Event], None]


@dataclass
class Knobs:
    """A generation's budget and temperature, which its caller may change while it runs (the app's
    sliders): each step reads them before it drafts, so a change applies from the next step, and
    that step is exact for the temperature it runs at. Trees stay within `most` nodes (the largest
    the run prepares its caches for; the budget at the start by default)."""

    budget: int | str
    temperature: float
    most: int | None = None


def until_stop(tokens: list[int], stop_ids: frozenset[int]) -> int:
    """How many of `tokens` to keep when one ends the generation (up to and including the first
    stop token), or 0 when none does."""
    return next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), 0)


def encode_prompt(pair: ModelPair, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
    """Token ids of a prompt: a string goes through the tokenizer's chat template when it has one."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    tok = pair.tokenizer
    if chat and tok.chat_template:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tok(text, add_special_tokens=False).input_ids
    return tok(prompt).input_ids


def tree_cap(budget: int | str) -> int:
    """The most nodes a step's tree may have: `budget`, or under "auto" (which sizes each tree by
    its expected gain) AUTO_CAP."""
    return AUTO_CAP if budget == "auto" else budget


def check_settings(policy: str, budget: int | str, temperature: float, max_new_tokens: int, options: dict) -> None:
    """Checks that need no model, so that a CLI can fail before loading anything."""
    check_options(policy, options)
    if budget == "auto":
        shape = [o for o in get_policy(policy).auto.shape_options if options.get(o) is not None]
        if shape:
            raise DyspecError(
                f"budget 'auto' sizes {policy}'s tree each step, but the option {shape[0]} fixes it: give a number"
            )
    elif not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise DyspecError(f"budget must be 'auto' or between 1 and {MAX_BUDGET}, got {budget}")
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise DyspecError(f"temperature must be between 0 and {MAX_TEMPERATURE}, got {temperature}")
    if max_new_tokens < 1:
        raise DyspecError(f"max new tokens must be at least 1, got {max_new_tokens}")


def _target_probs(s: Step) -> list[float]:
    """Target probability of each node's token after its parent (at T = 1 when decoding greedily);
    NaN where the target did not run (a replay)."""
    tree = s.tree
    if s.target_probs is not None:
        return [1.0, *s.target_probs[1:]]
    if tree.size == 0 or s.logits is None:
        return [1.0] + [math.nan] * tree.size
    nodes = list(zip(tree.parents[1:], tree.tokens[1:]))
    if s.p is not None:
        return [1.0, *entries.read(s.p, nodes)]
    log_z = s.log_z.tolist()
    return [1.0, *(math.exp(x - log_z[p]) for x, (p, _) in zip(entries.read(s.logits, nodes), nodes))]


def _emit(event: Event, hooks: Sequence[Hook]) -> Event:
    for hook in hooks:
        try:
            hook(event)
        except Exception as e:  # a broken view must never break a generation
            warnings.warn(f"dyspec hook {hook!r} raised {e!r}; ignored", stacklevel=2)
    return event


def step_events(
    pair: ModelPair, number: int, s: Step, emitted: list[int], emitted_texts: list[str], step_s: float
) -> list[Event]:
    """The views' events of one step: each expansion of its tree, then the verified step; the text
    each emitted token adds is `emitted_texts` (`stream_texts`)."""
    tree, texts = s.tree, token_labels(pair.tokenizer, s.tree.tokens)
    starts = [1, *tree.growth[:-1]]
    grown = [
        TreeExpanded(
            number,
            list(range(a, b)),
            tree.parents[a:b],
            tree.tokens[a:b],
            texts[a:b],
            tree.draft_probs[a:b],
            tree.values[a:b],
        )
        for a, b in zip(starts, tree.growth)
    ]
    verified = StepVerified(
        step=number,
        tokens=tree.tokens,
        texts=texts,
        parents=tree.parents,
        depths=tree.depths,
        draft_probs=tree.draft_probs,
        values=tree.values,
        target_probs=_target_probs(s),
        accepted=s.accepted,
        emitted=emitted,
        emitted_texts=emitted_texts,
        next_token=s.next_token,
        draft_s=s.draft_s,
        target_s=s.target_s,
        overhead_s=step_s - s.draft_s - s.target_s,
        tree_build_s=s.build_s,
        draft_forwards=s.draft_forwards,
        extra=tree.extra,
        copied_after=tree.copied_after,
        budget=s.budget,
        temperature=s.temperature,
    )
    return [*grown, verified]


def open_drafts(
    pair: ModelPair, ids: list[int], spec: Policy, temperature: float, need: int, sizes: list[int]
) -> list[DraftSession]:
    """The draft sessions of a generation: the first draft's, or every merged one's for a multi-draft
    policy; each cache holds `need` tokens where it is preallocated, and forwards of `sizes` tokens
    are ready."""
    models = [pair.draft, *(pair.extra_drafts if spec.multi_draft else [])]
    kv = [
        None if m is None else pair.forward(m).session(f"draft{i}", need, sizes, keep_hidden=True, draft_vocab=True)
        for i, m in enumerate(models)
    ]
    return [DraftSession(m, ids, temperature, session, pair.memo) for m, session in zip(models, kv)]


def start(
    pair: ModelPair, ids: list[int], spec: Policy, options: dict, temperature: float, seed: int, cap: int, max_new: int
) -> Decoding:
    """A generation's sessions, their caches empty; a preallocated cache holds the prompt, the answer
    and a step's forwards, which reach past the committed tokens by up to twice the tree, padded to
    buckets; the forwards of trees up to `cap` nodes are ready (compiled where the forward compiles)
    before the clock starts."""
    need = bucket(len(ids)) + max_new + 2 * bucket(cap + 1)  # the draft's first forward reads the whole prompt
    sizes = [b for b in BUCKETS if b <= bucket(cap + 1)]
    drafts = open_drafts(pair, ids, spec, temperature, need, sizes)
    layers = [d.feature_layers for d in drafts if d.needs_features]  # one set: load_pair checks
    target = pair.forward(pair.target).session(
        "target", need, sizes, keep_hidden=bool(layers), hidden_layers=layers[0] if layers else FINAL
    )
    for session in [target, *(d.kv for d in drafts if d.kv is not None)]:
        session.compiled = compiles_programs(pair.fast_path)
    generator = torch.Generator(device=pair.device).manual_seed(seed)
    return Decoding(spec, options, target, drafts, temperature, generator)


def prefill(run: Decoding, ids: list[int]) -> None:
    """Both caches hold the prompt but its last token, the first step's root: the draft's where the
    policy drafts (as a serving engine prefills its draft), so that the first step's draft reads one
    token as every later step's does, and reading the prompt is not counted as decoding."""
    if len(ids) > 1:
        run.target.append(ids[:-1], last_only=True)
        run.target.forwards = 0  # count decoding steps only
    read_prompts(run, run.target.hidden)
    sync(run.target.device)


def read_prompts(run: Decoding, features: torch.Tensor | None) -> None:
    """Every draft gets the target's `features` at the prompt's tokens but the last, and reads the
    prompt where the policy drafts; elsewhere it stays idle (`DraftSession.reads`)."""
    for draft in run.drafts:
        draft.set_prompt_features(features)
        draft.reads = run.policy.drafts(run.options)
        if draft.reads:
            draft.read_prompt()


def check_fits(pair: ModelPair, ids: list[int], max_new_tokens: int, cap: int) -> None:
    if len(ids) + max_new_tokens + cap + 1 > pair.max_context:
        raise DyspecError(
            f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens + a tree of {cap} does not fit "
            f"the model's context of {pair.max_context} tokens"
        )


def plan(
    pair: ModelPair,
    ids: list[int],
    policy: str,
    budget: int | str,
    temperature: float,
    max_new_tokens: int,
    options: dict | None,
    auto_state: AutoState | None,
) -> tuple[Policy, dict, Budget]:
    """A checked request's policy, its options resolved once (`Policy.prepare`), and its budget
    controller."""
    options = dict(options or {})
    check_settings(policy, budget, temperature, max_new_tokens, options)
    spec, cap = get_policy(policy), tree_cap(budget)
    if spec.needs_draft and pair.draft is None:
        raise DyspecError(f"policy '{policy}' needs a draft model; none is loaded")
    if not ids:
        raise DyspecError("the prompt is empty")
    check_fits(pair, ids, max_new_tokens, cap)
    options = spec.prepare(pair, temperature, options) if spec.prepare else options
    return spec, options, budget_controller(pair, spec, budget, options, temperature, auto_state)


def tuned_steps(run: Decoding, request: tuple, knobs: Knobs, most: int, controller: Budget) -> Callable:
    """`speculative_step` under `knobs`: where the budget or temperature changed, the request
    (pair, ids, policy, max_new_tokens, options, auto_state) is planned again before the next step,
    a budget cut to `most` and "auto" taken only where `most` holds its trees; each Step says the
    settings it ran with."""
    pair, ids, policy, max_new_tokens, options, auto_state = request
    ran = [knobs.budget, knobs.temperature, controller]

    def step(root: int, left: int) -> Step:
        budget = min(knobs.budget, most) if isinstance(knobs.budget, int) else knobs.budget
        if tree_cap(budget) <= most and (budget, knobs.temperature) != tuple(ran[:2]):
            _, run.options, planned = plan(
                pair, ids, policy, budget, knobs.temperature, max_new_tokens, options, auto_state
            )
            run.temperature = knobs.temperature
            for draft in run.drafts:  # a copying draft mixes its copies at it
                draft.temperature = knobs.temperature
            ran[:] = budget, knobs.temperature, planned
        return replace(speculative_step(run, root, ran[2], left), budget=ran[0], temperature=ran[1])

    return step


@dataclass
class Progress:
    """What a generation has committed so far, and why it ended."""

    out: list[int] = field(default_factory=list)
    steps: int = 0
    pending: list[int] = field(default_factory=list)  # committed tokens that end inside a character
    stop_reason: str = "max_new_tokens"  # or "eos", "stopped"


def decode_steps(
    pair: ModelPair,
    root: int,
    max_new_tokens: int,
    step: Callable[[int, int], Step],
    done: Progress,
    hooks: Sequence[Hook] = (),
    stop: Callable[[], bool] | None = None,
) -> Iterator[Event]:
    """Steps (`step(root, left)`) from the prompt's last token `root` until the answer ends, with
    their events; `done` holds what they committed."""
    while len(done.out) < max_new_tokens:
        if stop is not None and stop():
            done.stop_reason = "stopped"
            return
        t0 = time.perf_counter()
        s = step(root, max_new_tokens - len(done.out) - 1)
        emitted = [s.tree.tokens[i] for i in s.accepted] + [s.next_token]
        if cut := until_stop(emitted, pair.stop_ids):
            emitted, done.stop_reason = emitted[:cut], "eos"
        emitted = emitted[: max_new_tokens - len(done.out)]
        done.out, root = done.out + emitted, s.next_token
        texts, done.pending = stream_texts(pair.tokenizer, emitted, done.pending)
        for event in step_events(pair, done.steps, s, emitted, texts, time.perf_counter() - t0):
            yield _emit(event, hooks)
        done.steps += 1
        if done.stop_reason == "eos":
            return


@forward_thread  # each event made on the model thread, wherever the caller is
def stream(
    pair: ModelPair,
    prompt: str | Sequence[int],
    policy: str | None = None,
    budget: int | str | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    max_new_tokens: int = 64,
    options: dict | None = None,
    hooks: Sequence[Hook] = (),
    chat: bool = True,
    stop: Callable[[], bool] | None = None,
    auto_state: AutoState | None = None,
    knobs: Knobs | None = None,
) -> Iterator[Event]:
    """Generate, yielding `TreeExpanded` and `StepVerified` events per step and a final
    `GenerationFinished`. `policy`, `budget` and the options default to the fastest measured on
    the pair's device and int8 kernel (`dyspec.defaults.settings`); the final event says which ran.
    `budget="auto"` sizes each step's tree by expected gain against the pair's measured latency
    profile (dyspec.auto.controller), with acceptance rates learnt in earlier steps, and in earlier
    generations when the caller passes the same `auto_state` (a `dyspec.auto.budget.AutoState`)
    again: without one, each call starts afresh and a seeded call repeats exactly. `stop()` is
    polled between steps: when it returns True the generation ends cleanly with stop_reason
    "stopped". With `knobs`, the budget and temperature are read from it before every step
    (`Knobs`), and each `StepVerified` says which it ran with; `budget` and `temperature` are then
    its values at the start."""
    policy, budget, options = settings(pair.device, policy, budget, options, pair.int8_kernel)
    knobs = knobs or Knobs(budget, temperature)
    budget, temperature = knobs.budget, knobs.temperature
    ids = encode_prompt(pair, prompt, chat)
    user_options = options
    spec, options, controller = plan(pair, ids, policy, budget, temperature, max_new_tokens, options, auto_state)
    most = max(tree_cap(budget), knobs.most or 0)
    check_fits(pair, ids, max_new_tokens, most)  # the largest tree a change may ask for
    run = start(pair, ids, spec, options, temperature, seed, most, max_new_tokens)
    t_start = time.perf_counter()
    prefill(run, ids)
    prefill_s = time.perf_counter() - t_start
    done = Progress()
    request = (pair, ids, policy, max_new_tokens, user_options, auto_state)
    step = tuned_steps(run, request, knobs, most, controller)
    yield from decode_steps(pair, ids[-1], max_new_tokens, step, done, hooks, stop)
    wall_s = time.perf_counter() - t_start
    yield _emit(
        GenerationFinished(
            text=pair.tokenizer.decode(done.out, skip_special_tokens=True),
            token_ids=done.out,
            new_tokens=len(done.out),
            target_forwards=done.steps,
            draft_forwards=sum(d.forwards for d in run.drafts),
            tokens_per_forward=len(done.out) / max(done.steps, 1),
            wall_s=wall_s,
            prefill_s=prefill_s,
            tokens_per_s=len(done.out) / wall_s,
            policy=policy,
            budget=budget,
            temperature=temperature,
            seed=seed,
            options=options,
            stop_reason=done.stop_reason,
        ),
        hooks,
    )


@forward_thread
def generate(pair: ModelPair, prompt: str | Sequence[int], **kwargs) -> GenerationFinished:
    """Blocking form of `stream`: the final text and statistics."""
    *_, finished = stream(pair, prompt, **kwargs)
    return finished
