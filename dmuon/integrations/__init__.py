"""Using ``dmuon.Muon`` from training frameworks.

- :mod:`dmuon.integrations.huggingface`: Hugging Face Trainer (Accelerate and Lightning need no
  helper: ``dmuon.Muon`` is an ordinary ``torch.optim.Optimizer`` for them).
- :mod:`dmuon.integrations.torchtitan`: torchtitan's optimizer container (imported on its own,
  since it imports torchtitan).
"""

from dmuon.integrations.huggingface import hf_optimizer_cls_and_kwargs, muon_for_model

__all__ = ["hf_optimizer_cls_and_kwargs", "muon_for_model"]
