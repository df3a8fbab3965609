"""The lean forward (`--fast-path lean`, dyspec.forward.lean) against the Hugging Face forward, the
reference: the same logits on the same weights, prefill, tree and decode."""

import dataclasses

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dyspec import generate
from dyspec.core.kv import KVSession
from dyspec.core.tree import Tree
from dyspec.decode.engine import encode_prompt
from dyspec.errors import DyspecError
from dyspec.eval.anatomy import counting
from dyspec.forward import lean as lean_module
from dyspec.forward.choose import LeanRun, check_lean, pick_fast_path
from dyspec.forward.lean import LeanForward, lean_unsupported
from dyspec.kernels import row_attention
from dyspec.load import load_pair

from .conftest import PROMPTS
from .tiny import tiny_feature_pair, tiny_model, tiny_pair

SMALL = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def forwards(model, lean: bool, prompt: list[int], tree: Tree) -> list[torch.Tensor]:
    """The logits of a prefill, a tree forward after it, and a one-token decode after committing a
    path of the tree: through the lean forward, or the Hugging Face forward."""
    run = LeanForward(model) if lean else model
    kv = KVSession(run, keep_hidden=True, cache=run.cache_for("reference") if lean else None)
    out = [kv.append(prompt)]
    out.append(kv.forward(tree.tokens, [kv.length + d for d in tree.depths], tree.ancestor_mask()))
    out.append(kv.hidden)
    kv.commit([kv.length + i for i in tree.path(len(tree) - 1)])
    out.append(kv.forward([tree.tokens[1]]))
    return out


def random_tree(root: int, vocab: int, size: int = 12, seed: int = 0) -> Tree:
    g = torch.Generator().manual_seed(seed)
    tree = Tree.root(root)
    for _ in range(size - 1):
        tree.add(int(torch.randint(len(tree), (), generator=g)), int(torch.randint(vocab, (), generator=g)), 1.0)
    return tree


def check_against_reference(model, prompt: list[int], atol: float) -> None:
    tree = random_tree(prompt[-1], model.config.vocab_size)
    for lean, reference in zip(forwards(model, True, prompt, tree), forwards(model, False, prompt, tree)):
        torch.testing.assert_close(lean, reference, atol=atol, rtol=0)


CPU_DEFAULT = pytest.mark.skipif(torch.cuda.is_available(), reason="the int8 default runs on a CPU only")


@pytest.mark.parametrize("precision", ["fp32", pytest.param("int8", marks=CPU_DEFAULT)])
def test_lean_logits_are_the_hugging_face_forwards(precision, pair, default_pair):
    """On the int8 default the lean forward runs the same ops on the same values as the Hugging Face
    forward, so its logits are equal bit for bit (an int8 path must be: a last-bit change of an
    activation can cross a rounding boundary). In fp32 it fuses q/k/v and gate/up into one product
    each, which rounds differently: logits agree to 1e-4 (they are ~10 in size; fp32 keeps ~7 digits,
    and 30 layers compound them), the bound the tree forwards are held to against full forwards."""
    model = (pair if precision == "fp32" else default_pair).target
    check_against_reference(model, encode_prompt(pair, PROMPTS[3])[:-1], atol=1e-4 if precision == "fp32" else 0)


def test_a_wrong_rotary_fails_the_reference_comparison(pair, monkeypatch):
    """The comparison can fail: a rotary that drops its sine half is caught."""
    monkeypatch.setattr(lean_module.lean_graph, "rotate", lambda x, cos, sin: x * cos)
    with pytest.raises(AssertionError):
        check_against_reference(pair.target, encode_prompt(pair, PROMPTS[3])[:-1], atol=1e-4)


