"""The built-in workloads' shapes, and a Llama-style decoder with a synthetic token stream.

The demo, the benchmarks and the end-to-end tests all train the same model on
the same data, so that their numbers can be compared with each other and so
that nothing has to be downloaded. The model has exactly the parameter shapes of
the real Llama / Qwen checkpoints named in ``PRESETS`` (separate q/k/v/o and
gate/up/down projections, grouped-query attention), because those shapes are
what a distributed Muon has to partition and orthogonalize.

The embodied (vision–language–action) workload's shapes are here too (:class:`VLAConfig`,
``VLA_PRESETS``), so that the shape functions (:func:`muon_units`, :func:`param_count`, …) answer
for every preset; its model and data are in :mod:`dmuon.tools.vla`.
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
    "VLAConfig",
    "VLA_PRESETS",
    "VisionConfig",
    "get_config",
    "param_count",
    "trainable_params",
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


@dataclass(frozen=True)
class VisionConfig:
    """Shape of a ViT vision tower: a ``patch_size`` convolution over ``image_size``² RGB images,
    a learned position embedding per patch, ``n_layers`` pre-norm blocks (LayerNorm; q/k/v/o and
    a GELU MLP ``fc1``/``fc2``, all with biases), a final LayerNorm."""

    image_size: int
    patch_size: int
    dim: int
    ffn_dim: int
    n_layers: int
    n_heads: int

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "dim", "ffn_dim", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"VisionConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % self.patch_size or self.dim % self.n_heads:
            raise ValueError(f"patch_size ({self.patch_size}) must divide image_size ({self.image_size}) and "
                             f"n_heads ({self.n_heads}) dim ({self.dim})")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, rows, columns) of each block's Linear weights."""
        d, f = self.dim, self.ffn_dim
        block = [("q_proj", d, d), ("k_proj", d, d), ("v_proj", d, d), ("o_proj", d, d), ("fc1", f, d), ("fc2", d, f)]
        return [(f"vision.layers.{i}.{name}.weight", m, n) for i in range(self.n_layers) for name, m, n in block]

    def param_count(self) -> int:
        matrices = sum(m * n for _, m, n in self.matrices())
        biases_and_norms = self.n_layers * (4 * self.dim + self.ffn_dim + self.dim + 4 * self.dim) + 2 * self.dim
        patch = self.dim * (3 * self.patch_size**2 + 1)
        return matrices + biases_and_norms + patch + self.n_patches * self.dim


