"""Newton–Schulz numerics: every tolerance of docs/numerics.md §Test tolerances."""

from __future__ import annotations

import itertools

import pytest
import torch

import dmuon
from dmuon import ns_defaults, orthogonalization
from dmuon.coefficients import coefficient_schedule, default_gram_restarts, polar_express_schedule
from dmuon.ns_defaults import choose_method
from dmuon.orthogonalization import NSConfig, newton_schulz, newton_schulz_flops, orthogonalize
from dmuon.tools.ns_accuracy import compose, exact_polynomial, gradient_like, rel

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
EXACT_TOL = {F64: 1e-6, F32: 1e-3, BF16: 5e-2, F16: 1e-2}
SHAPES = [(32, 96), (96, 32), (48, 48), (7, 5)]
COEFFICIENTS = ["polar_express", "keller", "you"]


def random_matrix(shape, seed: int = 0, dtype=F64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


# ---------------------------------------------------------------- 1. against the exact polynomial

# Gram NS never runs in bf16 (it raises: test_gram_rejects_bf16). In fp16 on a *square* matrix
# it reaches 1.1e-2 with Polar Express, just above fp16's 1e-2: Gram NS is for wide matrices and
# "auto" runs standard NS on square ones, so that case has its own bound below.
EXACT_CASES = [
    (shape, coefficients, method, dtype)
    for shape, coefficients, method, dtype in itertools.product(
        SHAPES, COEFFICIENTS, ["standard", "gram"], [F64, F32, BF16, F16]
    )
    if not (method == "gram" and (dtype == BF16 or (dtype == F16 and shape[0] == shape[1])))
]


@pytest.mark.parametrize("shape,coefficients,method,dtype", EXACT_CASES)
def test_matches_exact_polynomial(shape, coefficients, method, dtype):
    G = random_matrix(shape)
    out = newton_schulz(G.to(dtype), coefficients=coefficients, method=method, dtype=dtype)
    assert out.dtype == dtype and out.shape == G.shape
    expected = exact_polynomial(G.to(dtype), coefficient_schedule(coefficients, 5))
    assert rel(out, expected) <= EXACT_TOL[dtype]


@pytest.mark.parametrize("coefficients", COEFFICIENTS)
def test_gram_fp16_square(coefficients):
    G = random_matrix((48, 48)).to(F16)
    out = newton_schulz(G, coefficients=coefficients, method="gram", dtype=F16)
    assert rel(out, exact_polynomial(G, coefficient_schedule(coefficients, 5))) <= 1.5e-2


# ---------------------------------------------------------------- 2. Gram vs standard

@pytest.mark.parametrize("dtype,tol", [(F64, 1e-10), (F32, 1e-3)])
@pytest.mark.parametrize("coefficients", COEFFICIENTS)
@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (40, 40)])
def test_gram_equals_standard(shape, coefficients, dtype, tol):
    for G in (random_matrix(shape, seed=1), gradient_like(*shape, seed=1)):
        standard = newton_schulz(G, coefficients=coefficients, method="standard", dtype=dtype)
        gram = newton_schulz(G, coefficients=coefficients, method="gram", dtype=dtype)
        assert rel(gram, standard) <= tol


@pytest.mark.parametrize("coefficients,steps", itertools.product(COEFFICIENTS, [5, 6, 7, 8]))
def test_gram_fp16_with_default_restarts_beats_standard_bf16(coefficients, steps):
    """Near-low-rank input, the case restarts exist for: fp16 Gram NS with the default restart
    positions stays well below the error of standard NS in bf16 (torch.optim.Muon's choice)."""
    G = gradient_like(64, 256, seed=2).to(F16)
    expected = exact_polynomial(G, coefficient_schedule(coefficients, steps))
    gram = newton_schulz(G, steps=steps, coefficients=coefficients, method="gram", dtype=F16)
    bf16 = newton_schulz(G, steps=steps, coefficients=coefficients, method="standard", dtype=BF16)
    assert rel(gram, expected) <= min(0.03, 0.5 * rel(bf16, expected))
    sigma_max = torch.linalg.matrix_norm(gram.double(), ord=2)
    assert sigma_max <= max(1.2, torch.linalg.matrix_norm(expected, ord=2) + 0.02)


