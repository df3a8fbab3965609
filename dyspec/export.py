"""`dyspec export`: a tuned tree in a serving engine's own format.

A static tree is written as its nodes' paths of child ranks from the root: (0,) is the root's first
child, (0, 1) that node's second. dyspec's trees number siblings in the order they were drawn, the
draft's rank at T = 0, which is what the engines' choice lists mean. Sources, checked against each
engine's own validation rules (tests/test_export.py re-implements them):

- TensorRT-LLM: no static EAGLE tree (`eagle_choices` was removed), a dynamic EAGLE-2 build sized
  by `Eagle3DecodingConfig(use_dynamic_tree=True, ...)`; the export is the settings that cover the
  tree, checked by `validate_eagle_config` in tensorrt_llm/llmapi/llm_args.py.
- Medusa `medusa_choices`: a list of paths as lists, deduplicated, sorted by (length, path), every
  path's parent present; TensorRT-LLM's runtime caps depth and child rank at `MEDUSA_MAX`.
- vLLM `speculative_config["speculative_token_tree"]`: a string holding a Python list of tuples,
  with `num_speculative_tokens` its length (vllm/v1/spec_decode/eagle.py). Its proposer drafts the
  same number of children for every node of a level, so only level-uniform trees run as written.
- SGLang: no static tree, a dynamic EAGLE-2 build sized by three server arguments; the export is
  the triple that covers the tree (a budget, not a shape).
- Sequoia: the growmap dict its generators `torch.save` (roots, branches, Successors, mask, depth,
  size).
"""

from __future__ import annotations

import ast
import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dyspec.core.events import StepVerified
from dyspec.decode.engine import stream
from dyspec.errors import DyspecError
from dyspec.policies import get_policy
from dyspec.policies.sequoia import optimal_tree, tree_score

FORMATS = ("trtllm", "medusa", "vllm", "sglang", "sequoia")
ENGINES = ("sglang", "vllm", "trtllm")  # the serving engines whose settings `dyspec recommend` measures
MEDUSA_MAX = 16  # the most levels, and children per node, TensorRT-LLM's Medusa runtime takes

Path_ = tuple[int, ...]


def tree_paths(parents: list[int]) -> list[Path_]:
    """Each drafted node's path of child ranks, in the engines' order: sorted by (length, path)."""
    paths: list[Path_] = [()]
    children = Counter()
    for p in parents[1:]:
        paths.append((*paths[p], children[p]))
        children[p] += 1
    return sorted(paths[1:], key=lambda t: (len(t), t))


def tree_parents(paths: list[Path_]) -> list[int]:
    """The parent ids (root -1, breadth-first, siblings by rank) of a prefix-closed set of paths."""
    order = sorted(set(map(tuple, paths)), key=lambda t: (len(t), t))
    index = {(): 0, **{path: i for i, path in enumerate(order, start=1)}}
    if missing := [p for p in order if p[:-1] not in index]:
        raise DyspecError(f"path {list(missing[0])} has no parent {list(missing[0][:-1])} in the tree")
    return [-1, *(index[p[:-1]] for p in order)]


def is_level_uniform(paths: list[Path_]) -> bool:
    """Whether every node of a level has the same children, ranks 0 .. c - 1: what vLLM's proposer builds."""
    levels = max(map(len, paths), default=0)
    width = [0] * (levels + 1)
    for p in paths:
        width[len(p)] = max(width[len(p)], p[-1] + 1)
    full = set(
        itertools.chain.from_iterable(
            itertools.product(*(range(w) for w in width[1 : n + 1])) for n in range(1, levels + 1)
        )
    )
    return set(map(tuple, paths)) == full


def level_uniform_trees(budget: int, max_depth: int):
    """Every level-uniform tree of at most `budget` nodes, as children per level."""

    def grow(widths: tuple[int, ...], nodes: int, last: int):
        if widths:
            yield widths
        if len(widths) == max_depth:
            return
        for c in range(1, budget + 1):
            if nodes + last * c > budget:
                break
            yield from grow((*widths, c), nodes + last * c, last * c)

    return grow((), 0, 1)


def uniform_paths(widths: tuple[int, ...]) -> list[Path_]:
    return [p for n in range(1, len(widths) + 1) for p in itertools.product(*(range(c) for c in widths[:n]))]


def nearest_level_uniform(paths: list[Path_], acceptance: list[float] | None = None) -> list[Path_]:
    """The level-uniform tree of at most as many nodes and levels that keeps the most: the best
    expected tokens per step under `acceptance` where one is given, else the most nodes in common."""
    budget, depth, given = len(paths), max(map(len, paths)), set(map(tuple, paths))

    def worth(widths):
        candidate = uniform_paths(widths)
        if acceptance is not None:
            return tree_score(tree_parents(candidate), acceptance), len(given & set(candidate))
        return len(given & set(candidate)), -len(candidate)

    return uniform_paths(max(level_uniform_trees(budget, depth), key=worth))


