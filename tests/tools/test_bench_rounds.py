"""`dmuon bench` measures its configurations interleaved, in rounds, so that a change of load hits
them alike; the ratios are medians of per-round ratios with their range, and a run that saw other
load or a wide spread says so. Everything here runs on a fake clock with fake trainers: no ranks."""

from __future__ import annotations

import io
import json

import pytest

import dmuon.tools.bench as bench
from dmuon.tools.bench import BenchResult, Load, format_table, json_records, run_rounds, run_warnings, summarize
from dmuon.tools.cli import main


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.load = 1.0  # every duration is multiplied by it: the machine's load

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds * self.load


class FakeTrainer:
    """A configuration whose forward+backward and optimizer step take fixed times on the fake clock."""

    def __init__(self, name: str, clock: FakeClock, calls: list, fb_s: float, opt_s: float) -> None:
        self.name, self.clock, self.calls, self.fb_s, self.opt_s = name, clock, calls, fb_s, opt_s
        self.load_by_step: list[float] | None = None

    def forward_backward(self, step: int) -> float:
        self.calls.append((self.name, step))
        if self.load_by_step is not None:
            self.clock.load = self.load_by_step[step]
        self.clock.advance(self.fb_s)
        return 10.0 - step

    def optimizer_step(self) -> None:
        self.clock.advance(self.opt_s)

    def sync(self) -> None:
        pass

    def release(self) -> None:
        pass

    def ns_alone_s(self) -> float | None:
        return None


def _trainers(clock, calls, times=None):
    times = times or {"fsdp-adamw": (1.0, 0.1), "fsdp-torch-muon": (1.0, 2.0), "fsdp-dmuon": (1.0, 1.0)}
    return {name: FakeTrainer(name, clock, calls, fb, opt) for name, (fb, opt) in times.items()}


@pytest.fixture
def fake_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(bench, "clock", clock)
    return clock


def test_rounds_interleave_the_configurations_and_rotate_the_order(fake_clock):
    calls = []
    records = run_rounds(_trainers(fake_clock, calls), warmup=1, steps=4, steps_per_round=2)
    a, v, d = "fsdp-adamw", "fsdp-torch-muon", "fsdp-dmuon"
    assert calls == [(a, 0), (v, 0), (d, 0),  # warm-up, one after another
                     (a, 1), (a, 2), (v, 1), (v, 2), (d, 1), (d, 2),  # round 1
                     (v, 3), (v, 4), (d, 3), (d, 4), (a, 3), (a, 4)]  # round 2, rotated by one
    assert [r.round for r in records if r.config == d] == [-1, 0, 0, 1, 1]
    assert all(r.opt_s == pytest.approx(1.0) and r.step_s == pytest.approx(2.0) for r in records if r.config == d)


def test_ratios_are_medians_of_per_round_ratios_and_survive_a_load_change(fake_clock):
    """Rounds 2 and 4 run at three times the load: the medians of the raw times move, the ratios do not."""
    trainers = _trainers(fake_clock, [])
    for trainer in trainers.values():
        trainer.load_by_step = [1.0, 3.0, 1.0, 3.0]  # no warm-up: step k runs in round k + 1
    results = list(summarize(run_rounds(trainers, warmup=0, steps=4, steps_per_round=1), 2).values())
    dmuon = next(r for r in results if r.config == "fsdp-dmuon")
    assert dmuon.round_opt_step_ms == pytest.approx((1000.0, 3000.0, 1000.0, 3000.0))
    assert dmuon.opt_step_ms == pytest.approx(2000.0)  # median of the raw times: the load shows
    record = next(r for r in json_records(results, Load(0.0, 2)) if r["config"] == "fsdp-dmuon")
    assert record["opt_step_vs_vanilla"] == pytest.approx(0.5)  # 1.0 / 2.0 in every round
    assert record["opt_step_vs_vanilla_min"] == pytest.approx(0.5) == record["opt_step_vs_vanilla_max"]
    assert record["step_vs_adamw"] == pytest.approx(2.0 / 1.1)
    assert record["opt_step_vs_vanilla_halfwidth"] == pytest.approx(0.0)
    assert record["warnings"] == [] and record["trustworthy"] is True
    table = format_table(results, Load(0.0, 2))
    assert "0.50 ±0%" in next(line for line in table.splitlines() if line.startswith("fsdp-dmuon"))
    assert "WARNING" not in table and "step 1.82x AdamW (+82% ±0%); 0.67x vanilla Muon (-33% ±0%)" in table
    assert "settled: every step ratio above within ±10%" in table
    assert table.splitlines()[0].startswith("dmuon bench verdict")  # the verdict comes first
    assert max(len(line) for line in table.splitlines() if not line.startswith(("times:", "other"))) <= 100


