"""`dyspec export`: every format parses back, by the engines' own rules, to the tree dyspec verified."""

import ast
import json
import random
from pathlib import Path

import pytest
import torch

from dyspec.cli import main
from dyspec.core.tree import Tree
from dyspec.errors import DyspecError
from dyspec.eval.recommend import (
    STATIC_DEPTHS,
    STATIC_SIZES,
    UNIFORM_PER_SIZE,
    dynamic_settings,
    vllm_settings,
)
from dyspec.export import (
    FORMATS,
    export,
    frequent_tree,
    growmap_parents,
    is_level_uniform,
    level_uniform_trees,
    nearest_level_uniform,
    tree_parents,
    tree_paths,
    uniform_paths,
)
from dyspec.policies.sequoia import optimal_tree, tree_score

GOLDEN = Path(__file__).parent / "data" / "export"
SIX = [-1, 0, 0, 1, 1, 2, 3]  # (0,) (1,) (0,0) (0,1) (1,0) (0,0,0)


def tree_of(parents: list[int]) -> Tree:
    tree = Tree.root(0)
    for p in parents[1:]:
        tree.add(p, 1, 0.5)
    return tree


def ancestry(tree: Tree) -> set[tuple]:
    """Each node as its path of sibling ranks, with the paths of the nodes its mask row sees."""
    rank = {0: ()}
    for node in range(1, len(tree)):
        parent = tree.parents[node]
        rank[node] = (*rank[parent], tree.children(parent).index(node))
    mask = tree.ancestor_mask()
    return {(rank[i], frozenset(rank[j] for j in range(len(tree)) if mask[i, j])) for i in range(len(tree))}


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1, *(rng.randrange(i) for i in range(1, n + 1))]


def check_eagle_choices(choices: list[list[int]]) -> list[list[int]]:
    """TensorRT-LLM's `EagleDecodingConfig.check_eagle_choices` (tensorrt_llm/llmapi/llm_args.py):
    deduplicate, sort by (length, path), and require each path's parent."""
    choices = sorted([list(t) for t in {tuple(c) for c in choices}], key=lambda x: (len(x), x))
    for choice in choices:
        if len(choice) > 1:
            assert choice[:-1] in choices, f"choice {choice} is not connected"
    return choices


def validate_dynamic_eagle(config: dict) -> dict:
    """TensorRT-LLM's `EagleDecodingConfig.validate_eagle_config` (tensorrt_llm/llmapi/llm_args.py)
    for a dynamic tree: max_draft_len > 0, no static choices, a positive dynamic_tree_max_topK, and
    max_draft_len <= max_total_draft_tokens <= dynamic_tree_max_topK * max_draft_len."""
    assert config["decoding_type"] == "Eagle3" and config["use_dynamic_tree"] is True
    assert "eagle_choices" not in config
    depth, topk, total = config["max_draft_len"], config["dynamic_tree_max_topK"], config["max_total_draft_tokens"]
    assert depth > 0 and topk > 0 and depth <= total <= topk * depth
    return config


