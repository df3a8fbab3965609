"""The budget controller: what the speculative step asks before the policy drafts and tells it
after verification (dyspec.decode.step). A fixed budget is the trivial controller; `--budget auto`
applies dyspec.auto.budget's rules, with the cost model (dyspec.auto.cost) and the acceptance
estimator (dyspec.auto.estimate).

    plan(context, left)        the step's Plan: the most nodes the next tree may have (None: draft
                               nothing this step), the arguments the policy's build takes from it
    cut(plan, tree, drafts)    the nodes of the built tree worth verifying, their old ids, the plan
                               with what the tree cost (`whole`: all of them, for a tree verified
                               on the device, whose target forward was the built tree's size)
    pad_to(plan, n)            the size the target's forward runs at for n tree tokens
    learn(plan, tree, accepted)

Its learnt state belongs to the caller: a generation starts a fresh one unless given an `AutoState`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dyspec.auto.budget import AUTO_CAP, AutoState, Built, auto_tree, step_cap
from dyspec.auto.cost import CostModel, StepCost, interpolate_ms, padded_size
from dyspec.auto.estimate import bin_rates, learn
from dyspec.auto.profile import pair_profile, target_profiles
from dyspec.core.contract import Budget, Plan, Policy
from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree

NOTHING = Plan(None)


class FixedBudget:
    """Every tree is built up to `budget` nodes and verified whole, but for the answer's last token:
    the target's forward of the root alone gives it, and no drafted node could be kept."""

    def __init__(self, budget: int):
        self.fixed = Plan(budget)  # the same every step: made once, not per step

    def plan(self, context: int, left: int) -> Plan:
        return self.fixed if left else NOTHING

    def cut(
        self, plan: Plan, tree: Tree, drafts: list[DraftSession], whole: bool = False
    ) -> tuple[Tree, list[int] | None, Plan]:
        return tree, None, plan

    def pad_to(self, plan: Plan, n: int) -> int:
        return 0

    def learn(self, plan: Plan, tree: Tree, accepted: list[int]) -> None:
        pass


@dataclass(frozen=True)
class AutoPlan(Plan):
    """An auto step's plan: t(n) at its context and the cap it asked for; after the cut, the draft
    ms its tree took and its kept nodes' bins."""

    cost: StepCost | None = None
    asked: int = 0
    spent_ms: float = 0.0
    bins: tuple[int, ...] = ()
    last: bool = False  # the answer's last token: nothing drafted, and nothing to learn from


class AutoBudget:
    """`--budget auto`: each tree sized by expected tokens per ms (dyspec.auto.budget's rules), with
    every millisecond priced by the pair's measured profile, never read off the clock, so the same
    seeded call with the same state repeats exactly."""

    def __init__(self, pair, policy: Policy, options: dict, temperature: float, state: AutoState | None):
        profile = pair_profile(pair)
        draft_ms = {int(n): ms for n, ms in profile.get("draft", {"1": 0.0}).items()}
        self.cost = CostModel(target_profiles(profile), draft_ms)
        self.state = AutoState() if state is None else state
        self.needs, self.options, self.temperature = policy.auto, options, temperature
        self.drafts = 1 + (len(pair.extra_drafts) if policy.multi_draft else 0)

    def plan(self, context: int, left: int) -> AutoPlan:
        if not left:  # as FixedBudget: no drafted node could be kept
            return AutoPlan(None, cost=self.cost.at(context), last=True)
        cap = step_cap(self.state.growth)
        if cap:  # no node deeper than the answer's end, but a node per merged draft (a probe's cap is 1)
            cap = max(self.drafts, min(cap, left))
        args = {}
        if self.needs.rates:
            args["auto_rates"] = bin_rates(self.state.acceptance, sampled=True)
        if self.needs.free_nodes:  # copies cost no draft time: the cut sizes them, not the cap
            args["free_budget"] = max(1, min(AUTO_CAP, left))
        return AutoPlan(cap if cap or self.needs.free_nodes else None, args, self.cost.at(context), asked=cap)

    def cut(
        self, plan: AutoPlan, tree: Tree, drafts: list[DraftSession], whole: bool = False
    ) -> tuple[Tree, list[int] | None, AutoPlan]:
        if plan.last:
            return tree, None, plan
        calls = [call for draft in drafts for call in draft.calls]  # (tree size when issued, tokens)
        spent_ms = sum(self.cost.draft_forward_ms(tokens) for _, tokens in calls)
        plan = replace(plan, spent_ms=spent_ms)
        undrafted = self.needs.free_nodes and not calls  # copies, or nothing
        if not (plan.asked or self.needs.free_nodes) or undrafted:
            self.state.growth.idle += 1
        if not (plan.asked or self.needs.free_nodes):
            return tree, None, plan
        forwards = max(1, len(calls))
        if self.needs.forwards_for is not None:  # as the policy prices a tree of n nodes
            per_forward_ms = spent_ms / forwards
            build_ms = lambda n: per_forward_ms * self.needs.forwards_for(n, self.options)  # noqa: E731
        else:  # the forwards this tree's first n nodes took
            build_ms = lambda n: sum(self.cost.draft_forward_ms(k) for size, k in calls if size <= n)  # noqa: E731
        sampled = self.temperature > 0 and tree.sampling != "deterministic"
        built = Built(
            sampled,
            spent_ms,
            build_ms,
            per_forward=-(-tree.size // forwards),
            grows_by_value=self.needs.grows_by_value,
            copied=tree.copied_after if undrafted and tree.size else 0,
        )
        # a tree sized by the answer's end says nothing of the next answer's: it leaves the cap alone
        sets_cap = plan.asked >= self.state.growth.cap and not undrafted
        tree, old_ids, bins = auto_tree(self.state, tree, built, plan.cost.target_ms, sets_cap, whole)
        return tree, old_ids, replace(plan, bins=tuple(bins))

    def pad_to(self, plan: AutoPlan, n: int) -> int:
        return padded_size(plan.cost.measured_ms, n)

    def learn(self, plan: AutoPlan, tree: Tree, accepted: list[int]) -> None:
        if plan.last:
            return
        step_ms = plan.spent_ms + interpolate_ms(plan.cost.target_ms, len(tree))
        learn(self.state.acceptance, tree, list(plan.bins), accepted, step_ms)


def budget_controller(
    pair, policy: Policy, budget: int | str, options: dict, temperature: float, state: AutoState | None = None
) -> Budget:
    if budget == "auto":
        return AutoBudget(pair, policy, options, temperature, state)
    return FixedBudget(budget)
