"""Tensor parallel (row-wise ``Shard(1)``, column-wise ``Shard(0)``) and FSDP + tensor parallel on a
2×2 mesh: ``dmuon.Muon`` orthogonalizes each full logical matrix once, and training matches one
process to the tolerance of the reduction order; placements never change; a TP checkpoint loads
into one process (unsupported layouts: tests/distributed/test_distributed_step.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import dmuon
from dmuon.column_block_ns import orthogonalize_column_blocks
from dmuon.orthogonalization import orthogonalize, resolve_config
from tests.harness import run_on_ranks
from tests.helpers import dcp_load, dcp_save, full_tensor, single_process

HPARAMS = dict(lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32)
STEPS, GLOBAL_BATCH = 3, 12  # divisible by every data-parallel size used (2, 3)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(16, 40)  # column-wise: weight Shard(0)
        self.down = nn.Linear(40, 24)  # row-wise: weight Shard(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 24, generator=g)


def build(parallel: str | None, dtype: torch.dtype = torch.float32,
          **options) -> tuple[nn.Module, dmuon.Muon, int, int]:
    """The MLP (its parameters in ``dtype``) under ``parallel`` ("tp": 1-D TP mesh; "fsdp+tp":
    2×2 (dp, tp) mesh; None: one process), its optimizer, and this rank's data-parallel index
    and count."""
    model = MLP().to(dtype)
    dp_rank, dp_size = 0, 1
    if parallel == "tp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    elif parallel == "fsdp+tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        dp_rank, dp_size = mesh["dp"].get_local_rank(), 2
    elif parallel == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        dp_rank, dp_size = dist.get_rank(), dist.get_world_size()
    return model, dmuon.Muon(model, **HPARAMS, **options), dp_rank, dp_size


def train(parallel: str | None, dtype: torch.dtype = torch.float32, **options) -> dict:
    model, opt, dp_rank, dp_size = build(parallel, dtype, **options)
    placements_before = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    losses = []
    for step in range(STEPS):
        x, y = (t.chunk(dp_size)[dp_rank].to(dtype) for t in batch(step))
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    placements_after = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return dict(params={n: full_tensor(p) for n, p in model.named_parameters()}, losses=losses,
                placements=(placements_before, placements_after), matrices=opt.last_step_stats.matrices_orthogonalized,
                planned=[len(plan.units) for plan in opt.plans])


@pytest.fixture(scope="module")
def reference() -> dict:
    return single_process(train, None)


@pytest.mark.parametrize("parallel,world", [("tp", 2), ("tp", 4), ("fsdp+tp", 4)])
def test_tensor_parallel_matches_single_process(reference, parallel, world):
    results = run_on_ranks(world, train, parallel)
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=f"{rank} {name}")
        before, after = r["placements"]
        assert before == after and before, rank
    if parallel == "tp":  # the same data everywhere: the same loss
        torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(reference["losses"]))
    assert sum(r["matrices"] for r in results) == 2  # each logical matrix once in the job


@pytest.mark.parametrize("parallel,world", [("tp", 2), ("fsdp+tp", 4)])
def test_bf16_parameters_under_tensor_parallel_stay_identical_across_ranks(parallel, world):
    """bf16 weights: every rank's full view of every parameter is bitwise the same (the TP
    shards are put together from the same updates; under FSDP + TP the two data-parallel
    replicas of each TP shard agree), and close to one process (bf16 rounding; TP splits the
    forward's sums)."""
    reference = single_process(train, None, torch.bfloat16)
    results = run_on_ranks(world, train, parallel, torch.bfloat16)
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, results[0]["params"][name]), (rank, name)
            torch.testing.assert_close(value, reference["params"][name], rtol=3e-2, atol=3e-2, msg=name)


def save_and_load_tp(path: str, parallel: str = "tp") -> dict:
    model, opt, _, _ = build(parallel)
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    opt.step()
    dcp_save(model, opt, path)
    return dict(params={n: full_tensor(p) for n, p in model.named_parameters()},
                momentum={n: full_tensor(opt.state[p]["momentum_buffer"])
                          for n, p in model.named_parameters() if p.ndim == 2})


