"""One speculative step: the policy drafts a token tree under the budget's cap, the target scores
every node in one forward with tree attention, the verifier accepts one root path and draws the
token after it, and both KV caches keep that path only. Autoregressive decoding is the same step
with a tree of the root alone."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dyspec.core import tree_tensors
from dyspec.core.contract import Budget, Plan, Policy
from dyspec.core.draft import DraftSession
from dyspec.core.kv import KVSession, sync
from dyspec.core.sampling import to_probs
from dyspec.core.tree import Tree
from dyspec.core.verify import verify_greedy, verify_sampled
from dyspec.kernels.row_stats import row_stats


@dataclass
class Decoding:
    """What the steps of one generation share."""

    policy: Policy
    options: dict
    target: KVSession | None  # None in a replay (dyspec.decode.replay): the trace stands for the target
    drafts: list[DraftSession]  # the first, or every merged one for a multi-draft policy
    temperature: float
    generator: torch.Generator
    device_generator: torch.Generator | None = None  # the step on a GPU's coins (`device_generator`)


@dataclass
class Step:
    """What one step did: its (cut) tree, the accepted node ids, the token after them, the target's
    logits over the tree with their rows' logsumexp (T = 0) or its probabilities (T > 0), and where
    the time went."""

    tree: Tree
    accepted: list[int]
    next_token: int
    logits: torch.Tensor | None  # None in a replay
    p: torch.Tensor | None
    draft_s: float
    build_s: float  # building the tree beyond the draft's forwards
    target_s: float
    draft_forwards: int
    budget: int | str | None = None  # the settings it ran with, where a run's may change (`engine.Knobs`)
    temperature: float | None = None
    log_z: torch.Tensor | None = None  # each row's logsumexp at T = 0, for the views' target probabilities
    target_probs: list[float] | None = None  # those probabilities, where the step read them with its tree


def draft_tree(run: Decoding, root: int, budget: Budget, plan: Plan) -> tuple[Tree, Plan, float, int]:
    """The step's tree from the last committed token `root` under the budget's `plan` for the step;
    the plan as the budget's cut left it, and the seconds and forwards its drafts took."""
    d = run.drafts
    draft_s0, forwards0 = sum(x.seconds for x in d), sum(x.forwards for x in d)
    source = d if run.policy.multi_draft else d[0]
    tree = (
        Tree.root(root)
        if plan.cap is None
        else run.policy.build(source, root, plan.cap, run.temperature, run.generator, **run.options, **plan.args)
    )
    tree, old_ids, plan = budget.cut(plan, tree, d)
    for draft in d if old_ids else []:
        draft.relabel(old_ids)
    return tree, plan, sum(x.seconds for x in d) - draft_s0, sum(x.forwards for x in d) - forwards0


def commit_drafts(
    run: Decoding, budget: Budget, plan: Plan, tree: Tree, accepted: list[int], next_token: int, target_hidden
) -> None:
    """Every draft keeps the accepted path; the budget learns from it."""
    for draft in run.drafts:
        draft.commit(tree, accepted, next_token, target_hidden)
    budget.learn(plan, tree, accepted)


def speculative_step(run: Decoding, root: int, budget: Budget, left: int) -> Step:
    """One step from the last committed token `root`, with `left` tokens of the answer to draft: on
    the device (`device_step`) where the policy grows its tree there for these settings."""
    t0 = time.perf_counter()
    plan = budget.plan(run.target.length, left)
    if plan.cap is not None and run.policy.on_device is not None:
        options = run.policy.options | run.options
        if run.policy.on_device(run.temperature, options):
            return device_step(run, root, budget, plan, t0, options)
    tree, plan, draft_s, draft_forwards = draft_tree(run, root, budget, plan)
    positions = [run.target.length + depth for depth in tree.depths]
    # even a chain gets a mask: a causal forward of several tokens is read as a prefill
    visible = tree.ancestor_mask() if len(tree) > 1 else None
    t1 = time.perf_counter()
    logits = run.target.forward(tree.tokens, positions, visible, pad_to=budget.pad_to(plan, len(tree)))
    sync(run.target.device)
    t2 = time.perf_counter()

    log_z = p = None
    if run.temperature == 0:
        target_argmax, log_z = row_stats(logits)
        accepted, next_token = verify_greedy(tree, target_argmax.tolist())
    else:
        p = to_probs(logits, run.temperature)
        accepted, next_token = verify_sampled(tree, p, run.generator)
    if run.policy.learn is not None:
        run.policy.learn(run.drafts[0], tree, logits)
    run.target.commit([run.target.length + i for i in [0, *accepted]])
    commit_drafts(run, budget, plan, tree, accepted, next_token, run.target.hidden)
    return Step(tree, accepted, next_token, logits, p, draft_s, t1 - t0 - draft_s, t2 - t1, draft_forwards, log_z=log_z)


