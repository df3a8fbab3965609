"""`dyspec calibrate`: measure a pair's positional acceptance vector, the input of Sequoia's
optimal tree (dyspec.policies.sequoia), by decoding with one-level trees of `width` children drawn
as Sequoia draws them and counting which child was accepted. An explicit step, never run behind a
generation's back; measured on IFEval prompts, never on the sets used to report speed."""

from __future__ import annotations

import json

import numpy as np
from tqdm.auto import tqdm

from dyspec.cache import write_cache
from dyspec.core.events import StepVerified
from dyspec.decode.engine import stream
from dyspec.errors import DyspecError
from dyspec.eval.prompts import load_prompts
from dyspec.policies.sequoia import acceptance_path

TEMPERATURES = (0.0, 0.6, 1.0)


def acceptance_from_ranks(ranks: list[int | None], width: int) -> list[float]:
    """a[k] = fraction of steps whose accepted child was the k-th drawn (None: none accepted)."""
    if not ranks:
        raise DyspecError("no steps to measure acceptance from")
    counts = np.zeros(width)
    for r in ranks:
        if r is not None:
            counts[r] += 1
    return (counts / len(ranks)).tolist()


def measure_acceptance(
    pair, prompts: list[str], temperature: float, width: int = 16, max_new_tokens: int = 32, progress: bool = True
) -> list[float]:
    """Positional acceptance of `pair` at `temperature` over `prompts`."""
    one_level = [-1] + [0] * width
    ranks: list[int | None] = []
    for prompt in tqdm(prompts, desc=f"acceptance at T={temperature:g}", disable=not progress):
        for e in stream(
            pair,
            prompt,
            "sequoia",
            budget=width,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            options={"parents": one_level},
        ):
            if isinstance(e, StepVerified):
                ranks.append(e.accepted[0] - 1 if e.accepted else None)
    return acceptance_from_ranks(ranks, width)


def calibrate(pair, temperatures=TEMPERATURES, num_prompts: int = 10, width: int = 16, progress: bool = True) -> dict:
    """Measure the vectors at `temperatures` and save them where `sequoia` reads them first
    (`acceptance_path`); returns what was saved."""
    prompts = [text for _, text in load_prompts("ifeval", num_prompts)]
    saved = {
        "target": pair.target_name,
        "draft": pair.draft_name,
        "precision": pair.precision,
        "prompts": f"ifeval, first {len(prompts)}",
        "width": width,
        "acceptance": {f"{t:g}": measure_acceptance(pair, prompts, t, width, progress=progress) for t in temperatures},
    }
    write_cache(acceptance_path(pair), json.dumps(saved, indent=1))
    return saved
