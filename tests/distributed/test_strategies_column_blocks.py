"""``dmuon/strategies/column_blocks.py`` and ``dmuon/column_block_ns.py``: distributed Newton–Schulz on
the ranks' own column blocks, against one process, and the cost model's choice of it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dmuon
from dmuon.column_block_ns import orthogonalize_column_blocks
from dmuon.orthogonalization import orthogonalize, resolve_config
from tests.distributed.test_tensor_parallel import HPARAMS, train
from tests.harness import run_on_ranks
from tests.helpers import single_process


@pytest.fixture(scope="module")
def reference() -> dict:
    return single_process(train, None)


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
