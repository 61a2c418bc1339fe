"""Numerical edge cases of the Muon update: huge but finite gradients (normalization must not
overflow, alone or on column blocks), empty matrices under torch.distributed, and where a stacked
Newton–Schulz call gives bitwise the same result as per-matrix calls."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmuon
from dmuon.column_block_ns import orthogonalize_column_blocks
from dmuon.orthogonalization import newton_schulz, normalize, orthogonalize, resolve_config
from dmuon.reference import ReferenceMuon
from dmuon.step.elementwise import apply_updates_all
from tests.harness import run_on_ranks
from tests.helpers import local, params_and_reference, placements_for, rows_of, step_with_reference

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def unit_max_matrix(shape, seed: int = 0) -> torch.Tensor:
    """A Gaussian matrix (fp64) scaled so that max|G| = 1: G·s then has max|G·s| = s."""
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return G / G.abs().max()


@contextlib.contextmanager
def intra_op_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ---------------------------------------------------------------- 1. huge but finite inputs

# (input dtype, NS dtype, scale): past fp32's √max ≈ 1.8e19 the plain Frobenius norm overflows.
HUGE = [(F32, F32, 1e20), (F32, F32, 3e38), (F32, BF16, 1e20), (BF16, BF16, 1e30), (BF16, BF16, 3e38),
        (F64, F64, 1e300)]
HUGE_CASES = [(*case, method) for case in HUGE for method in ("standard", "gram")
              if not (method == "gram" and case[1] == BF16)]  # Gram NS never runs in bf16


@pytest.mark.parametrize("dtype,ns_dtype,scale,method", HUGE_CASES)
def test_huge_finite_input_gives_the_unscaled_update(dtype, ns_dtype, scale, method):
    G = unit_max_matrix((64, 256))
    huge = (G * scale).to(dtype)
    assert torch.isfinite(huge).all()
    out = newton_schulz(huge, method=method, dtype=ns_dtype)
    # the same matrix at an ordinary scale (in at least fp32, so as not to round it again)
    ordinary = (huge.double() / scale).to(torch.promote_types(dtype, F32))
    expected = newton_schulz(ordinary, method=method, dtype=ns_dtype)
    assert rel(out, expected) <= (1e-3 if BF16 in (dtype, ns_dtype) else 1e-5)
    sigma = torch.linalg.svdvals(out.double())
    assert 0.7 <= sigma.min() and sigma.max() <= 1.13  # orthogonal: Polar Express's band [0.73, 1.12]


@pytest.mark.parametrize("dtype,ns_dtype,exponent", [(F32, F32, 66), (F32, F32, 120), (BF16, BF16, 100)])
def test_power_of_two_scaling_is_bitwise_invisible(dtype, ns_dtype, exponent):
    """Normalization divides by a power of two first, so scaling the input by one changes no bit
    (in fp32, where eps = 1e-7 is below the rounding of ‖G‖_F ≈ 30; in fp64 eps shows)."""
    G = unit_max_matrix((48, 96), seed=1).to(dtype)
    config = resolve_config(G.shape, "cpu", method="standard", dtype=ns_dtype)
    assert torch.equal(orthogonalize(G * 2.0**exponent, config), orthogonalize(G, config))


def huge_column_blocks(scales: tuple[float, ...], method: str) -> torch.Tensor:
    """Rank r's torch.chunk block of columns of a 2×24×80 stack, multiplied by scales[r]; the
    whole distributed result, reassembled."""
    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.randn(2, 24, 80, generator=torch.Generator().manual_seed(0))
    chunks = [c * s for c, s in zip(full.chunk(world, dim=-1), scales)]

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    config = resolve_config((24, 80), "cpu", method=method, dtype=F32)
    pieces = [None] * world
    dist.all_gather_object(pieces, orthogonalize_column_blocks(chunks[rank], config, all_reduce))
    return torch.cat(pieces, dim=-1)


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("scales", [(1e20, 1e20), (3e37, 1.0), (1e-3, 1e25), (1e20, 1e20, 1e20)])
def test_column_blocks_normalize_huge_inputs_as_one_process(scales, method):
    """The squared norms summed over ranks must not overflow either, even when one rank's block
    is huge and another's is not."""
    full = torch.randn(2, 24, 80, generator=torch.Generator().manual_seed(0))
    whole = torch.cat([c * s for c, s in zip(full.chunk(len(scales), dim=-1), scales)], dim=-1)
    assert torch.isfinite(whole).all()
    expected = orthogonalize(whole, resolve_config((24, 80), "cpu", method=method, dtype=F32))
    assert expected.abs().max() > 0.1
    for result in run_on_ranks(len(scales), huge_column_blocks, scales, method):
        torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)


