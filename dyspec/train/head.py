"""`dyspec train-head`: training data and training for SpecDec++'s acceptance head (dyspec.load.head).

Training data: the target's own greedy continuations of real instructions (dyspec.train.corpus); at
every response position the draft samples y from q, and the soft label is min(1, p(y) / q(y)), the
chance that speculative sampling accepts y. The hidden state is the draft's at y on the real
prefix: where y differs from the real next token, y is forwarded as an extra branch token with tree
attention, so no context is ever corrupted by substituted tokens.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from dyspec.core.copying import mix_along
from dyspec.core.draft_model import draft_model
from dyspec.core.kv import KVSession, target_features
from dyspec.core.sampling import sample_rows, to_probs
from dyspec.drafts.feature import features_before
from dyspec.errors import DyspecError
from dyspec.eval.bench import host_stamp
from dyspec.eval.prompts import load_prompts
from dyspec.load import ModelPair
from dyspec.load.head import AcceptanceHead, auc, save_head
from dyspec.train.corpus import continuations, training_prompts


@torch.inference_mode()
def head_examples(
    pair: ModelPair, prompt: list[int], response: list[int], temperature: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Training examples from one sequence: for every response token position, the draft's hidden
    state at a draft-sampled y on the real prefix, the soft label min(1, p(y)/q(y)) at `temperature`,
    and q(y) at T = 1 (the raw draft probability that the head is compared against); a copying
    draft's q is the mixture with its copies (dyspec.core.copying)."""
    seq = prompt + response
    n0 = len(prompt) - 1  # logits row n0 predicts the first response token
    declared = draft_model(pair.draft)
    needs_features = declared.needs_features
    out = pair.target(torch.tensor([seq[:-1]], device=pair.device), output_hidden_states=needs_features)
    target_logits = out.logits[0, n0:].float()
    h = target_features(out.hidden_states, declared.feature_layers)[0] if needs_features else None
    draft = KVSession(pair.draft, keep_hidden=True)
    draft_logits = draft.forward(seq[:-1], features=None if h is None else features_before(h))[n0:]
    if weights := declared.copy_weights:  # a copying draft's q, as the engine's
        draft_logits = mix_along(draft_logits, seq, n0, weights, temperature)
    hidden = draft.hidden[n0:]  # row i: the draft read seq[n0 + i]; we need it at the token after
    q, p = to_probs(draft_logits, temperature), to_probs(target_logits, temperature)
    y = sample_rows(q, 1, generator)[:, 0] if temperature > 0 else q.argmax(-1)
    rows = torch.arange(len(y))
    label = (p[rows, y] / q[rows, y]).clamp(max=1.0)
    q1 = torch.softmax(draft_logits, dim=-1)[rows, y]
    # The real next token's hidden state is the next row, except after the last row (forward it too).
    is_branch = y != torch.tensor(response, device=y.device)
    is_branch[-1] = True
    same, branch = (~is_branch).nonzero()[:, 0], is_branch.nonzero()[:, 0].tolist()
    feature = torch.empty(len(y), hidden.shape[1], device=hidden.device)
    feature[same] = hidden[same + 1].float()
    if branch:
        cached = draft.cached
        visible = torch.zeros(len(branch), cached + len(branch), dtype=torch.bool)
        for j, i in enumerate(branch):
            visible[j, : n0 + i + 1] = True  # the real prefix up to the position y follows
            visible[j, cached + j] = True
        features = None if h is None else h[[n0 + i for i in branch]]  # y follows seq[n0 + i]
        draft.forward([int(y[i]) for i in branch], [n0 + i + 1 for i in branch], visible, features=features)
        feature[branch] = draft.hidden.float()
    return {"hidden": feature.cpu(), "label": label.cpu(), "q": q1.cpu()}