def vllm_levels(tree: str) -> tuple[list[tuple], list[int]]:
    """vLLM's reading of `speculative_token_tree` (vllm/v1/spec_decode/eagle.py): a literal, sorted
    breadth-first, and children per level = drafts at the level // drafts at the level above."""
    choices = sorted(ast.literal_eval(tree), key=lambda t: (len(t), t))
    per_level = [0] * len(choices[-1])
    for node in choices:
        per_level[len(node) - 1] += 1
    children = [per_level[0]] + [per_level[i] // per_level[i - 1] for i in range(1, len(per_level))]
    return choices, children


def vllm_drafts(children: list[int]) -> list[tuple]:
    """The tree vLLM's proposer actually drafts: every node of a level gets that level's children."""
    level, out = [()], []
    for c in children:
        level = [(*p, k) for p in level for k in range(c)]
        out += level
    return out


@pytest.mark.parametrize("seed", range(30))
def test_choice_lists_parse_back_to_the_same_tree(seed):
    rng = random.Random(seed)
    parents = random_parents(rng, rng.randrange(1, 40))
    _, text = export(parents, "medusa")
    choices = check_eagle_choices(json.loads(text))
    assert choices == json.loads(text)  # already in the engine's order
    assert ancestry(tree_of(tree_parents([tuple(c) for c in choices]))) == ancestry(tree_of(parents))


@pytest.mark.parametrize("seed", range(30))
def test_trtllm_gets_dynamic_tree_settings_that_cover_the_tree(seed):
    """TensorRT-LLM's only EAGLE tree is dynamic: the settings pass its validation, verify the
    tree's node count, draft as many levels, and top-K reaches the widest node's children."""
    rng = random.Random(seed)
    parents = random_parents(rng, rng.randrange(1, 40))
    paths = tree_paths(parents)
    snippet, text = export(parents, "trtllm")
    config = validate_dynamic_eagle(json.loads(text))
    assert config["max_total_draft_tokens"] == len(paths) and config["max_draft_len"] == max(map(len, paths))
    assert config["dynamic_tree_max_topK"] > max(p[-1] for p in paths)
    assert "Eagle3DecodingConfig(" in snippet and "eagle_choices" not in snippet


@pytest.mark.parametrize("seed", range(30))
def test_vllm_gets_level_uniform_trees_and_an_offer_for_the_rest(seed):
    rng = random.Random(seed)
    widths = tuple(rng.randrange(1, 4) for _ in range(rng.randrange(1, 4)))
    parents = tree_parents(uniform_paths(widths))
    config = json.loads(export(parents, "vllm")[1])
    choices, children = vllm_levels(config["speculative_token_tree"])
    assert config["num_speculative_tokens"] == len(choices) and vllm_drafts(children) == choices
    assert ancestry(tree_of(tree_parents(choices))) == ancestry(tree_of(parents))
    other = random_parents(rng, rng.randrange(2, 30))
    if not is_level_uniform(tree_paths(other)):
        with pytest.raises(DyspecError, match="not level-uniform; the nearest"):
            export(other, "vllm")
        near = nearest_level_uniform(tree_paths(other))
        assert is_level_uniform(near) and len(near) <= len(other) - 1


def test_the_nearest_level_uniform_tree_is_the_best_one_for_the_acceptance():
    a = [0.6, 0.2, 0.1]
    parents, _ = optimal_tree(tuple(a), 12, 4)
    near = nearest_level_uniform(tree_paths(parents), a)
    best = max(
        (
            uniform_paths(w)
            for w in [(1,), (2,), (1, 1), (2, 1), (3, 1), (1, 1, 1), (2, 1, 1), (2, 2), (3, 2), (2, 2, 2)]
            if len(uniform_paths(w)) <= 12
        ),
        key=lambda p: tree_score(tree_parents(p), a),
    )
    assert tree_score(tree_parents(near), a) >= tree_score(tree_parents(best), a)


@pytest.mark.parametrize("seed", range(10))
def test_a_sequoia_growmap_round_trips_through_torch_load(tmp_path, seed):
    rng = random.Random(seed)
    parents = tree_parents(tree_paths(random_parents(rng, rng.randrange(1, 30))))  # breadth-first ids
    g = export(parents, "sequoia")[1]
    torch.save(g, tmp_path / "g.pt")
    loaded = torch.load(tmp_path / "g.pt")
    assert growmap_parents(loaded) == parents and loaded["size"] == len(parents)
    assert torch.equal(loaded["mask"].bool(), tree_of(parents).ancestor_mask())
    assert loaded["depth"].tolist() == tree_of(parents).depths
    # each level's nodes expand into consecutive ids, as Sequoia's generators number them
    assert sum(map(sum, loaded["branches"])) == len(parents) - 1 and loaded["roots"][0] == [0]


@pytest.mark.parametrize("fmt", ["trtllm", "medusa", "sglang"])
def test_golden_six_node_tree(fmt):
    assert export(SIX, fmt)[0] + "\n" == (GOLDEN / f"six.{fmt}.txt").read_text()


def test_golden_six_node_tree_for_vllm_is_its_nearest_level_uniform_tree():
    """Node (0,) has two children and (1,) one: vLLM would draft two under each."""
    with pytest.raises(DyspecError, match=r"\(6 nodes\): \[\(0,\), \(1,\), \(0, 0\), \(1, 0\)"):
        export(SIX, "vllm")
    near = tree_parents(nearest_level_uniform(tree_paths(SIX)))
    assert export(near, "vllm")[0] + "\n" == (GOLDEN / "six.vllm.txt").read_text()


def test_golden_six_node_growmap():
    g = export(SIX, "sequoia")[1]
    assert g["roots"] == [[0], [1, 2], [3, 4, 5], [6]] and g["branches"] == [[2], [2, 1], [1, 0, 0], [0]]
    assert g["Successors"] == [[1, 2], [3, 4], [5], [6], [], [], []] and g["size"] == 7


def test_golden_six_node_tree_for_trtllm_is_its_dynamic_settings():
    config = json.loads(export(SIX, "trtllm")[1])
    assert (config["max_draft_len"], config["dynamic_tree_max_topK"], config["max_total_draft_tokens"]) == (3, 2, 6)


def test_sglang_settings_cover_the_tree():
    args = json.loads(export(SIX, "sglang")[1])
    steps, topk, tokens = (
        args[k] for k in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    )
    assert (steps, topk, tokens) == (3, 2, 7)
    assert tokens - 1 <= topk + (steps - 1) * topk**2  # SGLang's candidates per step


def test_the_most_frequent_paths_form_a_tree():
    trees = [[-1, 0, 1, 2], [-1, 0, 0, 1], [-1, 0, 1], [-1, 0, 0]]  # chains of 3 and 2; branchy ones
    assert tree_paths(frequent_tree(trees, 2)) == [(0,), (0, 0)]
    assert tree_paths(frequent_tree(trees, 3)) == [(0,), (1,), (0, 0)]
    rng = random.Random(0)
    many = [random_parents(rng, rng.randrange(1, 12)) for _ in range(50)]
    for budget in (1, 5, 20):
        paths = tree_paths(frequent_tree(many, budget))
        assert len(paths) == budget and all(p[:-1] in paths or len(p) == 1 for p in paths)


def test_cli_exports_sequoias_tree_for_a_vector(capsys, tmp_path):
    assert main(["export", "--format", "medusa", "--acceptance", "[0.6,0.2,0.1]", "--budget", "6"]) == 0
    out = capsys.readouterr()
    parents, score = optimal_tree((0.6, 0.2, 0.1), 6, 8)
    assert json.dumps([list(p) for p in tree_paths(parents)]) in out.out and f"{score:.2f}" in out.err
    assert (
        main(
            [
                "export",
                "--format",
                "sequoia",
                "--acceptance",
                "[0.6,0.2]",
                "--budget",
                "6",
                "--out",
                str(tmp_path / "g.pt"),
            ]
        )
        == 0
    )
    assert growmap_parents(torch.load(tmp_path / "g.pt")) == optimal_tree((0.6, 0.2), 6, 8)[0]
    assert main(["export", "--format", "vllm", "--acceptance", "[0.6,0.3]", "--budget", "5", "--max-depth", "2"]) == 2
    assert "not level-uniform" in capsys.readouterr().err
    assert (
        main(
            [
                "export",
                "--format",
                "vllm",
                "--acceptance",
                "[0.6,0.3]",
                "--budget",
                "5",
                "--max-depth",
                "2",
                "--nearest",
            ]
        )
        == 0
    )
    config = json.loads(capsys.readouterr().out.removeprefix("speculative_config = "))
    assert is_level_uniform(vllm_levels(config["speculative_token_tree"])[0]) and config["num_speculative_tokens"] <= 5
    assert main(["export", "--format", "sequoia", "--acceptance", "[0.6]"]) == 2
    assert "--out" in capsys.readouterr().err


def test_every_format_is_covered():
    assert set(FORMATS) == {"trtllm", "medusa", "vllm", "sglang", "sequoia"}


def test_cli_exports_the_paths_a_policy_grew_most_often(capsys):
    assert main(["export", "--format", "trtllm", "--from", "nosuch"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    args = [
        "export",
        "--format",
        "medusa",
        "--from",
        "chain",
        "--budget",
        "3",
        "--num-prompts",
        "1",
        "--max-new-tokens",
        "8",
    ]
    assert main(args) == 0
    assert "medusa_choices = [[0], [0, 0], [0, 0, 0]]" in capsys.readouterr().out  # a chain grows one path


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_recommend_ranks_dynamic_tree_settings_by_their_measured_trees(capsys, engine):
    """Every setting the engine accepts in the grid is measured as EAGLE-2's build (`sglang`); the
    best modelled speedup comes first and is what the command recommends."""
    grid = dynamic_settings(engine)
    for s in grid:
        steps, topk, count = (value for _, value in s.columns)
        assert s.policy == "sglang" and s.options == {"steps": steps, "topk": topk}
        if engine == "sglang":
            assert count == steps + 1 if topk == 1 else 2 <= count <= topk + (steps - 1) * topk**2 + 1
            assert s.budget == count - 1
        else:
            config = dict(s.columns, decoding_type="Eagle3", use_dynamic_tree=True)
            assert validate_dynamic_eagle(config) and s.budget == count
            assert f"max_total_draft_tokens={count}," in s.config and "Eagle3DecodingConfig(" in s.config
    assert len({s.config for s in grid}) == len(grid)
    args = ["recommend", "--engine", engine, "--num-prompts", "1", "--max-new-tokens", "6", "--profile", "h100"]
    assert main(args) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ") and "max_draft_len" not in line]
    table = [line for line in table if "steps" not in line and "---" not in line]
    speedups = [float(line.split("|")[5].strip().rstrip("x")) for line in table]
    assert len(table) == min(10, len(grid)) and speedups == sorted(speedups, reverse=True)
    best = [cell.strip() for cell in table[0].split("|")]
    if engine == "sglang":
        assert f"--speculative-num-steps {best[1]} --speculative-eagle-topk {best[2]}" in out
    else:
        assert f"max_draft_len={best[1]}, use_dynamic_tree=True, dynamic_tree_max_topK={best[2]}" in out


def test_vllm_candidates_are_level_uniform_and_the_best_of_their_size():
    acceptance = [0.6, 0.25, 0.12, 0.06]
    settings = vllm_settings(acceptance)
    for s in settings:
        config = json.loads(s.config.removeprefix("speculative_config = "))
        choices, children = vllm_levels(config["speculative_token_tree"])
        assert vllm_drafts(children) == choices and config["num_speculative_tokens"] == len(choices) == s.budget
        assert s.policy == "sequoia" and tree_paths(s.options["parents"]) == choices
        assert s.options["select"] == "top"  # a path's ranks are draft ranks, at any temperature
        assert s.columns[0][1] == ",".join(map(str, children))
    assert len({s.config for s in settings}) == len(settings)
    for smaller, size in zip((0, *STATIC_SIZES), STATIC_SIZES):  # the best tree of each size is measured
        rivals = [uniform_paths(w) for w in level_uniform_trees(size, max(STATIC_DEPTHS))]
        best = max(tree_score(tree_parents(p), acceptance) for p in rivals if len(p) > smaller)
        kept = [tree_score(s.options["parents"], acceptance) for s in settings if smaller < s.budget <= size]
        assert 1 <= len(kept) <= UNIFORM_PER_SIZE and max(kept) == pytest.approx(best)


def test_recommend_measures_static_trees_for_vllm(capsys):
    args = ["recommend", "--engine", "vllm", "--num-prompts", "1", "--max-new-tokens", "6", "--profile", "h100"]
    assert main(args) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ") and "tokens per step" not in line]
    speedups = [float(line.split("|")[4].strip().rstrip("x")) for line in table if "---" not in line]
    assert speedups and speedups == sorted(speedups, reverse=True)
    assert "speculative_token_tree" in out.split("recommended")[1]
