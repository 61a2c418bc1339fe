"""The built-in workload: a Llama-style decoder and a synthetic token stream.

The demo, the benchmarks and the end-to-end tests all train the same model on
the same data, so that their numbers can be compared with each other and so
that nothing has to be downloaded. The model has exactly the parameter shapes of
the real Llama / Qwen checkpoints named in ``PRESETS`` (separate q/k/v/o and
gate/up/down projections, grouped-query attention), because those shapes are
what a distributed Muon has to partition and orthogonalize.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LlamaConfig",
    "PRESETS",
    "MOE_PRESETS",
    "get_config",
    "param_count",
    "Llama",
    "SyntheticTokens",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder.

    ``head_dim`` is explicit rather than ``dim // n_heads`` because some real
    models (e.g. Gemma, Qwen3) have an attention width ``n_heads * head_dim``
    different from ``dim``, which makes ``q_proj``/``o_proj`` non-square.
    Each block holds ``attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``; with
    ``n_experts`` (a mixture of experts, as Qwen3-MoE: every block's MLP is one, no shared
    expert) its MLP is a router ``mlp.router`` (n_experts × dim) and three expert stacks
    ``mlp.experts.{gate,up,down}_proj`` of ``n_experts`` matrices each, ``expert_ffn_dim``
    wide, of which each token uses ``experts_per_token``. Only ``dmuon plan`` models those;
    :class:`Llama` builds dense configs.
    """

    vocab_size: int
    dim: int
    ffn_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_experts: int = 0  # 0: dense MLPs
    expert_ffn_dim: int = 0
    experts_per_token: int = 0

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "dim", "ffn_dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_seq_len")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.n_experts and not (self.expert_ffn_dim >= 1 and 1 <= self.experts_per_token <= self.n_experts):
            raise ValueError(f"a mixture of experts needs expert_ffn_dim >= 1 and 1 <= experts_per_token <= n_experts "
                             f"({self.n_experts}); got {self.expert_ffn_dim} and {self.experts_per_token}")


PRESETS: dict[str, LlamaConfig] = {
    # Unit tests: a forward/backward takes milliseconds.
    "tiny": LlamaConfig(
        vocab_size=128, dim=32, ffn_dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=128
    ),
    # The demo: trains visibly within a minute or two on two CPU cores.
    "demo": LlamaConfig(
        vocab_size=512, dim=128, ffn_dim=384, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, max_seq_len=512
    ),
    # Benchmarks: big enough that optimizer cost is not pure overhead.
    "bench": LlamaConfig(
        vocab_size=2048, dim=512, ffn_dim=1536, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, max_seq_len=2048
    ),
    # Real shapes of public checkpoints (max_seq_len: their documented context length).
    "qwen2.5-1.5b": LlamaConfig(
        vocab_size=151936, dim=1536, ffn_dim=8960, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
        max_seq_len=32768, tie_embeddings=True, norm_eps=1e-6, rope_theta=1e6,
    ),
    "llama-3.2-3b": LlamaConfig(
        vocab_size=128256, dim=3072, ffn_dim=8192, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128,
        max_seq_len=131072, tie_embeddings=True, norm_eps=1e-5, rope_theta=5e5,
    ),
    "qwen2.5-7b": LlamaConfig(
        vocab_size=152064, dim=3584, ffn_dim=18944, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
        max_seq_len=32768, tie_embeddings=False, norm_eps=1e-6, rope_theta=1e6,
    ),
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, dim=4096, ffn_dim=14336, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        max_seq_len=131072, tie_embeddings=False, norm_eps=1e-5, rope_theta=5e5,
    ),
    "llama-3.1-70b": LlamaConfig(
        vocab_size=128256, dim=8192, ffn_dim=28672, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
        max_seq_len=131072, tie_embeddings=False, norm_eps=1e-5, rope_theta=5e5,
    ),
}


# Mixtures of experts, for ``dmuon plan`` (real shapes of public checkpoints).
MOE_PRESETS: dict[str, LlamaConfig] = {
    "qwen3-30b-a3b": LlamaConfig(
        vocab_size=151936, dim=2048, ffn_dim=6144, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        max_seq_len=40960, tie_embeddings=False, norm_eps=1e-6, rope_theta=1e6,
        n_experts=128, expert_ffn_dim=768, experts_per_token=8,
    ),
}


