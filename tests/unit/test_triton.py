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
    assert opt._symmetric_by_shape == {(32, 96): "torch"}
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
    assert opt._symmetric_by_shape == {}


def auto_on_ranks() -> dict:
    layer = nn.Linear(16, 8, bias=False)
    opt = dmuon.Muon(layer, symmetric_products="auto")  # the ranks exchange their (empty) timings
    layer(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    return opt._symmetric_by_shape


def test_auto_agrees_across_ranks_without_triton():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    from tests.harness import run_on_ranks

    assert run_on_ranks(2, auto_on_ranks) == [{}, {}]
