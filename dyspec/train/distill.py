"""`dyspec distill`: train a feature-conditioned draft (dyspec.drafts.feature) for any target.

Data: the target's greedy continuations of real instructions, or real conversations (ShareGPT;
both in dyspec.train.corpus), run once through the target, teacher-forced, to store its final hidden
states (fp16 shards, resumable). Teacher forcing is several times faster than generating on a
CPU, so conversations that need no generating give far more data per hour. The target's
next-token distribution at every position is recomputed from the stored features during training,
so soft labels cost no storage.

Training, EAGLE-style, unrolled to the trees' depth (EAGLE-3's training-time test): position j
reads (F[j-1], x[j]) and predicts F[j]; the loss is cross-entropy to the target's distribution over
the draft's vocabulary plus a small smooth-L1 on the features. Each further pass feeds the draft its
own predictions F^[j-1] from the pass before, as a node that deep in a tree reads them, so every
depth is trained (a draft trained on true features alone predicts poorly from its own:
docs/guide/training.md).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from dyspec.auto.profile import forward_ms
from dyspec.core.copying import MATCHES, copied
from dyspec.core.draft_model import draft_model
from dyspec.core.kv import FINAL, KVSession, target_features
from dyspec.core.sampling import to_probs
from dyspec.drafts.feature import (
    CONFIG_NAME,
    FeatureDraft,
    features_before,
    is_feature_draft,
    load_feature_draft,
    save_feature_draft,
)
from dyspec.errors import DyspecError
from dyspec.load import ModelPair
from dyspec.train.corpus import answer_prompts, continuations, sharegpt_sequences, training_prompts
from dyspec.train.vocab import draft_vocab

SHARD = 32  # sequences per feature shard
REG_WEIGHT = 0.1
SETTINGS = (
    "corpus",
    "num_prompts",
    "max_new_tokens",
    "steps",
    "batch",
    "window",
    "lr",
    "seed",
    "draft_layers",
    "unroll",
)
UNROLL = 4  # training-time test's depth: the trees' depth where most accepted tokens come from
DEPTH_WEIGHT = 0.8  # depth d's loss weighs DEPTH_WEIGHT ** (d - 1), as EAGLE-3's does
ANSWER_TEMPERATURES = (0.0, 0.7)  # the "answers" corpus: greedy and sampled answers in turn
COPY_GRID = [i / 20 for i in range(20)]  # the copy weights `fit_copy_weights` tries (< 1: see copying.mix)


@torch.inference_mode()
def collect_features(
    pair: ModelPair,
    seqs: list[list[int]],
    folder: Path,
    autocast: torch.dtype | None = None,
    layers: tuple[int, ...] = FINAL,
    batch: int = 1,
) -> list[Path]:
    """The target's hidden states at `layers` (`target_features`) at every token of every sequence,
    in shards of SHARD sequences; shards already on disk for the same tokens at these layers or
    more are kept (resume: a run with more sequences redoes the last, partial shard; other text or
    other layers in the same folder are computed anew). `autocast` (e.g. bfloat16) runs the
    teacher forcing at that precision: faster on a CPU with AMX, for features close to fp32's.
    `batch` sequences run as one right-padded forward (`teacher_batch`)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in tqdm(range(0, len(seqs), SHARD), desc="target features", unit="shard"):
        path = folder / f"features-{i // SHARD:04d}.safetensors"
        chunk = seqs[i : i + SHARD]
        if not path.exists() or not _shard_serves(path, [t for s in chunk for t in s], layers):
            with torch.autocast(pair.device.type, dtype=autocast, enabled=autocast is not None):
                feats = [
                    f for j in range(0, len(chunk), batch) for f in teacher_forced(pair, chunk[j : j + batch], layers)
                ]
            save_file(
                {
                    "tokens": torch.tensor([t for s in chunk for t in s], dtype=torch.int32),
                    "lengths": torch.tensor([len(s) for s in chunk], dtype=torch.int32),
                    "layers": torch.tensor(layers, dtype=torch.int32),
                    "features": torch.cat(feats).half().cpu(),
                },
                path,
            )
        paths.append(path)
    return paths