@dataclass(frozen=True)
class VLAConfig:
    """Shape of an embodied foundation model (vision–language–action), after π0: a vision tower
    whose patches a ``projector`` maps into a language model's width, the language model over
    [image patches, prompt tokens], and an action expert — a decoder of the language model's
    depth and attention heads at a width of its own — over ``action_steps`` action tokens, which
    attend to the language model's keys and values at every layer (one attention per depth over
    both streams). Its input and output are ``action_in_proj``/``action_out_proj`` (action_size ↔
    its width; openpi's and LeRobot's names). ``freeze_vision``: the tower is not trained (the
    usual recipe), so its matrices are in no optimizer's step.

    Routing (``dmuon.Muon(model)``): the blocks' matrices and the projector to Muon; the token
    embedding, ``lm_head``, the action input/output projections, norms and biases to AdamW, and — when the tower
    trains — its patch convolution and position embedding to AdamW too: they are the tower's
    input embedding, which Muon's rule leaves to AdamW like a token embedding (a convolution
    named ``*embed*`` is an embedding to dmuon's routing, not a hidden kernel to flatten).
    """

    vision: VisionConfig
    language: LlamaConfig
    action: LlamaConfig  # vocab_size unused (1); depth and attention heads the language model's
    action_size: int  # numbers per action step
    action_steps: int  # action tokens per sample (the chunk predicted at once)
    text_tokens: int  # prompt tokens per sample
    freeze_vision: bool = True

    def __post_init__(self) -> None:
        for name in ("action_size", "action_steps", "text_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"VLAConfig.{name} must be >= 1, got {getattr(self, name)}")
        joint = ("n_layers", "n_heads", "n_kv_heads", "head_dim")
        if any(getattr(self.action, k) != getattr(self.language, k) for k in joint):
            raise ValueError(f"the action expert attends with the language model: its {joint} must be the language "
                             f"model's {tuple(getattr(self.language, k) for k in joint)}, got "
                             f"{tuple(getattr(self.action, k) for k in joint)}")
        if self.language.n_experts or self.action.n_experts:
            raise ValueError("the VLA's language model and action expert are dense")
        if self.max_seq_len > self.language.max_seq_len:
            raise ValueError(f"{self.max_seq_len} tokens per sample exceed the language model's max_seq_len "
                             f"{self.language.max_seq_len}")

    # What the cost model reads of a decoder's config.
    n_experts = 0
    experts_per_token = 0

    @property
    def n_layers(self) -> int:
        return self.language.n_layers

    @property
    def prefix_tokens(self) -> int:
        """Image patches and prompt tokens: what the language model reads."""
        return self.vision.n_patches + self.text_tokens

    @property
    def max_seq_len(self) -> int:
        """Tokens of one sample's joint sequence: image patches, prompt tokens, action tokens."""
        return self.prefix_tokens + self.action_steps

    def with_layers(self, n_layers: int) -> VLAConfig:
        """The same widths at another depth of the language model and action expert."""
        return dataclasses.replace(self, language=dataclasses.replace(self.language, n_layers=n_layers),
                                   action=dataclasses.replace(self.action, n_layers=n_layers))

    def muon_units(self) -> list[tuple[str, int, int, int]]:
        """The trained Muon matrices in the model's order (:func:`muon_units`)."""
        vision = [] if self.freeze_vision else [(name, 1, m, n) for name, m, n in self.vision.matrices()]
        projector = [("projector.weight", 1, self.language.dim, self.vision.dim)]
        per_layer = {stream: block_matrices(config) for stream, config in
                     (("language", self.language), ("action", self.action))}
        joint = [(f"layers.{i}.{stream}.{name}", 1, m, n) for i in range(self.n_layers)
                 for stream in ("language", "action") for name, m, n in per_layer[stream]]
        return vision + projector + joint

    def param_count(self) -> int:
        """Every parameter, the frozen tower's included."""
        return self.trainable_params() + (self.vision.param_count() if self.freeze_vision else 0)

    def trainable_params(self) -> int:
        """The parameters an optimizer steps (the tower's only when it trains)."""
        lm, act = self.language, self.action
        vision = 0 if self.freeze_vision else self.vision.param_count()
        blocks = self.n_layers * sum(m * n for config in (lm, act) for _, m, n in block_matrices(config))
        norms = self.n_layers * 2 * (lm.dim + act.dim) + lm.dim + act.dim
        embeddings = lm.vocab_size * lm.dim * (1 if lm.tie_embeddings else 2)
        projector = lm.dim * (self.vision.dim + 1)
        action_io = 2 * self.action_size * act.dim + act.dim  # embed's bias; the head has none
        return vision + blocks + norms + embeddings + projector + action_io


def block_matrices(config: LlamaConfig) -> list[tuple[str, int, int]]:
    """(name in a ``Block``, rows, columns) of a dense decoder block's Linear weights."""
    q, kv, d, f = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.dim, config.ffn_dim
    return [("attn.q_proj.weight", q, d), ("attn.k_proj.weight", kv, d), ("attn.v_proj.weight", kv, d),
            ("attn.o_proj.weight", d, q), ("mlp.gate_proj.weight", f, d), ("mlp.up_proj.weight", f, d),
            ("mlp.down_proj.weight", d, f)]


def _gemma_like(vocab_size: int, dim: int, ffn_dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                head_dim: int, max_seq_len: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, dim=dim, ffn_dim=ffn_dim, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, head_dim=head_dim, max_seq_len=max_seq_len, tie_embeddings=True,
                       norm_eps=1e-6)


# Embodied (vision–language–action) models. Parameter counts: dmuon plan prints them.
VLA_PRESETS: dict[str, VLAConfig] = {
    # Tests: every width different, a forward/backward takes milliseconds.
    "vla-tiny": VLAConfig(
        vision=VisionConfig(image_size=16, patch_size=8, dim=24, ffn_dim=48, n_layers=2, n_heads=2),
        language=_gemma_like(100, 32, 64, 2, 4, 2, 8, 128),
        action=_gemma_like(1, 16, 48, 2, 4, 2, 8, 128),
        action_size=3, action_steps=4, text_tokens=8,
    ),
    # π0's three widths and its proportions, scaled for a 2-core CPU (dmuon bench --preset vla):
    # a 288-wide vision tower (6 layers, frozen), a 512-wide language model (4 layers, 8 heads and
    # 1 kv head of 64; 2,500-token vocabulary, tied) and a 256-wide action expert; 8×8 patches of
    # 32×32 images (16 patches), 16 prompt tokens, 8 action steps of 8 numbers: 40 tokens a sample.
    # 26.3 M parameters: 5.8 M in the frozen tower, 20.5 M trained, 19.4 M of them in 57 Muon matrices.
    "vla": VLAConfig(
        vision=VisionConfig(image_size=32, patch_size=8, dim=288, ffn_dim=1072, n_layers=6, n_heads=4),
        language=_gemma_like(2500, 512, 2048, 4, 8, 1, 64, 2048),
        action=_gemma_like(1, 256, 1024, 4, 8, 1, 64, 2048),
        action_size=8, action_steps=8, text_tokens=16,
    ),
    # π0's shapes (Physical Intelligence, 2024): SigLIP So400m/14 at 224² (27 layers, 1152 wide,
    # MLP 4304, 16 heads; 256 patches), Gemma 2B (18 layers, 2048 wide, MLP 16384, 8 heads and 1
    # kv head of 256, vocabulary 257,152, tied) and a 1024-wide action expert (MLP 4096) over
    # 50 action steps of 32 numbers; 48 prompt tokens (354 tokens a sample). 3.23 B parameters:
    # 0.41 B in the frozen tower, 2.82 B trained, 2.30 B of them in 253 Muon matrices.
    "pi0": VLAConfig(
        vision=VisionConfig(image_size=224, patch_size=14, dim=1152, ffn_dim=4304, n_layers=27, n_heads=16),
        language=_gemma_like(257152, 2048, 16384, 18, 8, 1, 256, 8192),
        action=_gemma_like(1, 1024, 4096, 18, 8, 1, 256, 8192),
        action_size=32, action_steps=50, text_tokens=48,
    ),
}


def get_config(name: str, **overrides: object) -> LlamaConfig | VLAConfig:
    """Return preset ``name`` (of :data:`PRESETS`, :data:`MOE_PRESETS` or :data:`VLA_PRESETS`),
    with fields replaced by ``overrides`` (e.g. ``n_layers=2``; of a VLA only ``n_layers``, the
    language model's and action expert's depth).

    Shrinking the depth of a real shape keeps every matrix shape real while
    making the model small enough to instantiate in a test.
    """
    presets = {**PRESETS, **MOE_PRESETS, **VLA_PRESETS}
    try:
        config = presets[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid names: {', '.join(presets)}") from None
    if isinstance(config, VLAConfig):
        unknown = set(overrides) - {"n_layers"}
        if unknown:
            raise ValueError(f"a VLA preset takes only n_layers as an override, got {sorted(unknown)}")
        return config.with_layers(int(overrides["n_layers"])) if overrides else config
    return dataclasses.replace(config, **overrides)


def muon_units(config: LlamaConfig | VLAConfig) -> list[tuple[str, int, int, int]]:
    """(name, matrices, rows, columns) of every trained Muon parameter, in the model's order: each
    block's q/k/v/o weights, then its gate/up/down weights (``nn.Linear`` weights are out×in) or,
    in a mixture of experts, its router and its three expert stacks. Embeddings, head and norms
    go to AdamW. A VLA: :meth:`VLAConfig.muon_units`."""
    if isinstance(config, VLAConfig):
        return config.muon_units()
    block = {name: (1, m, n) for name, m, n in block_matrices(config)}
    if config.n_experts:
        e, g, d = config.n_experts, config.expert_ffn_dim, config.dim
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            del block[name]
        block.update({"mlp.router.weight": (1, e, d), "mlp.experts.gate_proj": (e, g, d),
                      "mlp.experts.up_proj": (e, g, d), "mlp.experts.down_proj": (e, d, g)})
    return [(f"layers.{i}.{name}", *shape) for i in range(config.n_layers) for name, shape in block.items()]


def matrix_shapes(config: LlamaConfig) -> list[tuple[str, int, int]]:
    """(name, rows, columns) of every Muon matrix of a dense config (:func:`muon_units`, one
    matrix each)."""
    if config.n_experts:
        raise ValueError("a mixture of experts has stacks of matrices: use muon_units")
    return [(name, m, n) for name, _, m, n in muon_units(config)]


def param_count(config: LlamaConfig | VLAConfig) -> int:
    """Number of parameters of ``Llama(config)`` (or of the VLA, frozen ones included), computed
    from the shapes alone.

    Lets benchmarks and planners size the real presets without allocating them.
    """
    if isinstance(config, VLAConfig):
        return config.param_count()
    d = config.dim
    block = sum(count * m * n for _, count, m, n in muon_units(dataclasses.replace(config, n_layers=1)))
    block += 2 * d  # two RMSNorm weights
    embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return embeddings + config.n_layers * block + d  # final norm


def trainable_params(config: LlamaConfig | VLAConfig) -> int:
    """The parameters an optimizer steps: all of a Llama's, a VLA's less its frozen tower."""
    return config.trainable_params() if isinstance(config, VLAConfig) else param_count(config)


def training_bytes(config: LlamaConfig | VLAConfig, sequences: int, seq_len: int, models: int = 1
                   ) -> tuple[int, int]:
    """A lower bound on the memory one process needs to train ``models`` copies of
    ``Llama(config)`` in fp32 on a batch of ``sequences`` × ``seq_len`` tokens, as (bytes of the
    parameters: weights, gradients and at least one optimizer state, 12 per parameter; bytes of
    the activations autograd keeps for one batch: per token and layer at least 4·dim +
    4·ffn_dim floats (the norms' inputs and outputs, the MLP's four ffn-wide tensors), and two
    floats per vocabulary entry for the log-softmax and its gradient). The command line refuses
    what is over the machine's memory before it starts. A VLA: ``sequences`` samples of its own
    length, each token counted at the language model's widths (the expert is narrower), its
    frozen tower's weights at 4 bytes (no gradient, no state) and its activations not kept."""
    if isinstance(config, VLAConfig):
        frozen = config.param_count() - config.trainable_params()
        params = 12 * config.trainable_params() + 4 * frozen
        per_token = config.n_layers * (4 * config.language.dim + 4 * config.language.ffn_dim)
        per_sample = config.max_seq_len * per_token + 2 * config.text_tokens * config.language.vocab_size
        return params * models, 4 * sequences * per_sample
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

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rotated queries and keys, and the values, of ``x``: [batch, heads, tokens, head_dim]."""
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self.project(x, cos, sin)
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


def tensor_parallel_blocks(model: Llama, tp_mesh) -> None:
    """A Llama's blocks over ``tp_mesh`` as torchtitan lays them out: q, k, v, gate and up
    column-wise, o and down row-wise; each attention module then counts its own rank's heads
    (``n_heads`` and ``n_kv_heads`` must divide by the mesh's size)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    degree = tp_mesh.size()
    if model.config.n_kv_heads % degree:
        raise ValueError(f"Tensor parallel over {degree} ranks needs n_kv_heads ({model.config.n_kv_heads}) to divide "
                         f"by {degree}.")
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            **{f"attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
            **{f"mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")},
            "attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        block.attn.n_heads //= degree
        block.attn.n_kv_heads //= degree


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
        inputs, targets = self.batch(step, global_batch, seq_len)
        rows = rank_rows(global_batch, rank, world_size)
        return inputs[rows], targets[rows]


def rank_rows(global_batch: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s contiguous rows of a global batch split evenly over ``world_size`` ranks."""
    if global_batch % world_size:
        raise ValueError(f"global_batch {global_batch} is not divisible by world_size {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    size = global_batch // world_size
    return slice(rank * size, (rank + 1) * size)
