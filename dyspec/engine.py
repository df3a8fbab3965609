"""The decoding loop. Per step: a policy builds a token tree with the draft, one target forward
scores every node with tree attention, a verifier accepts one root path, and both KV caches keep
that path only. Autoregressive decoding is the empty tree through the same loop.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch

from dyspec.budget import (
    AUTO_CAP,
    AutoState,
    auto_tree,
    auto_update,
    bin_rates,
    padded_profile,
    padded_size,
    profile_at,
    step_cap,
)
from dyspec.defaults import defaults_for
from dyspec.draft import DraftSession
from dyspec.errors import DyspecError
from dyspec.events import Event, GenerationFinished, StepVerified, TreeExpanded
from dyspec.kv import FINAL, KVSession, sync
from dyspec.models import ModelPair
from dyspec.policies import Policy, check_options, get_policy
from dyspec.profile import target_profile
from dyspec.sampling import to_probs
from dyspec.tree import Tree
from dyspec.verify import verify_greedy, verify_sampled

MAX_BUDGET = 256
MAX_TEMPERATURE = 5.0

Hook = Callable[[Event], None]


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


def check_settings(policy: str, budget: int | str, temperature: float, max_new_tokens: int, options: dict) -> None:
    """Checks that need no model, so that a CLI can fail before loading anything."""
    check_options(policy, options)
    if budget == "auto":
        shape = [o for o in get_policy(policy).shape_options if options.get(o) is not None]
        if shape:
            raise DyspecError(
                f"budget 'auto' sizes {policy}'s tree each step, but the option {shape[0]} fixes it: give a number"
            )
        return check_settings(policy, AUTO_CAP, temperature, max_new_tokens, options)
    if not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise DyspecError(f"budget must be 'auto' or between 1 and {MAX_BUDGET}, got {budget}")
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise DyspecError(f"temperature must be between 0 and {MAX_TEMPERATURE}, got {temperature}")
    if max_new_tokens < 1:
        raise DyspecError(f"max new tokens must be at least 1, got {max_new_tokens}")


def check_request(
    pair: ModelPair,
    ids: list[int],
    policy: str,
    budget: int | str,
    temperature: float,
    max_new_tokens: int,
    options: dict,
) -> None:
    check_settings(policy, budget, temperature, max_new_tokens, options)
    budget = AUTO_CAP if budget == "auto" else budget
    if get_policy(policy).needs_draft and pair.draft is None:
        raise DyspecError(f"policy '{policy}' needs a draft model; none is loaded")
    if not ids:
        raise DyspecError("the prompt is empty")
    need = len(ids) + max_new_tokens + budget + 1
    if need > pair.max_context:
        raise DyspecError(
            f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens + a tree of {budget} does not fit "
            f"the model's context of {pair.max_context} tokens"
        )


def _texts(pair: ModelPair, ids: list[int]) -> list[str]:
    return pair.tokenizer.batch_decode([[i] for i in ids])


def _target_probs(logits: torch.Tensor, tree: Tree, p: torch.Tensor | None) -> list[float]:
    """Target probability of each node's token after its parent (at T = 1 when decoding greedily)."""
    if tree.size == 0:
        return [1.0]
    parents = torch.tensor(tree.parents[1:], device=logits.device)
    tokens = torch.tensor(tree.tokens[1:], device=logits.device)
    if p is None:
        rows, inverse = torch.unique(parents, return_inverse=True)
        p = torch.softmax(logits[rows], dim=-1)
        parents = inverse
    return [1.0] + p[parents, tokens].tolist()


def _seconds(drafts: list[DraftSession]) -> float:
    return sum(d.seconds for d in drafts)


def _forwards(drafts: list[DraftSession]) -> int:
    return sum(d.forwards for d in drafts)


def _emit(event: Event, hooks: Sequence[Hook]) -> Event:
    for hook in hooks:
        try:
            hook(event)
        except Exception as e:  # a broken view must never break a generation
            warnings.warn(f"dyspec hook {hook!r} raised {e!r}; ignored", stacklevel=2)
    return event