def test_a_round_keeps_its_least_step_so_a_spike_in_it_changes_nothing(fake_clock):
    """Two steps a round: one of the dmuon configuration's steps in round 2 runs at three times
    the load (another job, a page fault). The round keeps its least step, so the ratios stay
    exact and the run settles; the median over all measured steps still shows the spike."""
    trainers = _trainers(fake_clock, [])
    dmuon = trainers["fsdp-dmuon"]
    turns = []

    def optimizer_step():
        turns.append(None)
        fake_clock.load = 3.0 if len(turns) == 4 else 1.0  # round 2's first step (after one warm-up)
        fake_clock.advance(dmuon.opt_s)
        fake_clock.load = 1.0

    dmuon.optimizer_step = optimizer_step
    results = list(summarize(run_rounds(trainers, warmup=1, steps=6, steps_per_round=2), 2).values())
    result = next(r for r in results if r.config == "fsdp-dmuon")
    assert result.round_opt_step_ms == pytest.approx((1000.0, 1000.0, 1000.0))
    record = next(r for r in json_records(results, Load(0.0, 2)) if r["config"] == "fsdp-dmuon")
    assert record["opt_step_vs_vanilla"] == pytest.approx(0.5) == record["opt_step_vs_vanilla_max"]
    assert record["trustworthy"] is True


def test_a_load_change_within_rounds_widens_the_interval_and_warns(fake_clock):
    """The load doubles for the dmuon configuration's turn in one round only: that round's ratio is
    off, the median is not, and the interval and the warning say the run was disturbed."""
    trainers = _trainers(fake_clock, [])
    dmuon = trainers["fsdp-dmuon"]
    turns = []

    def optimizer_step():
        turns.append(None)
        fake_clock.load = 2.0 if len(turns) == 3 else 1.0  # dmuon's step in round 2 (after one warm-up)
        fake_clock.advance(dmuon.opt_s)
        fake_clock.load = 1.0

    dmuon.optimizer_step = optimizer_step
    results = list(summarize(run_rounds(trainers, warmup=1, steps=4, steps_per_round=1), 2).values())
    record = next(r for r in json_records(results, Load(0.0, 2)) if r["config"] == "fsdp-dmuon")
    assert record["opt_step_vs_vanilla"] == pytest.approx(0.5)
    assert record["opt_step_vs_vanilla_max"] == pytest.approx(1.0)
    assert record["trustworthy"] is False
    assert any("fsdp-dmuon step vs vanilla" in w and "after 4 rounds" in w for w in record["warnings"])
    table = format_table(results, Load(0.0, 2), verbose=True)
    assert "0.50 (0.50-1.00)" in table  # --verbose: the range
    assert "WARNING: fsdp-dmuon step vs vanilla" in table and "NOT settled after 4 rounds" in table


def test_other_load_during_the_rounds_warns():
    results = [BenchResult("fsdp-adamw", 2, 10.0, 100.0, None, None, 0, 5.0, (10.0, 10.0), (100.0, 100.0)),
               BenchResult("fsdp-torch-muon", 2, 80.0, 180.0, None, None, 0, 4.0, (80.0, 80.0), (180.0, 180.0))]
    assert all(r["trustworthy"] for r in json_records(results, Load(0.1, 2)))
    assert "WARNING" not in format_table(results, Load(0.1, 2))
    busy = Load(0.5, 2)
    records = json_records(results, busy)
    assert not records[0]["trustworthy"] and records[0]["other_jobs_cores"] == 0.5
    assert "other jobs used 0.50 of 2 cores" in records[0]["warnings"][0]
    assert "WARNING: other jobs used 0.50 of 2 cores" in format_table(results, busy)


