"""The models the tools train, built and fed alike: a Llama-style decoder on a synthetic token
stream (:mod:`dmuon.tools.models`) or the embodied vision–language–action model on synthetic
episodes (:mod:`dmuon.tools.vla`), chosen by the preset's config."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmuon.tools.models import Llama, LlamaConfig, SyntheticTokens, VLAConfig
from dmuon.tools.vla import VLA, EpisodeBatch, SyntheticEpisodes, vla_loss

Batch = tuple[torch.Tensor, ...]


def build_model(config: LlamaConfig | VLAConfig, seed: int = 0) -> nn.Module:
    return VLA(config, seed=seed) if isinstance(config, VLAConfig) else Llama(config, seed=seed)


def make_data(config: LlamaConfig | VLAConfig, seed: int = 0) -> SyntheticTokens | SyntheticEpisodes:
    if isinstance(config, VLAConfig):
        return SyntheticEpisodes(config, seed=seed)
    return SyntheticTokens(config.vocab_size, seed=seed)


def local_batch(data: SyntheticTokens | SyntheticEpisodes, step: int, global_batch: int, seq_len: int, rank: int,
                world_size: int, device: torch.device) -> Batch:
    """Rank ``rank``'s share of step ``step``'s batch on ``device`` (an episode fixes its own length)."""
    if isinstance(data, SyntheticEpisodes):
        batch = data.local_batch(step, global_batch, rank, world_size)
    else:
        batch = data.local_batch(step, global_batch, seq_len, rank, world_size)
    return type(batch)(*(t.to(device) for t in batch)) if isinstance(batch, EpisodeBatch) else tuple(
        t.to(device) for t in batch)


def training_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    """The batch's loss through ``module``'s own forward (a DDP or FSDP2 wrapper's: its hooks fire)."""
    if isinstance(batch, EpisodeBatch):
        return vla_loss(module(batch.images, batch.tokens, batch.noisy_actions), batch)
    inputs, targets = batch
    return F.cross_entropy(module(inputs).flatten(0, 1).float(), targets.flatten())
