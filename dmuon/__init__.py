"""DMuon: a distributed Muon optimizer for PyTorch.

Public API: :class:`Muon` (the optimizer), :func:`shard_by_owner` (owner-sharded data
parallel for the Muon matrices), :func:`clip_grad_norm_` (global-norm clipping for every
layout), :func:`newton_schulz` (the orthogonalization core).
"""

from dmuon.clipping import clip_grad_norm_
from dmuon.orthogonalization import newton_schulz
from dmuon.optimizer import Muon
from dmuon.owner import OwnerSharding, shard_by_owner

__all__ = ["Muon", "OwnerSharding", "clip_grad_norm_", "newton_schulz", "shard_by_owner"]
__version__ = "0.1.0"