def teacher_batch(device: torch.device) -> int:
    """Sequences per teacher-forced forward: one on a CPU, where padding only adds work; 16 on a GPU,
    which one sequence of a thousand tokens leaves mostly idle."""
    return 1 if device.type == "cpu" else 16


def teacher_forced(pair: ModelPair, seqs: list[list[int]], layers: tuple[int, ...]) -> list[torch.Tensor]:
    """The target's hidden states at `layers` for each sequence [len, width], the sequences run as
    one right-padded forward (padding after a causal sequence changes nothing before it). Logits
    are computed for the last position only: the output layer over every position would be the
    forward's largest product, and training recomputes the distributions from the features."""
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long, device=pair.device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    out = pair.target(ids, output_hidden_states=True, logits_to_keep=1)
    return [f[: len(s)] for f, s in zip(target_features(out.hidden_states, layers), seqs)]


def _shard_serves(path: Path, tokens: list[int], layers: tuple[int, ...]) -> bool:
    """Whether a shard holds these tokens' features at these layers, or at more (shards from before
    layers were stored hold the final one)."""
    with safe_open(path, "pt") as f:
        stored = f.get_tensor("layers").tolist() if "layers" in f.keys() else list(FINAL)
        return set(layers) <= set(stored) and f.get_tensor("tokens").tolist() == tokens


def load_sequences(paths: list[Path], layers: tuple[int, ...] = FINAL) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens [L], features [L, len(layers) x H] fp16) per sequence: the shards' hidden states at
    `layers`, which they must hold (shards of more layers serve a draft that reads fewer)."""
    out = []
    for path in paths:
        shard = load_file(path)
        stored = shard["layers"].tolist() if "layers" in shard else list(FINAL)
        if missing := sorted(set(layers) - set(stored)):
            raise DyspecError(f"{path} holds the target's layers {stored}, not {missing}: collect them anew")
        H = shard["features"].shape[1] // len(stored)
        columns = torch.cat([torch.arange(H) + stored.index(i) * H for i in layers])
        features = shard["features"] if list(layers) == stored else shard["features"][:, columns]
        lengths = shard["lengths"].tolist()
        out += zip(shard["tokens"].long().split(lengths), features.split(lengths))
    return out


def windows(
    seqs: list[tuple[torch.Tensor, torch.Tensor]], length: int, hidden_size: int
) -> list[tuple[torch.Tensor, ...]]:
    """Training windows of at most `length` tokens: (tokens x, the final-layer features F [n, H],
    the target features before each token F_prev [n, feature width]; zeros before a sequence's
    first token)."""
    out = []
    for tokens, feats in seqs:
        prev = features_before(feats)
        for s in range(0, len(tokens), length):
            out.append((tokens[s : s + length], feats[s : s + length, -hidden_size:], prev[s : s + length]))
    return out


def collate(batch: list[tuple[torch.Tensor, ...]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Right-padded tensors and a mask of real positions (padding after a causal window changes
    nothing before it)."""
    n = max(len(x) for x, _, _ in batch)
    x = torch.zeros(len(batch), n, dtype=torch.long)
    F, prev = torch.zeros(len(batch), n, batch[0][1].shape[1]), torch.zeros(len(batch), n, batch[0][2].shape[1])
    mask = torch.zeros(len(batch), n, dtype=torch.bool)
    for i, (xi, fi, pi) in enumerate(batch):
        x[i, : len(xi)], F[i, : len(xi)], prev[i, : len(xi)], mask[i, : len(xi)] = xi, fi.float(), pi.float(), True
    return tuple(t.to(device) for t in (x, F, prev, mask))