def test_optimizer_step_with_huge_gradients_matches_the_unscaled_one():
    """dmuon.Muon on one nn.Linear: gradients 2^66 (≈ 7e19) or 1e20 times larger give the same
    updates (bitwise for the power of two), step after step, instead of zeros."""
    def train(scale: float) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = nn.Linear(48, 32, bias=False)
        opt = dmuon.Muon([{"params": [layer.weight], "algorithm": "muon"}], lr=0.02, weight_decay=0.0,
                         ns_dtype=F32, ns_method="standard")
        deltas = []
        for step in range(4):
            grad = torch.randn(32, 48, generator=torch.Generator().manual_seed(step))
            layer.weight.grad = grad * scale
            before = layer.weight.detach().clone()
            opt.step()
            deltas.append(layer.weight.detach() - before)
        assert opt.skipped_steps == 0
        return deltas

    plain = train(1.0)
    assert all(d.abs().max() > 0 for d in plain)
    assert all(torch.equal(a, b) for a, b in zip(train(2.0**66), plain))
    for a, b in zip(train(1e20), plain):
        assert rel(a, b) <= 1e-5


# ---------------------------------------------------------------- 2. empty matrices, distributed

EMPTY_SHAPES = [(0, 8), (8, 0), (16, 32), (0, 0), (24, 40)]
HPARAMS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, ns_method="standard", ns_dtype=F32)


def step_with_empty_matrices(layout: str, distributed_ns: bool | None) -> dict:
    world = dist.get_world_size()
    mesh, placements = placements_for(layout, world)
    init = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(EMPTY_SHAPES)]
    params, ref_params = params_and_reference(init, mesh, placements)
    opt = dmuon.Muon([{"params": params, "algorithm": "muon"}], distributed_ns=distributed_ns, **HPARAMS)
    ref = ReferenceMuon(ref_params, **HPARAMS)
    for step in range(2):
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(10 + step)) for s in EMPTY_SHAPES]
        step_with_reference(opt, ref, params, ref_params, grads, mesh, placements)
    return dict(
        shapes=[tuple(p.shape) for p in params],
        close=[torch.allclose(local(p), rows_of(r.detach(), p), rtol=1e-4, atol=1e-5)
               for p, r in zip(params, ref_params)],
        equal=[torch.equal(local(p), rows_of(r.detach(), p)) for p, r in zip(params, ref_params)],
        momentum=[tuple(opt.state[p]["momentum_buffer"].shape) for p in params],
    )


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout,distributed_ns", [("ddp", None), ("fsdp", None), ("fsdp", True)])
def test_empty_matrices_step_under_torch_distributed(layout, distributed_ns, world):
    """0×n, n×0 and 0×0 Muon matrices are planned and stepped (an empty update) beside ordinary
    ones, which still match the single-process step (bitwise when each matrix has an owner)."""
    for rank, r in enumerate(run_on_ranks(world, step_with_empty_matrices, layout, distributed_ns)):
        assert r["shapes"] == EMPTY_SHAPES and r["momentum"] == EMPTY_SHAPES, (rank, r)
        assert all(r["close"]), (rank, r)
        if distributed_ns is None:
            assert all(r["equal"]), (rank, r)


