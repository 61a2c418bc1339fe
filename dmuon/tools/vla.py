"""The embodied workload: a vision–language–action model and synthetic episodes to train it on.

Shapes (:class:`dmuon.tools.models.VLAConfig`, presets ``vla`` and ``pi0``) are in
:mod:`dmuon.tools.models`; this module builds the model and its data. The model follows π0's
layout: a ViT tower encodes the image into patches, a projector maps them into the language
model's width, and the language model runs over [patches, prompt tokens] while an action expert
of another width runs over noisy action tokens, the two joined in one attention per layer (each
stream with its own norms, projections and MLP). The prefix is causal (so that the prompt's
next-token loss is honest); action tokens see the whole prefix and each other. The loss is the
prompt's next-token cross-entropy plus the mean squared error of the denoised actions.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dmuon.tools.models import (
    Block,
    LlamaConfig,
    SyntheticTokens,
    VisionConfig,
    VLAConfig,
    _mix_seed,
    _rotary_cos_sin,
    rank_rows,
)

__all__ = ["VLA", "EpisodeBatch", "SyntheticEpisodes", "vla_loss"]


class VisionBlock(nn.Module):
    """Pre-norm ViT block: bidirectional attention over the patches, then a GELU MLP."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d, self.n_heads = config.dim, config.n_heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, config.ffn_dim), nn.Linear(config.ffn_dim, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, patches, d = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(batch, patches, self.n_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        x = x + self.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, patches, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class VisionTower(nn.Module):
    """Patch convolution and position embedding, ``layers`` of :class:`VisionBlock`, a final norm."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, config.dim, config.patch_size, stride=config.patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(config.n_patches, config.dim))
        self.layers = nn.ModuleList(VisionBlock(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class JointLayer(nn.Module):
    """One depth of the language model (``language``) and the action expert (``action``): one
    attention over both streams' tokens, then each stream's own MLP. A module of its own so that
    FSDP2 and owner sharding gather both blocks' weights in its forward."""

    def __init__(self, language: LlamaConfig, action: LlamaConfig) -> None:
        super().__init__()
        self.language, self.action = Block(language), Block(action)

    def forward(self, x: torch.Tensor, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = x.shape[1]
        qx, kx, vx = self.language.attn.project(self.language.attn_norm(x), cos[:prefix], sin[:prefix])
        qa, ka, va = self.action.attn.project(self.action.attn_norm(a), cos[prefix:], sin[prefix:])
        attn = self.language.attn
        out = F.scaled_dot_product_attention(torch.cat((qx, qa), 2), torch.cat((kx, ka), 2), torch.cat((vx, va), 2),
                                             attn_mask=mask, enable_gqa=attn.n_heads != attn.n_kv_heads)
        out = out.transpose(1, 2).flatten(2)
        x = x + self.language.attn.o_proj(out[:, :prefix])
        a = a + self.action.attn.o_proj(out[:, prefix:])
        x = x + self.language.mlp(self.language.mlp_norm(x))
        return x, a + self.action.mlp(self.action.mlp_norm(a))


def joint_mask(prefix: int, actions: int, device: torch.device) -> torch.Tensor:
    """Which keys each query sees (True: attends): the prefix causally, actions everything."""
    total = prefix + actions
    mask = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    mask[prefix:] = True
    return mask


class VLA(nn.Module):
    """The vision–language–action model of ``config`` (module docstring); ``VLA(config, seed)``
    is deterministic, as :class:`dmuon.tools.models.Llama` is."""

    def __init__(self, config: VLAConfig, seed: int = 0) -> None:
        super().__init__()
        lm, act = config.language, config.action
        self.config = config
        self.vision = VisionTower(config.vision)
        self.projector = nn.Linear(config.vision.dim, lm.dim)
        self.embed_tokens = nn.Embedding(lm.vocab_size, lm.dim)
        self.layers = nn.ModuleList(JointLayer(lm, act) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(lm.dim, eps=lm.norm_eps)
        self.lm_head = nn.Linear(lm.dim, lm.vocab_size, bias=False)
        if lm.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # openpi's and LeRobot's names for the action expert's input and output layers
        self.action_in_proj = nn.Linear(config.action_size, act.dim)
        self.action_norm = nn.RMSNorm(act.dim, eps=act.norm_eps)
        # no bias, as lm_head: the model's outputs are then no views, which FSDP2's root would warn about
        self.action_out_proj = nn.Linear(act.dim, config.action_size, bias=False)
        self.init_weights(seed)
        self.vision.requires_grad_(not config.freeze_vision)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Matrices and the patch kernel N(0, 0.02), biases and the position embedding zero,
        norms one (meta parameters are left alone)."""
        if self.projector.weight.device.type == "meta":
            return
        generator = torch.Generator(device=self.projector.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            elif name == "vision.pos_embed":
                param.zero_()
            else:
                nn.init.normal_(param, std=0.02, generator=generator)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, noisy_actions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(next-token logits of the prompt [B, T, vocab], denoised actions [B, A, action_size])."""
        config = self.config
        frozen = torch.no_grad() if config.freeze_vision else contextlib.nullcontext()
        with frozen:
            patches = self.vision(images)
        x = torch.cat((self.projector(patches), self.embed_tokens(tokens)), dim=1)
        a = self.action_in_proj(noisy_actions)
        cos, sin = _rotary_cos_sin(x.shape[1] + a.shape[1], config.language.head_dim, config.language.rope_theta,
                                   tokens.device)
        mask = joint_mask(x.shape[1], a.shape[1], tokens.device)
        for layer in self.layers:
            x, a = layer(x, a, cos, sin, mask)
        logits = self.lm_head(self.norm(x[:, patches.shape[1]:]))
        return logits, self.action_out_proj(self.action_norm(a))


class EpisodeBatch(NamedTuple):
    """One batch of synthetic episodes: images [B, 3, H, W], prompt tokens and their next tokens
    [B, T], the noisy actions the expert reads and the clean ones it should give [B, A, action_size]."""

    images: torch.Tensor
    tokens: torch.Tensor
    targets: torch.Tensor
    noisy_actions: torch.Tensor
    actions: torch.Tensor


def vla_loss(outputs: tuple[torch.Tensor, torch.Tensor], batch: EpisodeBatch) -> torch.Tensor:
    """The prompt's mean next-token cross-entropy plus the actions' mean squared error."""
    logits, actions = outputs
    text = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten())
    return text + F.mse_loss(actions.float(), batch.actions.float())


class SyntheticEpisodes:
    """Seeded episodes with something to learn in both heads: prompts from
    :class:`dmuon.tools.models.SyntheticTokens`, random images, and actions a fixed function of
    the image (tanh of a random projection of its 4×4 pooled pixels) that the expert reads with
    noise added. Like the token stream, batch ``step`` is a pure function of the seed and step."""

    NOISE = 0.5

    def __init__(self, config: VLAConfig, seed: int = 0) -> None:
        self.config, self.seed = config, seed
        self.tokens = SyntheticTokens(config.language.vocab_size, seed=seed)
        generator = torch.Generator().manual_seed(_mix_seed(seed, -1))
        self.projection = torch.randn(3 * 16, config.action_steps * config.action_size, generator=generator) / 4

    def batch(self, step: int, global_batch: int) -> EpisodeBatch:
        c = self.config
        generator = torch.Generator().manual_seed(_mix_seed(self.seed, -(step + 2)))
        images = torch.randn(global_batch, 3, c.vision.image_size, c.vision.image_size, generator=generator)
        pooled = F.adaptive_avg_pool2d(images, 4).flatten(1)
        actions = torch.tanh(pooled @ self.projection * 4).view(global_batch, c.action_steps, c.action_size)
        noisy = actions + self.NOISE * torch.randn(actions.shape, generator=generator)
        tokens, targets = self.tokens.batch(step, global_batch, c.text_tokens)
        return EpisodeBatch(images, tokens, targets, noisy, actions)

    def local_batch(self, step: int, global_batch: int, rank: int, world_size: int) -> EpisodeBatch:
        """Rank ``rank``'s contiguous share of ``batch(step, global_batch)``."""
        rows = rank_rows(global_batch, rank, world_size)
        return EpisodeBatch(*(t[rows] for t in self.batch(step, global_batch)))