def draft_forwards(draft, lean: bool, prompt: list[int], tree: Tree) -> list[torch.Tensor]:
    """A feature draft's logits and predicted features for a prompt, a tree after it and a step
    after committing a path, on random target features: its lean layers or its Hugging Face ones."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(len(prompt) + len(tree), draft.feature_size, generator=g)
    if lean:
        draft.use_lean()
    kv = KVSession(draft, keep_hidden=True, cache=draft.cache_for("reference") if lean else None)
    out = [kv.append(prompt, features=features[: len(prompt)]), kv.hidden]
    tree_features = features[len(prompt) :, : draft.config.hidden_size]  # its own predictions, in a tree
    out.append(
        kv.forward(tree.tokens, [kv.length + d for d in tree.depths], tree.ancestor_mask(), features=tree_features)
    )
    out.append(kv.hidden)
    kv.commit([kv.length + i for i in tree.path(len(tree) - 1)])
    out.append(kv.forward([tree.tokens[1]], features=features[:1]))
    return out


def check_draft_against_reference(draft, atol: float) -> None:
    prompt = [1, 4, 2, 3, 0, 4, 4, 1, 2]
    tree = random_tree(prompt[-1], draft.config.vocab_size)
    for lean, reference in zip(draft_forwards(draft, True, prompt, tree), draft_forwards(draft, False, prompt, tree)):
        torch.testing.assert_close(lean, reference, atol=atol, rtol=0)


@pytest.mark.parametrize("precision", ["fp32", pytest.param("int8", marks=CPU_DEFAULT)])
def test_a_feature_drafts_lean_layers_are_its_hugging_face_layers(precision, monkeypatch):
    """On the lean and compiled paths a feature draft decodes with its layers run lean: the same
    logits and predicted features as its Hugging Face layers (int8: bit for bit; fp32: fused q/k/v
    and gate/up round differently, 1e-4 as for targets). A rotary that drops its sine half is caught."""
    draft = tiny_feature_pair().draft
    if precision == "int8":
        draft.quantize_int8()
    check_draft_against_reference(draft, atol=1e-4 if precision == "fp32" else 0)
    monkeypatch.setattr(lean_module.lean_graph, "rotate", lambda x, cos, sin: x * cos)
    with pytest.raises(AssertionError):
        check_draft_against_reference(draft, atol=1e-4)


ARCHITECTURES = [
    lambda: tiny_model(1, 2),
    lambda: MistralForCausalLM(MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=None)),
    lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=2)),  # q/k/v biases
    lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16)),  # q/k norms
]


@pytest.mark.parametrize("model", ARCHITECTURES, ids=["llama", "mistral", "qwen2", "qwen3"])
def test_every_covered_architecture_matches_its_reference(model):
    torch.manual_seed(0)
    model = model().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    assert lean_unsupported(model) is None
    check_against_reference(model, [1, 4, 2, 3, 0, 4, 4, 1], atol=1e-5)


def test_a_model_the_lean_forward_does_not_cover_runs_the_reference_with_a_note():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2))
    assert "GPT2LMHeadModel is not one of" in lean_unsupported(model)
    with pytest.warns(UserWarning, match="the Hugging Face forward runs"):
        assert check_lean("lean", "auto", model, False) == "off"
    with pytest.raises(DyspecError, match="--fast-path lean: GPT2LMHeadModel"):
        check_lean("lean", "lean", model, False)
    assert check_lean("static", "static", model, False) == "static"


@CPU_DEFAULT
def test_the_cpu_default_runs_the_compiled_int8_forward_where_it_can(default_pair, monkeypatch):
    """Compiled measured fastest with int8 layers; fp32, or a machine with no C++ compiler for
    torch.compile, gets the lean forward."""
    assert default_pair.fast_path == "compiled" and default_pair.precision == "int8"
    assert isinstance(default_pair.forward(default_pair.draft), LeanRun)  # its draft's layers lean, eager
    cpu = torch.device("cpu")
    assert pick_fast_path("auto", cpu, "fp32") == "lean"
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert pick_fast_path("auto", cpu, "int8") == "lean"
    assert pick_fast_path("compiled", cpu, "int8") == "compiled"  # asked for by name: as asked
    monkeypatch.delenv("CXX")
    monkeypatch.delattr(torch.compiler, "load_compiled_function")  # a PyTorch too old to keep graphs
    assert pick_fast_path("auto", cpu, "int8") == "lean"
    with pytest.raises(DyspecError, match="needs a newer PyTorch"):
        LeanForward(default_pair.target).compile_layers()
    assert load_pair(precision="fp32", fast_path="off").fast_path == "off"


@pytest.fixture(scope="module")
def off_pair(pair):
    """The fp32 pair on the Hugging Face forward, the reference the lean default is held to."""
    return dataclasses.replace(pair, fast_path="off")


@pytest.mark.parametrize("policy,budget", [("chain", 2), ("dyspec", 8)])
def test_greedy_is_token_identical_on_both_forwards(pair, off_pair, policy, budget):
    """The suite's exactness tests run the lean default; the Hugging Face forward keeps its own."""
    expected = generate(off_pair, PROMPTS[0], policy="ar", max_new_tokens=16).token_ids
    for p in (pair, off_pair):
        assert generate(p, PROMPTS[0], policy=policy, budget=budget, max_new_tokens=16).token_ids == expected


