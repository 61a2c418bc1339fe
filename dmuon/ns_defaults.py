"""Newton–Schulz's processor-fit defaults: the compute dtype ``ns_dtype=None`` resolves to (and
why), whether bf16 products are native here, and the method ``ns_method="auto"`` picks
(standard or Gram NS) for a shape.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Literal

import torch

Method = Literal["standard", "gram"]

# `method="auto"` picks Gram NS from this aspect ratio max(m, n)/min(m, n) on, by device type.
# CUDA: the FLOP ratio and GPU timings from outside the project (Gram 20–26 % slower when square,
# 0.67× at α = 4; docs/numerics.md §Compute dtype and method choice); CPU: measured with
# `dmuon.newton_schulz` in fp32 on a 2-core AMD EPYC (`python benchmarks/newton_schulz_methods.py`;
# the figures in docs/numerics.md).
# bf16 always runs standard NS (Gram NS is unstable in bf16).
GRAM_MIN_ASPECT: dict[str, float] = {"cuda": 2.0, "cpu": 2.0}


NS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# DMUON_CPU_BF16=native|emulated overrides the detection (heterogeneous jobs, tests of the other case)
CPU_BF16_OVERRIDE = "DMUON_CPU_BF16"



@functools.cache
def _cpu_bf16_native() -> bool:
    forced = os.environ.get(CPU_BF16_OVERRIDE, "")
    if forced:
        if forced not in ("native", "emulated"):
            raise ValueError(f"Invalid {CPU_BF16_OVERRIDE}={forced!r}. Must be 'native' or 'emulated'.")
        return forced == "native"
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)



def native_bf16(device_type: str) -> bool:
    """Whether bf16 products run natively on ``device_type``: CUDA, or a CPU with AVX512-BF16 or
    AMX. Other CPUs emulate them at about a tenth of their fp32 rate (docs/options.md, ``ns_dtype``)."""
    return device_type == "cuda" or (device_type == "cpu" and _cpu_bf16_native())



def default_dtype(device_type: str, method: str) -> torch.dtype:
    """Compute dtype when none is given (``ns_dtype=None``); :func:`default_dtype_reason` says why.

    CUDA: fp16 (tensor-core speed with less rounding error than bf16; Gram NS requires it).
    CPU: bf16 for standard NS where bf16 products are native (AVX512-BF16, AMX: faster than
    fp32), fp32 where they are emulated; fp32 for Gram NS, since bf16 Gram NS is unstable and
    fp16 products are emulated (slow) on CPU. The figures are in docs/numerics.md §Compute dtype
    and method choice.
    """
    if device_type == "cuda":
        return torch.float16
    return torch.bfloat16 if method != "gram" and native_bf16(device_type) else torch.float32



def default_dtype_reason(device_type: str) -> str:
    """One line: what ``ns_dtype=None`` resolves to on ``device_type``, and why."""
    if device_type == "cuda":
        return "ns_dtype=None on cuda: float16 (tensor cores; 8x less rounding than bfloat16)"
    if native_bf16(device_type):
        return ("ns_dtype=None on this CPU: bfloat16 for standard Newton-Schulz (AVX512-BF16/AMX: bf16 products "
                "are native), float32 for Gram")
    return ("ns_dtype=None on this CPU: float32 (no AVX512-BF16 or AMX: bf16 products are emulated at about a "
            "tenth of fp32's rate)")



def choose_method(
    shape: Sequence[int], method: str, dtype: torch.dtype | None, device_type: str
) -> tuple[Method, torch.dtype]:
    """Resolve ``method`` ("auto", "standard", "gram") and the compute dtype for one matrix shape."""
    if method not in ("auto", "standard", "gram"):
        raise ValueError(f"Invalid ns_method={method!r}. Must be 'auto', 'standard' or 'gram'.")
    if method == "auto":
        compute_dtype = dtype if dtype is not None else default_dtype(device_type, "standard")
        m, n = sorted(shape[-2:])
        aspect = n / max(m, 1)
        wide_enough = aspect >= GRAM_MIN_ASPECT.get(device_type, GRAM_MIN_ASPECT["cuda"])
        resolved: Method = "gram" if wide_enough and compute_dtype != torch.bfloat16 else "standard"
        return resolved, compute_dtype
    compute_dtype = dtype if dtype is not None else default_dtype(device_type, method)
    if method == "gram" and compute_dtype == torch.bfloat16:
        raise ValueError(
            "Invalid ns_dtype=torch.bfloat16 for ns_method='gram': Gram NS amplifies bf16 rounding "
            "(σ_max up to 2.2, blow-ups without restarts). Use float16 or float32."
        )
    return method, compute_dtype  # type: ignore[return-value]