def _build_ms(
    spec: Policy, drafts: list[DraftSession], options: dict, draft_s: float, forwards: int
) -> Callable[[int], float]:
    """Draft ms a tree of n nodes costs, for `--budget auto`'s next cap: as the policy prices it
    (`forwards_for`: DySpec's batched build takes 4 forwards at any size), else the forwards this
    tree's first n nodes took (a chain, or a static tree built layer by layer)."""
    if spec.forwards_for is not None:
        return lambda n: 1000 * draft_s * spec.forwards_for(n, options) / forwards
    return lambda n: 1000 * sum(d.seconds_to_build(n) for d in drafts)


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
) -> Iterator[Event]:
    """Generate, yielding `TreeExpanded` and `StepVerified` events per step and a final
    `GenerationFinished`. `policy` and `budget` default to the fastest measured on the pair's
    device (`dyspec.defaults`); the final event says which ran. `budget="auto"` sizes each step's
    tree by expected gain against the target's measured latency profile (dyspec.budget), with
    acceptance rates learnt in earlier steps, and in earlier generations when the caller passes the
    same `auto_state` (a `dyspec.budget.AutoState`) again: without one each call starts afresh, and
    what one call learnt never changes another's trees. `stop()` is polled between steps: when it
    returns True the generation ends cleanly with stop_reason "stopped"."""
    defaults = defaults_for(pair.device)
    policy = policy or defaults.policy
    budget = defaults.budget if budget is None else budget
    options = dict(options or {})
    ids = encode_prompt(pair, prompt, chat)
    check_request(pair, ids, policy, budget, temperature, max_new_tokens, options)
    auto = (AutoState() if auto_state is None else auto_state) if budget == "auto" else None
    profiles = target_profile(pair) if auto else None
    spec = get_policy(policy)
    if spec.prepare is not None:
        options = spec.prepare(pair, temperature, auto.cap if auto else budget, options)
    device = pair.device
    generator = torch.Generator(device=device).manual_seed(seed)
    stop_ids = pair.stop_ids
    drafts = [DraftSession(m, ids, temperature) for m in [pair.draft, *(pair.extra_drafts if spec.multi_draft else [])]]
    source = drafts if spec.multi_draft else drafts[0]  # what the policy drafts from
    learns = auto is not None and spec.auto_rates  # the policy grows by auto's rates
    free = auto is not None and spec.free_nodes  # it adds nodes that need no draft forward
    layers = [d.feature_layers for d in drafts if d.needs_features]  # one set: load_pair checks
    target = KVSession(pair.target, keep_hidden=bool(layers), hidden_layers=layers[0] if layers else FINAL)

    t_start = time.perf_counter()
    if len(ids) > 1:
        target.forward(ids[:-1], last_only=True)
        target.length = target.cached
        target.forwards = 0  # count decoding steps only
    for draft in drafts:
        draft.set_prompt_features(target.hidden)
    sync(device)
    prefill_s = time.perf_counter() - t_start
    root, out, step, stop_reason = ids[-1], [], 0, "max_new_tokens"
    skipped = True  # under auto: the draft has not run since the prompt, or since steps that drafted nothing
    while len(out) < max_new_tokens:
        if stop is not None and stop():
            stop_reason = "stopped"
            break
        t0, seconds0, forwards0 = time.perf_counter(), _seconds(drafts), _forwards(drafts)
        cap = step_cap(auto) if auto else budget
        if auto:  # t(n) behind this step's context, as verification will pay it (padded)
            measured_ms = profile_at(profiles, target.length)
            target_ms = padded_profile(measured_ms)
        left = max_new_tokens - len(out) - 1  # a node deeper than this (less the bonus token) is worth nothing
        if auto and cap:
            cap = min(cap, max(len(drafts), left))  # a node per merged draft
        if auto and cap and spec.needs_draft and skipped:  # so that auto prices the tree alone
            for draft in drafts:
                draft.catch_up()
            skipped = False
        draft_s0, draft_f0 = _seconds(drafts), _forwards(drafts)
        bins = []
        if cap == 0 and not free:  # under auto no tree paid for its draft time: an autoregressive step
            tree, skipped = Tree.root(root), True
            auto.idle += 1
        else:
            learnt = {"auto_rates": bin_rates(auto, sampled=True)} if learns else {}
            if free:  # copies cost no draft time: the cut sizes them, not the cap learnt from draft trees
                learnt["free_budget"] = max(1, min(AUTO_CAP, left))
            tree = spec.build(source, root, cap, temperature, generator, **options, **learnt)
        tree_draft_s = _seconds(drafts) - draft_s0  # the draft's time for this tree alone
        undrafted = free and _forwards(drafts) == draft_f0  # copies, or nothing: the draft built no tree
        if undrafted:
            auto.idle += 1
        if auto and (cap or free):
            sampled = temperature > 0 and tree.sampling != "deterministic"
            forwards = max(1, _forwards(drafts) - draft_f0)
            build_ms = _build_ms(spec, drafts, options, tree_draft_s, forwards)
            tree, old_ids, bins = auto_tree(
                auto,
                tree,
                sampled,
                target_ms,
                build_ms,
                1000 * tree_draft_s,
                -(-tree.size // forwards),
                spec.grows_by_value and sampled,
                sets_cap=cap >= auto.cap and not undrafted,  # else the tree was sized by the answer's end
                copied=tree.copied_after if undrafted and tree.size else 0,
            )
            for draft in drafts:
                draft.relabel(old_ids)
        t1 = time.perf_counter()

        # even a chain gets its mask: a causal forward of several tokens is read as a prefill
        visible = None
        if len(tree) > 1:
            visible = torch.cat([torch.ones(len(tree), target.length, dtype=torch.bool), tree.ancestor_mask()], dim=1)
        positions = [target.length + d for d in tree.depths]
        pad_to = padded_size(measured_ms, len(tree)) if auto else 0  # as `auto` priced it
        t2 = time.perf_counter()
        logits = target.forward(tree.tokens, positions, visible, pad_to=pad_to)
        sync(device)
        t3 = time.perf_counter()

        if temperature == 0:
            p = None
            accepted, next_token = verify_greedy(tree, logits.argmax(-1).tolist())
        else:
            p = to_probs(logits, temperature)
            accepted, next_token = verify_sampled(tree, p, generator)
        target.commit([target.length + i for i in [0, *accepted]])
        for draft in drafts:
            draft.commit(tree, accepted, next_token, target.hidden)
        emitted = [tree.tokens[i] for i in accepted] + [next_token]
        if cut := until_stop(emitted, stop_ids):
            emitted = emitted[:cut]
            stop_reason = "eos"
        emitted = emitted[: max_new_tokens - len(out)]
        out += emitted
        root = next_token
        target_s, draft_s = t3 - t2, _seconds(drafts) - seconds0  # the catch-up included
        if auto:
            step_ms = 1000 * (time.perf_counter() - t0)
            timed = step > 0  # a first step's times carry one-off costs
            auto_update(
                auto, tree, bins, accepted, len(emitted), step_ms, 1000 * draft_s, 1000 * target_s, target_ms, timed
            )

        texts = _texts(pair, tree.tokens)
        starts = [1, *tree.growth[:-1]]
        for a, b in zip(starts, tree.growth):
            yield _emit(
                TreeExpanded(
                    step,
                    list(range(a, b)),
                    tree.parents[a:b],
                    tree.tokens[a:b],
                    texts[a:b],
                    tree.draft_probs[a:b],
                    tree.values[a:b],
                ),
                hooks,
            )
        overhead_s = time.perf_counter() - t0 - draft_s - target_s
        yield _emit(
            StepVerified(
                step=step,
                tokens=tree.tokens,
                texts=texts,
                parents=tree.parents,
                depths=tree.depths,
                draft_probs=tree.draft_probs,
                values=tree.values,
                target_probs=_target_probs(logits, tree, p),
                accepted=accepted,
                emitted=emitted,
                emitted_texts=_texts(pair, emitted),
                next_token=next_token,
                draft_s=draft_s,
                target_s=target_s,
                overhead_s=overhead_s,
                tree_build_s=t1 - t0 - draft_s,
                draft_forwards=_forwards(drafts) - forwards0,
                extra=tree.extra,
                copied_after=tree.copied_after,
            ),
            hooks,
        )
        step += 1
        if stop_reason == "eos":
            break

    wall_s = time.perf_counter() - t_start
    yield _emit(
        GenerationFinished(
            text=pair.tokenizer.decode(out, skip_special_tokens=True),
            token_ids=out,
            new_tokens=len(out),
            target_forwards=step,
            draft_forwards=_forwards(drafts),
            tokens_per_forward=len(out) / max(step, 1),
            wall_s=wall_s,
            prefill_s=prefill_s,
            tokens_per_s=len(out) / wall_s,
            policy=policy,
            budget=budget,
            temperature=temperature,
            seed=seed,
            options=options,
            stop_reason=stop_reason,
        ),
        hooks,
    )


def generate(pair: ModelPair, prompt: str | Sequence[int], **kwargs) -> GenerationFinished:
    """Blocking form of `stream`: the final text and statistics."""
    *_, finished = stream(pair, prompt, **kwargs)
    return finished
