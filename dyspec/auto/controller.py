"""The budget controller: what the speculative step asks before the policy drafts and tells it
after verification (dyspec.decode.step). A fixed budget is the trivial controller; `--budget auto`
(dyspec.auto.budget) learns.

    cap(context, left)   the most nodes the next tree may have, or None: draft nothing this step,
                         and the arguments the policy's build takes from the controller
    cut(tree, drafts)    the nodes of the built tree worth verifying, and their old ids
    pad_to(n)            the size the target's forward runs at for n tree tokens
    learn(tree, accepted)

Its state belongs to the caller: a generation starts a fresh one unless given an `AutoState`.
"""

from __future__ import annotations

from dyspec.auto.budget import (
    AUTO_CAP,
    AutoState,
    auto_tree,
    auto_update,
    bin_rates,
    interpolate_ms,
    padded_profile,
    padded_size,
    profile_at,
    step_cap,
)
from dyspec.auto.profile import pair_profile, target_profiles
from dyspec.core.contract import Budget, Policy
from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree


class FixedBudget:
    """Every tree is built up to `budget` nodes and verified whole."""

    def __init__(self, budget: int):
        self.budget = budget

    def cap(self, context: int, left: int) -> tuple[int | None, dict]:
        return self.budget, {}

    def cut(self, tree: Tree, drafts: list[DraftSession]) -> tuple[Tree, list[int] | None]:
        return tree, None

    def pad_to(self, n: int) -> int:
        return 0

    def learn(self, tree: Tree, accepted: list[int]) -> None:
        pass


class AutoBudget:
    """`--budget auto`: each tree sized by expected tokens per ms (dyspec.auto.budget's rules), with
    every millisecond priced by the pair's measured profile, never read off the clock, so the same
    seeded call with the same state repeats exactly."""

    def __init__(self, pair, policy: Policy, options: dict, temperature: float, state: AutoState | None):
        profile = pair_profile(pair)
        self.target_profiles = target_profiles(profile)
        self.draft_ms = {int(n): ms for n, ms in profile.get("draft", {"1": 0.0}).items()}
        self.state = AutoState() if state is None else state
        self.policy, self.options, self.temperature = policy, options, temperature
        self.drafts = 1 + (len(pair.extra_drafts) if policy.multi_draft else 0)

    def cap(self, context: int, left: int) -> tuple[int | None, dict]:
        self.measured_ms = profile_at(self.target_profiles, context)
        self.target_ms = padded_profile(self.measured_ms)  # t(n) as verification will pay it
        cap = step_cap(self.state)
        if cap:  # no node deeper than the answer's end, but a node per merged draft
            cap = min(cap, max(self.drafts, left))
        self.asked, args = cap, {}
        if self.policy.auto_rates:
            args["auto_rates"] = bin_rates(self.state, sampled=True)
        if self.policy.free_nodes:  # copies cost no draft time: the cut sizes them, not the cap
            args["free_budget"] = max(1, min(AUTO_CAP, left))
        elif not cap:
            return None, args
        return cap, args

    def cut(self, tree: Tree, drafts: list[DraftSession]) -> tuple[Tree, list[int] | None]:
        calls = [call for draft in drafts for call in draft.calls]  # (tree size when issued, tokens)
        self.spent_ms = sum(interpolate_ms(self.draft_ms, tokens) for _, tokens in calls)
        self.bins = []
        undrafted = self.policy.free_nodes and not calls  # copies, or nothing
        if not (self.asked or self.policy.free_nodes) or undrafted:
            self.state.idle += 1
        if not (self.asked or self.policy.free_nodes):
            return tree, None
        sampled = self.temperature > 0 and tree.sampling != "deterministic"
        forwards = max(1, len(calls))
        if self.policy.forwards_for is not None:  # as the policy prices a tree of n nodes
            per_forward = self.spent_ms / forwards
            build_ms = lambda n: per_forward * self.policy.forwards_for(n, self.options)  # noqa: E731
        else:  # the forwards this tree's first n nodes took
            build_ms = lambda n: sum(interpolate_ms(self.draft_ms, k) for size, k in calls if size <= n)  # noqa: E731
        tree, old_ids, self.bins = auto_tree(
            self.state,
            tree,
            sampled,
            self.target_ms,
            build_ms,
            self.spent_ms,
            per_forward=-(-tree.size // forwards),
            grows_by_values=self.policy.grows_by_value and sampled,
            sets_cap=self.asked >= self.state.cap and not undrafted,  # else sized by the answer's end
            copied=tree.copied_after if undrafted and tree.size else 0,
        )
        return tree, old_ids

    def pad_to(self, n: int) -> int:
        return padded_size(self.measured_ms, n)

    def learn(self, tree: Tree, accepted: list[int]) -> None:
        step_ms = self.spent_ms + interpolate_ms(self.target_ms, len(tree))
        auto_update(self.state, tree, self.bins, accepted, step_ms)


def budget_controller(
    pair, policy: Policy, budget: int | str, options: dict, temperature: float, state: AutoState | None = None
) -> Budget:
    if budget == "auto":
        return AutoBudget(pair, policy, options, temperature, state)
    return FixedBudget(budget)