def get_config(name: str, **overrides: object) -> LlamaConfig:
    """Return preset ``name`` (of :data:`PRESETS` or :data:`MOE_PRESETS`), with fields replaced by
    ``overrides`` (e.g. ``n_layers=2``).

    Shrinking the depth of a real shape keeps every matrix shape real while
    making the model small enough to instantiate in a test.
    """
    presets = {**PRESETS, **MOE_PRESETS}
    try:
        config = presets[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid names: {', '.join(presets)}") from None
    return dataclasses.replace(config, **overrides)


def muon_units(config: LlamaConfig) -> list[tuple[str, int, int, int]]:
    """(name, matrices, rows, columns) of every Muon parameter, in the model's order: each
    block's q/k/v/o weights, then its gate/up/down weights (``nn.Linear`` weights are out×in) or,
    in a mixture of experts, its router and its three expert stacks. Embeddings, head and norms
    go to AdamW."""
    q, kv, d, f = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.dim, config.ffn_dim
    block = {"attn.q_proj.weight": (1, q, d), "attn.k_proj.weight": (1, kv, d), "attn.v_proj.weight": (1, kv, d),
             "attn.o_proj.weight": (1, d, q)}
    if config.n_experts:
        e, g = config.n_experts, config.expert_ffn_dim
        block.update({"mlp.router.weight": (1, e, d), "mlp.experts.gate_proj": (e, g, d),
                      "mlp.experts.up_proj": (e, g, d), "mlp.experts.down_proj": (e, d, g)})
    else:
        block.update({"mlp.gate_proj.weight": (1, f, d), "mlp.up_proj.weight": (1, f, d),
                      "mlp.down_proj.weight": (1, d, f)})
    return [(f"layers.{i}.{name}", *shape) for i in range(config.n_layers) for name, shape in block.items()]


def matrix_shapes(config: LlamaConfig) -> list[tuple[str, int, int]]:
    """(name, rows, columns) of every Muon matrix of a dense config (:func:`muon_units`, one
    matrix each)."""
    if config.n_experts:
        raise ValueError("a mixture of experts has stacks of matrices: use muon_units")
    return [(name, m, n) for name, _, m, n in muon_units(config)]


def param_count(config: LlamaConfig) -> int:
    """Number of parameters of ``Llama(config)``, computed from the shapes alone.

    Lets benchmarks and planners size the real presets without allocating them.
    """
    d = config.dim
    block = sum(count * m * n for _, count, m, n in muon_units(dataclasses.replace(config, n_layers=1)))
    block += 2 * d  # two RMSNorm weights
    embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return embeddings + config.n_layers * block + d  # final norm


def training_bytes(config: LlamaConfig, sequences: int, seq_len: int, models: int = 1) -> tuple[int, int]:
    """A lower bound on the memory one process needs to train ``models`` copies of
    ``Llama(config)`` in fp32 on a batch of ``sequences`` × ``seq_len`` tokens, as (bytes of the
    parameters: weights, gradients and at least one optimizer state, 12 per parameter; bytes of
    the activations autograd keeps for one batch: per token and layer at least 4·dim +
    4·ffn_dim floats (the norms' inputs and outputs, the MLP's four ffn-wide tensors), and two
    floats per vocabulary entry for the log-softmax and its gradient). The command line refuses
    what is over the machine's memory before it starts."""
    tokens = sequences * seq_len
    per_token = config.n_layers * (4 * config.dim + 4 * config.ffn_dim) + 2 * config.vocab_size
    return 12 * param_count(config) * models, 4 * tokens * per_token


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim] for the "rotate half" RoPE layout.

    Computed per forward instead of cached in a buffer: it is cheap at the
    sequence lengths used here and keeps buffers out of the state dict.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        # called with the rotated q and k when set (dmuon.QKClip.for_model records max logits through it)
        self.qk_logits_hook: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.qk_logits_hook is not None:
            self.qk_logits_hook(q, k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style decoder: ``embed_tokens`` -> ``layers`` -> ``norm`` -> ``lm_head``.

    ``Llama(config, seed)`` is deterministic: the same seed gives the same
    weights on the same device type, without touching the global RNG, so that
    several optimizers (or several ranks) can start from one initialization.
    """

    def __init__(self, config: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        if config.n_experts:
            raise ValueError("Llama builds dense configs; mixture-of-experts presets are for dmuon plan")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Re-initialize every parameter from ``seed``.

        Matrices get N(0, 0.02); the projections that write into the residual
        stream (``o_proj``, ``down_proj``) are further scaled by
        ``1/sqrt(2 * n_layers)`` so the residual variance does not grow with
        depth (GPT-2 style). Norm weights start at one. Parameters on the meta
        device are left alone (there is nothing to fill).
        """
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            return
        generator = torch.Generator(device=device).manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():  # tied weights are visited once
            if param.ndim == 1:
                param.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, std=residual_std, generator=generator)
            else:
                nn.init.normal_(param, std=0.02, generator=generator)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for token ids ``tokens`` (LongTensor ``[B, T]``)."""
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = _rotary_cos_sin(seq_len, self.config.head_dim, self.config.rope_theta, tokens.device)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (in nats) over all ``[B, T]`` positions.

        The mean is per token, so the mean of equal-sized per-rank losses equals
        the global-batch loss: data-parallel runs can be compared with a
        single-process run.
        """
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _mix_seed(seed: int, stream: int) -> int:
    """A 63-bit generator seed for ``(seed, stream)``, distinct for distinct pairs in practice.

    Each batch gets its own generator so that batch ``step`` never depends on
    how many batches were drawn before it.
    """
    return (seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + 1) % (2**63)


