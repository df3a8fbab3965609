"""The `dyspec` command line. Each command's module declares its arguments and runs it by calling the
library: decode.py (generate, profile, export), measure.py (bench, report, replay, recommend,
calibrate), train.py (distill, fit-copy, train-head); common.py holds what they share. Errors are
one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import sys

from dyspec.cli import decode, measure, train
from dyspec.cli.common import Parser
from dyspec.errors import DyspecError
from dyspec.forward import thread

COMMANDS = (  # in the order `dyspec --help` lists them
    decode.add_generate,
    measure.add_bench,
    measure.add_report,
    measure.add_replay,
    decode.add_profile,
    decode.add_export,
    measure.add_recommend,
    measure.add_calibrate,
    train.add_distill,
    train.add_fit_copy,
    train.add_draft_vocab,
    train.add_train_head,
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dyspec", description="Speculative decoding with token trees.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        thread.run(args.func, args)  # every model of the command on the model thread
    except DyspecError as e:
        print(f"dyspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dyspec: interrupted", file=sys.stderr)
        return 130
    return 0
