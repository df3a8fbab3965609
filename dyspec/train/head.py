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


def head_data(pair: ModelPair, seqs: list[dict], data_path: Path, temperature: float, seed: int) -> dict:
    """Every sequence's examples (`head_examples`), with the sequence each came from, made once and
    kept at `data_path`."""
    if data_path.exists():
        return load_file(data_path)
    generator = torch.Generator(device=pair.device).manual_seed(seed)
    parts = [
        head_examples(pair, s["prompt"], s["response"], temperature, generator)
        for s in tqdm(seqs, desc="head examples", unit="seq")
        if s["response"]
    ]
    data = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
    data["seq"] = torch.cat([torch.full((len(part["label"]),), i) for i, part in enumerate(parts)])
    save_file(data, data_path)
    return data


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
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1, "best": best}, ckpt_path)

    return best


def train_head(
    pair: ModelPair,
    out: Path,
    prompts: list[str] | list[list[int]] | None = None,
    num_prompts: int = 256,
    max_new_tokens: int = 128,
    temperature: float = 0.6,
    n_blocks: int = 3,
    epochs: int = 20,
    lr: float = 1e-4,
    weight_decay: float = 0.1,
    reject_weight: float = 6.0,
    heldout: float = 0.1,
    seed: int = 0,
) -> dict:
    """Build the data (resumable), train with checkpoints every epoch (resumable), and save
    `out/head.safetensors` with its metrics. Returns the report. `prompts` (strings or token ids)
    default to the Arena-Hard v2.0 and IFEval instructions, interleaved."""
    if pair.draft is None:
        raise DyspecError("train-head needs a draft model")
    if not 0 < heldout < 1:
        raise DyspecError(f"held-out fraction must be between 0 and 1, got {heldout}")
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(pair, prompts, num_prompts)
    seqs = continuations(pair, prompts, max_new_tokens, out / "continuations.jsonl")
    data = head_data(pair, seqs, out / f"examples-T{temperature:g}.safetensors", temperature, seed)
    # Split by sequence, not by token: the last `heldout` for the report, as much before it to pick
    # the epoch (the head overfits within a few epochs), the rest to train on.
    last = int(data["seq"].max())
    test = data["seq"] >= int(last * (1 - heldout))
    val = ~test & (data["seq"] >= int(last * (1 - 2 * heldout)))
    train = ~test & ~val

    def loss_on(mask: torch.Tensor) -> float:
        with torch.no_grad():
            return float(_loss(head(data["hidden"][mask], data["q"][mask]), data["label"][mask], reject_weight))

    torch.manual_seed(seed)
    head = AcceptanceHead(data["hidden"].shape[1], n_blocks)
    best = fit_head(
        head, data, train, lambda: loss_on(val), out / "checkpoint.pt", epochs, lr, weight_decay, reject_weight, seed
    )
    head.load_state_dict(best["head"])
    scores = head.accept_prob(data["hidden"][test], data["q"][test])
    report = {
        "target": pair.target_name,
        "draft": pair.draft_name,
        "temperature": temperature,
        "examples": {"train": int(train.sum()), "validation": int(val.sum()), "heldout": int(test.sum())},
        "sequences": int(data["seq"].max()) + 1,
        "acceptance_rate_heldout": float(data["label"][test].mean()),
        "loss": {"train": loss_on(train), "validation": loss_on(val), "heldout": loss_on(test)},
        "best_epoch": best["epoch"],
        "auc_heldout": {
            "head": auc(scores, data["label"][test]),
            "draft_prob": auc(data["q"][test], data["label"][test]),
        },
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
    }
    save_head(head, out / "head.safetensors", report)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report