def test_progress_is_one_line_per_step_and_shows_the_tables_loss(fake_clock):
    log = io.StringIO()  # not a terminal
    records = run_rounds(_trainers(fake_clock, []), warmup=1, steps=2, steps_per_round=1, log=log)
    lines = log.getvalue().splitlines()
    assert len(lines) == 9 and lines[0].startswith("warm-up") and lines[-1].startswith("round 2/2")
    results = summarize(records, 2)
    last = [line for line in lines if "fsdp-dmuon" in line][-1]
    assert "step 3/3" in last and f"loss {results['fsdp-dmuon'].final_loss:.3f}" in last
    table = format_table(list(results.values()), verbose=True)
    assert any(line.startswith("config") and "loss" in line for line in table.splitlines())


def test_run_times_every_configuration_in_one_set_of_ranks(monkeypatch, tmp_path):
    """``run`` spawns one set of ranks for the timing (all configurations) and, for the peak memory,
    fresh ranks per configuration; the JSON keeps its fields and adds the ratios and warnings."""
    calls = []

    def fake_run_config(names, args, mode="memory"):
        calls.append((names, mode))
        if mode == "memory":
            return 2**20 * (2 if names.endswith("adamw") else 1)
        return {"results": {n: BenchResult(n, 2, 10.0 * (i + 1), 100.0 * (i + 1), None, None, 0, 4.0,
                                           (10.0 * (i + 1),) * 2, (100.0 * (i + 1),) * 2)
                            for i, n in enumerate(names)}}

    monkeypatch.setattr(bench, "run_config", fake_run_config)
    out = tmp_path / "bench.json"
    names = ["fsdp-adamw", "fsdp-torch-muon", "fsdp-dmuon"]
    assert main(["bench", "--preset", "tiny", "--steps", "2", "--configs", ",".join(names), "--json", str(out)]) == 0
    assert calls == [(n, "memory") for n in names] + [(names, "timed")]
    records = json.loads(out.read_text())
    assert [r["peak_mem_bytes"] for r in records] == [2**21, 2**20, 2**20]
    assert records[2]["opt_step_vs_vanilla"] == pytest.approx(1.5) and records[2]["mem_vs_adamw"] == 0.5
    assert records[2]["step_vs_adamw_min"] == pytest.approx(3.0) == records[2]["step_vs_adamw_max"]
    assert {"warnings", "trustworthy", "other_jobs_cores", "round_step_ms"} <= set(records[0])


def test_efficiency_is_newton_schulz_alone_over_the_opt_step_per_round(fake_clock):
    """The busiest rank's Newton–Schulz time alone (here 0.8 s, scaled by the round's load like the
    step) over the optimizer step (1.0 s): 0.8 in every round, whatever the load."""
    trainers = _trainers(fake_clock, [])
    dmuon = trainers["fsdp-dmuon"]
    dmuon.ns_alone_s = lambda: 0.8 * fake_clock.load
    for trainer in trainers.values():
        trainer.load_by_step = [1.0, 3.0, 1.0, 3.0]
    results = list(summarize(run_rounds(trainers, warmup=0, steps=4, steps_per_round=1), 2).values())
    by_name = {r.config: r for r in results}
    assert by_name["fsdp-dmuon"].round_ns_alone_ms == pytest.approx((800.0, 2400.0, 800.0, 2400.0))
    assert by_name["fsdp-adamw"].round_ns_alone_ms == ()
    records = {r["config"]: r for r in json_records(results, Load(0.0, 2))}
    assert records["fsdp-dmuon"]["opt_step_efficiency"] == pytest.approx(0.8)
    assert records["fsdp-dmuon"]["opt_step_efficiency_min"] == pytest.approx(0.8)
    assert records["fsdp-adamw"]["opt_step_efficiency"] is None
    table = format_table(results, Load(0.0, 2), verbose=True)
    detail = table.splitlines()[table.splitlines().index("") + 1:]
    assert any("NS/opt step" in line for line in detail)
    assert [line for line in detail if line.startswith("fsdp-dmuon")][-1].endswith("0.80 ±0%")