# ---------------------------------------------------------------- 3. coefficients

def test_polar_express_is_scaled_in_code():
    first = polar_express_schedule(5)[0]
    assert first == pytest.approx((7.892583, -20.383014, 13.555306), abs=1e-6)
    assert len(polar_express_schedule(12)) == 12
    assert polar_express_schedule(12)[-1] == polar_express_schedule(12)[8]


@pytest.mark.parametrize("name,low,high", [
    ("polar_express", 0.729, 1.124),  # docs/numerics.md §Coefficients, exact arithmetic
    ("keller", 0.47, 1.20),  # 0.68 from x ≈ 0.01 on; 5 Keller steps lift 1e-3 only to 0.47
])
def test_composed_map_range(name, low, high):
    x = torch.linspace(1e-3, 1, 100_001, dtype=F64)
    y = compose(coefficient_schedule(name, 5), x)
    assert y.min().item() == pytest.approx(low, abs=0.02)
    assert y.max().item() == pytest.approx(high, abs=0.02)


@pytest.mark.parametrize("name", COEFFICIENTS)
def test_composed_map_bounded_and_safe_beyond_one(name):
    x = torch.linspace(1e-3, 1.05, 100_001, dtype=F64)
    y = compose(coefficient_schedule(name, 5), x)
    assert torch.isfinite(y).all() and y.max() <= 1.25 and y[x <= 1].min() >= 0.45


def test_schedule_length_follows_steps():
    assert coefficient_schedule("keller", 7) == ((3.4445, -4.7750, 2.0315),) * 7
    you = coefficient_schedule("you", 7)
    assert len(you) == 7 and you[5] == you[6] == you[4]
    assert coefficient_schedule((1.5, -0.5, 0.0), 3) == ((1.5, -0.5, 0.0),) * 3
    assert coefficient_schedule([(2, -1, 0), (1.5, -0.5, 0)], 3)[2] == (1.5, -0.5, 0.0)


@pytest.mark.parametrize("bad", ["polar", (1.0, 2.0), [(1, 2, 3, 4)], [(1, 2, float("nan"))], [], 3.0, [(1, 1, 1)] * 6])
def test_malformed_coefficients_raise(bad):
    with pytest.raises(ValueError, match="ns_coefficients|coefficients"):
        coefficient_schedule(bad, 5)


@pytest.mark.parametrize("steps", [0, 101, 2.5, True])
def test_bad_steps_raise(steps):
    with pytest.raises(ValueError, match="ns_steps"):
        newton_schulz(torch.randn(4, 4), steps=steps)


def test_restart_positions_depend_on_schedule():
    assert default_gram_restarts("polar_express", 5) == (2,)
    assert default_gram_restarts("keller", 5) == (3,)
    assert default_gram_restarts("polar_express", 8) == (1, 3)
    assert default_gram_restarts("you", 7) == (2, 4)
    with pytest.raises(ValueError, match="restarts"):
        newton_schulz(torch.randn(4, 16), method="gram", restarts=[0])
    out = newton_schulz(torch.randn(4, 16, dtype=F64), method="gram", restarts=[1, 3], dtype=F64)
    ref = newton_schulz(torch.randn(4, 16, dtype=F64), method="gram", restarts=[], dtype=F64)
    assert out.shape == ref.shape


# ---------------------------------------------------------------- 4. symmetries

@pytest.mark.parametrize("method", ["standard", "gram"])
def test_transpose_equivariance(method):
    G = random_matrix((24, 80), dtype=F32)
    assert rel(newton_schulz(G.T, method=method, dtype=F32), newton_schulz(G, method=method, dtype=F32).T) <= 1e-5


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_orthogonal_invariance(method):
    G = random_matrix((24, 80), seed=3)
    U, _ = torch.linalg.qr(random_matrix((24, 24), seed=4))
    V, _ = torch.linalg.qr(random_matrix((80, 80), seed=5))
    rotated = newton_schulz(U @ G @ V, method=method, dtype=F64)
    assert rel(rotated, U @ newton_schulz(G, method=method, dtype=F64) @ V) <= 1e-12


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_scale_invariance(method):
    G = random_matrix((24, 80), dtype=F32)
    for scale in (1e-3, 7.0, 1e4):
        scaled = newton_schulz(G * scale, method=method, dtype=F32)
        assert rel(scaled, newton_schulz(G, method=method, dtype=F32)) <= 1e-4


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_batched_equals_per_matrix(dtype):
    stack = random_matrix((3, 2, 16, 40), dtype=dtype)
    batched = newton_schulz(stack, dtype=dtype)
    for i in range(3):
        for j in range(2):
            assert torch.equal(batched[i, j], newton_schulz(stack[i, j], dtype=dtype))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape", [(16, 40), (40, 16)])