def load_plain(path: str, parallel: str | None = None) -> dict:
    model, opt, _, _ = build(parallel)
    dcp_load(model, opt, path)
    return dict(params={n: full_tensor(p) for n, p in model.named_parameters()},
                momentum={n: full_tensor(opt.state[p]["momentum_buffer"])
                          for n, p in model.named_parameters() if p.ndim == 2})


@pytest.mark.parametrize("parallel,world", [("tp", 2), ("fsdp+tp", 4)])
def test_tensor_parallel_checkpoint_loads_in_one_process(tmp_path, parallel, world):
    saved = run_on_ranks(world, save_and_load_tp, str(tmp_path / "tp"), parallel)[0]
    loaded = run_on_ranks(1, load_plain, str(tmp_path / "tp"))[0]
    for part in ("params", "momentum"):
        assert saved[part].keys() == loaded[part].keys() and saved[part]
        for name in saved[part]:
            assert torch.equal(saved[part][name], loaded[part][name]), (part, name)


@pytest.mark.parametrize("saved_as,loaded_as", [(("fsdp+tp", 4), ("tp", 2)), (("fsdp+tp", 4), ("fsdp", 3)),
                                               (("fsdp", 3), ("fsdp+tp", 4)), (("tp", 2), ("fsdp+tp", 4))],
                         ids=["fsdp+tp@4->tp@2", "fsdp+tp@4->fsdp@3", "fsdp@3->fsdp+tp@4", "tp@2->fsdp+tp@4"])
def test_checkpoint_loads_across_two_d_layouts_and_world_sizes(tmp_path, saved_as, loaded_as):
    """A torch.distributed.checkpoint of weights and momentum saved under one layout and world
    size loads bitwise under another (each rank takes its own piece)."""
    saved = run_on_ranks(saved_as[1], save_and_load_tp, str(tmp_path / "ckpt"), saved_as[0])[0]
    for rank, loaded in enumerate(run_on_ranks(loaded_as[1], load_plain, str(tmp_path / "ckpt"), loaded_as[0])):
        for part in ("params", "momentum"):
            assert saved[part].keys() == loaded[part].keys() and saved[part]
            for name in saved[part]:
                assert torch.equal(saved[part][name], loaded[part][name]), (rank, part, name)


# ---------------------------------------------------------------- distributed Newton–Schulz


def column_blocks_ns(shape: tuple[int, int, int], method: str, rows: bool,
                     coefficients: str = "polar_express") -> torch.Tensor:
    """Every rank orthogonalizes its torch.chunk block of the same stack — of columns, or of
    rows (through the transpose) — and returns the whole result, reassembled."""
    world, rank = dist.get_world_size(), dist.get_rank()
    full_input = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    config = resolve_config(shape[-2:] if not rows else shape[-2:][::-1], "cpu", method=method, dtype=torch.float32,
                            coefficients=coefficients)
    dim = -2 if rows else -1
    chunks = full_input.chunk(world, dim=dim)  # torch.chunk may give fewer chunks than ranks
    mine = chunks[rank] if rank < len(chunks) else full_input.narrow(dim, 0, 0)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    block = orthogonalize_column_blocks(mine.mT if rows else mine, config, all_reduce)
    pieces = [None] * world
    dist.all_gather_object(pieces, block.mT if rows else block)
    return torch.cat(pieces, dim=dim)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("coefficients", ["polar_express", "aol"])
def test_column_block_newton_schulz_matches_one_process(world, method, rows, coefficients):
    """Column blocks (and row blocks, as the transpose) of 3 wide 24×80 matrices, or 3 tall
    80×24 ones: the distributed result equals one process's up to the order of the sums (AOL
    rescaling too: every rank scales its rows by the all-reduced Gram matrix's row sums)."""
    shape = (3, 80, 24) if rows else (3, 24, 80)
    expected = orthogonalize(torch.randn(shape, generator=torch.Generator().manual_seed(0)),
                             resolve_config(shape[-2:], "cpu", method=method, dtype=torch.float32,
                                            coefficients=coefficients))
    for result in run_on_ranks(world, column_blocks_ns, shape, method, rows, coefficients):
        torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("parallel,world", [("tp", 2), ("tp", 4), ("fsdp", 3), ("fsdp+tp", 4)])