def sglang_settings(paths: list[Path_]) -> dict[str, int]:
    """SGLang's EAGLE server arguments that cover the tree: as many draft steps as levels, top-k the
    widest node's children, and the tree's tokens with the root (SGLang counts it). SGLang picks
    the best num_draft_tokens - 1 of topk + (steps - 1) * topk^2 candidates each step."""
    steps, topk = max(map(len, paths)), max(p[-1] for p in paths) + 1
    tokens = len(paths) + 1
    return {"speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens}


def trtllm_settings(paths: list[Path_]) -> dict:
    """TensorRT-LLM's dynamic EAGLE tree settings that cover the tree: a drafter layer per level,
    top-K the widest node's children (raised where needed so that K * max_draft_len reaches the
    tree's nodes, which its validation requires), and the tree's nodes (the root not counted). Each
    step it keeps the best max_total_draft_tokens of K + (max_draft_len - 1) * K^2 candidates, the
    EAGLE-2 build of the `sglang` policy."""
    depth, nodes = max(map(len, paths)), len(paths)
    topk = max(max(p[-1] for p in paths) + 1, -(-nodes // depth))
    return {
        "decoding_type": "Eagle3",
        "max_draft_len": depth,
        "use_dynamic_tree": True,
        "dynamic_tree_max_topK": topk,
        "max_total_draft_tokens": nodes,
    }


def trtllm_config(args: dict) -> str:
    """The settings as the LLM API's config object (`speculative_model` is the user's EAGLE-3 draft)."""
    keys = ", ".join(f"{k}={v}" for k, v in args.items() if k != "decoding_type")
    return f"speculative_config = Eagle3DecodingConfig({keys}, speculative_model=EAGLE3_DRAFT)"


def sglang_flags(args: dict[str, int]) -> str:
    """SGLang's server arguments on its command line."""
    return " ".join(["--speculative-algorithm EAGLE", *(f"--{k.replace('_', '-')} {v}" for k, v in args.items())])


def growmap(parents: list[int]) -> dict:
    """Sequoia's growmap of the tree: per level, the nodes expanded and their child counts; each
    node's children, its ancestor mask (itself included), depth, and the node count."""
    n = len(parents)
    successors: list[list[int]] = [[] for _ in range(n)]
    depth = [0] * n
    mask = torch.zeros(n, n, dtype=torch.long)
    for i, p in enumerate(parents):
        if p >= 0:
            successors[p].append(i)
            depth[i] = depth[p] + 1
            mask[i] = mask[p]
        mask[i, i] = 1
    levels = max(depth) + 1
    roots = [[i for i in range(n) if depth[i] == d] for d in range(levels)]
    return {
        "roots": roots,
        "branches": [[len(successors[i]) for i in level] for level in roots],
        "Successors": successors,
        "mask": mask,
        "depth": torch.LongTensor(depth),
        "size": n,
    }


def growmap_parents(grow_map: dict) -> list[int]:
    """The parent ids of a Sequoia growmap (`torch.load` of its .pt file)."""
    parents = [-1] * int(grow_map["size"])
    for node, children in enumerate(grow_map["Successors"]):
        for child in children:
            parents[child] = node
    return parents


def export(parents: list[int], fmt: str, acceptance: list[float] | None = None) -> tuple[str, object]:
    """The snippet to paste for `fmt` and the object to write (`--out`): text, or Sequoia's dict."""
    paths = tree_paths(parents)
    if not paths:
        raise DyspecError("the tree has no drafted node: nothing to export")
    if fmt == "medusa":
        if max(map(len, paths)) > MEDUSA_MAX or max(p[-1] for p in paths) >= MEDUSA_MAX:
            raise DyspecError(f"Medusa takes at most {MEDUSA_MAX} levels and {MEDUSA_MAX} children a node")
        choices = json.dumps([list(p) for p in paths])
        depth = max(map(len, paths))
        return f"medusa_choices = {choices}  # max_draft_len = {depth}, {len(paths)} draft tokens", choices
    if fmt == "trtllm":
        args = trtllm_settings(paths)
        note = "# TensorRT-LLM builds its own tree each step: these set its size, not this shape"
        return f"{note}\n{trtllm_config(args)}", json.dumps(args)
    if fmt == "vllm":
        if not is_level_uniform(paths):
            near = nearest_level_uniform(paths, acceptance)
            raise DyspecError(
                "vLLM's proposer drafts the same number of children for every node of a level, and this tree "
                f"is not level-uniform; the nearest that is ({len(near)} nodes): {near} (--nearest exports it)"
            )
        tree = str(paths).replace(" ", "")
        config = {"method": "eagle", "num_speculative_tokens": len(paths), "speculative_token_tree": tree}
        return f"speculative_config = {json.dumps(config)}", json.dumps(config)
    if fmt == "sglang":
        args = sglang_settings(paths)
        note = "# SGLang builds its own tree each step: these set its budget, not this shape"
        return f"{note}\n{sglang_flags(args)}", json.dumps(args)
    if fmt == "sequoia":
        g = growmap(parents)
        return f"# a Sequoia growmap of {g['size']} nodes and {len(g['roots'])} levels: write it with --out FILE.pt", g
    raise DyspecError(f"unknown format '{fmt}'; choose one of: {', '.join(FORMATS)}")


def write(obj: object, path: Path) -> None:
    if isinstance(obj, dict):
        torch.save(obj, path)
    else:
        path.write_text(obj + "\n")


def parse_vllm(tree: str) -> list[Path_]:
    """The paths of a vLLM `speculative_token_tree` string, as vLLM reads it (a Python literal)."""
    return [tuple(p) for p in ast.literal_eval(tree)]


def frequent_tree(trees: list[list[int]], budget: int) -> list[int]:
    """The union of the `budget` most frequent paths over `trees` (each a parent list), as parent
    ids: a node occurs whenever it does, its parent too, so the most frequent paths are closed
    under prefixes (ties go to the shorter, then the lower-ranked path)."""
    counts = Counter(p for parents in trees for p in tree_paths(parents))
    ranked = sorted(counts, key=lambda p: (-counts[p], len(p), p))
    return tree_parents(ranked[:budget])


# the text formats a view can show, each with where its snippet goes
VIEW_FORMATS = {
    "trtllm": "TensorRT-LLM: the dynamic-tree `Eagle3DecodingConfig` whose tree covers this one",
    "medusa": "Medusa: the `medusa_choices` of a Medusa engine (TensorRT-LLM's or Medusa's own)",
    "vllm": "vLLM: the `speculative_token_tree` of `speculative_config`, with its `num_speculative_tokens`",
    "sglang": "SGLang: the three `--speculative-*` server arguments whose dynamic tree covers this one",
}


def run_snippet(trees: list[list[int]], fmt: str) -> str:
    """What a view shows for "export this tree": the union of the paths a run grew most often,
    as many as its biggest tree, in `fmt`; for vLLM, the nearest level-uniform tree when needed."""
    size = max((len(parents) - 1 for parents in trees), default=0)
    if size == 0:
        return "# this run drafted no tree: nothing to export"
    parents = frequent_tree(trees, size)
    head = f"# the {size} paths this run grew most often over {len(trees)} steps"
    if fmt == "vllm" and not is_level_uniform(tree_paths(parents)):
        parents = tree_parents(nearest_level_uniform(tree_paths(parents)))
        head += ", made level-uniform for vLLM"
    return f"{head}\n{export(parents, fmt)[0]}"


def grown_trees(
    pair, prompts: list[str], policy: str, budget: int | str, temperature: float, max_new_tokens: int
) -> list[list[int]]:
    """The shape (parents) of every tree `policy` grew over `prompts`, behind a progress bar: what
    `frequent_tree` mines."""
    trees = []
    for prompt in tqdm(prompts, desc=f"{policy} trees"):
        events = stream(pair, prompt, policy, budget, temperature, max_new_tokens=max_new_tokens)
        trees += [e.parents for e in events if isinstance(e, StepVerified)]
    return trees


@dataclass(frozen=True)
class TreeSource:
    """Where an exported tree comes from: `name` "sequoia", Sequoia's optimal tree of `budget` nodes
    and `max_depth` levels for `acceptance` (the pair's measured vector where None); or a policy's
    name, the union of the `budget` paths it grew most often over `prompts`."""

    name: str
    budget: int
    temperature: float = 0.0
    acceptance: list[float] | None = None
    max_depth: int = 8
    prompts: tuple[str, ...] = ()
    max_new_tokens: int = 64


def export_tree(pair, source: TreeSource, level_uniform: bool = False) -> tuple[list[int], list[float] | None, str]:
    """The tree `source` names (parents), the acceptance vector it is scored by (None for a policy's
    tree without one) and a line saying where it comes from; with `level_uniform`, the nearest
    level-uniform tree where it is not one (vLLM runs only those as written)."""
    acceptance = source.acceptance
    if source.name == "sequoia":
        if acceptance is None:  # the pair's measured vector (`dyspec calibrate`, or shipped)
            acceptance = get_policy("sequoia").prepare(pair, source.temperature, {})["acceptance"]
        parents, _ = optimal_tree(tuple(acceptance), source.budget, source.max_depth)
        said = f"Sequoia's optimal tree for a = {[round(a, 3) for a in acceptance]}"
    else:
        trees = grown_trees(
            pair, list(source.prompts), source.name, source.budget, source.temperature, source.max_new_tokens
        )
        parents = frequent_tree(trees, source.budget)
        said = f"the {source.budget} paths {source.name} grew most often over {len(trees)} steps"
    if level_uniform and not is_level_uniform(tree_paths(parents)):
        parents = tree_parents(nearest_level_uniform(tree_paths(parents), acceptance))
        said += ", made level-uniform"
    return parents, acceptance, said
