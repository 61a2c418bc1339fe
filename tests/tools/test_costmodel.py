"""Cost model, simulator and ``dmuon plan``: the pure parts (profiles, formulas, the plan's own
FLOPs and bytes, bounds, scaling, config.json parsing, speed at 4096 ranks), and the validation
against ``dmuon bench`` on this machine at world sizes 2 and 4."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dmuon.orthogonalization import newton_schulz_flops, resolve_config
from dmuon.tools.cli import main
from dmuon.tools.costmodel import (
    Workload,
    build_plan,
    config_from_hf,
    data_parallel_collectives,
    forward_backward_flops,
    load_model_config,
    measured_mfu,
    memory_seconds,
    muon_params,
    muon_units,
    normalize_bytes,
    ns_seconds,
    stage_plan,
)
from dmuon.tools.hardware import (
    PROFILES,
    OtherJobsCpu,
    get_profile,
    measure_cpu_profile,
    measure_one_rank_seconds,
)
from dmuon.tools.models import get_config, matrix_shapes, param_count
from dmuon.tools.simulate import (
    after_backward_seconds,
    bucket_costs,
    measured_elementwise_efficiency,
    predict,
    simulate_optimizer_step,
    stage_costs,
    total_traffic,
)

H100 = PROFILES["h100"]


def workload(model: str = "llama-3.1-8b", world: int = 8, mode: str = "fsdp2", profile=H100, **kw) -> Workload:
    layers = kw.pop("layers", None)
    return Workload(load_model_config(model, layers), world, mode, profile, **kw)


# ---------------------------------------------------------------------------- profiles


def test_gpu_profiles_are_sane():
    for name, p in PROFILES.items():
        assert p.device_type == "cuda" and p.ranks_per_node == 8 and p.mfu == 0.4, name
        assert p.bf16_flops == p.fp16_flops > 10 * p.fp32_flops > 0, name
        assert p.memory_bandwidth > 1e12 and p.intra_bandwidth > 3 * p.inter_bandwidth > 0, name
        assert 0 < p.intra_latency <= p.inter_latency < 1e-3 and 0 < p.matmul_efficiency <= 1, name
        assert p.share(8) == 1.0 and p.comm_overlaps_compute, name
    assert PROFILES["h200"].bf16_flops == 790e12  # measured (docs/hardware.md §GPU profiles), not the datasheet
    assert PROFILES["b200"].bf16_flops > PROFILES["h100"].bf16_flops > PROFILES["a800"].bf16_flops
    with pytest.raises(ValueError, match="unknown hardware"):
        get_profile("tpu")


def test_cpu_profile_is_measured_and_cached():
    profile = measure_cpu_profile(1)
    assert profile is get_profile("cpu") is get_profile("cpu", 1)  # cached within the process
    assert profile.threads == 1 and profile.cores >= 1 and profile.busy_cores >= 0
    assert profile.device_type == "cpu" and profile.train_dtype == torch.float32 and profile.mfu is None
    # bf16 only > 1e7: CPUs without native bf16 products emulate them (1.9 GFLOP/s on an AVX2 EPYC)
    assert profile.bf16_flops > 1e7 and profile.fp32_flops > 1e9 and profile.memory_bandwidth > 1e9
    assert profile.intra_bandwidth > 1e7 and profile.intra_latency >= 0 and not profile.comm_overlaps_compute
    assert [count for count, _ in profile.parallel_efficiency] == sorted({profile.cores, 2 * profile.cores})
    assert all(0 < e <= 1 for _, e in profile.parallel_efficiency) and profile.efficiency_of(1) == 1.0
    # the non-finite check is measured on CPU (compute-bound there), memory-bound on GPUs
    assert profile.check_rate > 1e7 and all(p.check_rate is None for p in PROFILES.values())
    crowded = dataclasses.replace(profile, cores=2, busy_cores=0.0, parallel_efficiency=((2, 0.9), (4, 0.8)))
    assert crowded.share(1) == 1.0 and crowded.share(2) == pytest.approx(crowded.share(3) * 3 / 2) == 0.9
    assert crowded.share(4) == pytest.approx(crowded.share(6) * 6 / 4) == 0.5 * 0.8


# ---------------------------------------------------------------------------- formulas


def test_ns_flops_per_rank_sum_to_the_model_total_with_dmuons_recipe(monkeypatch):
    import dmuon.ns_defaults as ns_defaults

    monkeypatch.setattr(ns_defaults, "native_bf16", lambda device_type: True)  # a CPU with AVX512-BF16 or AMX
    for profile, expect in ((H100, {"gram": torch.float16, "standard": torch.float16}),
                            (dataclasses.replace(H100, device_type="cpu"), {"standard": torch.bfloat16})):
        w = workload(world=16, profile=profile)
        plan, configs = build_plan(w)
        total = 0
        for (_, m, n), config in zip(matrix_shapes(w.config), configs):
            assert config == resolve_config((m, n), profile.device_type)
            assert expect[config.method] == config.dtype
            assert config.method == ("gram" if profile.device_type == "cuda" and max(m, n) >= 2 * min(m, n)
                                     else "standard")
            total += newton_schulz_flops(m, n, steps=5, method=config.method, restarts=config.restarts)
        assert sum(plan.flops(p) for p in range(16)) == total
        assert predict(w).ns_gflop_total == pytest.approx(total / 1e9)


@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_simulated_bytes_are_the_plans(mode, world):
    w = workload("qwen2.5-1.5b", world, mode, layers=3)
    plan, configs = build_plan(w)
    traffic = total_traffic(bucket_costs(plan, configs, w), world)
    assert (traffic.intra_out + traffic.inter_out).tolist() == [plan.bytes_sent(p) for p in range(world)]
    assert (traffic.intra_in + traffic.inter_in).tolist() == [plan.bytes_received(p) for p in range(world)]
    if mode == "fsdp2" and world in (2, 4, 8):  # rows divide evenly: the closed form
        # fp32 gradients to the owners, the fp16 updates back (Newton–Schulz's dtype on GPUs)
        expected = (world - 1) / world**2 * muon_params(w.config) * (4 + 2)
        assert sum(plan.bytes_sent(p) for p in range(world)) / world == pytest.approx(expected)


def test_inter_node_bytes_only_cross_nodes():
    w = workload(world=16)  # two nodes of 8
    plan, configs = build_plan(w)
    traffic = total_traffic(bucket_costs(plan, configs, w), 16)
    assert traffic.inter_out.sum() == traffic.inter_in.sum() > 0
    single = total_traffic(bucket_costs(*build_plan(workload(world=8)), workload(world=8)), 8)
    assert single.inter_out.sum() == 0


def test_step_formulas():
    config = get_config("llama-3.1-8b")
    in_products = muon_params(config) + config.vocab_size * config.dim
    assert forward_backward_flops(config, 1000, 4096) == 1000 * (6 * in_products + 12 * 32 * 32 * 128 * 4096)
    w = workload(world=64, mode="ddp")
    buckets = -(-param_count(config) * 4 // (25 * 2**20))
    assert data_parallel_collectives(w) == [("all_reduce", 2 * 63 / 64 * param_count(config) * 4, buckets)]
    fsdp = dict((k, b) for k, b, _ in data_parallel_collectives(workload(world=64)))
    total = param_count(config)
    assert fsdp == {"all_gather": 2 * 63 / 64 * total * 2, "reduce_scatter": 63 / 64 * total * 4}
    owner = data_parallel_collectives(workload(world=64, mode="owner"))
    muon_bytes = sum(b for k, b, calls in owner if calls == len(matrix_shapes(config)))
    assert muon_bytes == pytest.approx(63 / 64 * muon_params(config) * (2 + 4))  # 2(N−1)/N·P at 3 bytes a weight


def test_owner_mode_moves_nothing_in_the_optimizer():
    p = predict(workload(world=64, mode="owner"))
    assert p.mb_sent_per_rank == (0.0, 0.0, 0.0)
    assert p.dmuon_opt_ms < predict(workload(world=64)).dmuon_opt_ms


def test_momentum_dtype_and_normuon_in_the_state_and_the_bytes():
    """bf16 momentum halves the Muon part of dmuon's state, 8-bit blocks keep 1 + 4/128 bytes per
    weight; NorMuon adds 4 bytes per row of state, and one ring all-reduce of it per step."""
    base = predict(workload(world=64))
    adamw_part = base.dmuon_state_gb - 4 * muon_params(load_model_config("llama-3.1-8b")) / 64 / 2**30
    for dtype, per_weight in (("bfloat16", 2), ("int8", 1 + 4 / 128)):
        p = predict(workload(world=64, momentum_dtype=dtype))
        assert p.dmuon_state_gb - adamw_part == pytest.approx((base.dmuon_state_gb - adamw_part) * per_weight / 4)
    rows = sum(count * m for _, count, m, _ in muon_units(load_model_config("llama-3.1-8b")))
    normuon = predict(workload(world=64, update_rule="normuon"))
    assert (normuon.dmuon_state_gb - base.dmuon_state_gb) * 2**30 == pytest.approx(4 * rows)
    sent = [(a - b) * 2**20 for a, b in zip(normuon.mb_sent_per_rank, base.mb_sent_per_rank)]
    assert sent == pytest.approx([2 * 63 / 64 * 4 * rows] * 3)
    with pytest.raises(ValueError, match="Invalid momentum_dtype='float16'"):
        workload(momentum_dtype="float16")


def test_elementwise_efficiency_scales_only_the_elementwise_phases():
    cpu = dataclasses.replace(H100, name="cpu", device_type="cpu", comm_overlaps_compute=False)
    w = workload("bench", 1, "ddp", cpu, layers=2, tokens_per_rank=64, seq_len=64)
    stage = stage_plan(w)
    full = simulate_optimizer_step(stage, w).max().item()
    products = sum(ns_seconds(u.flops, c, w) for u, c in zip(stage.units, stage.configs))
    halved = dataclasses.replace(w, elementwise_efficiency=0.5)
    assert simulate_optimizer_step(stage, halved).max().item() == pytest.approx(2 * full - products)
    # measured: the step's element-wise part took twice what the full rates give → 0.5
    normalize = sum(memory_seconds(u.m * u.n * normalize_bytes(c.dtype), w) for u, c in zip(stage.units, stage.configs))
    elementwise = full - products - normalize
    assert measured_elementwise_efficiency(w, products + normalize + 2 * elementwise, products + normalize) == \
        pytest.approx(0.5)
    assert measured_elementwise_efficiency(w, 1.0, 1.0) == 1.0  # nothing beyond NS: no evidence of a shortfall
    assert measured_elementwise_efficiency(w, products + normalize + elementwise / 2, products + normalize) == 1.0
    with pytest.raises(ValueError, match="elementwise_efficiency=0"):
        dataclasses.replace(w, elementwise_efficiency=0)


# ---------------------------------------------------------------------------- simulator


@pytest.mark.parametrize("model,world,mode,hardware", [
    ("qwen2.5-1.5b", 8, "fsdp2", "a800"), ("llama-3.1-8b", 8, "ddp", "h100"), ("llama-3.1-8b", 64, "fsdp2", "h100"),
    ("llama-3.1-8b", 512, "owner", "b200"), ("qwen2.5-7b", 32, "fsdp2", "h200"), ("bench", 3, "ddp", "a100"),
])
def test_simulator_never_beats_the_lower_bound(model, world, mode, hardware):
    p = predict(workload(model, world, mode, get_profile(hardware)))
    assert p.lower_bound_opt_ms <= p.dmuon_opt_ms
    assert p.dmuon_step_ms >= p.adamw_step_ms - p.adamw_opt_ms + p.dmuon_opt_ms - 1e-9 or mode == "owner"


@pytest.mark.parametrize("world", [8, 64])
def test_early_start_hides_at_most_the_idle_backward_time_and_never_the_last_bucket(world):
    from dmuon.tools.simulate import BACKWARD_SHARE

    w = workload("llama-3.1-8b", world)
    p = predict(w)
    backward_ms = BACKWARD_SHARE * p.forward_backward_ms
    assert 0 < p.early_start_hidden_ms <= H100.backward_idle_fraction * backward_ms + 1e-9
    # what follows the backward pass: at least the last bucket's step alone, more than an even
    # share of the step (its exchange waits on every rank's slowest link)
    early = dataclasses.replace(w, split=False, ready_order=True)
    stage = stage_plan(early)
    costs = stage_costs(stage, early)
    after = after_backward_seconds(stage, early, costs) * 1e3
    last_alone = simulate_optimizer_step(stage, early, costs[-1:]).max().item() * 1e3
    assert len(costs) > 1 and p.dmuon_early_opt_ms >= after >= last_alone > (p.dmuon_early_opt_ms +
                                                                             p.early_start_hidden_ms) / len(costs)
    # early start's own plan (whole matrices, buckets in the backward order) with what it hides
    assert p.dmuon_early_step_ms == pytest.approx(p.dmuon_step_ms - p.dmuon_opt_ms + p.dmuon_early_opt_ms)
    assert p.early_overhead_vs_adamw < p.overhead_vs_adamw
    # DDP with dmuon's comm hook runs it too; at 64 ranks its plan (fewer, whole-matrix buckets in
    # the backward order) overlaps DDP's large update returns worse than the step's own plan
    ddp = predict(dataclasses.replace(w, mode="ddp"))
    assert 0 < ddp.early_start_hidden_ms <= H100.backward_idle_fraction * backward_ms + 1e-9
    assert (ddp.early_overhead_vs_adamw < ddp.overhead_vs_adamw) == (world == 8)
    owner = predict(dataclasses.replace(w, mode="owner"))  # after each layer's reduce onto the owner
    assert 0 < owner.early_start_hidden_ms and owner.early_overhead_vs_adamw < owner.overhead_vs_adamw
    # a CPU does not run early start, where the hooks share the cores
    cpu = predict(dataclasses.replace(w, profile=dataclasses.replace(H100, backward_idle_fraction=0.0)))
    assert cpu.early_start_hidden_ms == 0 and cpu.dmuon_early_step_ms == pytest.approx(cpu.dmuon_step_ms)


def test_no_overlap_hardware_adds_communication():
    overlapped = workload("qwen2.5-1.5b", 8, layers=4)
    serial = dataclasses.replace(overlapped, profile=dataclasses.replace(H100, comm_overlaps_compute=False))
    assert predict(serial).dmuon_opt_ms > predict(overlapped).dmuon_opt_ms
    assert predict(serial).lower_bound_opt_ms > predict(overlapped).lower_bound_opt_ms


def test_more_ranks_less_ns_per_rank_down_to_the_largest_matrix():
    largest = max(newton_schulz_flops(m, n, steps=5, method=c.method, restarts=c.restarts) / 1e9
                  for (_, m, n), c in zip(matrix_shapes(get_config("llama-3.1-8b")), build_plan(workload())[1]))
    busiest = [predict(workload(world=n, split=False)).ns_gflop_per_rank[2] for n in (1, 2, 8, 32, 128, 256, 1024)]
    assert all(a > b for a, b in zip(busiest[:4], busiest[1:5]))  # 224 matrices: splits down to 128
    assert busiest[4] > largest  # some of 128 ranks own two matrices
    assert busiest[5] == busiest[6] == pytest.approx(largest)  # one matrix a rank at most: the floor
    # ... unless matrices may be split over gangs of ranks (dmuon's default)
    split = predict(workload(world=1024))
    assert split.split_matrices == 224 and split.gang_size >= 2 and split.ns_gflop_per_rank[2] < largest
    # it pays at 512 ranks (gangs of 2); from 1024 on the planner's byte price (DEFAULT_FLOPS_PER_BYTE,
    # a CPU's ratio) makes it split where the simulator, with updates back in fp16, finds whole
    # matrices 5-11 % faster (BENCHMARKS.md, "Updates back in Newton–Schulz's dtype")
    assert predict(workload(world=512)).dmuon_opt_ms < predict(workload(world=512, split=False)).dmuon_opt_ms


def test_simulation_is_deterministic():
    w = workload("qwen2.5-1.5b", 24, layers=6)
    stage = stage_plan(w)
    assert torch.equal(simulate_optimizer_step(stage, w), simulate_optimizer_step(stage, w))
    assert predict(w) == predict(w)


def test_70b_at_4096_ranks():  # how long the prediction takes is a benchmark's business, not a test's
    p = predict(workload("llama-3.1-70b", 4096))
    assert p.buckets > 0 and p.imbalance > 1 and p.lower_bound_opt_ms <= p.dmuon_opt_ms


# ---------------------------------------------------------------------------- models and CLI


HF_LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
}


def test_config_json_parsing(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_LLAMA_8B))
    assert load_model_config(str(path)) == get_config("llama-3.1-8b")
    assert load_model_config(str(path), layers=2).n_layers == 2
    minimal = config_from_hf({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "vocab_size": 100, "head_dim": 32})
    assert (minimal.n_kv_heads, minimal.head_dim, minimal.tie_embeddings) == (4, 32, False)
    assert config_from_hf({**HF_LLAMA_8B, "head_dim": None}).head_dim == 128
    with pytest.raises(ValueError, match="intermediate_size"):
        config_from_hf({k: v for k, v in HF_LLAMA_8B.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="neither a model preset"):
        load_model_config("no-such-model")


def test_plan_command(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "qwen2.5-1.5b", "--world-size", "4", "--hardware", "a800", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "   3  " in text and "imbalance" in text and "dmuon (fsdp2)" in text and "vanilla Muon" in text
    record = json.loads(out.read_text())
    assert record["world_size"] == 4 and record["dmuon_step_ms"] > 0
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_LLAMA_8B))
    assert main(["plan", "--model", str(config), "--world-size", "512", "--mode", "owner",
                 "--tokens-per-step", str(512 * 4096)]) == 0
    text = capsys.readouterr().out
    assert "owner" in text and "median" in text and "rank  matrices" not in text
    # more ranks than matrices: the planner splits, and the table compares with whole matrices
    assert main(["plan", "--model", "llama-3.1-8b", "--world-size", "512"]) == 0
    text = capsys.readouterr().out
    assert "splits 224 matrices over gangs of 2 ranks" in text and "dmuon, matrices whole" in text
    assert main(["plan", "--model", "llama-3.1-8b", "--world-size", "512", "--no-split"]) == 0
    text = capsys.readouterr().out
    assert "splits" not in text and "matrices whole" not in text
    # early start predicted slower (DDP at 64): the table says what to do
    assert main(["plan", "--model", "llama-3.1-8b", "--world-size", "64", "--mode", "ddp"]) == 0
    assert "early start is predicted slower here" in capsys.readouterr().out
    assert main(["plan", "--model", "llama-3.1-8b", "--world-size", "8", "--mode", "ddp"]) == 0
    assert "early start is predicted slower" not in capsys.readouterr().out
    # cpu: the MFU and the element-wise efficiency are measured on one rank, now
    assert main(["plan", "--model", "bench", "--layers", "1", "--world-size", "2", "--hardware", "cpu",
                 "--tokens-per-step", "128", "--seq-len", "64", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert 0 < record["mfu"] <= 1 and 0 < record["elementwise_efficiency"] <= 1 and record["dmuon_opt_ms"] > 0
    assert "element-wise phases at" in capsys.readouterr().out


# ---------------------------------------------------------------------------- validation

# Above this share of the machine taken by other jobs during a run, the ranks' share of it
# swings too much within the run for its timings to test the model: the test skips (and says so).
BUSY_LIMIT = 0.1


@pytest.mark.slow  # ~1 minute of benchmarks, and timing-sensitive: run with `python -m pytest -m slow`
def test_cpu_predictions_match_bench_at_2_and_4_ranks(tmp_path):
    """The simulator, fed the measured CPU profile, predicts ``dmuon bench``'s optimizer-step and
    step times within ±25 % (bench preset at 2 layers, one 64-token sequence per rank), and with
    early start (``fsdp-dmuon-early``) its step time: no gain on CPU, where the model gives the
    backward pass no idle time to fill.

    Inputs measured here and nowhere fitted: the CPU profile (product, memory and gloo rates of
    one rank alone), one rank alone training the model (the MFU of its forward+backward, the
    element-wise efficiency of its optimizer step), and the CPU other jobs took during each
    bench run's steps (this machine is shared; the ranks get what is left).
    """
    config, batch, seq, steps = get_config("bench", n_layers=2), 1, 64, 8
    with OtherJobsCpu() as others:
        profile = measure_cpu_profile.__wrapped__(1)  # fresh: the machine as it is now
        alone = measure_one_rank_seconds(config, batch, seq)
    mfu = measured_mfu(config, batch * seq, seq, alone.forward_backward, profile)
    efficiency = measured_elementwise_efficiency(Workload(config, 1, "ddp", profile, batch * seq, seq, mfu),
                                                 alone.optimizer_step, alone.newton_schulz)
    rows, errors = [f"profile: {profile}", f"one rank alone: {alone}; forward+backward MFU {mfu:.3f}, "
                    f"element-wise efficiency {efficiency:.3f}"], []
    if others.cores_used > BUSY_LIMIT * profile.cores:
        pytest.skip(f"other jobs took {others.cores_used:.2f} cores while the profile was measured")
    for world in (2, 4):
        for name, mode in (("fsdp-dmuon", "fsdp2"), ("ddp-dmuon", "ddp"), ("fsdp-dmuon-early", "fsdp2")):
            path = tmp_path / f"{name}-{world}.json"
            with OtherJobsCpu() as others:
                main(["bench", "--preset", "bench", "--layers", "2", "--world-size", str(world),
                      "--batch-size", str(batch), "--seq-len", str(seq), "--steps", str(steps), "--warmup", "1",
                      "--max-seconds", "0", "--configs", name, "--json", str(path)])
            measured = json.loads(path.read_text())[0]
            # the steps run last, after the ranks start: the load that matters is the run's tail
            busy = others.cores_used_in_last((steps + 1) * measured["step_ms"] / 1e3 + 1.0)
            during = dataclasses.replace(profile, busy_cores=busy)
            p = predict(Workload(config, world, mode, during, batch * seq, seq, mfu, efficiency))
            compared = ((("step", p.dmuon_early_step_ms, measured["step_ms"]),) if name.endswith("-early") else
                        (("opt step", p.dmuon_opt_ms, measured["opt_step_ms"]), ("step", p.dmuon_step_ms,
                                                                                   measured["step_ms"])))
            for what, predicted, actual in compared:
                errors.append(predicted / actual - 1)
                rows.append(f"{name} x{world} {what}: predicted {predicted:.0f} ms, measured {actual:.0f} ms "
                            f"({errors[-1]:+.0%}; other jobs {busy:.2f} cores)")
            if busy > BUSY_LIMIT * profile.cores:
                pytest.skip(f"other jobs took more than {BUSY_LIMIT:.0%} of the machine during a run; its "
                            "timings would not test the model:\n" + "\n".join(rows))
    report = "\n".join(rows)
    print(report)
    assert all(abs(e) <= 0.25 for e in errors), report


@pytest.mark.parametrize(("flags", "named"), [
    ([], []),
    (["--tp", "2"], ["tensor parallel"]),
    (["--pp", "2"], ["bubble"]),
    (["--model", "qwen3-30b-a3b", "--tp", "2", "--pp", "2", "--ep", "2"], ["tensor parallel", "all-to-alls", "bubble"]),
])
def test_plan_says_what_it_does_not_model_for_tp_pp_ep(flags, named, tmp_path, capsys):
    out = tmp_path / "plan.json"
    model = [] if "--model" in flags else ["--model", "llama-3.1-8b"]
    assert main(["plan", *model, "--world-size", "16", *flags, "--json", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("not modelled: ")]
    caveats = json.loads(out.read_text())["not_modelled"]
    assert caveats == lines and len(lines) == (1 if named else 0)
    for what in named:
        assert what in lines[0]
    assert all(what not in "".join(lines) for what in {"tensor parallel", "all-to-alls", "bubble"} - set(named))
