"""``dmuon/step/elementwise.py``: the element-wise kernels of a step. Early start computes the
momentum out of place during the backward pass and must get the bits the in-place update leaves
in the buffers (fp32, bf16, and a bf16 buffer beside fp32 gradients); the Nesterov input is
``G + μ·(B − G)``."""

from __future__ import annotations

import pytest
import torch

from dmuon.step.elementwise import momentum_out_of_place, nesterov_inputs_all, update_momentum_all


def _pairs(buffer_dtype: torch.dtype, grad_dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (16, 32), (3,)]
    return ([torch.randn(s, generator=g).to(buffer_dtype) for s in shapes],
            [torch.randn(s, generator=g).to(grad_dtype) for s in shapes])


@pytest.mark.parametrize("buffer_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                     (torch.bfloat16, torch.float32)])
def test_momentum_out_of_place_has_the_bits_of_the_update_in_place(buffer_dtype, grad_dtype):
    bufs, grads = _pairs(buffer_dtype, grad_dtype)
    before = [b.clone() for b in bufs]
    moved = momentum_out_of_place(bufs, grads, 0.95)
    assert all(torch.equal(b, kept) for b, kept in zip(bufs, before))  # the buffers untouched
    update_momentum_all(bufs, grads, 0.95)
    assert all(m.dtype == b.dtype and torch.equal(m, b) for m, b in zip(moved, bufs))


def test_nesterov_input_is_the_gradient_moved_towards_the_momentum():
    bufs, grads = _pairs(torch.float64, torch.float64)
    for value, g, b in zip(nesterov_inputs_all(grads, bufs, 0.9), grads, bufs):
        torch.testing.assert_close(value, g + 0.9 * (b - g), rtol=1e-12, atol=1e-12)
