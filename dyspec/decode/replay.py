"""Replay: every policy against one target trace, at T = 0.

At T = 0 a tree's fate is fixed by the target's greedy output: the verifier accepts the longest
root path the target's own continuation follows, then takes the target's next token. So one greedy
run of the target, the trace, tells what any policy would accept at any budget. A replay grows each
policy's tree at every step along the trace with the real draft, accepts that path, and never runs
the target again: tree shapes, accepted paths, tokens per forward and draft forwards are those of a
real run (tests/test_replay.py checks it on every tree policy), while time is only modelled: price
the steps with a latency model (dyspec.auto.whatif).

One difference, at the answer's end: where a path matches the trace to its last token (the stop
token, or the last allowed one), the real target would name one token more, which the trace does
not hold; a replay then stops the path one node short and commits that node's token as the
target's, so the committed tokens agree and only that last step's accepted path is shorter.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from dyspec.core.events import StepVerified
from dyspec.core.kv import bucket
from dyspec.core.verify import verify_greedy
from dyspec.decode.engine import (
    Hook,
    Progress,
    decode_steps,
    encode_prompt,
    open_drafts,
    plan,
    prefill,
    read_prompts,
    start,
    tree_cap,
)
from dyspec.decode.step import Decoding, Step, commit_drafts, draft_tree, speculative_step
from dyspec.errors import DyspecError
from dyspec.forward.thread import forward_thread
from dyspec.load import ModelPair
from dyspec.load.pair import measured_lane

NO_TOKEN = -1  # past the trace's end: no token is known there


@dataclass
class Trace:
    """The target's greedy answer to a prompt: all a replay needs of the target."""

    prompt_ids: list[int]
    tokens: list[int]  # the answer, ending with a stop token or at max_new_tokens
    max_new_tokens: int
    # the target's features (what a feature draft reads) at every position but the last; None when
    # no loaded draft reads them
    features: torch.Tensor | None
    steps: list[StepVerified]  # the recording `ar` run's steps: measured, its decode rate is `ar`'s


@dataclass
class ReplayRun:
    """One policy and budget along a trace: its steps as a real run's `StepVerified` events, with the
    target's probabilities NaN and its time 0 (the target did not run)."""

    policy: str
    budget: int | str
    steps: list[StepVerified]

    @property
    def tokens(self) -> int:
        return sum(len(s.emitted) for s in self.steps)

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(len(self.steps), 1)

    @property
    def draft_forwards(self) -> int:
        return sum(s.draft_forwards for s in self.steps)


@forward_thread
def record_trace(pair: ModelPair, prompt: str | Sequence[int], max_new_tokens: int = 64, chat: bool = True) -> Trace:
    """Decode `prompt` greedily with `ar` (one target forward per token, as `dyspec.generate` does),
    keeping the target's features where a loaded draft reads them."""
    ids = encode_prompt(pair, prompt, chat)
    spec, options, controller = plan(pair, ids, "ar", 1, 0.0, max_new_tokens, {}, None)
    run = start(pair, ids, spec, options, 0.0, 0, 0, max_new_tokens)
    prefill(run, ids)
    hidden = [] if run.target.keep_hidden else None
    if hidden is not None and run.target.hidden is not None and len(ids) > 1:
        hidden.append(run.target.hidden)

    def step(root: int, left: int) -> Step:
        s = speculative_step(run, root, controller, left)
        if hidden is not None:
            hidden.append(run.target.hidden)
        return s

    done = Progress()
    events = decode_steps(pair, ids[-1], max_new_tokens, step, done)
    steps = [e for e in events if isinstance(e, StepVerified)]
    features = torch.cat(hidden) if hidden else None
    return Trace(ids, done.out, max_new_tokens, features, steps)


def follow(tree, answer: Sequence[int]) -> tuple[list[int], int]:
    """The greedy verifier's outcome on `tree` when the target's continuation is `answer`: the longest
    root path that `answer` follows and the token after it; a path that reaches the answer's end
    stops one node short (module docstring)."""
    accepted, next_token = verify_greedy(tree, [answer[d] if d < len(answer) else NO_TOKEN for d in tree.depths])
    if next_token == NO_TOKEN:
        next_token = tree.tokens[accepted.pop()]
    return accepted, next_token


