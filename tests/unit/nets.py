"""What the one-process optimizer tests share: a model with every kind of parameter routing tells
apart, and gradients and snapshots of its parameters."""

from __future__ import annotations

import torch
from torch import nn

BF16_PARITY_TOL = 2e-2


class Net(nn.Module):
    """Every kind of parameter the routing rule distinguishes."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(2 * dim)
        self.conv = nn.Conv1d(2, 3, kernel_size=3)
        self.experts = nn.Parameter(torch.randn(3, 2 * dim, dim) * 0.1)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.hidden(self.embed(tokens))))
        h = torch.einsum("bd,edk->bk", h, self.experts) / 3
        conv = self.conv(h.reshape(h.shape[0], 2, -1)).mean()
        return self.lm_head(h) + conv


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def set_random_grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def loss_of(net: Net) -> torch.Tensor:
    return net(torch.arange(6) % 11).square().mean()
