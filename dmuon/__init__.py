"""DMuon: a distributed Muon optimizer for PyTorch.

Public API: :class:`Muon` (the optimizer), :func:`newton_schulz` (the orthogonalization core).
"""

from dmuon.orthogonalization import newton_schulz
from dmuon.optimizer import Muon

__all__ = ["Muon", "newton_schulz"]
__version__ = "0.1.0"
