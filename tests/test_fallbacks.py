"""Each fallback, forced: what runs instead of the fast path, said in one line, and the same tokens
where the fallback computes the same numbers."""

import pytest
import torch

from dyspec.errors import DyspecError
from dyspec.forward import choose
from dyspec.forward import lean as lean_module
from dyspec.forward.cuda_graph import GraphForward
from dyspec.forward.lean import LeanForward
from dyspec.kernels import int8_mm as kernel
from dyspec.load import loading

from .tiny import tiny_pair

CPU = torch.device("cpu")


def one_line(record) -> str:
    text = str(record[0].message)
    assert "\n" not in text
    return text


def test_without_a_cpp_compiler_the_int8_forward_runs_eager(monkeypatch):
    monkeypatch.setattr(choose, "cpp_compiler", lambda: None)
    with pytest.warns(UserWarning) as record:
        assert choose.pick_fast_path("auto", CPU, "int8") == "lean"
    assert one_line(record) == (
        "no C++ compiler found ($CXX, c++, g++ or clang++; install one for the compiled forward): the int8 "
        "forward runs eager (--fast-path lean), slower"
    )


def test_without_graphs_that_keep_the_int8_forward_runs_eager(monkeypatch):
    monkeypatch.setattr(choose.lean_graph, "supported", lambda: False)
    with pytest.warns(UserWarning, match="cannot keep compiled graphs") as record:
        assert choose.pick_fast_path("auto", CPU, "int8") == "lean"
    assert one_line(record).endswith("the int8 forward runs eager (--fast-path lean), slower")


def test_without_fbgemm_the_models_run_in_fp32_and_int8_says_why(monkeypatch):
    """As on a PyTorch build without the quantized ops (fbgemm: x86 only)."""
    monkeypatch.setattr(loading, "int8_available", lambda: False)
    with pytest.warns(UserWarning) as record:
        assert loading.pick_precision("auto", CPU) == "native"
    assert one_line(record) == "this PyTorch lacks fbgemm's quantized ops: the models run in fp32, slower"
    with pytest.raises(DyspecError, match="fbgemm"):
        loading.pick_precision("int8", CPU)


@pytest.mark.parametrize("native_bf16, dtype", [(True, torch.bfloat16), (False, torch.float16)])
def test_a_gpu_without_native_bf16_runs_fp16(monkeypatch, native_bf16, dtype):
    """As on Colab's T4 (compute capability 7.5): bf16 there is emulated, fp16 is not."""
    asked = []
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation: asked.append(including_emulation) or native_bf16
    )
    assert loading.pick_dtype(torch.device("cuda")) == dtype and asked == [False]
    assert loading.pick_dtype(CPU) == torch.float32


def test_without_the_int8_kernel_products_run_torch_int_mm_with_the_same_sums(monkeypatch):
    """As on an ARM CPU: no build to try; the products run oneDNN's torch._int_mm, exact as the kernel."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(-128, 128, (64, 32), dtype=torch.int8, generator=g)
    x = torch.randint(-128, 128, (5, 32), dtype=torch.int8, generator=g)
    with_kernel = kernel.int8_mm(x, *kernel.int8_operands(weight))
    monkeypatch.setattr(kernel.platform, "machine", lambda: "aarch64")
    kernel.kernel_available.cache_clear()
    try:
        with pytest.warns(UserWarning) as record:
            assert not kernel.kernel_available()
        assert "needs an x86-64 CPU with AVX2: int8 products run torch._int_mm" in one_line(record)
        assert kernel.kernel_path() == "torch._int_mm"
        packed, comp, plain = kernel.int8_operands(weight)
        assert comp is None and torch.equal(kernel.int8_mm(x, packed, comp, plain), with_kernel)
    finally:
        kernel.kernel_available.cache_clear()


@pytest.fixture
def graph_layer_choice():
    """`compiled_graph_layer` chosen afresh in a test and forgotten after it."""
    lean_module.compiled_graph_layer.cache_clear()
    yield lean_module.compiled_graph_layer
    lean_module.compiled_graph_layer.cache_clear()


def test_without_triton_the_gpu_forwards_layers_run_uncompiled(monkeypatch, graph_layer_choice):
    monkeypatch.setattr(lean_module, "has_triton", lambda: False)
    with pytest.warns(UserWarning) as record:
        assert graph_layer_choice() is lean_module.graph_layer
    assert one_line(record) == "Triton is not installed: the GPU forward's layers run uncompiled, slower"
    assert lean_module.graph_layers_run() == "eager"


def test_the_gpu_forwards_layers_run_uncompiled_when_asked_to_measure_them(monkeypatch, graph_layer_choice):
    monkeypatch.setattr(lean_module, "has_triton", lambda: True)
    assert lean_module.graph_layers_run() == "compiled"
    graph_layer_choice.cache_clear()
    monkeypatch.setenv("DYSPEC_GRAPH_LAYERS", "eager")
    assert graph_layer_choice() is lean_module.graph_layer


def test_a_gpu_forward_whose_layers_fail_to_compile_runs_them_uncompiled(monkeypatch, graph_layer_choice):
    """As where Triton finds no C compiler: the forward gives the uncompiled layers' logits, the note
    is one line, and later forwards run uncompiled without trying again."""
    tries = []

    def failing(*args):
        tries.append(args)
        raise torch._dynamo.exc.BackendCompilerFailed(failing, RuntimeError("Failed to find C compiler"), None)

    def logits(forward) -> torch.Tensor:
        kv = forward.session("check", 64, (1, 2), last_only=(False,))
        kv.append([0, 3, 1, 2])
        return torch.cat([kv.forward([4]), kv.forward([1])])

    target = tiny_pair().target
    expected = logits(GraphForward(LeanForward(target)))
    monkeypatch.setattr(lean_module, "COMPILE_FAILED", [])
    monkeypatch.setattr(lean_module, "layer_function", lambda device: lean_module.compiled_graph_layer())
    monkeypatch.setattr(lean_module, "has_triton", lambda: True)
    monkeypatch.setattr(lean_module.torch, "compile", lambda fn, **kw: failing)
    with pytest.warns(UserWarning) as record:
        got = logits(GraphForward(LeanForward(target)))
    assert one_line(record) == (
        "the GPU forward's layers did not compile (Failed to find C compiler): they run uncompiled, slower"
    )
    assert len(tries) == 1 and lean_module.graph_layers_run() == "eager"
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