# ---------------------------------------------------------------- 3. stacked vs per-matrix calls

STACK_SHAPES = [(9, 130), (130, 9), (5, 31), (13, 77), (16, 40), (48, 48), (64, 256), (128, 128), (100, 300)]


def stack_differences(dtype: torch.dtype, method: str, threads: int, batch: int = 3) -> dict:
    """Shape → max |stacked − per-matrix| over a stack of ``batch`` matrices."""
    out = {}
    with intra_op_threads(threads):
        for shape in STACK_SHAPES:
            config = resolve_config(shape, "cpu", method=method, dtype=dtype)
            stack = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(batch)).to(dtype)
            batched = orthogonalize(stack, config)
            out[shape] = max((batched[i].double() - orthogonalize(stack[i], config).double()).abs().max().item()
                             for i in range(batch))
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_stack_is_bitwise_per_matrix(threads):
    """docs/concepts.md, "Exactness": bf16 Newton–Schulz gives the same bits stacked or alone
    (small products padded onto one kernel: tests/unit/test_orthogonalization.py tries the shapes
    where they were not)."""
    assert all(d == 0 for d in stack_differences(BF16, "standard", threads).values())


@pytest.mark.parametrize("dtype,method", [(F32, "standard"), (F32, "gram"), (F64, "standard"), (F64, "gram")])
def test_fp32_stack_is_bitwise_per_matrix_with_one_thread(dtype, method):
    """With one intra-op thread Newton–Schulz gives a matrix the same bits stacked as alone, also
    where MKL's products depend on a matrix's alignment in memory: unpadded (without ``_aligned``),
    9×130, 130×9 and 5×31 differed on a 2-core AMD EPYC (Zen 4) by up to 1.1e-6 in fp32, and
    these and 13×77 by up to 2.2e-15 in fp64."""
    differences = stack_differences(dtype, method, threads=1)
    assert all(d == 0 for d in differences.values()), differences


@pytest.mark.parametrize("method,bound", [("standard", 1e-5), ("gram", 1e-4)])
def test_fp32_stack_is_within_the_stated_bound_with_two_threads(method, bound):
    """With more threads a single matrix's GEMMs may be split over threads while a stack's run one
    per thread: the results then differ by rounding (measured ≤ 2e-6 standard, 3.5e-5 Gram)."""
    differences = stack_differences(F32, method, threads=2)
    assert max(differences.values()) <= bound, differences


@pytest.mark.parametrize("param_dtype,update_dtype", [(F32, BF16), (F32, torch.float16), (F64, F32), (F32, F32),
                                                      (BF16, F32), (BF16, BF16), (torch.float16, BF16),
                                                      (torch.float16, torch.float16)])
