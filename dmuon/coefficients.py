"""Newton–Schulz's coefficient schedules: the quintic of each step for every named recipe
(Keller's, You's, Polar Express, AOL's, DeepSeek-V4's) or the user's own triples, the default
step counts, the check that a schedule stays bounded, and Gram NS's restart steps. Pure numbers:
:mod:`dmuon.orthogonalization` runs them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

Coefficients = tuple[float, float, float]


CoefficientsSpec = str | Coefficients | Sequence[Coefficients]


# Keller Jordan's Muon quintic, used at every step (torch.optim.Muon's default).
KELLER: tuple[Coefficients, ...] = ((3.4445, -4.7750, 2.0315),)


# You Jiacheng's five-step schedule; later steps repeat the last polynomial.
YOU: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


# Polar Express (Amsel et al., arXiv 2505.16932): the minimax-optimal quintic of each step for
# singular values in [1e-3, 1], *unscaled*. The safety factor is applied in code
# (polar_express_schedule); never store a scaled table — one published copy has wrong c values.
POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)


# Rounding can leave ‖X‖₂ slightly above 1; p(x/s) instead of p(x) keeps such inputs bounded
# (the 5-step composition then diverges only from ≈1.055 on).
POLAR_EXPRESS_SAFETY = 1.05


# The schedule fitted to AOL rescaling (ns_coefficients="aol", 4 steps unless ns_steps says
# otherwise), raw: the safety factor is applied in code as for Polar Express. Fitted by
# `python benchmarks/fit_aol.py`: greedy minimax quintics from singular values in [5.62e-3, 1], that
# lower end chosen for the lowest mean polar error over Gaussian, ill-conditioned and the bench
# model's gradient matrices (docs/numerics.md, "AOL rescaling").
AOL_RAW: tuple[Coefficients, ...] = (
    (8.271131696998093, -24.321171449248226, 18.002951968737424),
    (3.8775457156920847, -2.8950497455278184, 0.5564350263675303),
    (3.0904709913173183, -2.316678742047248, 0.4907467595871337),
    (2.1355142931153575, -1.5163383578575178, 0.40248554145362275),
)


AOL_STEPS = 4


# DeepSeek-V4's schedule (ns_coefficients="deepseek_v4"): Keller's quintic for fast growth of the
# small singular values, then two steps of a quintic with 1 as a fixed point of zero slope
# (p(1) = 1, p'(1) = 0), which pull the values Keller's leaves in about [0.7, 1.2] to 1. 8 + 2
# steps unless ns_steps says otherwise; the last two always stabilize.
STABILIZING: Coefficients = (2.0, -1.5, 0.5)


DEEPSEEK_V4_STEPS = 10


NAMED_COEFFICIENTS = ("polar_express", "keller", "you", "aol", "deepseek_v4")


# Gram NS restart steps (0-based: restart *before* that step) measured to keep fp16 Gram NS
# stable for a named schedule; the best position depends on the schedule (docs/numerics.md §Gram NS and restarts).
_MEASURED_GRAM_RESTARTS: dict[tuple[str, int], tuple[int, ...]] = {
    ("polar_express", 5): (2,),
    ("keller", 5): (3,),
    ("polar_express", 8): (1, 3),
}



def polar_express_schedule(steps: int, safety: float = POLAR_EXPRESS_SAFETY,
                           raw: Sequence[Coefficients] = POLAR_EXPRESS_RAW) -> list[Coefficients]:
    """The Polar Express schedule (or another ``raw`` table fitted the same way, AOL's) for
    ``steps`` steps with p(x) replaced by p(x/safety).

    p(x/s) = (a/s)·x + (b/s³)·x³ + (c/s⁵)·x⁵; steps beyond the table repeat its last polynomial.
    """
    if not safety >= 1.0:
        raise ValueError(f"Invalid {safety=}. Must be >= 1.0.")
    chosen = [raw[min(t, len(raw) - 1)] for t in range(steps)]
    return [(a / safety, b / safety**3, c / safety**5) for a, b, c in chosen]



def default_steps(coefficients: CoefficientsSpec) -> int:
    """The steps a recipe takes where ``ns_steps`` is None: 4 for "aol", 10 for "deepseek_v4",
    else 5 (torch.optim.Muon's)."""
    if isinstance(coefficients, str):
        return {"aol": AOL_STEPS, "deepseek_v4": DEEPSEEK_V4_STEPS}.get(coefficients, 5)
    return 5



def _validate_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
        raise ValueError(f"Invalid ns_steps={steps!r}. Must be an int in [1, 100), or None.")  # torch's bound



def _as_triple(item: object) -> Coefficients:
    if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 3:
        raise ValueError(f"Invalid Newton–Schulz coefficients {item!r}. Each step needs (a, b, c).")
    triple = tuple(float(v) for v in item)
    if not all(math.isfinite(v) for v in triple):
        raise ValueError(f"Invalid Newton–Schulz coefficients {item!r}. Must be finite.")
    return triple  # type: ignore[return-value]



def coefficient_schedule(coefficients: CoefficientsSpec, steps: int | None) -> tuple[Coefficients, ...]:
    """The (a, b, c) of every step, ``steps`` long (None: :func:`default_steps`).

    ``coefficients`` is a name in NAMED_COEFFICIENTS, one (a, b, c) used at every step, or a
    sequence of at most ``steps`` triples whose last one repeats.
    """
    steps = default_steps(coefficients) if steps is None else steps
    _validate_steps(steps)
    if isinstance(coefficients, str):
        if coefficients in ("polar_express", "aol"):
            raw = POLAR_EXPRESS_RAW if coefficients == "polar_express" else AOL_RAW
            return tuple(polar_express_schedule(steps, raw=raw))
        if coefficients == "deepseek_v4":
            if steps < 3:
                raise ValueError(f"Invalid ns_steps={steps} for ns_coefficients='deepseek_v4'. Must be >= 3: its last "
                                 "two steps stabilize what Keller's steps before them reach.")
            return (*KELLER * (steps - 2), STABILIZING, STABILIZING)
        table = {"keller": KELLER, "you": YOU}.get(coefficients)
        if table is None:
            raise ValueError(
                f"Invalid ns_coefficients={coefficients!r}. Must be one of {NAMED_COEFFICIENTS} "
                "or (a, b, c) triples."
            )
    elif (
        isinstance(coefficients, Sequence)
        and len(coefficients) == 3
        and all(isinstance(v, (int, float)) for v in coefficients)
    ):
        table = (_as_triple(coefficients),)
    elif isinstance(coefficients, Sequence) and len(coefficients) > 0:
        table = tuple(_as_triple(item) for item in coefficients)
        if len(table) > steps:
            raise ValueError(
                f"Invalid ns_coefficients: {len(table)} steps given but ns_steps={steps}."
            )
    else:
        raise ValueError(
            f"Invalid ns_coefficients={coefficients!r}. Must be one of {NAMED_COEFFICIENTS} "
            "or (a, b, c) triples."
        )
    return tuple(table[min(t, len(table) - 1)] for t in range(steps))


# A Newton–Schulz input has its singular values in [0, 1] (it is divided by its Frobenius norm).
# Where a schedule's composed polynomial leaves [−SCHEDULE_BOUND, SCHEDULE_BOUND] on [0, 1] after
# some step, the next odd quintics raise those singular values to the fifth power and the weights
# turn inf or NaN within a few steps. The named schedules stay below 2 (Polar Express's first step
# peaks at 1.99, You's at 1.27, Keller's at 1.20, for 1 to 100 steps).
SCHEDULE_BOUND = 4.0


_SCHEDULE_GRID = 4097



@functools.lru_cache(maxsize=256)
def check_bounded(schedule: tuple[Coefficients, ...]) -> None:
    """Raise a ValueError if the composed polynomials of ``schedule`` leave
    [−SCHEDULE_BOUND, SCHEDULE_BOUND] for some singular value in [0, 1] after some step."""
    x = torch.linspace(0.0, 1.0, _SCHEDULE_GRID, dtype=torch.float64)
    y = x
    for t, (a, b, c) in enumerate(schedule):
        square = y * y
        y = y * (a + square * (b + c * square))
        peak = y.abs().max().item()
        if not peak <= SCHEDULE_BOUND:  # NaN too
            worst = x[y.abs().nan_to_num(float("inf")).argmax()].item()
            raise ValueError(
                f"Invalid ns_coefficients: after step {t + 1} the Newton–Schulz polynomial maps the singular value "
                f"{worst:.3g} to {peak:.3g}, beyond ±{SCHEDULE_BOUND} (a sound schedule keeps every singular value "
                "in [0, 1] near 1); the weights would turn inf or NaN.")



def default_gram_restarts(coefficients: CoefficientsSpec, steps: int) -> tuple[int, ...]:
    """Steps before which Gram NS restarts, for a schedule.

    Measured positions where known; otherwise before step 2 and every second step after it,
    while at least two steps follow (a restart costs two passes over the long side, so one
    in the last step would not pay for itself). docs/numerics.md §Gram Newton–Schulz and
    restarts says how close this rule came to the best positions found by search
    (tests/unit/test_orthogonalization.py holds it below the error of standard NS in bf16).
    """
    if isinstance(coefficients, str) and (coefficients, steps) in _MEASURED_GRAM_RESTARTS:
        return _MEASURED_GRAM_RESTARTS[(coefficients, steps)]
    return tuple(range(2, steps - 1, 2))



def validate_restarts(restarts: Sequence[int], steps: int) -> tuple[int, ...]:
    positions = tuple(sorted(set(int(r) for r in restarts)))
    if any(not 1 <= r < steps for r in positions):
        raise ValueError(f"Invalid gram restarts {tuple(restarts)}. Each must be in [1, {steps - 1}].")
    return positions