def replay_step(run: Decoding, root: int, budget, trace: Trace, committed: int, left: int) -> Step:
    """One step after `committed` tokens of the trace's answer: the policy's tree, verified against it."""
    t0 = time.perf_counter()
    context = len(trace.prompt_ids) - 1 + committed  # the root's position
    tree, plan, draft_s, draft_forwards = draft_tree(run, root, budget, budget.plan(context, left))
    accepted, next_token = follow(tree, trace.tokens[committed:])
    hidden = None
    if trace.features is not None:  # the target's features at the nodes the drafts keep
        hidden = trace.features.new_zeros(len(tree), trace.features.shape[1])
        hidden[[0, *accepted]] = trace.features[context : context + 1 + len(accepted)]
    commit_drafts(run, budget, plan, tree, accepted, next_token, hidden)
    return Step(
        tree, accepted, next_token, None, None, draft_s, time.perf_counter() - t0 - draft_s, 0.0, draft_forwards
    )


@forward_thread
def replay_run(
    pair: ModelPair,
    trace: Trace,
    policy: str,
    budget: int | str,
    options: dict | None = None,
    seed: int = 0,
    hooks: Sequence[Hook] = (),
) -> ReplayRun:
    """`policy` at `budget` along `trace` (T = 0), its events passed to `hooks` as they come; what
    the policy keeps across generations is kept per setting (`measured_lane`)."""
    pair = measured_lane(pair, policy, budget, options, seed)
    ids = trace.prompt_ids
    spec, options, controller = plan(pair, ids, policy, budget, 0.0, trace.max_new_tokens, options, None)
    if spec.learn is not None:
        raise DyspecError(f"{policy} learns from the target's logits, which a replay does not have: run it live")
    cap = tree_cap(budget)
    need = bucket(len(ids)) + trace.max_new_tokens + 2 * bucket(cap + 1)
    drafts = open_drafts(pair, ids, spec, 0.0, need, sizes=())
    run = Decoding(spec, options, None, drafts, 0.0, torch.Generator(device=pair.device).manual_seed(seed))
    prompt_features = trace.features[: len(ids) - 1] if trace.features is not None and len(ids) > 1 else None
    read_prompts(run, prompt_features)
    done = Progress()
    events = decode_steps(
        pair,
        ids[-1],
        trace.max_new_tokens,
        lambda root, left: replay_step(run, root, controller, trace, len(done.out), left),
        done,
        hooks,
    )
    return ReplayRun(policy, budget, [e for e in events if isinstance(e, StepVerified)])


def replay(
    pair: ModelPair,
    prompt: str | Sequence[int] | Trace,
    policies: Iterable[str] = ("chain", "sequoia", "dyspec"),
    budgets: Iterable[int | str] = (32,),
    max_new_tokens: int = 64,
    options: dict[str, dict] | None = None,
    chat: bool = True,
    progress: bool = True,
) -> list[ReplayRun]:
    """Every policy at every budget along one greedy trace of the target (T = 0 only), recorded once
    from `prompt` unless a `Trace` is given. Exact tree shapes and acceptance at the price of the
    draft's forwards alone; the time of each run is not measured but modelled: price its steps with
    `dyspec.auto.whatif` (`modelled_speedup(step_shapes(run.steps), model)`). `options`: per policy."""
    trace = prompt if isinstance(prompt, Trace) else record_trace(pair, prompt, max_new_tokens, chat)
    jobs = [(p, b) for p in policies for b in budgets]
    if not jobs:
        raise DyspecError("replay needs at least one policy and one budget")
    return [
        replay_run(pair, trace, p, b, (options or {}).get(p))
        for p, b in tqdm(jobs, desc="replaying", disable=not progress or len(jobs) < 2)
    ]
