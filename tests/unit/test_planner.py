"""The planner is pure (docs/testing.md row 17): deterministic, every matrix owned once, stable under
parameter reordering, balanced within the LPT bound, fast up to 4096 ranks; plus its byte
accounting against the closed-form FSDP/DDP formulas."""

from __future__ import annotations

import random
import time

import pytest

from dmuon.choices import split_replicas_is_cheaper
from dmuon.layout import Layout, chunk_sizes
from dmuon.orthogonalization import newton_schulz_flops
from dmuon.planner import DEFAULT_FLOPS_PER_BYTE, Unit, make_plan, owner_cost
from dmuon.tools.models import get_config, matrix_shapes


def llama_units(preset: str, world: int, replicas: int = 1, layers: int | None = None) -> list[Unit]:
    """The Muon matrices of a Llama preset as FSDP (replicas=1) or HSDP units, fp32 on the wire."""
    config = get_config(preset, **({"n_layers": layers} if layers is not None else {}))
    layout = lambda m, n: Layout((m, n), replicas, world // replicas, tuple(range(world)))  # noqa: E731
    return [Unit(name, layout(m, n), 1, m, n, 4, newton_schulz_flops(m, n, steps=5, method="standard"))
            for name, m, n in matrix_shapes(config)]


def test_chunk_sizes_follow_torch_chunk():
    import torch

    for rows in range(0, 13):
        for shards in range(1, 6):
            expected = [len(c) for c in torch.chunk(torch.empty(rows), shards)] if rows else []
            expected += [0] * (shards - len(expected))
            assert list(chunk_sizes(rows, shards)) == expected


@pytest.mark.parametrize("world", [1, 3, 8, 64])
def test_every_matrix_owned_once_and_deterministic(world):
    units = llama_units("llama-3.1-8b", world, layers=4)
    plan = make_plan(units, world)
    assert len(plan.owners) == len(units) and all(0 <= o < world for o in plan.owners)
    assert sorted(i for b in plan.buckets for i in b) == list(range(len(units)))
    assert sum(plan.matrices(p) for p in range(world)) == len(units)
    assert make_plan(units, world) == plan


def test_stable_under_parameter_reordering():
    units = llama_units("qwen2.5-1.5b", 8, layers=6)
    shuffled = units[:]
    random.Random(0).shuffle(shuffled)
    a, b = make_plan(units, 8), make_plan(shuffled, 8)
    owner_a = {u.name: o for u, o in zip(a.units, a.owners)}
    owner_b = {u.name: o for u, o in zip(b.units, b.owners)}
    assert owner_a == owner_b


@pytest.mark.parametrize("preset,world", [("llama-3.1-8b", 8), ("llama-3.1-8b", 64), ("qwen2.5-7b", 24), ("mixed", 7)])
def test_balance_within_lpt_bound(preset, world):
    if preset == "mixed":
        rng = random.Random(1)
        units = []
        for i in range(50):
            m, n = rng.choice([16, 64, 128, 300]), rng.choice([16, 64, 512])
            layout = Layout((m, n), 1, world, tuple(range(world)))
            units.append(Unit(f"p{i}", layout, 1, m, n, 4, newton_schulz_flops(m, n, steps=5, method="standard")))
    else:
        units = llama_units(preset, world)
    plan = make_plan(units, world)
    costs = [owner_cost(u, world, 100.0) for u in units]
    loads = [0.0] * world
    for cost, owner in zip(costs, plan.owners):
        loads[owner] += cost
    # any greedy list schedule ends within one unit of the mean load
    assert max(loads) <= sum(costs) / world + max(costs)
    if preset != "mixed":  # many similar matrices: LPT is near perfect
        assert plan.imbalance < 1.07


def test_fewer_matrices_than_ranks_floor_is_the_largest_matrix():
    units = llama_units("llama-3.1-8b", 512, layers=1)
    plan = make_plan(units, 512)
    assert sum(1 for p in range(512) if plan.matrices(p)) == len(units)
    assert max(plan.flops(p) for p in range(512)) == max(u.flops for u in units)


def test_4096_ranks_in_milliseconds():
    units = llama_units("llama-3.1-70b", 4096)
    start = time.perf_counter()
    plan = make_plan(units, 4096)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, elapsed  # 560 units: LPT with a heap is O(U log P)
    assert sum(plan.matrices(p) for p in range(4096)) == len(units)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("rows,cols", [(64, 32), (3, 16), (7, 5)])
def test_bytes_match_closed_form(world, rows, cols):
    """FSDP: a non-owner sends its rows and receives them back; the owner receives and sends
    everyone else's rows. DDP: the owner sends the whole matrix to each other rank."""
    chunk = chunk_sizes(rows, world)
    fsdp = Unit("w", Layout((rows, cols), 1, world, tuple(range(world))), 1, rows, cols, 4, 1)
    plan = make_plan([fsdp], world)
    owner = plan.owners[0]
    others = 4 * cols * (rows - chunk[owner])
    for p in range(world):
        expected = others if p == owner else 4 * cols * chunk[p]
        assert plan.bytes_sent(p) == plan.bytes_received(p) == expected
    ddp = Unit("w", Layout((rows, cols), world, 1, tuple(range(world))), 1, rows, cols, 4, 1)
    plan = make_plan([ddp], world, world)
    owner = plan.owners[0]
    for p in range(world):
        assert plan.bytes_sent(p) == (4 * rows * cols * (world - 1) if p == owner else 0)
        assert plan.bytes_received(p) == (0 if p == owner else 4 * rows * cols)


def test_hsdp_split_decision_follows_the_cost_model():
    # big matrices, cheap bytes: splitting the NS work across replicas wins
    assert split_replicas_is_cheaper(llama_units("llama-3.1-8b", 8, replicas=2, layers=2), flops_per_byte=1.0)
    # tiny matrices: the replicas' return traffic crosses nodes, and costs more than it saves
    tiny = [Unit(f"w{i}", Layout((8, 8), 2, 2, (0, 1, 2, 3)), 1, 8, 8, 4, 10) for i in range(4)]
    assert not split_replicas_is_cheaper(tiny, flops_per_byte=100.0)


def test_table_lists_every_rank():
    plan = make_plan(llama_units("llama-3.1-8b", 4, layers=1), 4)
    table = plan.table()
    assert table.count("\n") == 6 and "imbalance" in table and table.startswith("exchange: row exchange")


def test_bad_group_shape_raises():
    with pytest.raises(ValueError, match="replicas"):
        make_plan([], 4, 3)
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_plan([], 4, bucket_bytes=0)


def test_buckets_keep_every_rank_busy_even_for_huge_matrices():
    """70B matrices are far larger than a bucket, yet the first bucket gives every rank a matrix
    (NS runs on all ranks at once), and a bucket only closes when an owner already in it would
    go over its per-owner budget."""
    budget = 8 * 2**20
    for units, world in [(llama_units("llama-3.1-70b", 8, layers=2), 8), (llama_units("bench", 2), 2)]:
        plan = make_plan(units, world, bucket_bytes=budget)
        assert {plan.owners[u] for u in plan.buckets[0]} == set(range(world))
        for bucket, following in zip(plan.buckets, plan.buckets[1:]):
            first = following[0]
            owned_before = [u for u in bucket if plan.owners[u] == plan.owners[first]]
            assert owned_before, "a bucket closed although the next owner had no work in it"
            assert sum(plan.units[u].total_bytes for u in owned_before) + plan.units[first].total_bytes > budget


def test_empty_matrices_are_planned_at_no_cost():
    """0×n, n×0 and 0×0 Muon matrices (a ZeroDivisionError in gang_member_flops once): owned like
    any other matrix, no FLOPs, never split over a gang."""
    import torch

    from dmuon.choices import choose_gangs, gang_costs, gang_member_cost, gang_member_flops
    from dmuon.orthogonalization import resolve_config

    shapes = [(0, 8), (8, 0), (0, 0), (16, 32)]
    units = [Unit(f"w{i}", Layout((m, n), 1, 2, (0, 1)), 1, m, n, 4,
                  newton_schulz_flops(m, n, steps=5, method="standard")) for i, (m, n) in enumerate(shapes)]
    configs = [resolve_config((max(m, 1), max(n, 1)), "cpu", method=method, dtype=torch.float32)
               for m, n in shapes for method in ["gram" if m * 2 <= n else "standard"]]
    for unit, config in zip(units[:3], configs):
        for k in (2, 3):
            assert gang_member_flops(unit, config, k) == 0
            assert gang_member_cost(unit, config, k) is None
        for method in ("standard", "gram"):  # column blocks with an empty Gram side do nothing
            assert newton_schulz_flops(unit.m, unit.n, steps=5, method=method, gram_side=0) == 0
    plan = make_plan(units, 2)
    assert sorted(i for b in plan.buckets for i in b) == [0, 1, 2, 3]
    assert sum(plan.flops(p) for p in range(2)) == units[3].flops
    assert not set(choose_gangs(units, gang_costs(units, configs), 2)) & {0, 1, 2}


@pytest.mark.parametrize("world", [1, 2, 3, 8, 64])
def test_early_start_buckets_follow_the_backward_pass_and_balance_each_bucket(world):
    """ready_order (early start): buckets in the model's order reversed, every matrix once, at most
    about eight buckets, each with a matrix per rank at least and balanced on its own."""
    units = llama_units("llama-3.1-8b", world, layers=8)
    plan = make_plan(units, world, ready_order=True)
    flat = [u for bucket in plan.buckets for u in bucket]
    assert flat == list(reversed(range(len(units))))
    assert len(plan.buckets) <= 9
    costs = [owner_cost(u, world, DEFAULT_FLOPS_PER_BYTE) for u in units]
    for bucket in plan.buckets[:-1]:
        assert len(bucket) >= world
        loads = [sum(costs[u] for u in bucket if plan.owners[u] == p) for p in range(world)]
        assert max(loads) <= sum(loads) / world + max(costs[u] for u in bucket) + 1e-12  # the LPT bound


def test_choose_makes_every_choice_in_order():
    """choices.choose: the options that turn choices off, and each choice where it pays."""
    from dmuon.choices import MatrixOptions, choose, column_block_cost
    from dmuon.orthogonalization import resolve_config

    def options(shapes, world, replicas=1, column_blocks=False):
        out = []
        for i, (m, n) in enumerate(shapes):
            config = resolve_config((m, n), "cpu")
            flops = newton_schulz_flops(m, n, steps=config.steps, method=config.method, restarts=config.restarts)
            layout = Layout((m, n), replicas, world // replicas, tuple(range(world)))
            unit = Unit(f"w{i:03d}", layout, 1, m, n, 4, flops)
            alone = Unit(unit.name, Layout((m, n), 1, world // replicas, tuple(range(world // replicas))), 1, m, n, 4,
                         flops)
            cost = column_block_cost(1, n, m, resolve_config((n, m), "cpu"), world) if column_blocks else None
            out.append(MatrixOptions(unit, alone, config, "torch.float32", cost, splittable=True))
        return out

    dominant = options([(256, 2048)] + [(64, 64)] * 8, 4)
    assert choose(dominant).gangs == {0: (0, 1, 2, 3)}  # one dominant matrix: a gang of all four
    assert choose(dominant, distributed_ns=False).gangs == {}  # every matrix whole
    assert choose(dominant, ready_order=True).gangs == {}  # early start: whole, too
    balanced = options([(256, 256)] * 64, 8)
    assert choose(balanced) == choose(balanced, distributed_ns=False)  # nothing pays: nothing split
    # distributed_ns=True: every matrix that can runs on its column blocks, no gangs
    sharded = options([(256, 2048)] + [(64, 64)] * 8, 4, column_blocks=True)
    forced = choose(sharded, distributed_ns=True)
    assert forced.column_blocks == frozenset(range(9)) and forced.gangs == {}
    # a matrix on column blocks is never also over a gang, and the choice is deterministic
    chosen = choose(sharded)
    assert not chosen.column_blocks & set(chosen.gangs) and chosen == choose(sharded)
    # HSDP: the replica groups share the work exactly where split_replicas_is_cheaper says so
    hsdp = options([(512, 512)] * 2, 4, replicas=2)
    assert choose(hsdp).split_replicas == split_replicas_is_cheaper([o.shared for o in hsdp])
    assert choose(hsdp, replica_split=False).split_replicas is False