def test_chunked_stack_equals_whole_stack(monkeypatch, dtype, shape):
    # a cache budget of about two 16×40 matrices' working set: a stack of 7 runs in chunks of 2
    monkeypatch.setattr(orthogonalization, "CPU_CHUNK_BYTES", 2 * 2 * (16 * 40 + 16 * 16) * dtype.itemsize)
    assert orthogonalization.matrices_per_chunk(*shape, dtype, "cpu") == 2
    stack = random_matrix((7, *shape), dtype=F32)
    config = orthogonalization.resolve_config(shape, "cpu", dtype=dtype, method="standard")
    chunked = orthogonalize(stack, config)
    assert chunked.dtype == F32 and chunked.is_contiguous() and chunked.shape == stack.shape
    monkeypatch.setattr(orthogonalization, "CPU_CHUNK_BYTES", 1 << 40)
    # 7 matrices in chunks of 3, 2 and 2
    assert torch.equal(chunked, torch.cat([orthogonalize(chunk, config) for chunk in stack.split([3, 2, 2])]))
    assert torch.equal(chunked, orthogonalize(stack, config))


def test_chunks_only_on_cpu_and_never_empty():
    assert orthogonalization.matrices_per_chunk(512, 1536, BF16, "cpu") == 2  # 4.2 MB each of 8 MiB
    assert orthogonalization.matrices_per_chunk(1536, 512, BF16, "cpu") == 2  # the wide working set
    assert orthogonalization.matrices_per_chunk(8192, 8192, F32, "cpu") == 2  # never a lone matrix
    assert orthogonalization.matrices_per_chunk(8192, 8192, F16, "cuda") > 10**9


@pytest.mark.parametrize("shape", [(40, 16), (16, 16), (12, 30), (8, 64), (64, 8), (1, 64)])
def test_a_small_matrix_gets_the_bits_alone_that_it_gets_in_a_stack(shape):
    """A rank may orthogonalize alone a matrix that one process stacks with others of its shape.
    Products of a short side up to 16 take torch's other CPU kernel below 16³ multiply-adds a batch;
    unpadded, 11 of these 1,260 matrices (all shapes but 1×64) came out different alone in bf16 on a
    2-core AMD EPYC with AVX512-BF16, by up to 7.8e-3."""
    config = orthogonalization.resolve_config(shape, "cpu", dtype=BF16, method="standard")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for seed in range(30):
            stack = torch.randn(7, *shape, generator=torch.Generator().manual_seed(seed), dtype=F64).float()
            stacked = orthogonalize(stack, config)
            for matrix, in_stack in zip(stack, stacked):
                assert torch.equal(orthogonalize(matrix, config), in_stack), (seed, shape)
    finally:
        torch.set_num_threads(previous)


def test_small_cpu_products_are_padded_past_the_kernel_switch():
    def batch(b: int, m: int, k: int, n: int, device: str = "cpu") -> int:
        return orthogonalization._one_kernel_batch(torch.empty(b, m, k, device=device),
                                                   torch.empty(b, k, n, device=device))

    assert batch(1, 16, 16, 16) == 2 and batch(2, 16, 16, 16) == 2  # 16³ is not past the switch
    assert batch(1, 12, 12, 12) == 3 and batch(1, 1, 1, 1) == 4097 and batch(5, 1, 1, 1) == 4097
    assert batch(1, 17, 17, 17) == 1 and batch(1, 1, 1, 5000) == 1  # past it: as they are
    assert batch(1, 0, 16, 16) == 1  # empty: nothing to pad
    assert batch(1, 16, 16, 16, device="meta") == 1  # CPU only
    A = torch.randn(1, 16, 40, dtype=BF16)
    gram = orthogonalization._local_gram(A)
    assert gram.shape == (1, 16, 16) and torch.equal(gram, torch.bmm(torch.cat([A, torch.zeros_like(A)]),
                                                                     torch.cat([A, torch.zeros_like(A)]).mT)[:1])