def test_distributed_ns_training_matches_single_process(reference, parallel, world):
    """``distributed_ns=True``: row-wise TP (column blocks), column-wise TP and FSDP2 (row
    blocks, as the transpose) — no gather, each rank does the small-side recurrence. FSDP + TP
    on a 2×2 mesh: the column-wise matrix, whose rows the four ranks hold disjointly
    (``_StridedShard(0), Shard(0)``), is split in place too; the row-wise one, held as 2-D
    blocks, goes to one owner through the piece exchange."""
    results = run_on_ranks(world, train, parallel, distributed_ns=True)
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=1e-5, msg=f"{rank} {name}")
        # nothing went through the row exchange; under FSDP + TP the 2-D blocks take the piece exchange
        assert r["planned"] == ([] if parallel != "fsdp+tp" else [1])
        assert r["placements"][0] == r["placements"][1]
    # a split matrix counts on every rank of its group; a gathered one on its owner only
    assert sum(r["matrices"] for r in results) == (2 * world if parallel != "fsdp+tp" else world + 1)


def test_planner_splits_a_matrix_only_when_it_lowers_the_makespan():
    """Splitting (distributed NS on every rank of the group) pays for one matrix much larger than
    the rest, and for fewer matrices than ranks; not when there are enough to balance."""
    from dmuon.choices import choose_distributed, distributed_cost
    from dmuon.layout import Layout
    from dmuon.orthogonalization import newton_schulz_flops
    from dmuon.planner import Unit

    def unit(name: str, m: int, n: int, size: int) -> tuple[Unit, float]:
        layout = Layout((m, n), 1, size, tuple(range(size)))
        full = newton_schulz_flops(m, n, steps=5, method="standard")
        blocks = newton_schulz_flops(n, -(-m // size), steps=5, method="standard", gram_side=n)  # rows split
        return Unit(name, layout, 1, m, n, 4, full), distributed_cost(blocks, 4 * n * n, 5, size)

    def choice(shapes, size):
        units, costs = zip(*(unit(f"w{i}", m, n, size) for i, (m, n) in enumerate(shapes)))
        return choose_distributed(units, costs, size)

    assert choice([(256, 256)] * 64, 8) == frozenset()  # 8 matrices a rank: LPT balances them
    assert choice([(16384, 256)] + [(256, 256)] * 8, 8) == {0}  # one large tall matrix: split it
    assert choice([(8192, 512)] * 2, 8) == {0, 1}  # fewer matrices than ranks


def fsdp_tall_and_square() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    init = [torch.randn(shape, generator=torch.Generator().manual_seed(i))
            for i, shape in enumerate([(4096, 16), (32, 32)])]
    params = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
    opt = dmuon.Muon([{"params": params, "algorithm": "muon"}], **HPARAMS)
    for p, t in zip(params, init):
        p.grad = distribute_tensor(t.flip(0).clone(), mesh, [Shard(0)])
    opt.step()
    return dict(planned=[[u.m for u in plan.units] for plan in opt.plans], params=[p.full_tensor() for p in params])


def test_cost_model_picks_column_blocks_for_a_tall_fsdp_matrix():
    """FSDP2 at 4 ranks: a 4096×16 matrix is cheaper orthogonalized on the ranks' row blocks
    (Gram side 16, nothing gathered) than gathered; a 32×32 one goes through the row exchange."""
    init = [torch.randn(shape, generator=torch.Generator().manual_seed(i))
            for i, shape in enumerate([(4096, 16), (32, 32)])]
    ref_params = [nn.Parameter(t.clone()) for t in init]
    opt = dmuon.Muon([{"params": ref_params, "algorithm": "muon"}], **HPARAMS)
    for p, t in zip(ref_params, init):
        p.grad = t.flip(0).clone()
    opt.step()
    for r in run_on_ranks(4, fsdp_tall_and_square):
        assert r["planned"] == [[32]]
        for got, expected in zip(r["params"], ref_params):
            torch.testing.assert_close(got, expected.detach(), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- 2-D meshes: the piece exchange

TWO_D = {  # placements on a (2, 2) mesh, and the shapes stepped with them
    "fsdp x colwise tp": ([_StridedShard(0, split_factor=2), Shard(0)], [(40, 16), (16, 24), (8, 8)]),
    "fsdp x rowwise tp": ([Shard(0), Shard(1)], [(24, 40), (16, 24), (7, 5)]),
    "2-D blocks, columns first": ([Shard(1), Shard(0)], [(24, 40), (16, 16)]),
    "expert stacks, efsdp dim 1": ([Shard(0), Shard(1)], [(4, 16, 32), (4, 32, 16)]),
    "expert stacks, efsdp dim 2": ([Shard(0), Shard(2)], [(4, 16, 32), (4, 32, 16)]),
    "hsdp replicas x rowwise tp": ([Replicate(), Shard(1)], [(24, 40), (16, 24)]),
}


def two_d_step(case: str, dtype: torch.dtype, steps: int = 2) -> dict:
    """``steps`` Muon steps of DTensors placed as ``TWO_D[case]`` on a (2, 2) mesh, beside the
    same steps in one process on the full tensors (the same gradients); the whole parameters,
    whether they are bitwise the reference's, and the bytes of the last step."""
    from dmuon.reference import ReferenceMuon
    from tests.helpers import full_tensors

    placements, shapes = TWO_D[case]
    mesh = init_device_mesh("cpu", (2, 2))
    init = [t.to(dtype) for t in full_tensors(shapes, seed=0)]
    params = [nn.Parameter(distribute_tensor(t.clone(), mesh, placements, src_data_rank=None)) for t in init]
    refs = [nn.Parameter(t.clone()) for t in init]
    names = [f"p{i}" for i in range(len(params))]
    hparams = {**HPARAMS, "ns_dtype": torch.float32 if dtype == torch.float32 else torch.bfloat16}
    opt = dmuon.Muon([{"params": params, "algorithm": "muon", "param_names": names}], **hparams)
    ref = ReferenceMuon(refs, **hparams)
    for step in range(steps):
        for p, r, g in zip(params, refs, full_tensors(shapes, seed=100 + step)):
            p.grad = distribute_tensor(g.to(dtype), mesh, placements, src_data_rank=None)
            r.grad = g.to(dtype)
        opt.step()
        ref.step()
    return dict(equal=[torch.equal(p.full_tensor(), r.detach()) for p, r in zip(params, refs)],
                bytes=opt.last_step_stats.bytes_sent, matrices=opt.last_step_stats.matrices_orthogonalized,
                muon_bytes=sum(t.numel() * t.element_size() for t in init))


@pytest.mark.parametrize("case", sorted(TWO_D))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_d_layouts_step_as_one_process_and_exchange_as_fsdp2(case, dtype):
    """Each owner receives exactly the pieces of its matrices and returns every rank its piece:
    bitwise the single-process step, every matrix orthogonalized once, and per rank on average
    2(N-1)/N of the Muon weights spread over the N ranks (the header's all-reduce aside)."""
    from dmuon.agreement import HEADER_LEN

    results = run_on_ranks(4, two_d_step, case, dtype)
    for r in results:
        assert all(r["equal"]), (case, r["equal"])
    _, shapes = TWO_D[case]
    assert sum(r["matrices"] for r in results) == sum(s[0] if len(s) == 3 else 1 for s in shapes)
    exchanged, weights = sum(r["bytes"] - 4 * HEADER_LEN for r in results), results[0]["muon_bytes"]
    if "replicas" in case:  # one replica sends its halves; the owner returns every rank its half
        assert exchanged <= (1 + 3 / 2) * weights
    elif (7, 5) not in shapes:  # even pieces: exactly FSDP2's bound
        assert exchanged == 2 * 3 / 4 * weights, (exchanged, weights)
    else:  # uneven pieces: each matrix out and back once, less its owner's own piece
        assert exchanged <= 2 * weights