def unrolled(draft: FeatureDraft, x: torch.Tensor, prev: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Predicted features at depths 1 to `depth`: depth 1 reads the target's features, depth d the
    draft's own depth d-1 prediction for the token before (the first token of a window reads the
    target's), so position j at depth d guesses token j+1 as a tree node d levels below the last
    verified token does."""
    positions = torch.arange(x.shape[1], device=x.device)[None].expand_as(x)
    first = draft.fused(prev[:, :1])
    out = [draft.predict(x, prev, positions)]
    for _ in range(depth - 1):
        out.append(draft.predict(x, torch.cat([first, out[-1][:, :-1]], dim=1), positions))
    return out


def unrolled_loss(draft: FeatureDraft, fs: list[torch.Tensor], F: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-position loss summed over depths, depth d weighted DEPTH_WEIGHT ** (d - 1)."""
    return sum(DEPTH_WEIGHT**d * loss_terms(draft, f, F, scale) for d, f in enumerate(fs))


def loss_terms(draft: FeatureDraft, f: torch.Tensor, F: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-position loss: cross-entropy to the target's distribution over the draft's vocabulary,
    plus REG_WEIGHT x smooth-L1 between predicted and real features (in units of their std)."""
    with torch.no_grad():
        p = torch.softmax(draft.subset_logits(F), dim=-1)
    ce = -(p * torch.log_softmax(draft.subset_logits(f), dim=-1)).sum(-1)
    reg = torch.nn.functional.smooth_l1_loss(f / scale, F / scale, reduction="none").mean(-1)
    return ce + REG_WEIGHT * reg


@torch.no_grad()
def evaluate(draft: FeatureDraft, head: torch.Tensor, batches: list, scale: float, depth: int) -> dict:
    """Held-out loss, and at depths 1 to `depth`: top-1 agreement with the target (full vocabulary)
    and alpha = sum min(p, q) at T = 1, the expected acceptance of one drafted token."""
    total = {"loss": 0.0} | {f"{m}_d{d}": 0.0 for d in range(1, depth + 1) for m in ("top1", "alpha")}
    count = 0
    draft.eval()
    for x, F, prev, mask in batches:
        fs = unrolled(draft, x, prev, depth)
        total["loss"] += float(unrolled_loss(draft, fs, F, scale)[mask].sum())
        F = F[mask]
        p = torch.softmax(F @ head.T, dim=-1)
        for d, f in enumerate(fs, 1):
            q = torch.zeros_like(p)
            q[:, draft.vocab] = torch.softmax(draft.subset_logits(f[mask]), dim=-1)
            total[f"top1_d{d}"] += float((q.argmax(-1) == p.argmax(-1)).sum())
            total[f"alpha_d{d}"] += float(torch.minimum(p, q).sum())
        count += int(mask.sum())
    draft.train()
    return {k: v / max(count, 1) for k, v in total.items()}


def corpus_texts(
    pair: ModelPair,
    corpus: str,
    count: int,
    prompts: list | None,
    max_new_tokens: int,
    out: Path,
    answerer: ModelPair | None = None,
) -> list:
    """Token ids of one corpus: "continuations" (the target's own greedy answers to `count` training
    prompts, generated into out/continuations.jsonl), "answers" (`answerer`'s, by default the
    target's, greedy and sampled answers to `count` of `answer_prompts`, or of `prompts`, generated
    into out/answers.jsonl), "sharegpt" (the first `count` ShareGPT V3
    conversations), "sharegpt:START" (`count` of them from the START-th: text a draft trained on
    the first START has not seen) or the path of a JSON file in ShareGPT's format."""
    if corpus == "continuations":
        gens = continuations(pair, training_prompts(pair, prompts, count), max_new_tokens, out / "continuations.jsonl")
        return [g["prompt"] + g["response"] for g in gens]
    if corpus == "answers":
        path = out / "answers.jsonl"
        chosen = answer_prompts(pair, count) if prompts is None else training_prompts(pair, prompts, count)
        gens = continuations(answerer or pair, chosen, max_new_tokens, path, ANSWER_TEMPERATURES)
        return [g["prompt"] + g["response"] for g in gens]
    if (start := sharegpt_start(corpus)) is not None:
        return sharegpt_sequences(pair, count, start=start)
    return sharegpt_sequences(pair, count, path=None if corpus == "sharegpt" else Path(corpus))


def sharegpt_start(corpus: str) -> int | None:
    """START of a "sharegpt:START" corpus (None for any other)."""
    if not corpus.startswith("sharegpt:"):
        return None
    if not (start := corpus.removeprefix("sharegpt:")).isdigit():
        raise DyspecError(f"corpus '{corpus}': sharegpt:START takes a conversation number, e.g. sharegpt:3200")
    return int(start)


def corpus_label(corpus: str) -> str:
    """A corpus' name in reports and its features folder: its own, sharegpt-START or a file's stem."""
    if corpus in ("continuations", "answers", "sharegpt") or corpus.startswith("sharegpt:"):
        return corpus.replace(":", "-")
    return Path(corpus).stem


def batch_windows(train_w: list[list], orders: list[list[int]], step: int, batch: int) -> list:
    """The windows of training step `step`: an equal share of `batch` from each corpus (the first
    corpora take the remainder), each corpus cycling through its own shuffled order."""
    n = len(train_w)
    shares = [batch // n + (c < batch % n) for c in range(n)]
    return [w[order[(step * k + i) % len(order)]] for w, order, k in zip(train_w, orders, shares) for i in range(k)]


def pooled(results: dict[str, dict], tokens: dict[str, int]) -> dict:
    """Per-token metrics over several held-out sets, from each set's averages."""
    total = sum(tokens.values())
    return {k: sum(r[k] * tokens[name] for name, r in results.items()) / total for k in next(iter(results.values()))}


def check_distill(
    pair: ModelPair,
    corpus: str,
    counts: list[int],
    heldout: float,
    copy_prompts: int,
    feature_layers: tuple[int, ...],
    init: Path | None,
    draft_layers: int,
) -> FeatureDraft | None:
    """`distill`'s settings checked before anything is made; the draft `init` names, loaded."""
    corpora = corpus.split(",")
    labels = [corpus_label(c) for c in corpora]
    if len(counts) != len(corpora):
        raise DyspecError(f"{len(counts)} prompt counts for {len(corpora)} corpora: give one, or one per corpus")
    for name in corpora:
        sharegpt_start(name)  # a bad START fails here, before anything is made
    if len(set(labels)) < len(labels) or "" in corpora:
        raise DyspecError(f"bad corpus list '{corpus}': each corpus once, separated by single commas")
    if not 0 < heldout < 1:
        raise DyspecError(f"held-out fraction must be between 0 and 1, got {heldout}")
    if copy_prompts and copy_prompts < 5:
        raise DyspecError(f"fitting copy weights needs at least 5 prompts (or 0 for none), got {copy_prompts}")
    n_layers = pair.target.config.num_hidden_layers
    if any(not 0 <= i < n_layers for i in feature_layers[:-1]):
        raise DyspecError(f"feature layers {list(feature_layers[:-1])}: lower layers are 0 to {n_layers - 1}")
    if init is not None and not is_feature_draft(init):
        raise DyspecError(f"--init {init}: not a draft folder made by `dyspec distill`")
    base = None if init is None else load_feature_draft(init, pair.target)
    if base is not None and base.feature_layers not in (FINAL, tuple(feature_layers)):
        raise DyspecError(f"--init {init} reads target layers {base.feature_layers}, not {tuple(feature_layers)}")
    if draft_layers < 1:
        raise DyspecError(f"a draft has at least one decoder layer, got --draft-layers {draft_layers}")
    if base is not None and len(base.layers) > draft_layers:
        raise DyspecError(
            f"--init {init} has {len(base.layers)} decoder layers, more than --draft-layers {draft_layers}"
        )
    return base


def split_corpora(
    pair: ModelPair, out: Path, texts: dict[str, list], heldout: float, features_dtype, feature_layers: tuple[int, ...]
) -> tuple[dict[str, list], dict[str, list]]:
    """Each corpus's sequences with the target's features, split by sequence: its last `heldout`
    share held out."""
    train_sets, test_sets = {}, {}
    for label, corpus_texts_ in texts.items():
        folder = out / ("features" if len(texts) == 1 else f"features-{label}")
        seqs = load_sequences(
            collect_features(pair, corpus_texts_, folder, features_dtype, feature_layers), feature_layers
        )
        n_test = max(1, math.ceil(len(seqs) * heldout))  # split by sequence: the last ones are held out
        if n_test >= len(seqs):
            raise DyspecError(f"{len(seqs)} sequences of {label} are too few for a held-out split")
        train_sets[label], test_sets[label] = seqs[:-n_test], seqs[-n_test:]
    return train_sets, test_sets


def train_draft(
    draft: FeatureDraft,
    train_w: list,
    scale: float,
    ckpt_path: Path,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    eval_every: int,
    depth: int,
    measure: Callable[[], dict],
) -> list[dict]:
    """`steps` AdamW steps (warm-up, then a cosine) on windows drawn from every corpus alike, unrolled
    to `depth`, resumed from and saved to `ckpt_path` every `eval_every` steps; returns the learning
    curve, `measure()` (the held-out metrics) before training (step 0) and at every checkpoint, kept
    in the checkpoint so that a resumed run reports where the draft started."""
    device = draft.device
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1)))
    )
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path)
        draft.load_state_dict(ckpt["draft"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        step, curve = ckpt["step"], ckpt.get("curve", [])
    else:
        step, curve = 0, [{"step": 0, **measure()}]

    g = torch.Generator().manual_seed(seed)
    orders = [torch.randperm(len(w), generator=g).tolist() for w in train_w]
    bar = tqdm(total=steps, initial=step, desc="distill", unit="step")
    while step < steps:
        x, F, prev, mask = collate(batch_windows(train_w, orders, step, batch), device)
        loss = unrolled_loss(draft, unrolled(draft, x, prev, depth), F, scale)[mask].mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        if step % eval_every == 0 or step == steps:
            curve.append({"step": step, **measure()})
            state = {"draft": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
            torch.save({**state, "step": step, "curve": curve}, ckpt_path)
    bar.close()
    return curve


def training_windows(pair: ModelPair, train_sets: dict, test_sets: dict, window: int, batch: int) -> tuple:
    """Each corpus's training windows, the held-out batches per corpus, and the scale of the target's
    final features (what the feature loss is measured in)."""
    H = pair.target.config.hidden_size
    train_seqs = [s for seqs in train_sets.values() for s in seqs]
    scale = float(torch.cat([f[:, -H:] for _, f in train_seqs[:64]]).float().std())
    train_w = [windows(seqs, window, H) for seqs in train_sets.values()]
    test_batches = {}
    for label, seqs in test_sets.items():
        w = windows(seqs, window, H)
        test_batches[label] = [collate(w[i : i + batch], pair.device) for i in range(0, len(w), batch)]
    return train_w, test_batches, scale


def new_draft(
    pair: ModelPair, vocab: torch.Tensor, feature_layers: tuple[int, ...], draft_layers: int, base: FeatureDraft | None
) -> FeatureDraft:
    """A feature draft to train, in fp32: initialised from the target, then from `base` where given (a
    fusion or decoder layers it lacks stay the identity)."""
    draft = FeatureDraft(pair.target, vocab, feature_layers, draft_layers).to(pair.device).float()
    draft.init_from_target(pair.target)
    if base is not None:
        draft.load_state_dict(base.state_dict(), strict=False)
    draft.borrowed.head = draft.borrowed.head.float()
    return draft


def distill_report(
    pair: ModelPair, draft: FeatureDraft, train_seqs: list, test_sets: dict, metrics: dict, curve: list, settings: dict
) -> dict:
    """What `distill` made: its data's size, the held-out metrics (pooled, before training, by
    corpus), the learning curve, the draft's and target's one-token forward times, and the settings."""
    test_tokens = {label: sum(len(t) for t, _ in seqs) for label, seqs in test_sets.items()}
    draft_ms = forward_ms(draft, sizes=(1,))[1]
    target_ms = forward_ms(pair.target, sizes=(1,))[1]
    return {
        "target": pair.target_name,
        "hidden_size": pair.target.config.hidden_size,
        "vocab_size": pair.target.config.vocab_size,
        "draft_vocab": len(draft.vocab),
        "sequences": {"train": len(train_seqs), "heldout": sum(len(seqs) for seqs in test_sets.values())},
        "tokens": {"train": sum(len(t) for t, _ in train_seqs), "heldout": sum(test_tokens.values())},
        "heldout": pooled(metrics, test_tokens),
        "heldout_untrained": next(({k: v for k, v in c.items() if k != "step"} for c in curve if c["step"] == 0), None),
        "heldout_by_corpus": {label: {"tokens": test_tokens[label], **m} for label, m in metrics.items()},
        "ms_per_token": {"draft": draft_ms, "target": target_ms, "ratio": draft_ms / target_ms},
        "settings": settings,
        "curve": curve,
    }


def distill(
    pair: ModelPair,
    out: Path,
    prompts: list | None = None,
    num_prompts: int | list[int] = 400,
    max_new_tokens: int = 128,
    vocab_size: int = 8192,
    steps: int = 600,
    batch: int = 16,
    window: int = 128,
    lr: float = 5e-4,
    heldout: float = 0.05,
    seed: int = 0,
    eval_every: int = 100,
    corpus: str = "continuations",
    features_dtype: torch.dtype | None = None,
    copy_prompts: int = 160,
    feature_layers: tuple[int, ...] = FINAL,
    init: Path | None = None,
    draft_layers: int = 1,
    unroll: int = UNROLL,
    answerer: ModelPair | None = None,
) -> dict:
    """Train a feature draft for `pair.target` in `out` (data, checkpoints and the result in `out/draft`,
    resumable at every stage) and return the report. `corpus` is one of corpus_texts' or several,
    comma-separated ("continuations,sharegpt"), with `num_prompts` one count for all or one per
    corpus; each corpus keeps its own held-out split (its last sequences) and gives an equal share of
    every batch, so a small corpus of the target's own answers is not drowned by a large one.
    `features_dtype` see collect_features. Then the draft's copy weights are fitted on the target's
    answers to `copy_prompts` training prompts (`fit_copy`; 0: none, the draft never copies).
    `feature_layers`: the target layers the draft reads (FeatureDraft; e.g. (3, 15, -1), EAGLE-3's
    low, middle and final). `draft_layers`: its decoder layers. `init`: a draft folder to start from
    (its vocabulary, layers and projection; what it lacks starts as the identity). `unroll`: the
    depths trained (`unrolled`). `answerer`: the pair whose target answers for the "answers" corpus
    (by default `pair`)."""
    corpora, labels = corpus.split(","), [corpus_label(c) for c in corpus.split(",")]
    counts = [num_prompts] * len(corpora) if isinstance(num_prompts, int) else list(num_prompts)
    base = check_distill(pair, corpus, counts, heldout, copy_prompts, feature_layers, init, draft_layers)
    if steps < 0 or batch < len(corpora) or window < 2 or unroll < 1:
        raise DyspecError("steps must be >= 0, batch >= the number of corpora, window >= 2 and unroll >= 1")
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    texts = [
        corpus_texts(pair, name, count, prompts, max_new_tokens, out, answerer) for name, count in zip(corpora, counts)
    ]
    train_sets, test_sets = split_corpora(pair, out, dict(zip(labels, texts)), heldout, features_dtype, feature_layers)
    train_seqs = [s for seqs in train_sets.values() for s in seqs]
    vocab = base.vocab if base is not None else draft_vocab(pair, train_seqs, vocab_size)
    train_w, test_batches, scale = training_windows(pair, train_sets, test_sets, window, batch)

    torch.manual_seed(seed)
    draft = new_draft(pair, vocab, feature_layers, draft_layers, base)
    full_head = pair.target.get_output_embeddings().weight.detach().float()

    test_tokens = {label: sum(len(t) for t, _ in seqs) for label, seqs in test_sets.items()}
    heldout_metrics = lambda: {label: evaluate(draft, full_head, b, scale, unroll) for label, b in test_batches.items()}  # noqa: E731, E501
    measure = lambda: pooled(heldout_metrics(), test_tokens)  # noqa: E731

    ckpt_path = out / "checkpoint.pt"
    curve = train_draft(draft, train_w, scale, ckpt_path, steps, batch, lr, seed, eval_every, unroll, measure)

    named = locals()  # the report's settings: the arguments as given, and what they resolved to
    settings = {k: named[k] for k in SETTINGS} | {
        "features_dtype": str(features_dtype or pair.target.dtype).removeprefix("torch."),
        "feature_layers": list(feature_layers),
        "init": None if init is None else str(init),
        "device": str(pair.device),
    }
    report = distill_report(pair, draft, train_seqs, test_sets, heldout_metrics(), curve, settings)
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    save_feature_draft(draft, out / "draft", report)
    if copy_prompts:
        saved = replace(pair, draft=load_feature_draft(out / "draft", pair.target))
        answers = out / "continuations.jsonl"  # shared with the corpus of that name
        report["copy"] = fit_copy(saved, out / "draft", answers, copy_prompts, max_new_tokens, prompts)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


Row = tuple[int, bool, bool, float, float]  # one position: match length, copy right, draft right, q(copy), max q


def copy_agrees(row: Row, weight: float) -> bool:
    """Whether the argmax of the copying draft's mixture (dyspec.core.copying.mix, T = 1) is the target's token."""
    n, copy_right, draft_right, q_copy, q_max = row
    return copy_right if n and weight + (1 - weight) * q_copy > (1 - weight) * q_max else draft_right


def copy_agreement(rows: list[Row], weights: list[float]) -> float:
    """Top-1 agreement with the target of the copying draft with `weights` (all 0: the draft alone)."""
    return sum(copy_agrees(r, weights[min(r[0], MATCHES) - 1] if r[0] else 0.0) for r in rows) / max(len(rows), 1)


def fit_copy_weights(rows: list[Row]) -> list[float]:
    """Per match length, the weight whose mixture agrees with the target most often (the smallest such)."""
    weights = []
    for n in range(1, MATCHES + 1):
        group = [r for r in rows if min(r[0], MATCHES) == n]
        weights.append(max(COPY_GRID, key=lambda w: (sum(copy_agrees(r, w) for r in group), -w)))
    return weights


def target_pass(pair: ModelPair, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target teacher-forced over `ids`: its logits [L, V] and the draft's input features [L, F]
    (position j's from token j - 1, as `features_before` aligns them)."""
    out = pair.target(torch.tensor([ids], device=pair.device), output_hidden_states=True)
    return out.logits[0], features_before(target_features(out.hidden_states, pair.draft.feature_layers)[0])


@torch.inference_mode()
def copy_rows(pair: ModelPair, sequences: list[tuple[int, list[int]]]) -> list[Row]:
    """`fit_copy_weights`' rows at every answer position of (prompt length, prompt + answer)
    sequences: target and draft teacher-forced over each (the draft reads the target's real
    features), the target's argmax as the label."""
    rows = []
    for prompt_len, ids in tqdm(sequences, desc="copy statistics", unit="sequence"):
        logits, features = target_pass(pair, ids)
        q = to_probs(KVSession(pair.draft).forward(ids, features=features), 1.0)
        labels, guesses, q_max = logits.argmax(-1).tolist(), q.argmax(-1).tolist(), q.amax(-1).tolist()
        for j in range(prompt_len - 1, len(ids) - 1):  # position j predicts token j + 1
            tokens, n = copied(ids[: j + 1], MATCHES, 1, 1)
            copy = tokens[0] if n else -1
            q_copy = float(q[j, copy]) if n else 0.0
            rows.append((n, copy == labels[j], guesses[j] == labels[j], q_copy, q_max[j]))
    return rows


def answer_sequences(
    pair: ModelPair, prompts: list, max_new_tokens: int, answers_file: Path
) -> list[tuple[int, list[int]]]:
    """(prompt length, prompt + the target's greedy answer) for each prompt with a non-empty answer,
    the answers generated into the JSONL `answers_file` (resumable)."""
    answers_file.parent.mkdir(parents=True, exist_ok=True)
    answers = continuations(pair, prompts, max_new_tokens, answers_file)
    return [(len(a["prompt"]), a["prompt"] + a["response"]) for a in answers if a["response"]]


@torch.inference_mode()
def depth_agreement(pair: ModelPair, sequences: list[tuple[int, list[int]]], depth: int = UNROLL) -> list[float]:
    """Top-1 agreement with the target over the answer tokens of (prompt length, prompt + answer)
    sequences, teacher-forced, of the draft alone at depths 1 to `depth` (`unrolled`: at depth d it
    reads its own features of the d - 1 tokens before, as a tree node d levels deep does)."""
    right, count = [0] * depth, 0
    for prompt_len, ids in tqdm(sequences, desc="agreement by depth", unit="sequence"):
        logits, features = target_pass(pair, ids)
        labels, x = logits[prompt_len - 1 : -1].argmax(-1), torch.tensor([ids], device=pair.device)
        for d, f in enumerate(unrolled(pair.draft, x, features[None], depth)):
            guesses = pair.draft.vocab.to(x.device)[pair.draft.subset_logits(f[0, prompt_len - 1 : -1]).argmax(-1)]
            right[d] += int((guesses == labels).sum())
        count += len(ids) - prompt_len
    return [r / max(count, 1) for r in right]


def copy_eval(pair: ModelPair, sequences: list[tuple[int, list[int]]], weights: list[float]) -> dict:
    """Top-1 agreement with the target over the answer tokens of `sequences`, teacher-forced, of
    the draft alone and of it copying with `weights`."""
    rows = copy_rows(pair, sequences)
    return {
        "positions": len(rows),
        "agreement": {"draft": copy_agreement(rows, [0.0] * MATCHES), "copying": copy_agreement(rows, weights)},
    }


def fit_copy(
    pair: ModelPair,
    folder: Path,
    answers_file: Path,
    num_prompts: int = 160,
    max_new_tokens: int = 96,
    prompts: list | None = None,
) -> dict:
    """Fit the copy weights (dyspec.core.copying) of the feature draft in `folder`, loaded as
    `pair.draft`, on the target's greedy answers to `num_prompts` training prompts (or `prompts`;
    generated into the JSONL `answers_file`, resumable; the last fifth held out from the fit for the
    report's agreement), and store them in its config."""
    config = folder / CONFIG_NAME
    if not config.is_file():
        raise DyspecError(f"{folder} is not a feature draft made by `dyspec distill` (no {CONFIG_NAME})")
    if num_prompts < 5:
        raise DyspecError(f"fitting copy weights needs at least 5 prompts, got {num_prompts}")
    if not draft_model(pair.draft).needs_features:
        raise DyspecError("copy weights are fitted for a feature draft: load one as the pair's draft")
    sequences = answer_sequences(pair, training_prompts(pair, prompts, num_prompts), max_new_tokens, answers_file)
    n_test = max(1, len(sequences) // 5)
    weights = fit_copy_weights(copy_rows(pair, sequences[:-n_test]))
    report = {"weights": weights, "prompts": len(sequences), **copy_eval(pair, sequences[-n_test:], weights)}
    info = json.loads(config.read_text())
    config.write_text(json.dumps({**info, "copy_weights": weights, "copy_fit": report}, indent=2))
    pair.draft.copy_weights = weights
    return report
