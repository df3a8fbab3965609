"""Tree policies. Each module builds one step's draft tree and knows nothing of the loop:

    build(draft, root, budget, temperature, generator, **options) -> Tree
    NEEDS_DRAFT: bool
    MULTI_DRAFT: bool   (optional: build() gets the list of every loaded draft instead of the first)
    prepare(pair, temperature, budget, options) -> options   (optional: once per generation)
    available(pair) -> bool   (optional: whether the policy can run on this pair with its defaults)
    AUTO_RATES: bool   (optional: build() takes `auto_rates`, what `--budget auto` learnt)
    GROWS_BY_VALUE: bool   (optional: the tree at a smaller budget is about the most valuable part
        of a bigger one, so under `--budget auto` the next cap follows the nodes the cut kept)
    FREE_NODES: bool   (optional: build() takes `free_budget`, how many nodes it may add that need
        no draft forward (lookup's copies, with the length of the match they follow in
        `tree.extra["match"]`); under `--budget auto` the tokens left bound those, not the cap
        learnt from draft trees, and the engine's cut sizes them)

To add a policy, write such a module and register it here.
"""

from __future__ import annotations

import inspect
import json
from types import ModuleType

from dyspec.errors import DyspecError
from dyspec.policies import ar, chain, dyspec, dyspec_threshold, eagle2, lookup, sequoia, specdecpp, specinfer

POLICIES: dict[str, ModuleType] = {
    "ar": ar,
    "chain": chain,
    "specinfer": specinfer,
    "sequoia": sequoia,
    "dyspec": dyspec,
    "dyspec-threshold": dyspec_threshold,
    "eagle2": eagle2,
    "specdecpp": specdecpp,
    "lookup": lookup,
}


def get_policy(name: str) -> ModuleType:
    if name not in POLICIES:
        raise DyspecError(f"unknown policy '{name}'; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name]


def available_policies(pair) -> list[str]:
    """The policies a view can offer for `pair`: those that need a draft only when it has one, and
    those that need trained parts (SpecDec++'s head) only when the parts ship for the pair."""
    return [
        name
        for name, module in POLICIES.items()
        if (pair.draft is not None or not module.NEEDS_DRAFT) and getattr(module, "available", lambda _: True)(pair)
    ]


ENGINE_SET = {"auto_rates", "free_budget"}  # `build` arguments the engine sets (under `--budget auto`), never a user


def policy_options(name: str) -> dict:
    """The options a policy takes beyond budget and temperature, with their defaults."""
    params = inspect.signature(get_policy(name).build).parameters
    return {k: p.default for k, p in params.items() if p.kind is p.KEYWORD_ONLY and k not in ENGINE_SET}


def check_options(name: str, options: dict) -> None:
    unknown = set(options) - set(policy_options(name))
    if unknown:
        known = ", ".join(policy_options(name)) or "none"
        raise DyspecError(f"policy '{name}' has no option {', '.join(sorted(unknown))} (its options: {known})")


def parse_option(text: str) -> tuple[str, object]:
    """`name=value`; the value is parsed as JSON where it can be (numbers, true/false), else kept as text."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise DyspecError(f"expected NAME=VALUE, got '{text}'")
    try:
        return name.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return name.replace("-", "_"), value