# ---------------------------------------------------------------- 5. degenerate inputs

@pytest.mark.parametrize("method", ["standard", "gram"])
def test_zero_matrix_maps_to_zeros(method):
    out = newton_schulz(torch.zeros(8, 32), method=method, dtype=F32)
    assert torch.isfinite(out).all() and (out == 0).all()


# In half precision the rounding noise of a rank-1 input is itself orthogonalized (σ₂ ≈ 0.07
# in fp16, 0.5 in bf16, docs/numerics.md §Test tolerances), and in fp16 Gram NS σ₁ moves by up to ±0.02 with it.
@pytest.mark.parametrize("method,dtype,tol", [
    ("standard", BF16, 0.01), ("standard", F16, 0.01), ("standard", F32, 0.01),
    ("gram", F32, 0.01), ("gram", F16, 0.02),
])
@pytest.mark.parametrize("seed", range(3))
def test_rank_one_input(method, dtype, tol, seed):
    u, v = random_matrix((32, 1), seed=6 + seed), random_matrix((1, 96), seed=7 + seed)
    sigma = torch.linalg.svdvals(newton_schulz(u @ v, method=method, dtype=dtype).double())
    expected = compose(coefficient_schedule("polar_express", 5), torch.tensor(1.0, dtype=F64)).item()
    assert sigma[0].item() == pytest.approx(expected, abs=tol)
    if dtype == F32:
        assert sigma[1:].max() < 1e-3


def test_empty_matrix():
    assert newton_schulz(torch.zeros(0, 5)).shape == (0, 5)


# ---------------------------------------------------------------- 6. spectral bounds

@pytest.mark.parametrize("seed", range(3))
def test_sigma_max_bounds(seed):
    for G in (random_matrix((64, 192), seed=seed), gradient_like(64, 192, seed=seed)):
        for method, dtype, bound in [("standard", BF16, 1.13), ("standard", F32, 1.13), ("gram", F16, 1.2)]:
            out = newton_schulz(G, method=method, dtype=dtype).double()
            assert torch.linalg.matrix_norm(out, ord=2) <= bound


# ---------------------------------------------------------------- 7. convergence to the polar factor

@pytest.mark.parametrize("method", ["standard", "gram"])
def test_converges_to_polar_factor(method):
    G = random_matrix((32, 64), seed=8)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    # The classical quintic p(x) = (15x − 10x³ + 3x⁵)/8 converges to 1 for every x in (0, √(7/3)).
    out = newton_schulz(G, steps=40, coefficients=(1.875, -1.25, 0.375), method=method, dtype=F64,
                        restarts=range(5, 40, 5))
    assert (out - U @ Vh).norm() <= 1e-10


# ---------------------------------------------------------------- method choice and cost

@pytest.mark.parametrize("native", [True, False])
def test_auto_method_choice(monkeypatch, native):
    """The CPU default follows the processor: bf16 (never Gram) where its products are native,
    fp32 (Gram for wide matrices) where they are emulated."""
    monkeypatch.setattr(ns_defaults, "native_bf16", lambda device_type: device_type == "cuda" or native)
    assert choose_method((64, 64), "auto", F16, "cuda") == ("standard", F16)
    assert choose_method((64, 256), "auto", None, "cuda") == ("gram", F16)
    assert choose_method((256, 64), "auto", F32, "cpu") == ("gram", F32)
    assert choose_method((64, 256), "auto", None, "cpu") == (("standard", BF16) if native else ("gram", F32))
    assert choose_method((64, 64), "auto", None, "cpu") == ("standard", BF16 if native else F32)
    assert choose_method((64, 256), "gram", None, "cpu") == ("gram", F32)


