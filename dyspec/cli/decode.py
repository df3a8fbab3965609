"""Commands that decode: generate, profile, export."""

from __future__ import annotations

import argparse
import json
import sys

from dyspec.cli.common import add_decoding_args, add_model_args, command_line, csv, pair_of
from dyspec.defaults import policy_spec, settings
from dyspec.errors import DyspecError
from dyspec.export import FORMATS


def cmd_generate(args: argparse.Namespace) -> None:
    from dyspec.decode.engine import check_settings, generate
    from dyspec.load import pick_device

    # checked before a model loads; the pair's int8 kernel may pick another default budget
    policy, budget, options = settings(pick_device(args.device), args.policy, args.budget, dict(args.option))
    check_settings(policy, budget, args.temperature, args.max_new_tokens, options)
    pair = pair_of(args)
    result = generate(
        pair,
        args.prompt,
        policy=policy,
        budget=args.budget,
        temperature=args.temperature,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        options=options,
    )
    if args.json:
        print(json.dumps(result.to_dict()))
        return
    print(result.text)
    print(
        f"[{policy_spec(result.policy, options)} budget={result.budget} T={result.temperature}; "
        f"{pair.precision} target, draft "
        f"{pair.drafts_label}, fast path {pair.fast_path}] {result.new_tokens} tokens in "
        f"{result.target_forwards} target forwards ({result.tokens_per_forward:.2f} per forward), "
        f"{result.wall_s:.2f} s, {result.tokens_per_s:.1f} tokens/s",
        file=sys.stderr,
    )


def add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text from one prompt")
    g.add_argument("--prompt", required=True)
    add_decoding_args(g)
    add_model_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    g.set_defaults(func=cmd_generate)


def cmd_profile(args: argparse.Namespace) -> None:
    from dyspec.auto.profile import CONTEXT, LONG_SIZES, measure_profile, profile_path, profile_table
    from dyspec.cache import write_cache
    from dyspec.eval.anatomy import ANATOMY_STEPS, anatomy, anatomy_table, stamp_line
    from dyspec.eval.bench import profile_stamp
    from dyspec.eval.peers import llamacpp_forward_ms
    from dyspec.eval.prompts import load_prompts
    from dyspec.eval.speedup import default_step_text

    if args.shape:
        pair, profile = shaped_profile(args)
        print(json.dumps(profile | profile_stamp(pair, command_line())) if args.json else profile_table(profile))
        return
    pair = pair_of(args)
    if args.steps:
        ((_, prompt),) = load_prompts("mtbench", 1)
        steps = anatomy(pair, prompt, args.policies or ANATOMY_STEPS, temperature=args.temperature)
        stamp = profile_stamp(pair, command_line())
        record = {"anatomy": steps, "temperature": args.temperature} | stamp
        print(json.dumps(record) if args.json else f"{anatomy_table(steps)}\n\n{stamp_line(stamp)}")
        return
    profile = measure_profile(pair)
    if pair.device.type == "cpu":
        try:  # the plain decoding users already have, beside dyspec's forwards
            profile["llamacpp"] = {str(n): ms for n, ms in llamacpp_forward_ms(pair, LONG_SIZES, CONTEXT).items()}
        except DyspecError as e:
            print(f"llama.cpp not measured: {e}", file=sys.stderr)
    # what `--budget auto` reads for this pair from now on: a profile taken while the machine was
    # busy misleads it until measured again
    write_cache(profile_path(pair), json.dumps(profile))
    print(f"saved for --budget auto: {profile_path(pair)}", file=sys.stderr)
    ((_, prompt),) = load_prompts("mtbench", 1)
    steps = anatomy(pair, prompt)
    if args.json:
        print(json.dumps(profile | {"anatomy": steps} | profile_stamp(pair, command_line())))
        return
    print(profile_table(profile))
    print(f"a step on an MT-Bench question, {default_step_text(pair, prompt)}")
    print("what a step does beside the two models' forwards (on a GPU each op is a launch, each read a stall):")
    print(anatomy_table(steps))


SHAPE_STEPS = (("ar", 1), ("chain", 8), ("dyspec", 16), ("dyspec", 64))  # the steps `--shape` times
PROMPT_TOKENS = 100


