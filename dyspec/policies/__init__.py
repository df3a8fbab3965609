"""Tree policies. Each module builds one step's draft tree and knows nothing of the loop:

    build(draft, root, budget, temperature, generator, **options) -> Tree
    NEEDS_DRAFT: bool
    prepare(pair, temperature, budget, options) -> options   (optional: once per generation)

To add a policy, write such a module and register it here.
"""

from __future__ import annotations

import inspect
from types import ModuleType

from dyspec.errors import DyspecError
from dyspec.policies import ar, chain, dyspec, dyspec_threshold, eagle2, sequoia, specinfer

POLICIES: dict[str, ModuleType] = {
    "ar": ar,
    "chain": chain,
    "specinfer": specinfer,
    "sequoia": sequoia,
    "dyspec": dyspec,
    "dyspec-threshold": dyspec_threshold,
    "eagle2": eagle2,
}


def get_policy(name: str) -> ModuleType:
    if name not in POLICIES:
        raise DyspecError(f"unknown policy '{name}'; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name]


def policy_options(name: str) -> dict:
    """The options a policy takes beyond budget and temperature, with their defaults."""
    params = inspect.signature(get_policy(name).build).parameters
    return {k: p.default for k, p in params.items() if p.kind is p.KEYWORD_ONLY}


def check_options(name: str, options: dict) -> None:
    unknown = set(options) - set(policy_options(name))
    if unknown:
        known = ", ".join(policy_options(name)) or "none"
        raise DyspecError(f"policy '{name}' has no option {', '.join(sorted(unknown))} (its options: {known})")
