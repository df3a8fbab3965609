"""SpecDec++'s acceptance head (Huang et al. 2024): a small MLP on the draft's final hidden state at
a drafted token that predicts the chance the target accepts that token. Trained by
`dyspec train-head` (dyspec.train.head); heads for the default pairs ship in dyspec/shipped/heads/."""

from __future__ import annotations

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


class AcceptanceHead(nn.Module):
    """Residual blocks x + SiLU(W_l x) with independent W_l (the reference code repeats one block,
    sharing its weights), then Linear(., 2); class 1 is "accepted". The input is the draft's final
    hidden state at the drafted token y and log q(y), the draft's own probability of y (T = 1):
    the hidden state alone predicted acceptance worse than q(y) does (see dyspec/shipped/heads/README.md)."""

    def __init__(self, hidden_size: int, n_blocks: int = 3):
        super().__init__()
        self.hidden_size = hidden_size
        width = hidden_size + 1
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n_blocks))
        self.out = nn.Linear(width, 2)
        for block in self.blocks:  # start as the identity map, so depth does not blow up the input
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden.float(), q.float().clamp_min(1e-9).log()[..., None]], dim=-1)
        for block in self.blocks:
            x = x + nn.functional.silu(block(x))
        return self.out(x)

    @torch.inference_mode()
    def accept_prob(self, hidden: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """On the head's device (it loads on the CPU; a draft on a GPU hands it a few rows a step)."""
        device = self.out.weight.device
        return torch.softmax(self.forward(hidden.to(device), q.to(device)), dim=-1)[..., 1]


def save_head(head: AcceptanceHead, path: Path, info: dict) -> None:
    meta = {"hidden_size": head.hidden_size, "n_blocks": len(head.blocks), **info}
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
    head = AcceptanceHead(meta["hidden_size"], meta["n_blocks"])
    head.load_state_dict(load_file(path))
    return head.eval(), meta


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
