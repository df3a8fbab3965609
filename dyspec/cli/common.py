"""What the commands share: the parser that says where to look on a mistake, argument types, the
model and decoding arguments, and the what-if hardware a command prices on."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence

from dyspec.auto.whatif import LatencyModel, from_profile, load_profile
from dyspec.defaults import DEFAULTS
from dyspec.errors import DyspecError
from dyspec.forward.choose import FAST_PATHS
from dyspec.load import DEFAULT_DRAFT, DEFAULT_TARGET, PRECISIONS, ModelPair
from dyspec.policies import parse_option

THIS_MACHINE_FLAG = "this"
SPREAD_HELP = (
    "take the prompts evenly spaced over the set, not the first ones (MT-Bench's file is ordered by "
    "category: its first 10 are all writing)"
)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"dyspec: error: {message} (see dyspec {self.prog.split()[-1]} --help)\n")


def option(text: str) -> tuple[str, object]:
    try:
        return parse_option(text)
    except DyspecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got '{text}'") from None


def csv(kind):
    def parse(text: str):
        try:
            return tuple(kind(x) for x in text.split(",") if x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got '{text}'") from None

    return parse


def command_line() -> str:
    """The command as typed, for the records' stamp."""
    return shlex.join(["dyspec", *sys.argv[1:]])


def add_model_args(p: argparse.ArgumentParser, with_draft: bool = True) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="hub id, local folder or .gguf file (default: %(default)s)")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    p.add_argument("--allow-download", action="store_true", help="let hub ids download (default: local cache only)")
    if not with_draft:
        return
    p.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help="auto (default): distilled, the feature draft shipped for the target, where one ships; else int8 "
        "for an fp32 target on a CPU, else truncated:2. Or: as --target; a folder made by `dyspec distill`; "
        "int8 (the target with int8 layers, drafting for the fp32 target on a CPU); truncated:N (its first N "
        "layers, untrained); eagle:PATH (a published EAGLE-1/2 or EAGLE-3 draft: a folder, or a hub id); "
        "medusa:PATH (published Medusa heads, likewise); "
        "self. Several, comma-separated (int8,distilled), are merged into one tree by "
        "specinfer; other policies use the first",
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=PRECISIONS,
        help="auto (default): int8 Linear layers on a CPU (the fast path; outputs exact for that int8 "
        "model), bf16 on a GPU; with --draft int8 on a CPU, fp32. fp32: the target's fp32 weights as they "
        "are, greedy outputs token-identical to autoregressive on a GPU too",
    )
    p.add_argument(
        "--fast-path",
        default="auto",
        choices=("auto", *FAST_PATHS),
        help="auto (default): compiled on a CPU with int8 layers (lean at fp32 or without a C++ compiler), off "
        "elsewhere. lean: dyspec's own forward for the Llama family (fused products, a preallocated cache; "
        "other models run off). off: the Hugging Face forward over a growing cache, the reference. static: a "
        "preallocated cache written in place and forwards at bucketed sizes; compiled: static, each bucket's "
        "forward compiled once (CUDA graphs on a GPU; cached across runs); with int8 on a CPU, the lean "
        "forward's layers compiled with dyspec's kernels: ~1.75x lean's speed or more, 40 s of compiling at "
        "the first generation on a machine, ~3 s of loading in later processes",
    )


def pair_of(args: argparse.Namespace, draft: str | None = None) -> ModelPair:
    """The pair that `add_model_args`' options name; `draft` in place of --draft."""
    from dyspec.load import load_pair

    return load_pair(
        args.target,
        draft or args.draft,
        args.device,
        allow_download=args.allow_download,
        precision=args.precision,
        fast_path=args.fast_path,
    )


def add_option_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--option", type=option, action="append", default=[], metavar="NAME=VALUE", help=help)


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    defaults = "; ".join(f"{device}: {d.text}" for device, d in DEFAULTS.items())
    p.add_argument(
        "--policy", default=None, help=f"decoding policy (default: the fastest measured on the device: {defaults})"
    )
    p.add_argument(
        "--budget",
        type=budget,
        default=None,
        help="drafted tokens per step: K for chain, tree size for trees; 'auto' sizes each step's tree "
        "by expected gain against the measured latency profile (default: the device's, as for --policy)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_option_arg(p, "a policy option, e.g. --option max_depth=8 (repeatable)")


def priced_pair(names: Sequence[str], load: Callable[[], ModelPair]) -> tuple[ModelPair, list[LatencyModel]]:
    """The pair `load` gives and a latency model per what-if name: a `dyspec profile --json` file,
    a shipped profile (h100), or `this` (this machine's measured profile). Files and shipped names
    are read before the pair loads, so that a wrong one fails at once."""
    read = {name: load_profile(name) for name in names if name != THIS_MACHINE_FLAG}
    pair = load()
    if THIS_MACHINE_FLAG in names:
        from dyspec.auto.profile import pair_profile

        read[THIS_MACHINE_FLAG] = from_profile(pair_profile(pair), "this machine")
    return pair, [read[name] for name in names]