def test_ns_alone_replays_the_last_steps_newton_schulz_calls(monkeypatch):
    """A real dmuon step lists its Newton–Schulz calls (one stacked call per shape here); the
    replay runs exactly those calls, with the same shapes, dtypes and configurations."""
    import torch

    import dmuon

    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 32, bias=False),
                                torch.nn.Linear(32, 32, bias=False))
    with pytest.warns(UserWarning, match="by shape alone"):  # bare tensors: every matrix a hidden one here
        opt = dmuon.Muon(model.parameters(), lr=0.02)
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    calls = opt.last_step_stats.ns_calls
    assert sorted(shape for shape, _, _, _ in calls) == [(1, 32, 16), (2, 32, 32)]
    replayed = []
    monkeypatch.setattr(bench, "orthogonalize", lambda x, config: replayed.append((tuple(x.shape), x.dtype, config)))
    assert bench.time_ns_calls(calls, torch.device("cpu")) >= 0
    assert replayed == [(shape, dtype, config) for shape, dtype, config, _ in calls]


@pytest.mark.parametrize("native,preset", [(True, "bench"), (False, "demo")])
def test_auto_preset_is_bench_only_where_bf16_products_are_native(monkeypatch, native, preset):
    """vanilla Muon orthogonalizes in bf16: where the CPU emulates it, the default is the demo preset."""
    import argparse

    monkeypatch.setattr(bench, "native_bf16", lambda device: native)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    bench.check_arguments(args)
    assert args.preset == preset
    forced = parser.parse_args(["--preset", "bench"])
    bench.check_arguments(forced)
    assert forced.preset == "bench"


def test_only_the_headline_ratios_warn():
    """Optimizer-step ratios (AdamW's few ms, dmuon's, early start's) spread with jitter and decide
    nothing; a dmuon configuration's whole step against AdamW's or vanilla Muon's does."""
    vanilla = BenchResult("fsdp-torch-muon", 2, 100.0, 200.0, None, None, 0, 4.0, (100.0, 100.0), (200.0, 200.0))
    adamw = BenchResult("fsdp-adamw", 2, 1.5, 100.0, None, None, 0, 5.0, (1.0, 2.0), (100.0, 100.0))
    assert run_warnings([adamw, vanilla], Load(0.0, 2)) == []
    dmuon = BenchResult("fsdp-dmuon", 2, 50.0, 150.0, None, None, 0, 4.0, (40.0, 80.0), (150.0, 150.0))
    assert run_warnings([adamw, vanilla, dmuon], Load(0.0, 2)) == []  # its optimizer step alone: shown, not judged
    jumpy = BenchResult("fsdp-dmuon", 2, 50.0, 150.0, None, None, 0, 4.0, (40.0, 80.0), (120.0, 180.0))
    assert any("fsdp-dmuon step vs adamw" in w for w in run_warnings([adamw, vanilla, jumpy], Load(0.0, 2)))
    early = BenchResult("fsdp-dmuon-early", 2, 3.0, 150.0, None, None, 0, 4.0, (1.0, 5.0), (150.0, 150.0))
    assert run_warnings([adamw, vanilla, early], Load(0.0, 2)) == []
    jittery = BenchResult("fsdp-dmuon-early", 2, 3.0, 150.0, None, None, 0, 4.0, (1.0, 5.0), (120.0, 180.0))
    assert any("fsdp-dmuon-early step vs adamw" in w for w in run_warnings([adamw, vanilla, jittery], Load(0.0, 2)))


