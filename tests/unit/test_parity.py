"""One process: ``dmuon.Muon`` against ``torch.optim.Muon`` (momentum bitwise, the displacement
within bf16's reach; a changed coefficient must fail), and the fast path against the plain
reference implementation, bitwise (docs/testing.md row 2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon
from dmuon.reference import ReferenceMuon
from tests.unit.nets import BF16_PARITY_TOL, make_net, set_random_grads


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_parity_with_torch_muon(adjust_lr_fn, nesterov, weight_decay):
    torch.manual_seed(0)
    params = [torch.randn(shape) * 0.1 for shape in [(32, 64), (64, 32), (48, 48), (7, 5)]]
    ours = [nn.Parameter(p.clone()) for p in params]
    theirs = [nn.Parameter(p.clone()) for p in params]
    kwargs = dict(lr=0.02, weight_decay=weight_decay, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt = dmuon.Muon([{"params": ours, "algorithm": "muon"}], ns_coefficients="keller",
                     ns_method="standard", ns_dtype=torch.bfloat16, **kwargs)
    ref = torch.optim.Muon(theirs, **kwargs)
    for step in range(5):
        set_random_grads(ours, step)
        set_random_grads(theirs, step)
        opt.step()
        ref.step()
    for p0, a, b in zip(params, ours, theirs):
        # momentum depends on gradients alone: identical
        assert torch.equal(opt.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"])
        # updates differ by bf16 rounding (torch normalizes in bf16, we in fp32)
        delta_ours, delta_theirs = a.detach() - p0, b.detach() - p0
        assert ((delta_ours - delta_theirs).norm() / delta_theirs.norm()).item() <= BF16_PARITY_TOL


def test_parity_fails_with_a_broken_coefficient():
    """The parity test above can fail: a changed Keller coefficient is caught."""
    torch.manual_seed(0)
    p0 = torch.randn(32, 64) * 0.1
    a, b = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    opt = dmuon.Muon([{"params": [a], "algorithm": "muon"}], lr=0.02, ns_coefficients=(3.4445, -4.7750, 2.1),
                     ns_method="standard", ns_dtype=torch.bfloat16, adjust_lr_fn="original")
    ref = torch.optim.Muon([b], lr=0.02, adjust_lr_fn="original")
    for step in range(5):
        set_random_grads([a], step)
        set_random_grads([b], step)
        opt.step()
        ref.step()
    delta_ours, delta_theirs = a.detach() - p0, b.detach() - p0
    assert ((delta_ours - delta_theirs).norm() / delta_theirs.norm()).item() > BF16_PARITY_TOL


@pytest.mark.parametrize("ns_method,ns_dtype", [("standard", torch.bfloat16), ("gram", torch.float32), ("auto", None)])
def test_fast_path_equals_reference_bitwise(ns_method, ns_dtype):
    net, ref_net = make_net(), make_net()
    kwargs = dict(lr=0.01, weight_decay=0.1, ns_method=ns_method, ns_dtype=ns_dtype)
    opt = dmuon.Muon(net, **kwargs)
    muon_names = {n for n, route in opt.routes().items() if route.algorithm == "muon"}
    ref_params = dict(ref_net.named_parameters())
    ref_muon = ReferenceMuon([ref_params[n] for n in sorted(muon_names) if n != "conv.weight"], **kwargs)
    ref_conv = ReferenceMuon([ref_params["conv.weight"]], matrix_view="flatten", **kwargs)
    ref_adamw = torch.optim.AdamW([p for n, p in ref_params.items() if n not in muon_names], lr=0.01, weight_decay=0.1)
    assert muon_names == {"hidden.weight", "conv.weight", "experts"}
    for step in range(4):
        set_random_grads(net.parameters(), step)
        set_random_grads(ref_net.parameters(), step)
        opt.step()
        for o in (ref_muon, ref_conv, ref_adamw):
            o.step()
    for (name, a), b in zip(net.named_parameters(), ref_net.parameters()):
        assert torch.equal(a, b), name