def _loss(logits: torch.Tensor, label: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """Soft-label cross-entropy, the rejection class weighted up (rejections are the rarer class)."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(label * logp[:, 1] + reject_weight * (1 - label) * logp[:, 0]).mean()


def head_data(
    pair: ModelPair, seqs: list[dict], data_path: Path, temperature: float, seed: int, desc: str = "head examples"
) -> dict:
    """Every sequence's examples (`head_examples`), with the sequence each came from, made once and
    kept at `data_path`."""
    if data_path.exists():
        return load_file(data_path)
    generator = torch.Generator(device=pair.device).manual_seed(seed)
    parts = [
        head_examples(pair, s["prompt"], s["response"], temperature, generator)
        for s in tqdm(seqs, desc=desc, unit="seq")
        if s["response"]
    ]
    data = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
    data["seq"] = torch.cat([torch.full((len(part["label"]),), i) for i, part in enumerate(parts)])
    save_file(data, data_path)
    return data


def fit_calibration(head: AcceptanceHead, hidden: torch.Tensor, q: torch.Tensor, label: torch.Tensor) -> None:
    """Platt scaling: the (a, b) of sigmoid(a z + b) that minimise the plain (unweighted) soft-label
    cross-entropy on these examples, so that the predicted acceptance is the observed one."""
    with torch.no_grad():
        z = head.logit(hidden, q)
    ab = torch.tensor([1.0, 0.0], requires_grad=True)
    opt = torch.optim.LBFGS([ab], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(ab[0] * z + ab[1], label.float())
        loss.backward()
        return loss

    opt.step(closure)
    head.calibration.copy_(ab.detach())


def calibration(predicted: torch.Tensor, label: torch.Tensor, bins: int = 10) -> dict:
    """Predicted against observed acceptance by bin of prediction (width 1/bins; empty bins left out),
    and the expected calibration error: the examples-weighted mean of |predicted - observed|."""
    which = (predicted.double() * bins).long().clamp(max=bins - 1)
    rows = []
    for b in which.unique().tolist():
        inside = which == b
        rows.append(
            {
                "bin": [b / bins, (b + 1) / bins],
                "examples": int(inside.sum()),
                "predicted": round(float(predicted[inside].mean()), 4),
                "observed": round(float(label[inside].mean()), 4),
            }
        )
    error = sum(r["examples"] * abs(r["predicted"] - r["observed"]) for r in rows) / len(label)
    return {"bins": rows, "error": round(error, 4)}


def scores(head: AcceptanceHead, data: dict, mask: torch.Tensor | None = None) -> dict:
    """What the head is judged by on these examples: the acceptance rate, the AUC of the head's
    predictions and of the draft probability q(y) alone, and the head's calibration."""
    x, q, label = (data[k] if mask is None else data[k][mask] for k in ("hidden", "q", "label"))
    predicted = head.accept_prob(x, q)
    return {
        "acceptance_rate": round(float(label.mean()), 4),
        "mean_predicted": round(float(predicted.mean()), 4),
        "auc": {"head": auc(predicted, label), "draft_prob": auc(q, label)},
        "calibration": calibration(predicted, label),
    }


def eval_scores(
    pair: ModelPair,
    head: AcceptanceHead,
    prompts: list | int,
    out: Path,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> dict:
    """`scores` on examples from the target's answers to `prompts` (a number: that many of MT-Bench's
    first turns, spread over its categories), made as the training examples are and kept in `out`."""
    if isinstance(prompts, int):
        prompts = [text for _, text in load_prompts("mtbench", prompts, spread=True)]
    prompts = training_prompts(pair, prompts, len(prompts))  # as long as the training prompts at most
    seqs = continuations(pair, prompts, max_new_tokens, out / "eval-continuations.jsonl")
    data = head_data(
        pair, seqs, out / f"eval-examples-T{temperature:g}.safetensors", temperature, seed, "eval examples"
    )
    return {"prompts": len(seqs), "examples": len(data["label"]), **scores(head, data)}


def fit_head(
    head: AcceptanceHead,
    data: dict,
    train: torch.Tensor,
    loss_on,
    ckpt_path: Path,
    epochs: int,
    lr: float,
    weight_decay: float,
    reject_weight: float,
    seed: int,
) -> dict:
    """Train `head` on the `train` examples for `epochs` (resumed from and saved to `ckpt_path` every
    epoch) and return the best epoch by `loss_on` the validation examples: its loss, number and weights."""
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    start = 0
    best = {"loss": loss_on(), "epoch": 0, "head": copy.deepcopy(head.state_dict())}
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path)
        if ckpt.get("design", "dyspec") != head.design:
            raise DyspecError(
                f"{ckpt_path} trains a head of design {ckpt.get('design', 'dyspec')!r}, not {head.design!r}: "
                "use another --out (copy its continuations and examples files there to reuse the data)"
            )
        head.load_state_dict(ckpt["head"])
        opt.load_state_dict(ckpt["opt"])
        start, best = ckpt["epoch"], ckpt["best"]
    x, q, y = data["hidden"][train], data["q"][train], data["label"][train]
    bar = tqdm(range(start, epochs), desc="train head", unit="epoch")
    for epoch in bar:
        head.train()
        for batch in torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + epoch)).split(512):
            loss = _loss(head(x[batch], q[batch]), y[batch], reject_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
        head.eval()
        val_loss = loss_on()
        if val_loss < best["loss"]:
            best = {"loss": val_loss, "epoch": epoch + 1, "head": copy.deepcopy(head.state_dict())}
        bar.set_postfix(val_loss=f"{val_loss:.4f}", best_epoch=best["epoch"])
        state = {"head": head.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1, "best": best}
        torch.save({**state, "design": head.design}, ckpt_path)

    return best


def split_by_sequence(seq: torch.Tensor, heldout: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks of the examples to train on, to validate on and to report, split by sequence, not by
    token: the last `heldout` of the sequences for the report, as many before them to pick the epoch
    (the head overfits within a few epochs) and calibrate, the rest to train on."""
    last = int(seq.max())
    test = seq >= int(last * (1 - heldout))
    val = ~test & (seq >= int(last * (1 - 2 * heldout)))
    return ~test & ~val, val, test


def train_head(
    pair: ModelPair,
    out: Path,
    prompts: list[str] | list[list[int]] | None = None,
    num_prompts: int = 256,
    max_new_tokens: int = 128,
    temperature: float = 0.6,
    design: str = "dyspec",
    n_blocks: int = 3,
    epochs: int = 20,
    lr: float = 1e-4,
    weight_decay: float = 0.1,
    reject_weight: float = 6.0,
    heldout: float = 0.1,
    eval_prompts: list[str] | list[list[int]] | int = 80,
    seed: int = 0,
    command: str | None = None,
) -> dict:
    """Build the data (resumable), train with checkpoints every epoch (resumable), calibrate on the
    validation examples, and save `out/head.safetensors` with its metrics. Returns the report.
    `prompts` (strings or token ids) default to the Arena-Hard v2.0 and IFEval instructions,
    interleaved; `eval_prompts`, answered the same way and only scored, to MT-Bench's 80 first turns
    (a number: that many of them; 0: none)."""
    if pair.draft is None:
        raise DyspecError("train-head needs a draft model")
    if not 0 < heldout < 1:
        raise DyspecError(f"held-out fraction must be between 0 and 1, got {heldout}")
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(pair, prompts, num_prompts)
    seqs = continuations(pair, prompts, max_new_tokens, out / "continuations.jsonl")
    data = head_data(pair, seqs, out / f"examples-T{temperature:g}.safetensors", temperature, seed)
    train, val, test = split_by_sequence(data["seq"], heldout)
    last = int(data["seq"].max())

    def loss_on(mask: torch.Tensor) -> float:
        with torch.no_grad():
            return float(_loss(head(data["hidden"][mask], data["q"][mask]), data["label"][mask], reject_weight))

    torch.manual_seed(seed)
    head = AcceptanceHead(data["hidden"].shape[1], n_blocks, design)
    best = fit_head(
        head, data, train, lambda: loss_on(val), out / "checkpoint.pt", epochs, lr, weight_decay, reject_weight, seed
    )
    head.load_state_dict(best["head"])
    uncalibrated = scores(head, data, test)
    fit_calibration(head, data["hidden"][val], data["q"][val], data["label"][val])
    report = {
        "target": pair.target_name,
        "draft": pair.draft_name,
        "design": design,
        "temperature": temperature,
        "examples": {"train": int(train.sum()), "validation": int(val.sum()), "heldout": int(test.sum())},
        "sequences": last + 1,
        "loss": {"train": loss_on(train), "validation": loss_on(val), "heldout": loss_on(test)},
        "best_epoch": best["epoch"],
        "calibration": [round(float(v), 4) for v in head.calibration],
        "heldout": scores(head, data, test),
        "heldout_uncalibrated": uncalibrated,
        "eval": eval_scores(pair, head, eval_prompts, out, max_new_tokens, temperature, seed) if eval_prompts else None,
        "settings": {
            "num_prompts": num_prompts,
            "max_new_tokens": max_new_tokens,
            "n_blocks": n_blocks,
            "epochs": epochs,
            "lr": lr,
            "weight_decay": weight_decay,
            "reject_weight": reject_weight,
            "seed": seed,
        },
        "seconds": round(time.perf_counter() - t_start, 1),
        "stamp": host_stamp(pair, command),  # the machine, versions, date and command
    }
    save_head(head, out / "head.safetensors", report)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report
