"""DMuon: a distributed Muon optimizer for PyTorch.

Public API: :class:`Muon` (the optimizer), :func:`shard_by_owner` (owner-sharded data
parallel for the Muon matrices), :func:`clip_grad_norm_` (global-norm clipping for every
layout), :class:`QKClip` (MuonClip: attention logits kept under a threshold, every layout),
:func:`newton_schulz` (the orthogonalization core), :func:`interleaved` and :func:`per_head`
(row-block patterns of fused weights, a group's ``ns_blocks``).
"""

from dmuon.clipping import clip_grad_norm_
from dmuon.optimizer import Muon
from dmuon.orthogonalization import newton_schulz
from dmuon.owner import OwnerSharding, shard_by_owner
from dmuon.qk_clip import AttentionLayer, QKClip, max_logits
from dmuon.row_blocks import interleaved, per_head

__all__ = ["AttentionLayer", "Muon", "OwnerSharding", "QKClip", "clip_grad_norm_", "interleaved", "max_logits",
           "newton_schulz", "per_head", "shard_by_owner"]
__version__ = "0.1.0"