def shaped_profile(args: argparse.Namespace) -> tuple:
    """A pair of a published shape with random weights (dyspec.load.shapes), and its profile with
    the time of a step of a few policies (a random draft is never right: each step drafts its whole
    budget)."""
    import torch

    from dyspec.auto.profile import DEFAULT_SIZES, measure_profile
    from dyspec.eval.speedup import step_splits
    from dyspec.forward.choose import pick_fast_path
    from dyspec.load.loading import pick_device, pick_dtype
    from dyspec.load.shapes import shaped_pair

    if args.precision not in ("auto", "native"):
        raise DyspecError("--shape measures the native precision (bf16 on a GPU, fp32 on a CPU)")
    device = pick_device(args.device)
    pair = shaped_pair(args.shape, device, pick_dtype(device), pick_fast_path(args.fast_path, device, "native"))
    profile = {"shape": args.shape, **measure_profile(pair, baseline=False, sizes=args.sizes or DEFAULT_SIZES)}
    prompt = torch.randint(pair.target.config.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    profile["steps"] = step_splits(pair, prompt.tolist(), SHAPE_STEPS, max_new_tokens=32)
    return pair, profile


def add_profile(sub) -> None:
    pr = sub.add_parser("profile", help="measure forward latency t(n) of target and draft")
    add_model_args(pr)
    pr.add_argument("--json", action="store_true")
    pr.add_argument(
        "--shape",
        help="instead of --target and --draft: a target of this published shape (llama-3.1-8b, smollm2-135m) "
        "with an EAGLE-3-shaped draft, random weights made on the device (latency depends on shapes, not "
        "on weights)",
    )
    pr.add_argument("--sizes", type=csv(int), help="with --shape: the tree sizes n to time (default: 1-16, ..., 80)")
    pr.add_argument(
        "--steps",
        action="store_true",
        help="only what a step of each policy does beside the forwards: ops, host reads, host time",
    )
    pr.add_argument(
        "--temperature", type=float, default=0.0, help="with --steps: the temperature the steps run at (default: 0)"
    )
    pr.add_argument(
        "--policies",
        type=csv(step_setting),
        help="with --steps: the steps to count, POLICY[:OPTION=VALUE...]@BUDGET, comma-separated, e.g. "
        "dyspec:step=device@16,dyspec:step=device@auto (default: each policy at the budgets its docs table shows)",
    )
    pr.set_defaults(func=cmd_profile)


def step_setting(text: str) -> tuple[str, int | str]:
    """`dyspec:step=device@16` -> ("dyspec:step=device", 16); a budget may be `auto`."""
    spec, at, budget = text.rpartition("@")
    if not (at and spec and (budget == "auto" or budget.isdigit() and int(budget) > 0)):
        raise argparse.ArgumentTypeError(f"expected POLICY@BUDGET, e.g. dyspec:step=device@16; got {text!r}")
    return spec, budget if budget == "auto" else int(budget)


def cmd_export(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.eval.prompts import load_prompts
    from dyspec.export import TreeSource, export, export_tree, write
    from dyspec.policies import get_policy
    from dyspec.policies.sequoia import tree_score

    if args.format == "sequoia" and not args.out:
        raise DyspecError("a Sequoia growmap is a torch file: give --out FILE.pt")
    grown = args.source != "sequoia"
    if grown:
        get_policy(args.source)  # an unknown name fails before a model loads
    prompts = tuple(p for _, p in load_prompts(args.dataset, args.num_prompts, spread=True)) if grown else ()
    source = TreeSource(
        args.source, args.budget, args.temperature, args.acceptance, args.max_depth, prompts, args.max_new_tokens
    )
    pair = pair_of(args) if grown or args.acceptance is None else None
    parents, acceptance, said = export_tree(pair, source, level_uniform=args.format == "vllm" and args.nearest)
    snippet, obj = export(parents, args.format, acceptance)
    print(f"# {said}", file=sys.stderr)
    if acceptance is not None:
        print(f"# expected tokens per step: {tree_score(parents, acceptance):.2f}", file=sys.stderr)
    print(snippet)
    if args.out:
        write(obj, Path(args.out))
        print(f"written: {args.out}", file=sys.stderr)


def add_export(sub) -> None:
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