def slow_turn(trainer: FakeTrainer, clock: FakeClock, turn: int, load: float) -> None:
    """Make ``trainer``'s optimizer step number ``turn`` (from 1, warm-up included) run at ``load``."""
    turns = []

    def optimizer_step():
        turns.append(None)
        clock.load = load if len(turns) == turn else 1.0
        clock.advance(trainer.opt_s)
        clock.load = 1.0

    trainer.optimizer_step = optimizer_step


def test_the_rounds_go_on_until_the_ratios_settle(fake_clock):
    """Rounds 1 and 2 disagree (the load doubles for dmuon's turn in round 2): ``more`` adds rounds
    until the interval is within ±10 %; it is asked after the planned rounds and each extra one."""
    trainers = _trainers(fake_clock, [])
    slow_turn(trainers["fsdp-dmuon"], fake_clock, turn=3, load=1.3)
    asked = []

    def more(records):
        results = list(summarize([r for r in records if r.round >= 0], 2).values())
        asked.append(len(results[0].round_step_ms))
        return bench.configs_to_settle(results) if len(asked) < 20 else []

    records = run_rounds(trainers, warmup=1, steps=2, steps_per_round=1, more=more)
    results = list(summarize(records, 2).values())
    assert asked[0] == 2 and asked == list(range(2, 2 + len(asked)))  # after the planned rounds, then each
    assert 2 < len(results[0].round_step_ms) < 21 and not bench.unsettled(results)


def test_an_extra_round_steps_only_the_configurations_of_unsettled_ratios(fake_clock):
    """ddp's ratios disagree between the two planned rounds, fsdp's do not: the extra rounds step
    ddp-dmuon and its two baselines alone, and the ratios pair the rounds both configurations ran."""
    times = {f"{mode}-{opt}": (1.0, t) for mode in ("ddp", "fsdp")
             for opt, t in (("adamw", 0.1), ("torch-muon", 2.0), ("dmuon", 1.0))}
    calls = []
    trainers = _trainers(fake_clock, calls, times)
    slow_turn(trainers["ddp-dmuon"], fake_clock, turn=2, load=1.5)  # round 1
    chosen = []

    def more(records):
        results = list(summarize([r for r in records if r.round >= 0], 2).values())
        chosen.append(bench.configs_to_settle(results))
        return chosen[-1] if len(chosen) < 10 else []

    records = run_rounds(trainers, warmup=0, steps=2, steps_per_round=1, more=more)
    assert chosen[0] == ["ddp-adamw", "ddp-torch-muon", "ddp-dmuon"]
    extra = {r.config for r in records if r.round >= 2}
    assert extra == {"ddp-adamw", "ddp-torch-muon", "ddp-dmuon"} and chosen[-1] == []
    results = {r.config: r for r in summarize(records, 2).values()}
    rounds = len(results["ddp-dmuon"].round_step_ms)
    assert rounds > 2 and len(results["fsdp-dmuon"].round_step_ms) == rounds  # NaN where it sat out
    assert sum(t == t for t in results["fsdp-dmuon"].round_step_ms) == 2
    comparisons = bench.compare(list(results.values()))
    assert comparisons["fsdp-dmuon"]["step_vs_adamw"].median == pytest.approx(2.0 / 1.1)
    assert comparisons["ddp-dmuon"]["step_vs_adamw"].settled and not bench.unsettled(list(results.values()))
    record = next(r for r in json_records(list(results.values())) if r["config"] == "fsdp-dmuon")
    assert record["round_step_ms"][2:] == [None] * (rounds - 2)
    json.dumps(record, allow_nan=False)  # sat-out rounds are null, not NaN


def test_the_verdict_states_the_model_and_the_tokens_per_step():
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--preset", "bench", "--tokens-per-step", "2048", "--seq-len", "256"])
    bench.check_arguments(args)
    assert args.batch_size == 4  # 2 ranks x 4 sequences x 256 tokens
    assert bench.model_summary(args) == ("bench preset, 27.3M parameters, 2 ranks x 4 sequences x 256 tokens = "
                                         "2,048 tokens per step, fp32")
    with pytest.raises(Exception, match="--tokens-per-step"):
        bench.check_arguments(parser.parse_args(["--preset", "bench", "--tokens-per-step", "1000"]))


