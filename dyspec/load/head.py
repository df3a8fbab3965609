"""SpecDec++'s acceptance head (Huang et al. 2024): a small MLP on the draft's final hidden state at
a drafted token that predicts the chance the target accepts that token, calibrated so that the
prediction is that chance. Trained by `dyspec train-head` (dyspec.train.head); heads for the
default pairs ship in dyspec/shipped/heads/."""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from dyspec.cache import SHIPPED as SHIPPED_FILES
from dyspec.errors import DyspecError
from dyspec.load.pair import ModelPair, pair_key

SHIPPED = SHIPPED_FILES / "heads"


DESIGNS = ("dyspec", "specdecpp")


class AcceptanceHead(nn.Module):
    """Residual blocks x + SiLU(W x), then Linear(., 2); class 1 is "accepted". Two designs:

    - "dyspec": the input is the draft's final hidden state at the drafted token y and log q(y),
      the draft's own probability of y (T = 1); `n_blocks` blocks with independent weights, each
      starting as the identity, so depth does not blow up the input.
    - "specdecpp": the reference's (Kaffaljidhmah2/SpecDec_pp, `wrap_model.py`,
      `AcceptancePredictionHead`): the hidden state alone, one block applied `n_blocks` times
      (its `[ResBlock(h)] * num_layers` shares the weights), PyTorch's default initialisation.

    `accept_prob` maps the logit z = logit(accept) - logit(reject) through sigmoid(a z + b) with
    `calibration` = (a, b), fitted on validation examples after training (dyspec.train.head): the
    rejection weight of the training loss shifts every prediction down by about log(weight) in z,
    and a small head is over- or under-confident besides."""

    def __init__(self, hidden_size: int, n_blocks: int = 3, design: str = "dyspec"):
        super().__init__()
        if design not in DESIGNS:
            raise DyspecError(f"head design must be one of {', '.join(DESIGNS)}, got {design!r}")
        self.hidden_size, self.n_blocks, self.design = hidden_size, n_blocks, design
        width = hidden_size + (design == "dyspec")
        shared = design == "specdecpp"
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(1 if shared else n_blocks))
        self.out = nn.Linear(width, 2)
        self.register_buffer("calibration", torch.tensor([1.0, 0.0]))
        if not shared:
            for block in self.blocks:
                nn.init.zeros_(block.weight)
                nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        if self.design == "dyspec":
            x = torch.cat([x, q.float().clamp_min(1e-9).log()[..., None]], dim=-1)
        for i in range(self.n_blocks):
            x = x + nn.functional.silu(self.blocks[i % len(self.blocks)](x))
        return self.out(x)

    def logit(self, hidden: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """z = logit(accept) - logit(reject), before calibration."""
        logits = self.forward(hidden, q)
        return logits[..., 1] - logits[..., 0]

    @torch.inference_mode()
    def accept_prob(self, hidden: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Calibrated, on the head's device (it loads on the CPU; a draft on a GPU hands it a few rows a step)."""
        device = self.out.weight.device
        return self.calibrated(hidden.to(device), q.to(device))

    def calibrated(self, hidden: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """`accept_prob` of inputs on the head's device, as a program on the device calls it."""
        a, b = self.calibration
        return torch.sigmoid(a * self.logit(hidden, q) + b)


def save_head(head: AcceptanceHead, path: Path, info: dict) -> None:
    meta = {"hidden_size": head.hidden_size, "n_blocks": head.n_blocks, "design": head.design, **info}
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, path, metadata={"dyspec": json.dumps(meta)})


def load_head(path: str) -> tuple[AcceptanceHead, dict]:
    """The head saved at `path` and its metadata (pair, training settings, held-out metrics)."""
    if not Path(path).is_file():
        raise DyspecError(f"acceptance head not found: {path}")
    return _load_head(path, Path(path).stat().st_mtime_ns)  # a retrained head at the same path is read again


@lru_cache(maxsize=8)
def _load_head(path: str, mtime_ns: int) -> tuple[AcceptanceHead, dict]:
    with safe_open(path, "pt") as f:
        meta = json.loads((f.metadata() or {}).get("dyspec", "{}"))
    if "hidden_size" not in meta:
        raise DyspecError(f"{path} is not an acceptance head saved by `dyspec train-head`")
    head = AcceptanceHead(meta["hidden_size"], meta["n_blocks"], meta.get("design", "dyspec"))
    state = load_file(path)
    state.setdefault("calibration", head.calibration)  # a head trained before calibration: as trained
    head.load_state_dict(state)
    return head.eval().requires_grad_(False), meta  # for inference: a program on it builds no autograd graph


def head_on(head: AcceptanceHead, device: torch.device) -> AcceptanceHead:
    """`head` (as `load_head` gives it) on `device`, for a step on the device: a copy there, kept, so
    that the host's builds keep theirs on the CPU and the step sends the head no rows across."""
    return head if device.type == "cpu" else _moved(head, device)


@lru_cache(maxsize=8)
def _moved(head: AcceptanceHead, device: torch.device) -> AcceptanceHead:
    return copy.deepcopy(head).to(device)


def shipped_head(pair: ModelPair) -> Path:
    return SHIPPED / f"{pair_key(pair)}.safetensors"


def head_for(pair: ModelPair, path: str | None = None) -> str:
    """The head to use: `path`, else the one shipped for this pair; its hidden size must fit the draft."""
    if path is None:
        shipped = shipped_head(pair)
        if not shipped.is_file():
            raise DyspecError(
                f"no acceptance head ships for target '{pair.target_name}' with draft '{pair.draft_name}': "
                "train one with `dyspec train-head --out DIR` and pass --option head=DIR/head.safetensors"
            )
        path = str(shipped)
    head, _ = load_head(path)
    if head.hidden_size != pair.draft.config.hidden_size:
        raise DyspecError(
            f"acceptance head {path} reads hidden states of size {head.hidden_size}, "
            f"the draft's are {pair.draft.config.hidden_size}"
        )
    return path


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve with soft labels: positives weighted by label, negatives by 1 - label
    (the expected AUC if each label were drawn as a Bernoulli); ties count half."""
    values, group = torch.unique(score.double(), return_inverse=True)
    pos = torch.zeros(len(values), dtype=torch.float64).index_add_(0, group, label.double())
    neg = torch.zeros(len(values), dtype=torch.float64).index_add_(0, group, 1 - label.double())
    below = torch.cumsum(neg, 0) - neg
    return float((pos * (below + neg / 2)).sum() / (pos.sum() * neg.sum()))
