"""Momentum in a smaller (or wider) dtype than the parameter's (``momentum_dtype``): the buffers
kept in it, half the bytes for bf16 beside fp32 weights and about a quarter for 8-bit blocks, the
8-bit format as its definition writes it, the step the plain reference's bitwise, the option
checked, a change of it converting the buffers, and a state dict keeping it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon
from dmuon import momentum
from dmuon.reference import ReferenceMuon
from dmuon.tools.models import Llama, SyntheticTokens, get_config


def muon_state_bytes(opt: dmuon.Muon) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
               if k in ("momentum_buffer", momentum.SCALE_KEY))


def test_bf16_momentum_halves_muon_state_of_fp32_weights():
    config = get_config("tiny")
    sizes = {}
    for dtype in (None, torch.bfloat16, torch.int8):
        model = Llama(config, seed=0)
        opt = dmuon.Muon(model, momentum_dtype=dtype)
        inputs, targets = SyntheticTokens(config.vocab_size, seed=0).batch(0, 2, 16)
        model.loss(inputs, targets).backward()
        opt.step()
        assert {s["momentum_buffer"].dtype for s in opt.state.values() if "momentum_buffer" in s} == {
            dtype or torch.float32}
        sizes[dtype] = muon_state_bytes(opt)
    assert sizes[torch.bfloat16] * 2 == sizes[None]
    assert sizes[torch.int8] <= sizes[None] * (1 + 4 / momentum.BLOCK) / 4 + 4 * len(opt.state) * 64  # + part blocks


@pytest.mark.parametrize("param_dtype,kept", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.int8), (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_step_is_the_references_bitwise(param_dtype, kept, nesterov):
    torch.manual_seed(0)
    init = [torch.randn(s).to(param_dtype) for s in [(16, 8), (8, 24), (3, 6, 10), (6, 300)]]  # 300: blocks of
    # 128, 128 and 44 columns
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
        if kept == torch.int8:
            assert torch.equal(opt.state[p][momentum.SCALE_KEY], ref.state[r][momentum.SCALE_KEY])


@pytest.mark.parametrize("value,message", [
    (torch.float16, r"Invalid momentum_dtype='float16'.*\('bfloat16', 'float32', 'int8'\)"),
    ("int16", r"Invalid momentum_dtype='int16'\. Must be a floating torch.dtype, torch.int8 \(8-bit blocks\)")])
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


def test_8bit_blocks_are_absmax_codes_per_128_columns():
    """The format as the docs define it, written out: per row, blocks of 128 columns from column
    0, each with scale = max |x| / 127 and codes round(x / scale); decoding multiplies back, so
    each element is within half a step of its block's scale."""
    torch.manual_seed(0)
    x = torch.randn(3, 300) * torch.logspace(-3, 1, 300)  # magnitudes that differ across blocks
    x[1, 128:256] = 0  # an all-zero block
    codes, scales = momentum.encode(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (3, 3)
    for row in range(3):
        for b, (start, stop) in enumerate([(0, 128), (128, 256), (256, 300)]):
            block = x[row, start:stop]
            scale = block.abs().max() / 127
            assert scales[row, b] == scale
            want = torch.zeros_like(block) if scale == 0 else torch.round(block / scale)
            assert torch.equal(codes[row, start:stop].float(), want)
    decoded = momentum.decode(codes, scales)
    assert torch.equal(decoded[1, 128:256], torch.zeros(128))
    assert ((decoded - x).abs() <= scales.repeat_interleave(128, -1)[:, :300] / 2 * (1 + 1e-6)).all()
    assert torch.equal(momentum.encode(-x)[0], -codes)  # symmetric


def test_8bit_momentum_tracks_fp32_momentum():
    """Momentum kept in 8-bit blocks over 20 steps stays within a few percent of fp32 momentum."""
    w8, w32 = (nn.Parameter(torch.zeros(32, 256)) for _ in range(2))
    opt8 = dmuon.Muon([{"params": [w8], "algorithm": "muon", "momentum_dtype": torch.int8, "lr": 0.0}])
    opt32 = dmuon.Muon([{"params": [w32], "algorithm": "muon", "lr": 0.0}])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        g = torch.randn(32, 256, generator=gen)
        w8.grad, w32.grad = g.clone(), g.clone()
        opt8.step()
        opt32.step()
    m8 = momentum.value(opt8.state[w8])
    m32 = opt32.state[w32]["momentum_buffer"]
    assert ((m8 - m32).norm() / m32.norm()).item() < 0.02


def test_8bit_momentum_converts_and_its_state_dict_keeps_codes_and_scales():
    """A change of momentum_dtype to and from int8 converts the values; torch's load, which casts
    state to the parameter's dtype, leaves the int8 codes and fp32 scales as saved."""
    w = nn.Parameter(torch.randn(8, 200, dtype=torch.bfloat16))
    opt = dmuon.Muon([{"params": [w], "algorithm": "muon"}])
    w.grad = torch.randn(8, 200, dtype=torch.bfloat16)
    opt.step()
    bf16 = opt.state[w]["momentum_buffer"].clone()
    opt.param_groups[0]["momentum_dtype"] = torch.int8  # as a dtype, as a user may set it
    w.grad = torch.zeros_like(w)
    opt.step()
    entry = opt.state[w]
    assert entry["momentum_buffer"].dtype == torch.int8 and entry[momentum.SCALE_KEY].shape == (8, 2)
    def rounded(x: torch.Tensor) -> torch.Tensor:  # stored in 8-bit blocks and read back
        return momentum.decode(*momentum.encode(x))

    want = rounded(rounded(bf16).lerp(torch.zeros(8, 200), 1 - 0.95))  # converted, then a step of zero gradient
    assert torch.equal(momentum.value(entry), want)
    fresh = dmuon.Muon([{"params": [w], "algorithm": "muon"}])
    fresh.load_state_dict(opt.state_dict())
    for key in ("momentum_buffer", momentum.SCALE_KEY):
        assert fresh.state[w][key].dtype == entry[key].dtype and torch.equal(fresh.state[w][key], entry[key]), key
    opt.param_groups[0]["momentum_dtype"] = None
    opt.step()
    assert momentum.SCALE_KEY not in opt.state[w] and opt.state[w]["momentum_buffer"].dtype == torch.bfloat16
    back = want.to(torch.bfloat16)
    assert torch.equal(opt.state[w]["momentum_buffer"], back.lerp(torch.zeros_like(back), 1 - 0.95))


def test_a_state_dict_without_its_scales_is_refused():
    w = nn.Parameter(torch.randn(8, 16))
    opt = dmuon.Muon([{"params": [w], "algorithm": "muon", "momentum_dtype": "int8"}])
    w.grad = torch.randn(8, 16)
    opt.step()
    saved = opt.state_dict()
    del saved["state"][0][momentum.SCALE_KEY]
    with pytest.raises(ValueError, match="lacks 'momentum_scale'"):
        dmuon.Muon([{"params": [w], "algorithm": "muon"}]).load_state_dict(saved)