def test_a_run_without_baselines_says_it_has_no_ratios():
    alone = BenchResult("fsdp-dmuon", 2, 50.0, 150.0, None, None, 0, 4.0, (50.0, 50.0), (150.0, 150.0))
    table = format_table([alone], Load(0.0, 2))
    assert "no AdamW or vanilla Muon of the same mode in this run: no step ratios to settle" in table
    assert "settled" not in table and "WARNING" not in table


def test_the_verdict_sets_dmuon_beside_each_peer_of_its_mode():
    """With ``--peers``, each dmuon configuration's optimizer step is set against every peer's of the
    same data-parallel mode, round by round (the peer's time here: 2x dmuon's in one round, 4x in
    the other), in the verdict and the JSON; a peer of the other mode is not compared."""
    adamw = BenchResult("fsdp-adamw", 2, 1.0, 100.0, None, None, 0, 5.0, (1.0, 1.0), (100.0, 100.0))
    dmuon = BenchResult("fsdp-dmuon", 2, 50.0, 150.0, None, None, 0, 4.0, (40.0, 60.0), (150.0, 150.0))
    peer = BenchResult("fsdp-dion", 2, 100.0, 200.0, None, None, 0, 4.0, (80.0, 240.0), (180.0, 220.0))
    ddp_peer = BenchResult("ddp-dion", 2, 100.0, 200.0, None, None, 0, 4.0, (10.0, 10.0), (180.0, 220.0))
    results = [adamw, dmuon, peer, ddp_peer]
    ratio = bench.peer_ratios(results)["fsdp-dmuon"]["fsdp-dion"]
    assert set(bench.peer_ratios(results)["fsdp-dmuon"]) == {"fsdp-dion"}
    assert (ratio.low, ratio.high) == (0.25, 0.5) and ratio.median == pytest.approx(0.375)
    lines = "\n".join(bench.verdict(results))
    assert "fsdp-dmuon         optimizer step 0.38x fsdp-dion's (±" in lines
    assert "settled: every step ratio above" in lines  # the peer's ratio is shown, not judged
    record = next(r for r in json_records(results, Load(0.0, 2)) if r["config"] == "fsdp-dmuon")
    assert record["opt_step_vs_peer"]["fsdp-dion"]["median"] == pytest.approx(0.375)


def test_the_verdict_ends_with_the_plan_command_that_predicts_this_run():
    """The bench's figure is one run's; its last verdict lines say what moves it and give the
    ``dmuon plan`` command of this very run (which plan's own parser accepts), and one for a real job."""
    import argparse
    import re
    import shlex

    from dmuon.tools import plan_cli

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--preset", "bench", "--layers", "2", "--world-size", "3", "--batch-size", "2",
                              "--seq-len", "64"])
    bench.check_arguments(args)
    text = " ".join(line.strip() for line in bench.plan_pointer(args))
    assert text.startswith("your job: these ratios are this run's (3 CPU ranks, 128 tokens per rank)")
    commands = re.findall(r"`(dmuon plan [^`]*)`", text)
    assert commands[0] == ("dmuon plan --model bench --layers 2 --world-size 3 --hardware cpu --tokens-per-step 384 "
                           "--seq-len 64")
    for command in commands:
        plan_parser = argparse.ArgumentParser()
        plan_cli.add_arguments(plan_parser)
        plan_cli.check_arguments(plan_parser.parse_args(shlex.split(command)[2:]))
    dmuon = BenchResult("fsdp-dmuon", 2, 50.0, 150.0, None, None, 0, 4.0, (50.0, 50.0), (150.0, 150.0))
    table = format_table([dmuon], Load(0.0, 2), your_job=bench.plan_pointer(args))
    assert table.split("\n\n")[0].splitlines()[-1].endswith("it predicts your job.")
