"""`dyspec recommend`: a serving engine's speculative settings for your pair and prompts. Each
setting in the engine's own parameter space runs on the prompts with the draft you have (SGLang's
tree build is the `sglang` policy), and is scored by its measured tokens per step priced with a
latency profile (this machine's, or a `dyspec profile --json` file from the serving GPU)."""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from dyspec.auto.whatif import LatencyModel, modelled_speedup, step_shapes
from dyspec.core.engine import stream
from dyspec.core.events import StepVerified
from dyspec.errors import DyspecError

# SGLang's own parameters, over the ranges its docs and defaults use: draft steps, top-k per step,
# and num_draft_tokens (the root included) up to the topk + (steps - 1) * topk^2 candidates they
# can fill; at top-1 SGLang fixes num_draft_tokens at steps + 1
SGLANG_STEPS, SGLANG_TOPK, SGLANG_TOKENS = (2, 3, 5), (1, 4, 8), (4, 8, 16, 32)
ENGINES = ("sglang",)


def sglang_settings() -> list[dict[str, int]]:
    grid = []
    for steps, topk in itertools.product(SGLANG_STEPS, SGLANG_TOPK):
        cap = topk + (steps - 1) * topk**2
        for tokens in [steps + 1] if topk == 1 else [t for t in SGLANG_TOKENS if t - 1 <= cap]:
            grid.append(
                {"speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens}
            )
    return grid


def recommend(
    pair,
    prompts: list[str],
    model: LatencyModel,
    engine: str = "sglang",
    temperature: float = 0.0,
    max_new_tokens: int = 32,
    progress: bool = True,
) -> list[dict]:
    """Every setting with its measured tokens per step and modelled speedup over `ar`, best first."""
    if engine not in ENGINES:
        raise DyspecError(f"unknown engine '{engine}'; choose one of: {', '.join(ENGINES)}")
    rows = []
    settings = sglang_settings()
    for setting in tqdm(settings, desc=f"{engine} settings", disable=not progress):
        steps = []
        options = {"steps": setting["speculative_num_steps"], "topk": setting["speculative_eagle_topk"]}
        for prompt in prompts:
            events = stream(
                pair,
                prompt,
                "sglang",
                setting["speculative_num_draft_tokens"] - 1,
                temperature,
                max_new_tokens=max_new_tokens,
                options=options,
            )
            steps += [e for e in events if isinstance(e, StepVerified)]
        shapes = step_shapes(steps)
        tokens = sum(emitted for _, _, emitted in shapes)
        rows.append({**setting, "tokens_per_step": tokens / len(shapes), "speedup": modelled_speedup(shapes, model)})
    return sorted(rows, key=lambda r: -r["speedup"])


def recommend_table(rows: list[dict], model: LatencyModel, top: int = 10) -> str:
    lines = [
        f"| steps | topk | num_draft_tokens | tokens per step | modelled speedup on {model.name} |",
        "|---|---|---|---|---|",
    ]
    for r in rows[:top]:
        lines.append(
            f"| {r['speculative_num_steps']} | {r['speculative_eagle_topk']} | {r['speculative_num_draft_tokens']} "
            f"| {r['tokens_per_step']:.2f} | {r['speedup']:.2f}x |"
        )
    return "\n".join(lines)
