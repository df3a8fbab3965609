"""The `dyspec` command line. Errors are one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys

from dyspec.errors import DyspecError
from dyspec.models import DEFAULT_TARGET, STANDIN_DRAFT


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"dyspec: error: {message} (see dyspec {self.prog.split()[-1]} --help)\n")


def _option(text: str) -> tuple[str, object]:
    """`name=value` policy option; the value is parsed as JSON when it can be (numbers, true/false)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got '{text}'")
    name, value = text.split("=", 1)
    try:
        return name.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return name.replace("-", "_"), value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="hub id, local folder or .gguf file (default: %(default)s)")
    p.add_argument("--draft", default=STANDIN_DRAFT, help="as --target, or truncated:N, or self (default: %(default)s)")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    p.add_argument("--allow-download", action="store_true", help="let hub ids download (default: local cache only)")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="chain", help="decoding policy (default: %(default)s)")
    p.add_argument("--budget", type=int, default=4, help="drafted tokens per step: K for chain, tree size for trees")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--option",
        type=_option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a policy option, e.g. --option max_depth=8 (repeatable)",
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from dyspec.engine import check_settings, generate
    from dyspec.models import load_pair

    options = dict(args.option)
    check_settings(args.policy, args.budget, args.temperature, args.max_new_tokens, options)
    pair = load_pair(args.target, args.draft, args.device, allow_download=args.allow_download)
    result = generate(
        pair,
        args.prompt,
        policy=args.policy,
        budget=args.budget,
        temperature=args.temperature,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        options=options,
    )
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.text)
        print(
            f"[{result.policy} budget={result.budget} T={result.temperature}] {result.new_tokens} tokens in "
            f"{result.target_forwards} target forwards ({result.tokens_per_forward:.2f} per forward), "
            f"{result.wall_s:.2f} s, {result.tokens_per_s:.1f} tokens/s",
            file=sys.stderr,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dyspec", description="Speculative decoding with token trees.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate text from one prompt")
    g.add_argument("--prompt", required=True)
    add_decoding_args(g)
    add_model_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DyspecError as e:
        print(f"dyspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dyspec: interrupted", file=sys.stderr)
        return 130
    return 0
