"""Momentum in a smaller (or wider) dtype than the parameter's (``momentum_dtype``): the buffers
kept in it, half the bytes for bf16 beside fp32 weights, the step the plain reference's bitwise,
the option checked, a change of it casting the buffers, and a state dict keeping it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon
from dmuon.reference import ReferenceMuon
from dmuon.tools.models import Llama, SyntheticTokens, get_config


def muon_state_bytes(opt: dmuon.Muon) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
               if k == "momentum_buffer")


def test_bf16_momentum_halves_muon_state_of_fp32_weights():
    config = get_config("tiny")
    sizes = {}
    for dtype in (None, torch.bfloat16):
        model = Llama(config, seed=0)
        opt = dmuon.Muon(model, momentum_dtype=dtype)
        inputs, targets = SyntheticTokens(config.vocab_size, seed=0).batch(0, 2, 16)
        model.loss(inputs, targets).backward()
        opt.step()
        assert {s["momentum_buffer"].dtype for s in opt.state.values() if "momentum_buffer" in s} == {
            dtype or torch.float32}
        sizes[dtype] = muon_state_bytes(opt)
    assert sizes[torch.bfloat16] * 2 == sizes[None]


@pytest.mark.parametrize("param_dtype,kept", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_step_is_the_references_bitwise(param_dtype, kept, nesterov):
    torch.manual_seed(0)
    init = [torch.randn(s).to(param_dtype) for s in [(16, 8), (8, 24), (3, 6, 10)]]
    params, ref_params = [nn.Parameter(t.clone()) for t in init], [nn.Parameter(t.clone()) for t in init]
    options = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_dtype=torch.float32,
                   momentum_dtype=kept)
    opt, ref = dmuon.Muon([{"params": params, "algorithm": "muon"}], **options), ReferenceMuon(ref_params, **options)
    for _ in range(3):
        for p, r in zip(params, ref_params):
            p.grad = torch.randn(p.shape).to(param_dtype)
            r.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r) and opt.state[p]["momentum_buffer"].dtype == kept
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[r]["momentum_buffer"])


@pytest.mark.parametrize("value,message", [(torch.float16, r"Invalid momentum_dtype='float16'.*\('bfloat16', "
                                                           r"'float32'\)"),
                                           ("int8", r"Invalid momentum_dtype='int8'\. Must be a floating")])
def test_bad_momentum_dtypes_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        dmuon.Muon([{"params": [nn.Parameter(torch.randn(4, 4))], "algorithm": "muon"}], momentum_dtype=value)


def test_changing_it_casts_the_buffers_and_a_state_dict_keeps_it():
    w = nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16))
    opt = dmuon.Muon([{"params": [w], "algorithm": "muon", "momentum_dtype": "float32"}])
    w.grad = torch.randn(8, 4, dtype=torch.bfloat16)
    opt.step()
    saved = opt.state[w]["momentum_buffer"].clone()
    fresh = dmuon.Muon([{"params": [w], "algorithm": "muon", "momentum_dtype": "float32"}])
    fresh.load_state_dict(opt.state_dict())  # torch's load casts to bf16; dmuon puts the fp32 values back
    assert fresh.state[w]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(fresh.state[w]["momentum_buffer"], saved)
    opt.param_groups[0]["momentum_dtype"] = None
    opt.step()
    assert opt.state[w]["momentum_buffer"].dtype == torch.bfloat16
