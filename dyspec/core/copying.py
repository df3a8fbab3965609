"""Copying from the context's repeats: what `lookup` proposes, and what a copying draft mixes in.

A small target repeats its prompt and itself: where a token follows a long repeat of the context,
the token that followed the repeat is the target's next one far more often than the draft's guess
is (docs/guide/training.md has the counts).
A copying draft adds that token to the draft's distribution q with a weight w_n fitted per match
length n (1 to 6+):

    q' = (1 - w_n) q + w_n [x = copied token]

q' is a distribution like any draft's: policies draw from it and verification tests against it,
so outputs keep the target's distribution. `fit_copy` fits the weights for a feature draft on the
target's own answers to training prompts (dyspec.train.distill) and stores them with the draft
(`copy_weights`).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence

import torch

from dyspec.core import entries
from dyspec.kernels.row_stats import row_stats

MATCHES = 6  # weights for matches of 1 to 5 tokens, and 6 or more


def earlier_starts(data: bytes, n: int) -> Iterator[int]:
    """Where the tokens after each earlier occurrence of the last n tokens of a context start, latest
    first; `data` is the context as 4-byte words (`array("i", context).tobytes()`), and an occurrence
    ends before the last token."""
    return occurrences(data, data[-4 * n :], len(data) - 4)


def occurrences(data: bytes, pattern: bytes, end: int) -> Iterator[int]:
    """Where the tokens after each occurrence of `pattern` within data[:end] start, latest first (all
    4-byte words). The search runs with `bytes.rfind` (C speed: a Python loop over a long context
    costs a step more than its forward saves), keeping only matches that start on a word."""
    while (at := data.rfind(pattern, 0, end)) >= 0:
        if at % 4 == 0:
            yield (at + len(pattern)) // 4
        end = at + len(pattern) - 1


def copied(context: Sequence[int], ngram: int, min_ngram: int, k: int) -> tuple[list[int], int]:
    """k tokens that followed the latest earlier occurrence of the context's last n tokens, for the
    largest n in ngram..min_ngram that has one, and n; ([], 0) if none does. Where the occurrence
    is less than k tokens back, the copy runs to the end of the context and on as the repeat it
    found (a loop of that period), as a small target's loops go on. An int array is read without
    converting."""
    data = array("i", context).tobytes()
    for n in range(min(ngram, len(context) - 1), min_ngram - 1, -1):
        start = next(earlier_starts(data, n), None)
        if start is not None:
            period = len(context) - start
            return [context[start + i % period] for i in range(k)], n
    return [], 0


def mix(logits: torch.Tensor, tokens: Sequence[int], weights: Sequence[float], temperature: float) -> torch.Tensor:
    """Logits [n, V] whose row i's distribution at `temperature` is (1 - weights[i]) q_i + weights[i]
    on tokens[i], q_i being row i's at that temperature (0 <= weight < 1; a row of weight 0 is left as
    it is). At temperature 0 (proposals chosen by argmax, valued at T = 1) the mixture is taken at
    T = 1: its argmax is the copy where weight + (1 - weight) q(token) beats (1 - weight) max q. Only
    the copy's logit changes: scaling every other token's probability by 1 - weight is the
    normaliser's work (one logsumexp over the copying rows, instead of a softmax, a log and three
    more passes over the vocabulary at every node). A draft round mixes a row or two, so the copies'
    few numbers are worked out in Python: each tensor op costs more than its arithmetic."""
    rows = [i for i, weight in enumerate(weights) if weight]
    if not rows:  # most of a draft's forwards: no copy, no copy of the logits either
        return logits.float()
    tau = temperature if temperature > 0 else 1.0
    mixed = logits.to(torch.float32, copy=True)
    copying = mixed if len(rows) == len(mixed) else mixed[rows]
    log_z = row_stats(copying if tau == 1.0 else copying / tau)[1].tolist()
    at = [(i, tokens[i]) for i in rows]
    new = [
        tau * (math.log((1 - weights[i]) * math.exp(x / tau - z) + weights[i]) - math.log1p(-weights[i]) + z)
        for i, x, z in zip(rows, entries.read(mixed, at), log_z)
    ]
    entries.write(mixed, at, new)
    return mixed


def copy_token(context: Sequence[int], weights: list[float]) -> tuple[int, float]:
    """The token a copying draft mixes in after `context`, and its weight (0 where nothing repeats)."""
    tokens, n = copied(context, MATCHES, 1, 1)
    return (tokens[0], weights[n - 1]) if n else (-1, 0.0)


def mix_along(
    logits: torch.Tensor, seq: list[int], start: int, weights: list[float], temperature: float
) -> torch.Tensor:
    """A copying draft's logits [L, V] along a teacher-forced sequence: row i, read after
    seq[: start + i + 1], mixed with that context's copy as the engine mixes a node's."""
    copies = [copy_token(seq[: start + i + 1], weights) for i in range(len(logits))]
    return mix(logits, [token for token, _ in copies], [weight for _, weight in copies], temperature)


def copy_tokens(
    sequences: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`copy_token` of many contexts at once on their device, with no host read: row i of `sequences`
    [rows, W] is a context of `lengths[i]` tokens (left-aligned; what follows is ignored), `weights`
    [MATCHES + 1] is 0 then the weights per match length. Returns each row's copied token (-1 where
    nothing repeats) and its weight. A match of n tokens ending at e is the context's last n tokens
    ending at e <= length - 2, the latest such e for the largest n, as `copied` finds with rfind."""
    rows, width = sequences.shape
    device = sequences.device
    # windows[i, e, j]: the token MATCHES - 1 - j before e (padding before the context), against the
    # context's last tokens in the same order; a match of n tokens ends at e where the last n agree
    padded = torch.cat([sequences.new_full((rows, MATCHES - 1), -2), sequences], 1)
    last = sequences.gather(1, (lengths[:, None] - MATCHES + torch.arange(MATCHES, device=device)).clamp(min=0))
    same = padded.unfold(1, MATCHES, 1) == last[:, None, :]
    run = same.flip(-1).cumprod(-1).bool()  # [rows, W, n - 1]: the last n tokens match, ending at e
    at = torch.arange(width, device=device)
    ends = torch.where(run & (at <= lengths[:, None] - 2)[:, :, None], at[None, :, None], -1).amax(1)
    n = ((ends >= 0) * torch.arange(1, MATCHES + 1, device=device)).amax(1)  # the longest match
    end = ends.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
    token = torch.where(n > 0, sequences.gather(1, (end + 1).clamp(min=0)[:, None])[:, 0], -1)
    return token, weights[n]


def mix_rows(logits: torch.Tensor, columns: torch.Tensor, weights: torch.Tensor, temperature: float) -> torch.Tensor:
    """`mix` as tensor ops on the logits' device, with no host read: `columns` [n] the copies' columns
    (any where the weight is 0), `weights` [n] float64."""
    tau = temperature if temperature > 0 else 1.0
    mixed = logits.to(torch.float32, copy=True)
    log_z = row_stats(mixed if tau == 1.0 else mixed / tau)[1].double()
    at = columns.clamp(min=0)[:, None]
    x, w = mixed.gather(1, at)[:, 0].double(), weights
    new = tau * (torch.log((1 - w) * torch.exp(x / tau - log_z) + w) - torch.log1p(-w) + log_z)
    mixed.scatter_(1, at, torch.where(w > 0, new, x).float()[:, None])  # a row of weight 0 keeps its own
    return mixed
