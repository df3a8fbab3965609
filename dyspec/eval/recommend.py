"""`dyspec recommend`: a serving engine's speculative settings for your pair and prompts. Each
candidate setting in the engine's own parameter space runs on the prompts with the draft you have,
and is scored by its measured tokens per step priced with a latency profile (this machine's, or a
`dyspec profile --json` file from the serving GPU).

- SGLang and TensorRT-LLM build their trees anew each step (EAGLE-2's build) from three settings:
  that build is the `sglang` policy, run over a grid of them within each engine's own limits.
- vLLM verifies a static tree, run here as `sequoia` with that tree's shape. Its proposer takes
  level-uniform trees only: the candidates are those that score best at each size under the
  pair's measured acceptance vector.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tqdm.auto import tqdm

from dyspec.auto.whatif import LatencyModel, modelled_speedup, step_shapes
from dyspec.core.events import StepVerified
from dyspec.decode.engine import stream
from dyspec.errors import DyspecError
from dyspec.export import ENGINES, export, level_uniform_trees, sglang_flags, tree_parents, trtllm_config, uniform_paths
from dyspec.policies.sequoia import tree_score

# The dynamic trees' settings, over the ranges SGLang's docs and defaults use: draft steps (drafter
# layers), top-k per step, and the tokens verified (the root included). SGLang fills up to the
# topk + (steps - 1) * topk^2 candidates and at top-1 fixes num_draft_tokens at steps + 1;
# TensorRT-LLM's validation wants steps <= drafted tokens <= topk * steps
DYNAMIC_STEPS, DYNAMIC_TOPK, DYNAMIC_TOKENS = (2, 3, 5), (1, 4, 8), (4, 8, 16, 32)
# Static trees: the sizes and depths tried, and how many level-uniform trees of each size (the
# best by expected tokens per step) are measured; the rest score lower before any is run
STATIC_SIZES, STATIC_DEPTHS, UNIFORM_PER_SIZE = (2, 4, 8, 16, 32), (2, 4, 6), 2


@dataclass(frozen=True)
class Setting:
    """One candidate: the engine's parameters as the table shows them, how dyspec runs it, and the
    configuration to paste."""

    columns: tuple[tuple[str, object], ...]
    policy: str
    budget: int
    options: dict
    config: str


def dynamic_settings(engine: str) -> list[Setting]:
    """The grid of `engine`'s dynamic-tree settings (SGLang's or TensorRT-LLM's), each run as the
    `sglang` policy: `steps` draft forwards, `topk`, and its verified tokens less the root as budget."""
    grid = []
    for steps, topk in itertools.product(DYNAMIC_STEPS, DYNAMIC_TOPK):
        if engine == "sglang":
            cap = topk + (steps - 1) * topk**2
            drafted = [steps] if topk == 1 else [t - 1 for t in DYNAMIC_TOKENS if t - 1 <= cap]
        else:
            drafted = sorted({min(max(t - 1, steps), topk * steps) for t in DYNAMIC_TOKENS})
        for nodes in drafted:
            if engine == "sglang":
                names = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
                config = sglang_flags(dict(zip(names, (steps, topk, nodes + 1))))
                columns = (("steps", steps), ("topk", topk), ("num_draft_tokens", nodes + 1))
            else:
                names = ("max_draft_len", "dynamic_tree_max_topK", "max_total_draft_tokens")
                columns = tuple(zip(names, (steps, topk, nodes)))
                config = trtllm_config({"max_draft_len": steps, "use_dynamic_tree": True, **dict(columns[1:])})
            grid.append(Setting(columns, "sglang", nodes, {"steps": steps, "topk": topk}, config))
    return grid


def static_setting(engine: str, parents: list[int], columns: tuple) -> Setting:
    config = export(parents, engine)[0]
    # children by draft rank at any temperature, as the engines read a static tree's paths
    return Setting(columns, "sequoia", len(parents) - 1, {"parents": parents, "select": "top"}, config)


def vllm_settings(acceptance: list[float]) -> list[Setting]:
    settings = {}
    for smaller, size in zip((0, *STATIC_SIZES), STATIC_SIZES):
        trees = [(w, tree_parents(uniform_paths(w))) for w in level_uniform_trees(size, max(STATIC_DEPTHS))]
        trees = [(w, parents) for w, parents in trees if len(parents) - 1 > smaller]
        best = sorted(trees, key=lambda tree: -tree_score(tree[1], acceptance))
        for widths, parents in best[:UNIFORM_PER_SIZE]:
            columns = (("children per level", ",".join(map(str, widths))), ("num_speculative_tokens", len(parents) - 1))
            settings[widths] = static_setting("vllm", parents, columns)
    return list(settings.values())


def engine_settings(engine: str, acceptance: list[float] | None) -> list[Setting]:
    if engine not in ENGINES:
        raise DyspecError(f"unknown engine '{engine}'; choose one of: {', '.join(ENGINES)}")
    if engine != "vllm":
        return dynamic_settings(engine)
    if acceptance is None:
        raise DyspecError("vLLM's candidate trees need the pair's acceptance vector: run `dyspec calibrate`")
    return vllm_settings(acceptance)


def recommend(
    pair,
    prompts: list[str],
    model: LatencyModel,
    engine: str = "sglang",
    temperature: float = 0.0,
    max_new_tokens: int = 32,
    acceptance: list[float] | None = None,
    progress: bool = True,
) -> list[dict]:
    """Every candidate setting with its measured tokens per step and modelled speedup over `ar`,
    best first."""
    rows = []
    for setting in tqdm(engine_settings(engine, acceptance), desc=f"{engine} settings", disable=not progress):
        steps, run = [], {"max_new_tokens": max_new_tokens, "options": setting.options}
        for prompt in prompts:
            events = stream(pair, prompt, setting.policy, setting.budget, temperature, **run)
            steps += [e for e in events if isinstance(e, StepVerified)]
        shapes = step_shapes(steps)
        tokens = sum(emitted for _, _, emitted in shapes)
        speedup = modelled_speedup(shapes, model)
        rows.append({"setting": setting, "tokens_per_step": tokens / len(shapes), "speedup": speedup})
    return sorted(rows, key=lambda r: -r["speedup"])


def recommend_table(rows: list[dict], model: LatencyModel, top: int = 10) -> str:
    names = [name for name, _ in rows[0]["setting"].columns]
    lines = [
        f"| {' | '.join(names)} | tokens per step | modelled speedup on {model.name} |",
        "|---" * (len(names) + 2) + "|",
    ]
    for r in rows[:top]:
        values = " | ".join(str(v) for _, v in r["setting"].columns)
        lines.append(f"| {values} | {r['tokens_per_step']:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)
