"""The Triton symmetric-product kernel (``dmuon.triton_kernels``), tested on CPU through Triton's
interpreter, as CI runs it: the lower-triangle Gram matrix and symmetric products against
``torch.bmm``/``baddbmm``, Newton–Schulz and a ``dmuon.Muon`` step with
``symmetric_products="triton"`` (and "auto", which measures both) against the plain path.
Skipped, with the reason, when Triton is not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import dmuon
from dmuon.orthogonalization import orthogonalize, resolve_config
from dmuon.triton_kernels import symmetric_baddbmm, symmetric_gram


def interpreter_checks() -> None:
    """Run under TRITON_INTERPRET=1 (the kernels are defined on first use, after it is set)."""
    torch.manual_seed(0)
    for shape in [(1, 5, 7), (3, 64, 100), (2, 130, 33)]:  # one tile, exact tiles, ragged tiles
        X = torch.randn(shape)
        torch.testing.assert_close(symmetric_gram(X), torch.bmm(X, X.mT), rtol=1e-5, atol=1e-4)
    for m in (5, 64, 130):  # symmetric products: b·R + c·R², R·Z, Z·R·Z of a symmetric R
        X = torch.randn(2, m, 40)
        R = torch.bmm(X, X.mT) / 40
        W = torch.baddbmm(R, R, R, beta=0.5, alpha=-0.25)
        torch.testing.assert_close(symmetric_baddbmm(R, R, R, beta=0.5, alpha=-0.25), W, rtol=1e-5, atol=1e-4)
        RZ = torch.baddbmm(R, R, W, beta=2.0)
        torch.testing.assert_close(symmetric_baddbmm(R, R, W, beta=2.0), RZ, rtol=1e-5, atol=1e-4)
        got = symmetric_baddbmm(RZ, W, RZ, beta=2.0)
        torch.testing.assert_close(got, torch.baddbmm(RZ, W, RZ, beta=2.0), rtol=1e-5, atol=1e-4)
        assert torch.equal(got, got.mT)  # mirrored: exactly symmetric
    X = torch.randn(2, 70, 50, dtype=torch.float64)  # fp64 accumulates in fp64
    torch.testing.assert_close(symmetric_gram(X), torch.bmm(X, X.mT), rtol=1e-12, atol=1e-12)
    # fp16 into an fp32 accumulator, rounded once; bf16 is left to the GPU check and the sm_90
    # compile below: the interpreter multiplies bf16's bit patterns (it has no bf16 tl.dot)
    for dtype in (torch.float16,):
        X = torch.randn(2, 70, 50).to(dtype)
        exact = torch.bmm(X.float(), X.float().mT).to(dtype)
        torch.testing.assert_close(symmetric_gram(X), exact, rtol=1e-2, atol=1e-2)
    from dmuon.tools.throughput import symmetric_products_timing  # the GPU check's table, runnable here

    [row] = symmetric_products_timing(torch.device("cpu"), sides=(16,), aspect=2, repeats=1)
    assert row.shape == (16, 32) and row.torch_ms > 0 and row.triton_ms > 0
    G = torch.randn(2, 48, 160)
    for method in ("standard", "gram"):
        plain = resolve_config(G.shape, "cpu", method=method, dtype=torch.float32)
        fast = resolve_config(G.shape, "cpu", method=method, dtype=torch.float32, symmetric="triton")
        torch.testing.assert_close(orthogonalize(G, fast), orthogonalize(G, plain), rtol=1e-4, atol=1e-5)
    results = []
    for symmetric in ("torch", "triton"):
        torch.manual_seed(1)
        layer = nn.Linear(96, 32, bias=False)
        opt = dmuon.Muon(layer, lr=0.05, ns_dtype=torch.float32, symmetric_products=symmetric)
        layer(torch.randn(8, 96)).square().mean().backward()
        opt.step()
        results.append(layer.weight.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(results[0], nn.Linear(96, 32, bias=False).weight)
    # "auto" times both kernels per shape at construction: the interpreter is far slower than
    # torch's products, so torch's are kept, and the step is the plain one
    torch.manual_seed(1)
    layer = nn.Linear(96, 32, bias=False)
    opt = dmuon.Muon(layer, lr=0.05, ns_dtype=torch.float32, symmetric_products="auto")
    assert opt._stepper.symmetric_by_shape == {(32, 96): "torch"}
    layer(torch.randn(8, 96)).square().mean().backward()
    opt.step()
    assert torch.equal(layer.weight.detach(), results[0])


def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed; pip install triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.unit.test_triton import interpreter_checks; interpreter_checks()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def test_triton_on_cpu_without_the_interpreter_is_refused_early():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    with pytest.raises(ValueError, match="symmetric_products='triton' needs Triton"):
        dmuon.Muon(nn.Linear(8, 8), symmetric_products="triton")
    with pytest.raises(ValueError, match="Invalid symmetric_products='cublas'"):
        dmuon.Muon(nn.Linear(8, 8), symmetric_products="cublas")
    opt = dmuon.Muon(nn.Linear(8, 8), symmetric_products="auto")  # nothing to measure: torch's products
    assert opt._stepper.symmetric_by_shape == {}


def auto_on_ranks() -> dict:
    torch.manual_seed(0)  # replicas of one layer with one gradient, as dmuon checks a step's plain tensors are
    layer = nn.Linear(16, 8, bias=False)
    opt = dmuon.Muon(layer, symmetric_products="auto")  # the ranks exchange their (empty) timings
    layer(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    return opt._stepper.symmetric_by_shape


def test_auto_agrees_across_ranks_without_triton():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    from tests.harness import run_on_ranks

    assert run_on_ranks(2, auto_on_ranks) == [{}, {}]


def compile_for_sm90(dtype: str, has_c: bool):
    """The kernel compiled ahead of time for an H100 (sm_90) with Triton's bundled ptxas: no GPU
    needed, so compile errors show on CPU."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dmuon.triton_kernels import BLOCK_K, BLOCK_M, _lower_product_kernel, kernel_options

    kernel = _lower_product_kernel()
    torch_dtype = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    constants = {"HAS_C": has_c, "BLOCK_M": BLOCK_M, "BLOCK_K": BLOCK_K, **kernel_options(torch_dtype)}
    signature = {name: f"*{dtype}" for name in ("a_ptr", "b_ptr", "c_ptr", "out_ptr")}
    signature.update({"M": "i32", "K": "i32", "beta": "fp32", "alpha": "fp32"})
    signature.update({name: "i64" for name in kernel.arg_names if name.startswith("stride")})
    signature.update({name: "constexpr" for name in constants})
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    assert isinstance(constants["ACC"], tl.dtype)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize("dtype", ["fp64", "fp32", "bf16", "fp16"])
def test_the_kernel_compiles_for_an_h100_in_every_dtype(dtype):
    """fp64 did not compile (an fp32 accumulator took fp64 products), and fp32 ran its products
    in TF32: now every dtype compiles to a cubin, and fp32's PTX has no TF32 instruction."""
    pytest.importorskip("triton", reason="triton is not installed; pip install triton")
    for has_c in (False, True):
        compiled = compile_for_sm90(dtype, has_c)
        assert compiled.asm["cubin"]
        if dtype == "fp32":
            assert "tf32" not in compiled.asm["ptx"]