class SyntheticTokens:
    """Token sequences from a fixed, seeded, sparse Markov chain.

    Every token has at most ``branching`` possible successors with random (unequal)
    probabilities, so a model that learns the transition table reaches a loss
    near the chain's entropy (about ``log(branching)`` nats or less), far below
    the ``log(vocab_size)`` of an untrained model. Nothing is downloaded and the
    data is exactly reproducible, which the optimizer comparisons and the
    distributed-vs-single-process parity tests depend on.
    """

    def __init__(self, vocab_size: int, seed: int = 0, branching: int = 4) -> None:
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching must be in [1, vocab_size={vocab_size}], got {branching}")
        self.vocab_size, self.seed = vocab_size, seed
        generator = torch.Generator().manual_seed(_mix_seed(seed, 0))
        # Repeated successors merely merge their probabilities; drawing them
        # with randint keeps memory at O(vocab_size * branching) for real vocabularies.
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=generator)  # [V, branching]
        weights = torch.rand(vocab_size, branching, generator=generator) + 0.1
        self.cumulative = (weights / weights.sum(dim=1, keepdim=True)).cumsum(dim=1)  # [V, branching]

    def batch(self, step: int, global_batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch for ``step``: ``(inputs, targets)``, both LongTensor ``[global_batch, seq_len]``.

        A pure function of ``(seed, step, global_batch, seq_len)``; ``targets``
        is ``inputs`` shifted left by one token (the next token at each position).
        """
        generator = torch.Generator().manual_seed(_mix_seed(self.seed, step + 1))
        tokens = torch.empty(global_batch, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (global_batch,), generator=generator)
        uniforms = torch.rand(seq_len, global_batch, 1, generator=generator)  # [t] is contiguous
        for t in range(seq_len):
            current = tokens[:, t]
            choice = torch.searchsorted(self.cumulative[current], uniforms[t]).clamp_(max=self.successors.shape[1] - 1)
            tokens[:, t + 1] = self.successors[current].gather(1, choice).squeeze(1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def local_batch(
        self, step: int, global_batch: int, seq_len: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s contiguous chunk of ``batch(step, ...)``: ``[global_batch // world_size, seq_len]``.

        Concatenating the chunks of ranks ``0..world_size-1`` gives the global
        batch back, so a data-parallel run sees exactly the single-process data.
        """
        if global_batch % world_size:
            raise ValueError(f"global_batch {global_batch} is not divisible by world_size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        inputs, targets = self.batch(step, global_batch, seq_len)
        size = global_batch // world_size
        rows = slice(rank * size, (rank + 1) * size)
        return inputs[rows], targets[rows]
