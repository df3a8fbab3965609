"""The contracts between the layers above the core: what a policy needs from the decoding loop and
offers it (`Policy`, declared once in each policy module as `POLICY = Policy(...)` and checked
when the policy is made, so the loop reads fields, never a module's optional attributes), what
the loop asks a budget controller (`Budget`), and the acceptance-rate slots that `--budget auto`
learns and a policy's build reads (`slot_rate`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch

from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import TreeTensors

ENGINE_SET = ("auto_rates", "free_budget")  # `build` arguments the engine sets (under `--budget auto`), never a user
BUILD_ARGS = ("draft", "root", "budget", "temperature", "generator")


def _always(pair: Any) -> bool:
    return True


@dataclass(frozen=True)
class AutoNeeds:
    """What `--budget auto` needs of a policy, declared in one place with it."""

    rates: bool = False  # build() takes `auto_rates`, the acceptance rates `--budget auto` learnt
    grows_by_value: bool = False  # a smaller cap builds about the most valuable part of a bigger tree
    free_nodes: bool = False  # build() takes `free_budget`, nodes it may add that need no draft forward
    forwards_for: Callable[[int, dict], int] | None = None  # draft forwards a tree of n nodes takes
    shape_options: tuple[str, ...] = ()  # options that fix the tree's size, which `--budget auto` sets


@dataclass(frozen=True)
class Policy:
    name: str
    build: Callable[..., Tree]  # build(draft, root, budget, temperature, generator, **options) -> Tree
    needs_draft: bool
    # an option of a policy that needs no draft under which it drafts, where one is loaded and the
    # option is nonzero (lookup's `fallback`)
    draft_option: str | None = None
    multi_draft: bool = False  # build() gets the list of every loaded draft instead of the first
    prepare: Callable[[Any, float, dict], dict] | None = None  # prepare(pair, temperature, options): resolved once
    available: Callable[[Any], bool] = _always  # whether it runs on a pair with its defaults (trained parts)
    auto: AutoNeeds = AutoNeeds()  # what `--budget auto` needs of it
    # learn(draft, tree, logits): after each verification, what it keeps (in `draft.memo`, the pair's) of the
    # target's logits over the tree; a replay, which has no target logits, refuses such a policy
    learn: Callable[[DraftSession, Tree, Any], None] | None = None
    summary: str = ""  # one line for the views' menus, in words a newcomer reads
    # grow(draft, root, budget, temperature, generator, options) -> TreeTensors: build's tree as a tensor
    # program on the draft's device (the step on the device: dyspec.decode.step), its draws from `generator`
    # (one on that device), where on_device(temperature, options) says the step runs it; both get every
    # option, the defaults filled in; a multi-draft policy's gets the list of drafts, as its build does
    grow: Callable[[DraftSession, int, int, float, torch.Generator, dict], TreeTensors] | None = None
    on_device: Callable[[float, dict], bool] | None = None

    def __post_init__(self) -> None:
        params = inspect.signature(self.build).parameters
        positional = [n for n, p in params.items() if p.kind is not p.KEYWORD_ONLY]
        expected = ("drafts" if self.multi_draft else "draft", *BUILD_ARGS[1:])  # a multi-draft policy gets a list
        if tuple(positional) != expected:
            raise TypeError(f"policy {self.name}: build must take ({', '.join(expected)}), not {positional}")
        for flag, arg in ((self.auto.rates, "auto_rates"), (self.auto.free_nodes, "free_budget")):
            if flag != (arg in params):
                raise TypeError(f"policy {self.name}: build takes `{arg}` exactly when the policy declares it")
        if unknown := set(self.auto.shape_options) - set(self.options):
            raise TypeError(f"policy {self.name}: shape options {sorted(unknown)} are not options of build")

    def drafts(self, options: dict) -> bool:
        """Whether it asks the draft for distributions under `options` (the defaults where unset)."""
        return self.needs_draft or bool(self.draft_option and {**self.options, **options}[self.draft_option])

    @cached_property  # read at every step (`speculative_step`): the signature is inspected once
    def options(self) -> dict[str, Any]:
        """The options a user may set beyond budget and temperature, with their defaults (do not
        change the dict: it is the policy's own)."""
        params = inspect.signature(self.build).parameters
        return {k: p.default for k, p in params.items() if p.kind is p.KEYWORD_ONLY and k not in ENGINE_SET}


@dataclass(frozen=True)
class Plan:
    """What a budget controller decided before the policy builds (`Budget.plan`), handed back to its
    `cut`, `pad_to` and `learn`: the most nodes the tree may have (None: draft nothing this step)
    and the `build` arguments the controller sets. A controller may extend it with what it priced."""

    cap: int | None
    args: dict = field(default_factory=dict)


class Budget(Protocol):
    """What the speculative step asks before the policy drafts and tells after verification
    (dyspec.auto.controller has the fixed budget and `--budget auto`). The controller keeps its
    learnt state; what it decides for one step travels in the step's `Plan`."""

    def plan(self, context: int, left: int) -> Plan: ...
    def cut(
        self, plan: Plan, tree: Tree, drafts: list[DraftSession], whole: bool = False
    ) -> tuple[Tree, list[int] | None, Plan]: ...
    def pad_to(self, plan: Plan, n: int) -> int: ...
    def learn(self, plan: Plan, tree: Tree, accepted: list[int]) -> None: ...


BINS = 10  # acceptance-rate slots per sibling group (first children, later siblings), by key


def slot_bin(key: float, later: bool) -> int:
    """The bin of a key in [0, 1], BINS bins up for a later sibling."""
    return min(int(key * BINS), BINS - 1) + (BINS if later else 0)


def slot_bins(keys: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """`slot_bin` of each key (a tensor of keys, `later` broadcast with them), a key below 0 (rounding)
    in the first bin, as `slot_rate` puts it."""
    return (keys.clamp(min=0) * BINS).long().clamp(max=BINS - 1) + BINS * later


def slot_rate(rates: list[float], key: float, later: bool) -> float:
    """The learnt rate (`dyspec.auto.estimate.bin_rates`) of a sampled slot of key `key` (the sum of q^2
    over the tokens its earlier siblings left, which rounding can put a hair below 0), for a policy
    that grows by it under auto (DySpec, its threshold build)."""
    return rates[slot_bin(max(0.0, key), later)]
