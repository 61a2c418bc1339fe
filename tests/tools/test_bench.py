"""`dmuon bench`: the table arithmetic, and one tiny end-to-end run on spawned gloo ranks."""

from __future__ import annotations

import json

import pytest

from dmuon.tools.bench import BenchResult, format_table, training_traffic
from dmuon.tools.cli import main
from dmuon.tools.models import Llama, get_config, matrix_shapes


def test_table_ratios():
    results = [
        BenchResult("fsdp-adamw", 2, 10.0, 100.0, 0.0, 3 * 2**20, 2**20, 5.0),
        BenchResult("fsdp-torch-muon", 2, 80.0, 180.0, None, 3 * 2**20, 2**21, 4.0),
        BenchResult("fsdp-dmuon", 2, 20.0, 110.0, 1234 * 2**20, 3 * 2**20, 3 * 2**19, 4.0),  # the optimizer: 1,234 MiB
    ]
    table = format_table(results, verbose=True)
    rows = [line for line in table.splitlines() if line.startswith("fsdp-dmuon")]
    assert "1.10" in rows[0] and "+10.0%" in rows[0] and "0.25" in rows[0] and "1.50" in rows[0]
    assert "1,234" in rows[1] and "3.00" in rows[1]  # --verbose: the optimizer's bytes and the training's
    vanilla = next(line for line in table.splitlines() if line.startswith("fsdp-torch-muon") and "3.00" in line)
    assert vanilla.split()[1] == "-"  # its DTensor traffic is not counted
    assert "  fsdp-dmuon         step 1.10x AdamW (+10%); 0.61x vanilla Muon (-39%)" in table


def test_tiny_run_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--max-seconds", "0",
                 "--configs", "fsdp-adamw,fsdp-dmuon,ownerz2-dmuon", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["config"] for r in records] == ["fsdp-adamw", "fsdp-dmuon", "ownerz2-dmuon"]
    # the optimizer's own collectives: none for AdamW; dmuon's exchange; the owner mode's agreement flags only
    assert records[0]["opt_bytes_per_step"] == 0 and records[1]["opt_bytes_per_step"] > 10_000
    assert 0 < records[2]["opt_bytes_per_step"] < 100
    # the training traffic, one accounting for all: at 2 ranks FSDP2 sends half of (the root's
    # parameters + twice the layers' + every gradient); owner Z2 moves the Muon matrices by a
    # broadcast and a reduce (half of each at 2 ranks) instead of the layers' gathers and reduce-scatter
    model = Llama(get_config("tiny"))
    total = 4 * sum(p.numel() for p in model.parameters())
    layers = 4 * sum(p.numel() for p in model.layers.parameters())
    muon = 4 * sum(m * n for _, m, n in matrix_shapes(get_config("tiny")))
    fsdp = 0.5 * ((total - layers) + 2 * layers + total)
    assert records[0]["train_bytes_per_step"] == records[1]["train_bytes_per_step"] == pytest.approx(fsdp)
    assert records[2]["train_bytes_per_step"] == pytest.approx(fsdp - 0.5 * 3 * muon + 0.5 * 2 * muon)
    assert all(r["world_size"] == 2 and r["step_ms"] > 0 and r["peak_mem_bytes"] > 0 for r in records)
    assert set(records[0]) == {"config", "world_size", "opt_step_ms", "step_ms", "opt_bytes_per_step",
                               "train_bytes_per_step",
                               "peak_mem_bytes", "final_loss", "state_bytes", "muon_state_bytes",
                               # added: per-round times, ratios with their range, the run's load and warnings
                               "round_opt_step_ms", "round_step_ms", "opt_step_vs_vanilla",
                               "opt_step_vs_vanilla_min", "opt_step_vs_vanilla_max", "step_vs_adamw",
                               "step_vs_adamw_min", "step_vs_adamw_max", "mem_vs_adamw", "other_jobs_cores",
                               "warnings", "trustworthy",
                               # added: the 95 % intervals' relative half-widths
                               "opt_step_vs_vanilla_halfwidth", "step_vs_adamw_halfwidth",
                               "opt_step_efficiency_halfwidth",
                               # added: the step against vanilla Muon's
                               "step_vs_vanilla", "step_vs_vanilla_min", "step_vs_vanilla_max",
                               "step_vs_vanilla_halfwidth",
                               # added: the busiest rank's Newton–Schulz alone per round, over the opt step
                               "round_ns_alone_ms", "opt_step_efficiency", "opt_step_efficiency_min",
                               "opt_step_efficiency_max",
                               # added: the optimizer step against each peer's (--peers), by peer
                               "opt_step_vs_peer"}
    assert records[0]["opt_step_efficiency"] is None and records[0]["round_ns_alone_ms"] == []
    assert all(r["opt_step_efficiency"] > 0 and len(r["round_ns_alone_ms"]) == 1 for r in records[1:])
    # one measured step is one round: no spread to judge the ratios by, and the run says so
    assert not records[0]["trustworthy"] and any("only one round" in w for w in records[0]["warnings"])


