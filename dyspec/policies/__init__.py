"""Tree policies. Each module builds one step's draft tree and knows nothing of the loop; it
declares what it needs and offers as `POLICY = Policy(...)` (dyspec.core.contract), checked
when it is made:

    build(draft, root, budget, temperature, generator, **options) -> Tree

To add a policy, write such a module and add its POLICY to POLICIES below.
"""

from __future__ import annotations

import json

from dyspec.core.contract import Policy
from dyspec.errors import DyspecError
from dyspec.policies import (
    ar,
    chain,
    dyspec,
    dyspec_threshold,
    eagle2,
    lookup,
    recycling,
    sequoia,
    sglang,
    specdecpp,
    specinfer,
    suffix,
)

POLICIES: dict[str, Policy] = {
    m.POLICY.name: m.POLICY
    for m in (
        ar,
        chain,
        specinfer,
        sequoia,
        dyspec,
        dyspec_threshold,
        eagle2,
        sglang,
        specdecpp,
        lookup,
        suffix,
        recycling,
    )
}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise DyspecError(f"unknown policy '{name}'; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name]


def available_policies(pair) -> list[str]:
    """The policies a view can offer for `pair`: those that need a draft only when it has one, and
    those that need trained parts (SpecDec++'s head) only when the parts ship for the pair."""
    return [
        name
        for name, policy in POLICIES.items()
        if (pair.draft is not None or not policy.needs_draft) and policy.available(pair)
    ]


def replayable(name: str) -> bool:
    """Whether a replay can run the policy: not one that learns from the target's logits."""
    return get_policy(name).learn is None


def policy_options(name: str) -> dict:
    """The options a policy takes beyond budget and temperature, with their defaults."""
    return get_policy(name).options


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


def parse_policy_spec(spec: str) -> tuple[str, dict]:
    """`NAME[:OPTION=VALUE...]`, e.g. `specdecpp:h=0.3`, so one run can compare option values."""
    name, *options = spec.split(":")
    try:
        return name, dict(parse_option(text) for text in options)
    except DyspecError as e:
        raise DyspecError(f"bad policy spec '{spec}' ({e}): use NAME:OPTION=VALUE, e.g. specdecpp:h=0.3") from None
