"""Commands that measure: bench, report, replay, recommend, calibrate."""

from __future__ import annotations

import argparse
import sys

from dyspec.cli.common import (
    SPREAD_HELP,
    THIS_MACHINE_FLAG,
    add_model_args,
    add_option_arg,
    budget,
    command_line,
    csv,
    pair_of,
    priced_pair,
)
from dyspec.defaults import BENCH_POLICIES, DEFAULTS, defaults_for
from dyspec.errors import DyspecError
from dyspec.export import ENGINES

REPLAY_POLICIES = ("chain", "specinfer", "sequoia", "dyspec")
REPLAY_BUDGETS = (2, 4, 8, 16, 32, 64, 128)


def cmd_bench(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.auto.profile import measure_profile
    from dyspec.eval.bench import BenchConfig, auto_table, markdown_table, run_bench, write_report
    from dyspec.eval.summary import summarize
    from dyspec.load import pick_device

    out = Path(args.out)
    if out.is_dir():
        raise DyspecError(f"--out {out} is a folder; give a file for the records, such as {out / 'results.jsonl'}")
    options = dict(args.option)
    config = BenchConfig(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        spread=args.spread,
        policies=args.policies,
        budgets=args.budgets or defaults_for(pick_device(args.device)).bench_budgets,
        temperatures=args.temperatures,
        seeds=args.seeds,
        max_new_tokens=args.max_new_tokens,
        options={p: options for p in args.policies} if options else None,
    )
    pair, models = priced_pair([args.whatif] if args.whatif else [], lambda: pair_of(args))
    records = run_bench(pair, config, out, resume=args.resume, command=command_line())
    report = out.with_suffix(".html")
    write_report(records, report, measure_profile(pair) if args.profile else None, models)
    rows = summarize(records)
    print(markdown_table(rows, records, models))
    if compared := auto_table(records, rows):
        print(f"\n{compared}")
    print(f"records: {out}  report: {report}", file=sys.stderr)


def add_bench(sub) -> None:
    b = sub.add_parser("bench", help="policies x budgets x temperatures on a prompt set, with a report")
    b.add_argument("--dataset", default="mtbench", help="mtbench, gsm8k, humaneval, or a .jsonl file of prompts")
    b.add_argument("--num-prompts", type=int, default=10)
    b.add_argument("--spread", action="store_true", help=SPREAD_HELP)
    b.add_argument(
        "--policies",
        type=csv(str),
        default=BENCH_POLICIES,
        help="comma-separated; besides the engine's policies: hf (model.generate), hf-assisted (with the pair's "
        "independent draft, on a CPU else the target's int8 copy), hf-lookup, and with the llamacpp extra llamacpp and "
        "llamacpp-lookup (the target's GGUF), and default (the device's default policy with its options: "
        + "; ".join(f"{device}: {d.spec}" for device, d in DEFAULTS.items())
        + "); a policy may carry options, e.g. specdecpp:h=0.3 "
        f"(default: {','.join(BENCH_POLICIES)})",
    )
    b.add_argument(
        "--budgets",
        type=csv(budget),
        default=None,
        help="comma-separated; 'auto' allowed (default: the device's, "
        + "; ".join(f"{device}: {','.join(map(str, d.bench_budgets))}" for device, d in DEFAULTS.items())
        + ")",
    )
    b.add_argument("--temperatures", type=csv(float), default=(0.0,))
    b.add_argument("--seeds", type=csv(int), default=(0,))
    b.add_argument("--max-new-tokens", type=int, default=64)
    add_option_arg(b, "a policy option passed to every policy (repeatable)")
    b.add_argument("--out", default="bench-out/results.jsonl", help="JSONL records; the report goes beside it")
    b.add_argument("--resume", action="store_true", help="keep the records in --out and run only what is missing")
    b.add_argument("--profile", action="store_true", help="also measure the latency profile t(n) for the report")
    b.add_argument(
        "--whatif",
        metavar="PROFILE",
        help="also show each row's speedup modelled on other hardware from the run's own trees: a file from "
        "`dyspec profile --json`, a shipped example (h100), or `this` (this machine's profile: the model's "
        "check against the measured column)",
    )
    add_model_args(b)
    b.set_defaults(func=cmd_bench)


def cmd_report(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.auto.whatif import load_profile
    from dyspec.eval.report import results_page

    print(results_page([Path(f) for f in args.records], args.title, [load_profile(w) for w in args.whatif]))


def add_report(sub) -> None:
    rp = sub.add_parser("report", help="a results page in Markdown from bench records, stamped with how they were made")
    rp.add_argument("records", nargs="+", help="JSONL files written by `dyspec bench --out`; one section each")
    rp.add_argument("--title", default="Results", help="the page's title")
    rp.add_argument(
        "--whatif",
        metavar="PROFILE",
        action="append",
        default=[],
        help="as for bench: a column modelled on other hardware (repeatable)",
    )
    rp.set_defaults(func=cmd_report)


def cmd_replay(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.eval.prompts import load_prompts
    from dyspec.eval.sweep import REPLAY_NOTE, check_sweep, run_sweep, sweep_rows, sweep_table

    check_sweep(args.policies, args.budgets, args.max_new_tokens)  # before the models load
    prompts = [("prompt", args.prompt)] if args.prompt else load_prompts(args.dataset, args.num_prompts, args.spread)
    pair, models = priced_pair(args.whatif or [THIS_MACHINE_FLAG, "h100"], lambda: pair_of(args))
    dataset, out = "prompt" if args.prompt else args.dataset, Path(args.out)
    records = run_sweep(pair, dataset, prompts, args.policies, args.budgets, args.max_new_tokens, out, command_line())
    print(sweep_table(sweep_rows(records, models)))
    print(f"{REPLAY_NOTE}\nrecords: {out}", file=sys.stderr)


def add_replay(sub) -> None:
    rl = sub.add_parser(
        "replay",
        help="policies x budgets replayed along the target's greedy answers (T = 0): exact trees and "
        "tokens per forward at the draft's cost alone, with speedups modelled per hardware",
    )
    source = rl.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="one prompt (instead of --dataset)")
    source.add_argument("--dataset", default="mtbench", help="as for bench")
    rl.add_argument("--num-prompts", type=int, default=10)
    rl.add_argument("--spread", action="store_true", help=SPREAD_HELP)
    rl.add_argument(
        "--policies",
        type=csv(str),
        default=REPLAY_POLICIES,
        help=f"NAME[:OPTION=VALUE...] as for bench (default: {','.join(REPLAY_POLICIES)})",
    )
    rl.add_argument(
        "--budgets",
        type=csv(budget),
        default=REPLAY_BUDGETS,
        help=f"up to 256; 'auto' allowed (default: {','.join(map(str, REPLAY_BUDGETS))})",
    )
    rl.add_argument("--max-new-tokens", type=int, default=64)
    rl.add_argument("--out", default="bench-out/replay.jsonl", help="JSONL records (`dyspec report` makes a page)")
    rl.add_argument(
        "--whatif",
        metavar="PROFILE",
        action="append",
        help="price the trees on this hardware: a file from `dyspec profile --json`, a shipped example (h100), "
        "or `this` (this machine's profile); repeatable (default: this and h100)",
    )
    add_model_args(rl)
    rl.set_defaults(func=cmd_replay)


def cmd_recommend(args: argparse.Namespace) -> None:
    from dyspec.eval.prompts import load_prompts
    from dyspec.eval.recommend import recommend, recommend_table
    from dyspec.policies import get_policy

    pair, (model,) = priced_pair([args.profile or THIS_MACHINE_FLAG], lambda: pair_of(args))
    if pair.draft is None:
        raise DyspecError("recommend measures what a draft proposes: give --draft")
    acceptance = None
    if args.engine == "vllm":  # its static trees are shortlisted by the pair's acceptance vector
        acceptance = get_policy("sequoia").prepare(pair, args.temperature, {})["acceptance"]
    prompts = [text for _, text in load_prompts(args.dataset, args.num_prompts, spread=True)]
    rows = recommend(pair, prompts, model, args.engine, args.temperature, args.max_new_tokens, acceptance)
    print(recommend_table(rows, model))
    best = rows[0]
    print(f"\nrecommended ({best['speedup']:.2f}x modelled on {model.name}):\n{best['setting'].config}")


def add_recommend(sub) -> None:
    rc = sub.add_parser("recommend", help="a serving engine's speculative settings, measured on your pair and prompts")
    rc.add_argument("--engine", default="sglang", choices=ENGINES)
    rc.add_argument(
        "--profile",
        help="latency profile to price with: a `dyspec profile --json` file or a shipped "
        "name such as h100 (default: this machine's)",
    )
    rc.add_argument("--dataset", default="mtbench", help="prompts (default: %(default)s, spread over the set)")
    rc.add_argument("--num-prompts", type=int, default=10)
    rc.add_argument("--max-new-tokens", type=int, default=32)
    rc.add_argument("--temperature", type=float, default=0.0)
    add_model_args(rc)
    rc.set_defaults(func=cmd_recommend)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from dyspec.eval.calibrate import calibrate
    from dyspec.policies.sequoia import acceptance_path

    pair = pair_of(args)
    if pair.draft is None:
        raise DyspecError("calibrate measures a draft's acceptance: give --draft")
    saved = calibrate(pair, args.temperatures, args.num_prompts, args.width)
    for t, a in saved["acceptance"].items():
        print(f"T={t}: " + " ".join(f"{x:.3f}" for x in a))
    print(f"saved for sequoia: {acceptance_path(pair)}", file=sys.stderr)


def add_calibrate(sub) -> None:
    ca = sub.add_parser("calibrate", help="measure the acceptance vector Sequoia's optimal tree is built from")
    ca.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6, 1.0], help="(default: %(default)s)")
    ca.add_argument("--num-prompts", type=int, default=10, help="IFEval prompts to decode (default: %(default)s)")
    ca.add_argument("--width", type=int, default=16, help="children drawn per step (default: %(default)s)")
    add_model_args(ca)
    ca.set_defaults(func=cmd_calibrate)