def test_a_lean_cache_grows_in_place_of_what_it_held(monkeypatch):
    """A cache that runs out of room is reallocated larger with its tokens kept: a generation past
    the first capacity decodes as the reference does."""
    monkeypatch.setattr(lean_module, "ROUND", 16)
    pair = tiny_pair()
    expected = generate(pair, [0, 3, 1, 2], policy="ar", max_new_tokens=40).token_ids
    lean = dataclasses.replace(pair, fast_path="lean")
    assert generate(lean, [0, 3, 1, 2], policy="dyspec", budget=4, max_new_tokens=40).token_ids == expected
    assert lean.forward(lean.target).run.cache_for("target").capacity > 16


@pytest.mark.parametrize("kernel", [True, False])
def test_a_stacked_cache_commits_every_layer_at_once(monkeypatch, kernel):
    """The graph path's cache: each layer's keys and values are views of two stacked tensors, through
    a growth too; a commit of a tree's path moves its slots in every layer as the per-layer cache's
    commit does, by the CPU's kernel or (`kernel` False) by the tensor ops a GPU runs."""
    monkeypatch.setattr(lean_module, "ROUND", 8)
    if not kernel:
        monkeypatch.setattr(row_attention, "kernel_available", lambda: False)
    model = LeanForward(tiny_pair().target)
    tree = random_tree(2, model.config.vocab_size)
    caches, ops = [], []
    for stacked in (False, True):
        kv = KVSession(model, cache=lean_module.new_cache(model, 8, stacked), bool_mask=True)
        kv.append([1, 4, 2, 3, 0])
        kv.forward(tree.tokens, [kv.length + d for d in tree.depths], tree.ancestor_mask())  # grows the cache
        path = tree.path(max(range(len(tree)), key=lambda node: tree.depths[node]))  # the root's slot first
        with counting() as count:
            kv.commit([kv.length + node for node in path])
        caches.append(kv.cache)
        ops.append(count.ops)
    plain, stacked = caches
    # the kernel: one op either way; tensor ops: the stacked pair's moves (an index, three ops a
    # tensor), where the per-layer cache moves 2 * layers tensors
    assert ops == [1, 1] if kernel else ops[1] <= 8 < ops[0], ops
    assert stacked.capacity > 8 and len(path) > 2 and path != list(range(len(path)))
    keys, values = stacked.stacked
    for i in range(len(stacked.k)):
        assert stacked.k[i].data_ptr() == keys[i].data_ptr() and stacked.v[i].data_ptr() == values[i].data_ptr()
        assert torch.equal(stacked.k[i][:, : stacked.length], plain.k[i][:, : plain.length])
        assert torch.equal(stacked.v[i][:, : stacked.length], plain.v[i][:, : plain.length])