def device_generator(run: Decoding, device: torch.device) -> torch.Generator:
    """The run's generator where it lives on the step's device, else one there seeded from it, kept
    for the run: drawing a GPU tensor's coins from a CPU generator would copy them over each time."""
    if run.generator.device == device or device.type == "cpu":
        return run.generator
    if run.device_generator is None:
        run.device_generator = torch.Generator(device).manual_seed(run.generator.initial_seed())
    return run.device_generator


def device_step(run: Decoding, root: int, budget: Budget, plan: Plan, t0: float, options: dict) -> Step:
    """`speculative_step` with the tree grown, verified and scored on the device
    (dyspec.core.tree_tensors) and read by the host once, after the target's forward: on a GPU
    nothing in the step waits for the device before that read. The budget sees the tree after the
    read, whole: a cut then would save nothing, the target having verified every node built."""
    drafts, draft = run.drafts, run.drafts[0]
    draft_s0, forwards0 = sum(d.seconds for d in drafts), sum(d.forwards for d in drafts)
    generator = device_generator(run, draft.kv.device)
    source = drafts if run.policy.multi_draft else draft
    t = run.policy.grow(source, root, plan.cap, run.temperature, generator, options | plan.args)
    draft_s = sum(d.seconds for d in drafts) - draft_s0
    t1 = time.perf_counter()
    mask_at = run.target.tree_mask_at(len(t))
    ids, mask = tree_tensors.target_inputs(t.tokens, t.depths, t.ancestors, mask_at, compiled=draft.compiled)
    logits = run.target.forward(ids, mask=mask)
    t2 = time.perf_counter()  # on a GPU, the time to queue it: the step's one read below waits for it all
    log_z = p = Q = q_square = None
    if run.temperature == 0:
        verdict = tree_tensors.greedy_verdict(logits, tree_tensors.node_tensors(t), compiled=draft.compiled)
        accepted, next_token, target_probs, log_z = verdict
    else:
        p = to_probs(logits, run.temperature, compiled=draft.compiled)
        if t.sampling != "deterministic":  # drawn children: read with their q's agreement (`Tree.agreement`)
            Q, q_square = tree_tensors.proposals(t, p.shape[-1], compiled=draft.compiled)
        accepted, next_token = tree_tensors.verify_sampled(t, p, generator, compiled=draft.compiled, Q=Q)
        target_probs = p[t.parents, t.tokens]
    forwarded = {f"forwarded{i}": d.forwarded_rows for i, d in enumerate(drafts)}
    read = {"compiled": draft.compiled, "q_square": q_square, **forwarded}
    host = tree_tensors.read_step(t, accepted, next_token, target_probs, **read)
    tree, old_ids, accepted, target_probs = tree_tensors.to_tree(t, host)
    first_ids = [host["origin"][i] for i in old_ids] if "origin" in host else old_ids  # ids before any cut
    for i, d in enumerate(drafts):
        d.place(host.get(f"forwarded{i}", []))
        d.relabel(first_ids)
    tree, _, plan = budget.cut(plan, tree, drafts, whole=True)
    hidden = run.target.hidden
    if len(old_ids) < len(t):  # padding dropped: the rows the views and the drafts read, renumbered
        rows = torch.tensor(old_ids, device=logits.device)
        logits, log_z, p, hidden = tree_tensors.rows_of((logits, log_z, p, hidden), rows, compiled=draft.compiled)
    run.target.commit([run.target.length + old_ids[i] for i in [0, *accepted]])
    commit_drafts(run, budget, plan, tree, accepted, host["next_token"], hidden)
    forwards = sum(d.forwards for d in drafts) - forwards0
    return Step(
        tree,
        accepted,
        host["next_token"],
        logits,
        p,
        draft_s,
        t1 - t0 - draft_s,
        t2 - t1,
        forwards,
        log_z=log_z,
        target_probs=target_probs,
    )