@pytest.mark.parametrize("value,native", [("native", True), ("emulated", False)])
def test_the_cpu_detection_can_be_overridden(monkeypatch, value, native):

    monkeypatch.setenv(ns_defaults.CPU_BF16_OVERRIDE, value)
    ns_defaults._cpu_bf16_native.cache_clear()
    try:
        assert ns_defaults.native_bf16("cpu") == native
        assert ns_defaults.default_dtype("cpu", "standard") == (BF16 if native else F32)
        assert ("bfloat16" if native else "emulated") in ns_defaults.default_dtype_reason("cpu")
        monkeypatch.setenv(ns_defaults.CPU_BF16_OVERRIDE, "yes")
        ns_defaults._cpu_bf16_native.cache_clear()
        with pytest.raises(ValueError, match="DMUON_CPU_BF16='yes'"):
            ns_defaults.native_bf16("cpu")
    finally:
        monkeypatch.undo()
        ns_defaults._cpu_bf16_native.cache_clear()


def test_gram_rejects_bf16():
    with pytest.raises(ValueError, match="bfloat16"):
        newton_schulz(torch.randn(4, 16), method="gram", dtype=BF16)
    with pytest.raises(ValueError, match="ns_method"):
        newton_schulz(torch.randn(4, 16), method="fast")


def test_flop_counts_match_reference_formulas():
    m = 64
    for alpha in (1, 4, 8):
        assert newton_schulz_flops(m, alpha * m, steps=5, method="standard") == (20 * alpha + 10) * m**3
        assert newton_schulz_flops(alpha * m, m, steps=5, method="gram", restarts=(2,)) == (28 + 8 * alpha) * m**3


def test_orthogonalize_with_explicit_config_matches_newton_schulz():
    G = random_matrix((16, 48))
    config = NSConfig(coefficient_schedule("keller", 5), "standard", F64)
    assert torch.equal(orthogonalize(G, config), newton_schulz(G, coefficients="keller", method="standard", dtype=F64))


def test_deepseek_v4_is_kellers_quintic_then_two_stabilizing_steps():
    """``ns_coefficients="deepseek_v4"``: 8 + 2 steps unless ``ns_steps`` says otherwise (the last two
    always stabilize, so at least 3); the stabilizing quintic keeps 1 fixed with zero slope, and
    the schedule ends far closer to the polar factor than Polar Express at 5 on a Gaussian matrix."""
    from dmuon.coefficients import KELLER, STABILIZING, coefficient_schedule

    assert coefficient_schedule("deepseek_v4", None) == (*KELLER * 8, STABILIZING, STABILIZING)
    assert coefficient_schedule("deepseek_v4", 5) == (*KELLER * 3, STABILIZING, STABILIZING)
    with pytest.raises(ValueError, match=r"Invalid ns_steps=2 for ns_coefficients='deepseek_v4'\. Must be >= 3"):
        coefficient_schedule("deepseek_v4", 2)
    a, b, c = STABILIZING
    assert a + b + c == 1 and a + 3 * b + 5 * c == 0  # p(1) = 1, p'(1) = 0
    G = torch.randn(128, 384, generator=torch.Generator().manual_seed(0))
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)

    def error(out: torch.Tensor) -> float:
        return ((out.double() - U @ Vh).norm() / (U @ Vh).norm()).item()

    deepseek = error(dmuon.newton_schulz(G, coefficients="deepseek_v4", dtype=torch.float32))
    assert deepseek < 1e-3 < error(dmuon.newton_schulz(G, dtype=torch.float32))


def test_ns_steps_and_coefficients_per_group():
    """Late layers may take more steps: each group's recipe runs on its own matrices."""
    w, v = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(8, 16))
    opt = dmuon.Muon([{"params": [w], "algorithm": "muon", "ns_coefficients": "deepseek_v4", "ns_steps": 6},
                      {"params": [v], "algorithm": "muon", "ns_steps": 7}], ns_dtype=torch.float32)
    w.grad, v.grad = torch.randn(8, 16), torch.randn(8, 16)
    opt.step()
    assert sorted(c.steps for _, _, c, _ in opt.last_step_stats.ns_calls) == [6, 7]