def test_apply_gives_the_bits_of_one_tensor_at_a_time_whatever_the_layout(param_dtype, update_dtype):
    """The foreach apply gives every element the bits the plain reference's per-tensor ops give
    it (``mul_`` by the decay factor, then ``add_`` of the update in at least fp32, a wider one
    rounded to the weight's dtype first), whatever the update's strides and wherever the element
    sits: on CPU torch's foreach multiply rounds a Python scalar to a bf16 tensor's dtype, and
    its bf16 add with alpha rounds differently in its vectorized and scalar loops, and a shard
    holds an element at another position than the whole tensor does."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(shape, generator=gen).to(param_dtype) for shape in [(64, 48), (1000, 3), (7,), (37,)]]
    updates = [torch.randn(params[0].shape, generator=gen).to(update_dtype),
               torch.randn(3, 1000, generator=gen).to(update_dtype).mT,
               torch.randn(7, generator=gen).to(update_dtype),
               torch.randn(37, generator=gen).to(update_dtype)]
    lr, wd, scale = 0.02, 0.1, 1.7
    wide = torch.promote_types(param_dtype, F32)
    expected = [p.clone() for p in params]
    for e, u in zip(expected, updates):
        e.mul_(1 - lr * wd)
        rounded = u.to(param_dtype) if torch.promote_types(u.dtype, param_dtype) != param_dtype else u
        e.add_(rounded.to(wide), alpha=-lr * scale)
    pieces = [params[3][:20].clone(), params[3][20:].clone()]  # a tensor's elements, held as two shards
    apply_updates_all(params, updates, lr, wd, scale)
    apply_updates_all(pieces, [updates[3][:20], updates[3][20:]], lr, wd, scale)
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    assert torch.equal(torch.cat(pieces), expected[3])


def test_normalize_gives_each_matrix_its_own_bits_in_a_mixed_stack():
    """normalize chooses its formula per matrix (plain, or scaled where the plain one would
    overflow or underflow): an ordinary matrix stacked with huge, tiny, zero and non-finite ones
    gets the bits it gets alone, and so does each of those."""
    G = unit_max_matrix((24, 40), seed=2).float()
    nan = G.clone()
    nan[3, 5] = float("nan")
    stack = torch.stack([G, G * 2.0**100, G * 1e30, G * 1e-30, torch.zeros_like(G), nan, G * 3.0])
    together = normalize(stack)
    for i, matrix in enumerate(stack):
        assert torch.equal(together[i].nan_to_num(7.0), normalize(matrix).nan_to_num(7.0)), i
    assert torch.equal(together[1], together[0])  # the scaled formula, where it is exact, gives the plain bits
    assert (together[4] == 0).all() and together[5].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_same_bits_tells_apart_what_equal_values_hide(dtype):
    """Early start's check under DDP (dmuon.tensors.same_bits): NaNs alike are the same bits,
    -0 and +0 are not, nor a one-ulp change, a shape or a dtype."""
    from dmuon.tensors import same_bits

    a = torch.tensor([1.0, float("nan"), 0.0, 3.0], dtype=dtype)
    assert same_bits([(a, a.clone()), (a[:2], a[:2].clone())]) and same_bits([])
    signed = a.clone()
    signed[2] = -0.0
    assert not same_bits([(a, a.clone()), (a, signed)])
    assert not same_bits([(a, torch.nextafter(a, torch.full_like(a, 10.0)))])
    assert not same_bits([(a, a.reshape(2, 2))]) and not same_bits([(a, a.to(torch.float32 if dtype != torch.float32
                                                                           else torch.float64))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("factor", [0.5, 1 - 2**-7, 1 + 2**-7, 1024.0, 1e-3])
def test_digest_moves_with_any_scaling_and_any_one_element(dtype, factor):
    """Early start's check where version counters stay (dmuon.tensors.digest): scaling a
    gradient of both signs by a factor other than 1, or changing one element (one ulp, or only
    its sign), moves the digest; the same bits, strided or not, give the same digest."""
    from dmuon.tensors import digest, same_bits

    torch.manual_seed(0)
    g = torch.randn(64, 48).to(dtype)
    g[0, :3] = 0.0
    assert same_bits([(digest(g), digest(g.clone())), (digest(g.T), digest(g))])
    scaled = g * factor
    assert not torch.equal(scaled, g) and not same_bits([(digest(scaled), digest(g))])
    for change in (lambda t: torch.nextafter(t, torch.full_like(t, 10.0)), torch.neg):
        one = g.clone()
        one[5, 7] = change(one[5, 7])
        assert not same_bits([(digest(one), digest(g))])


def test_digest_sees_a_power_of_two_scaling_that_wraps_the_bit_sum_around():
    """Halving 512 normal fp32 numbers lowers each one's integer reading by 2**23, the bit sum by
    2**32: it wraps around to where it was, and the value sum, halved exactly, shows the change."""
    from dmuon.tensors import digest

    g = torch.rand(512) + 1.0
    before, after = digest(g), digest(g * 0.5)
    assert before[0] == after[0] and before[1] != after[1]