@pytest.mark.parametrize("cpu_bf16,ratio", [("emulated", 0.5), ("native", 2 / 3)])
def test_bf16_wire_configuration_sends_fewer_bytes_than_the_exact_one(tmp_path, monkeypatch, cpu_bf16, ratio):
    """fp32 parameters at 2 FSDP2 ranks: the exact wire sends gradients in fp32 and the updates
    back in Newton–Schulz's dtype (fp32 where bf16 is emulated, bf16 where native: 4 + 2 bytes an
    element against bf16's 2 + 2)."""
    monkeypatch.setenv("DMUON_CPU_BF16", cpu_bf16)
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--memory-steps", "0",
                 "--max-seconds", "0", "--configs", "fsdp-dmuon,fsdp-dmuon-bf16wire", "--json", str(out)]) == 0
    exact, bf16 = json.loads(out.read_text())
    assert bf16["config"] == "fsdp-dmuon-bf16wire"
    # plus the agreement's few bytes
    assert bf16["opt_bytes_per_step"] / exact["opt_bytes_per_step"] == pytest.approx(ratio, rel=0.05)


def test_aol_configuration_runs_four_newton_schulz_steps_beside_polar_express(tmp_path):
    """``fsdp-dmuon-aol`` beside ``fsdp-dmuon`` in one run, each with its own optimizer-step time."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--memory-steps", "0",
                 "--max-seconds", "0", "--configs", "fsdp-dmuon,fsdp-dmuon-aol", "--json", str(out)]) == 0
    polar, aol = json.loads(out.read_text())
    assert (polar["config"], aol["config"]) == ("fsdp-dmuon", "fsdp-dmuon-aol")
    assert polar["opt_step_ms"] > 0 and aol["opt_step_ms"] > 0


def test_throughput_tables_run_on_cpu():
    import torch

    from dmuon.ns_defaults import default_dtype
    from dmuon.tools.throughput import ns_throughput, rank_share, symmetric_products_timing

    cpu = torch.device("cpu")
    rows = ns_throughput(cpu, [(16, 64)], batch=2, peak=1e9, repeats=1)
    standard = str(default_dtype("cpu", "standard")).removeprefix("torch.")  # the processor's default
    assert [(r.method, r.dtype) for r in rows] == [("standard", standard), ("gram", "float32")]
    assert all(r.ms > 0 and r.tflops > 0 and r.fraction_of_peak > 0 for r in rows)
    share = rank_share("tiny", 4, cpu, peak=1e9, repeats=1)
    # 14 matrices over 4 ranks: rank 0 gets a share (how many depends on the default dtype's method)
    assert 0 < share.matrices < 14 and share.ms > 0 and share.lower_bound_ms > 0
    assert share.adamw_ms > 0
    assert symmetric_products_timing(cpu) == []  # no Triton on a CPU without its interpreter


def test_ns_accuracy_check_runs_on_cpu(capsys):
    """The GPU check's correctness table (benchmarks/gpu_check.sh), on CPU in fp32 on small shapes."""
    import torch

    from dmuon.tools.ns_accuracy import accuracy_table
    from dmuon.tools.ns_accuracy import main as ns_accuracy

    rows = accuracy_table(torch.device("cpu"), torch.float32, shapes=[(32, 96), (96, 32)])
    assert [(shape, kind, method) for shape, kind, method, _ in rows][:4] == [
        ((32, 96), "gaussian", "standard"), ((32, 96), "gaussian", "gram"),
        ((32, 96), "gradient-like", "standard"), ((32, 96), "gradient-like", "gram")]
    assert len(rows) == 8 and all(err < 1e-3 for *_, err in rows)  # fp32 against the exact polynomial
    assert ns_accuracy(["--device", "cpu", "--dtype", "float32", "--shapes", "32x96,48x48"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("PASS")
    assert ns_accuracy(["--device", "cpu", "--dtype", "float32", "--shapes", "32x96", "--bound", "0"]) == 1


def test_ns_accuracy_polar_error_table(tmp_path):
    """``--polar-error``: every recipe's FLOPs and polar error per kind of matrix; AOL at 4 steps
    costs 4/5 of Polar Express at 5 and errs less than Polar Express at 4 on Gaussian matrices."""
    import json

    from dmuon.tools.ns_accuracy import main as ns_accuracy

    out = tmp_path / "polar.json"
    assert ns_accuracy(["--polar-error", "--device", "cpu", "--dtype", "float32", "--shapes", "64x192,96x96",
                        "--no-gradients", "--json", str(out)]) == 0
    rows = {(r["recipe"], r["steps"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("polar_express", 5), ("polar_express", 4), ("aol", 4), ("keller", 5), ("deepseek_v4", 10)}
    assert rows["aol", 4]["flops"] == rows["polar_express", 4]["flops"] == 0.8 * rows["polar_express", 5]["flops"]
    assert rows["aol", 4]["mean"]["gaussian"] < rows["polar_express", 4]["mean"]["gaussian"]
    assert set(rows["aol", 4]["mean"]) == {"gaussian", "ill-conditioned"}


def test_training_traffic_by_the_ring_costs():
    # 4 ranks: 3/4 of the bytes per gather, reduce-scatter, broadcast or reduce; 6/4 per all-reduce
    assert training_traffic("ddp", 4, root_bytes=100, layer_bytes=300, owned_bytes=0) == 1.5 * 400
    assert training_traffic("fsdp", 4, 100, 300, 0) == 0.75 * ((100 + 600) + 400)
    # Z2: the owned 200 bytes broadcast once and reduced once; Z3 broadcasts them twice
    assert training_traffic("ownerz2", 4, 100, 300, 200) == 0.75 * ((100 + 200) + 200) + 0.75 * 400
    assert training_traffic("ownerz3", 4, 100, 300, 200) == 0.75 * ((100 + 200) + 200) + 0.75 * 600
    assert training_traffic("ddp", 1, 100, 300, 0) == 0
    # FSDP2 over 2 data-parallel ranks of each rank's tensor-parallel half of the layers
    assert training_traffic("fsdptp", 4, 100, 300, 0) == training_traffic("fsdp", 2, 100, 150, 0)


def test_the_default_configurations_depend_on_the_device(monkeypatch):
    """On CPU the verdict's six (more could not settle in four minutes on two cores); on CUDA also
    early start off (on by default there) and owner sharding; --configs always wins. The precision
    too: fp32 on CPU, bf16 autocast on CUDA."""
    import argparse

    import torch

    from dmuon.tools import bench

    def parsed(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        args = parser.parse_args(list(argv))
        bench.check_arguments(args)
        return args

    assert parsed().configs == list(bench.CONFIGS) == ["ddp-adamw", "ddp-torch-muon", "fsdp-adamw",
                                                       "fsdp-torch-muon", "ddp-dmuon", "fsdp-dmuon"]
    assert parsed().precision == "fp32"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parsed("--device", "cuda").configs == [*bench.CONFIGS, "ddp-dmuon-atstep", "fsdp-dmuon-atstep",
                                                              "ownerz2-dmuon", "ownerz2-dmuon-atstep"]
    # on GPUs the model trains as GPU jobs do, in bf16 autocast, unless asked otherwise
    assert parsed("--device", "cuda").precision == "bf16-autocast"
    assert parsed("--device", "cuda", "--precision", "fp32").precision == "fp32"
    assert parsed("--device", "cuda", "--configs", "fsdp-adamw,fsdp-dmuon-early").configs == [
        "fsdp-adamw", "fsdp-dmuon-early"]
    # --layout fsdp-tp: FSDP2 and FSDP2 x TP, each with AdamW and vanilla Muon, on an even world size
    assert parsed("--layout", "fsdp-tp", "--world-size", "4").configs == list(bench.FSDP_TP_CONFIGS) == [
        "fsdp-adamw", "fsdp-torch-muon", "fsdp-dmuon", "fsdptp-adamw", "fsdptp-torch-muon", "fsdptp-dmuon"]
    with pytest.raises(bench.UsageError, match="invalid value 3: FSDP2 x tensor parallel"):
        parsed("--layout", "fsdp-tp", "--world-size", "3")


def test_small_momentum_configurations_count_their_state(tmp_path):
    """``-bf16mom`` and ``-int8mom`` beside ``fsdp-dmuon``: the state column counts each rank's
    optimizer state, and Muon's part of it is half in bf16 and near a quarter in 8-bit blocks."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--memory-steps", "0",
                 "--max-seconds", "0", "--configs", "fsdp-dmuon,fsdp-dmuon-bf16mom,fsdp-dmuon-int8mom",
                 "--json", str(out)]) == 0
    fp32, bf16, int8 = json.loads(out.read_text())
    assert fp32["muon_state_bytes"] > 0 and fp32["state_bytes"] > fp32["muon_state_bytes"]  # AdamW's part too
    assert bf16["muon_state_bytes"] * 2 == fp32["muon_state_bytes"]
    # 1 byte and a 4-byte scale per block where fp32 takes 4 per weight; the tiny model's rows are
    # shorter than a block of 128, so it keeps more scales than a real model's
    assert 0.25 < int8["muon_state_bytes"] / fp32["muon_state_bytes"] < 0.3
    assert fp32["state_bytes"] - fp32["muon_state_bytes"] == int8["state_bytes"] - int8["muon_state_bytes"]


def test_the_fsdp_tp_layout_runs_beside_fsdp2_at_fsdp2s_bytes(tmp_path):
    """dmuon under FSDP2 × TP on a (2, 2) mesh beside FSDP2 at 4 ranks, in one run: its optimizer
    sends the same bytes in both (FSDP2's bound: the piece exchange moves each rank's pieces out
    and back, as the row exchange its rows). ``--layout fsdp-tp``'s configurations:
    test_the_default_configurations_depend_on_the_device."""
    out = tmp_path / "bench.json"
    # a step of warm-up: the piece exchange's first step also exchanges the ranks' index lists, once
    assert main(["bench", "--configs", "fsdp-dmuon,fsdptp-dmuon", "--world-size", "4", "--preset", "tiny",
                 "--steps", "1", "--warmup", "1", "--memory-steps", "0", "--max-seconds", "0", "--json", str(out)]) == 0
    records = {r["config"]: r for r in json.loads(out.read_text())}
    fsdp, fsdp_tp = records["fsdp-dmuon"]["opt_bytes_per_step"], records["fsdptp-dmuon"]["opt_bytes_per_step"]
    assert fsdp_tp == pytest.approx(fsdp, rel=0.01)  # the agreement's header bytes aside
    assert records["fsdptp-dmuon"]["opt_step_ms"] > 0


def test_the_qk_clip_configuration_steps_beside_dmuon(tmp_path):
    """``fsdp-dmuon-qkclip``: dmuon with a QKClip recording every forward's max logits, beside
    dmuon without it in one run (its share of the step, BENCHMARKS.md "What QK-clip costs the step")."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--memory-steps", "0",
                 "--max-seconds", "0", "--configs", "fsdp-dmuon,fsdp-dmuon-qkclip", "--json", str(out)]) == 0
    records = {r["config"]: r for r in json.loads(out.read_text())}
    assert records["fsdp-dmuon-qkclip"]["step_ms"] > 0 and records["fsdp-dmuon"]["step_ms"] > 0
