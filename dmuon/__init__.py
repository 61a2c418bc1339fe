"""DMuon: a distributed Muon optimizer for PyTorch.

Public API: :class:`Muon` (the optimizer), :func:`shard_by_owner` (owner-sharded data
parallel for the Muon matrices), :func:`newton_schulz` (the orthogonalization core).
"""

from dmuon.orthogonalization import newton_schulz
from dmuon.optimizer import Muon
from dmuon.owner import OwnerSharding, shard_by_owner

__all__ = ["Muon", "OwnerSharding", "newton_schulz", "shard_by_owner"]
__version__ = "0.1.0"
