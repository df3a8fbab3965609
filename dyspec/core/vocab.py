"""A draft's reduced vocabulary (FR-Spec, Zhao et al. 2025; EAGLE-3's `d2t`): the draft reads out
only the V most frequent of the target's tokens, and its distributions q are V wide, column c
standing for target token `ids[c]`. The tree and its policies work on those V columns (a softmax, a
top-k and a copy's mixture over 8k columns instead of 49k, at every draft forward); verification
at T > 0 widens q to the target's vocabulary with zeros outside, so the residual max(p - q, 0)
covers every token and outputs keep the target's distribution.

A q as wide as the target's vocabulary is read as it is: a draft call whose copy (dyspec.core.copying)
is a token outside the subset returns full-width logits for that call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dyspec.errors import DyspecError


@dataclass(frozen=True)
class DraftVocab:
    ids: torch.Tensor  # [V_d] the target token of each column, for columns as tensors
    # for one token at a time, as lists: a list's item costs a fraction of a tensor op's
    token_of: list[int]  # ids
    column_of: list[int]  # [V] the column of each target token, -1 outside
    copies: dict[torch.device, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)  # `ids_on`

    @classmethod
    def of(cls, ids: torch.Tensor, size: int) -> DraftVocab | None:
        """The vocabulary of a draft reading out target tokens `ids` of a vocabulary of `size`; None
        where that is every token in order (nothing to map)."""
        ids = ids.long().cpu()
        if len(ids) == size and torch.equal(ids, torch.arange(size)):
            return None
        if len(ids) >= size or len(set(ids.tolist())) < len(ids) or int(ids.min()) < 0 or int(ids.max()) >= size:
            raise DyspecError(f"a draft vocabulary is fewer than {size} distinct tokens below {size}, got {len(ids)}")
        token_of, column_of = ids.tolist(), [-1] * size
        for column, token in enumerate(token_of):
            column_of[token] = column
        return cls(ids, token_of, column_of)

    def ids_on(self, device: torch.device) -> torch.Tensor:
        """`ids` on `device`, kept: a copy to a GPU each call would be an op each step."""
        if device not in self.copies:
            self.copies[device] = self.ids.to(device)
        return self.copies[device]

    @property
    def size(self) -> int:
        """The target's vocabulary size."""
        return len(self.column_of)

    def tokens(self, columns: torch.Tensor, width: int) -> torch.Tensor:
        """Target token ids of `columns` of distributions `width` wide."""
        return token_ids(columns, width, self.ids_on(columns.device), self.size)

    def widen(self, q: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """q [..., V_d] over the target's vocabulary [..., V], `fill` outside (0 for probabilities, -inf
        for logits); a full-width q as it is."""
        return widen(q, self.ids_on(q.device), self.size, fill)

    def token(self, column: int, width: int) -> int:
        """The target token of column `column` of distributions `width` wide."""
        return column if width == self.size else self.token_of[column]

    def column(self, token: int, width: int) -> int:
        """The column of target token `token` in distributions `width` wide; -1 outside."""
        return token if width == self.size else self.column_of[token]


def widen(q: torch.Tensor, ids: torch.Tensor, size: int, fill: float = 0.0) -> torch.Tensor:
    """q [..., V_d] over a vocabulary of `size` where its columns are token ids `ids` (`DraftVocab.ids`,
    on q's device), `fill` elsewhere; a q `size` wide as it is."""
    if q.shape[-1] == size:
        return q
    out = q.new_full((*q.shape[:-1], size), fill)
    return out.index_copy_(-1, ids, q)


def token_ids(columns: torch.Tensor, width: int, ids: torch.Tensor | None, size: int) -> torch.Tensor:
    """`DraftVocab.tokens` where the vocabulary is its columns' token ids `ids` (None: no reduced
    vocabulary) of `size` tokens, as a compiled program takes it."""
    return columns if ids is None or width == size else ids[columns]
