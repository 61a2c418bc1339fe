"""The built-in workload (model presets, synthetic data) and the ``dmuon demo`` command."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmuon.tools import cli, demo
from dmuon.tools.models import PRESETS, Llama, SyntheticTokens, get_config, param_count

REPO_ROOT = Path(__file__).resolve().parents[2]


def _tiny_batch(step: int = 0, batch: int = 3, seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return SyntheticTokens(PRESETS["tiny"].vocab_size, seed=0).batch(step, batch, seq_len)


def test_forward_returns_logits_per_position() -> None:
    config = get_config("tiny")
    inputs, _ = _tiny_batch(batch=3, seq_len=16)
    assert Llama(config)(inputs).shape == (3, 16, config.vocab_size)


def test_attention_is_causal() -> None:
    model = Llama(get_config("tiny"))
    inputs, _ = _tiny_batch(batch=2, seq_len=12)
    changed = inputs.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % model.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(inputs)[:, :8], model(changed)[:, :8])


@pytest.mark.parametrize("name", ["tiny", "demo", "bench"])
def test_param_count_formula_matches_module(name: str) -> None:
    config = get_config(name)
    assert param_count(config) == sum(p.numel() for p in Llama(config).parameters())


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "llama-3.1-8b"])
def test_param_count_formula_matches_real_shape_on_meta(name: str) -> None:
    config = get_config(name, n_layers=2)
    with torch.device("meta"):
        model = Llama(config)
    assert param_count(config) == sum(p.numel() for p in model.parameters())


def test_real_presets_have_published_sizes() -> None:
    billions = {name: param_count(PRESETS[name]) / 1e9 for name in ("qwen2.5-7b", "llama-3.1-8b", "llama-3.1-70b")}
    assert billions == pytest.approx({"qwen2.5-7b": 7.62, "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55}, abs=0.01)


def test_tied_embedding_shares_one_tensor() -> None:
    config = get_config("tiny", tie_embeddings=True)
    model = Llama(config)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert param_count(config) == sum(p.numel() for p in model.parameters())
    assert param_count(config) == param_count(get_config("tiny")) - config.vocab_size * config.dim


def test_get_config_overrides_and_rejects_unknown_names() -> None:
    assert get_config("llama-3.1-8b", n_layers=2).n_layers == 2
    assert PRESETS["llama-3.1-8b"].n_layers == 32
    with pytest.raises(ValueError, match="valid names: tiny, demo"):
        get_config("gpt-5")


def test_config_rejects_heads_not_divisible_by_kv_heads() -> None:
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        get_config("tiny", n_heads=3)


def test_init_is_a_function_of_the_seed() -> None:
    config = get_config("tiny")
    first, again, other = Llama(config, seed=0), Llama(config, seed=0), Llama(config, seed=1)
    for a, b in zip(first.parameters(), again.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(first.layers[0].attn.q_proj.weight, other.layers[0].attn.q_proj.weight)


def test_residual_projections_start_smaller() -> None:
    model = Llama(get_config("demo"))
    assert model.layers[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    expected = 0.02 / math.sqrt(2 * model.config.n_layers)
    assert model.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(expected, rel=0.05)


def test_synthetic_batch_is_a_pure_function_of_seed_and_step() -> None:
    data = SyntheticTokens(128, seed=7)
    later_first = data.batch(5, 4, 32)  # drawn before step 2: order must not matter
    early = data.batch(2, 4, 32)
    fresh = SyntheticTokens(128, seed=7)
    for got, want in zip(fresh.batch(5, 4, 32), later_first):
        assert torch.equal(got, want)
    assert torch.equal(fresh.batch(2, 4, 32)[0], early[0])
    assert not torch.equal(early[0], later_first[0])
    assert not torch.equal(SyntheticTokens(128, seed=8).batch(5, 4, 32)[0], later_first[0])


def test_synthetic_targets_are_next_tokens() -> None:
    inputs, targets = SyntheticTokens(128).batch(0, 4, 32)
    assert inputs.shape == targets.shape == (4, 32)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert 0 <= int(inputs.min()) and int(inputs.max()) < 128


def test_rank_chunks_reconstruct_the_global_batch() -> None:
    data = SyntheticTokens(128)
    inputs, targets = data.batch(3, 8, 16)
    chunks = [data.local_batch(3, 8, 16, rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat([c[0] for c in chunks]), inputs)
    assert torch.equal(torch.cat([c[1] for c in chunks]), targets)
    with pytest.raises(ValueError, match="not divisible"):
        data.local_batch(3, 8, 16, 0, 3)


def test_adamw_steps_on_tiny_reduce_the_loss() -> None:
    result = demo.train(
        "adamw", demo.adamw, preset="tiny", steps=40, lr=1e-2, weight_decay=0.0, batch_size=8, seq_len=32, seed=0,
        loss_window=5,
    )
    assert result.final_loss < math.log(PRESETS["tiny"].vocab_size) - 0.5


def test_hidden_matrices_are_the_block_linear_weights() -> None:
    model = Llama(get_config("tiny"))
    matrices = demo.hidden_matrices(model)
    assert len(matrices) == 7 * model.config.n_layers
    assert all(p.ndim == 2 for p in matrices)
    excluded = {id(model.embed_tokens.weight), id(model.lm_head.weight)}
    assert not excluded & {id(p) for p in matrices}


def test_format_table_lists_every_configuration() -> None:
    results = [
        demo.RunResult("adamw", 10, 2.5, 2.0, 20.0),
        demo.RunResult("torch-muon", 10, 2.4, 6.0, 25.0),
        demo.RunResult("dmuon", 10, 2.3, 4.0, 22.0),
    ]
    table = demo.format_table(results)
    lines = table.splitlines()
    assert len(lines) == 2 + len(results)
    for result, line in zip(results, lines[2:]):
        assert line.startswith(result.config)
    assert "3.00" in lines[3] and "1.25" in lines[3]  # torch-muon relative to adamw


def test_cli_demo_runs_every_configuration_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.json"
    threads = str(torch.get_num_threads())  # keep the test process's thread setting
    argv = ["demo", "--steps", "2", "--preset", "tiny", "--batch-size", "2", "--seq-len", "8", "--threads", threads]
    assert cli.main([*argv, "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    records = json.loads(out.read_text())
    assert [r["config"] for r in records] == list(demo.DEFAULT_CONFIGS)
    for record in records:
        assert record["config"] in stdout
        assert record["steps"] == 2
        assert math.isfinite(record["final_loss"]) and record["opt_step_ms"] > 0 and record["step_ms"] > 0
        # each at the lr the migration guide's rule starts from: the Muons at 2x AdamW's
        assert record["lr"] == pytest.approx(3e-3 * (2 if record["config"] in demo.MUON_CONFIGS else 1))
    assert "on the standard library's source" in stdout
    assert stdout.strip().splitlines()[-1].startswith("verdict: dmuon (lr 0.006) ended at loss")


def test_the_verdict_sets_dmuons_loss_and_step_beside_each_other_configuration() -> None:
    results = [demo.RunResult("adamw", 200, 2.4775, 3.5, 42.0, 0.003),
               demo.RunResult("torch-muon", 200, 1.8532, 20.0, 60.0, 0.012),
               demo.RunResult("dmuon", 200, 1.8669, 11.0, 50.4, 0.012)]
    assert demo.verdict(results) == ("verdict: dmuon (lr 0.012) ended at loss 1.8669 after 200 steps: 0.6106 below "
                                      "adamw's (lr 0.003) with a step 1.20x its; 0.0137 above torch-muon's (lr 0.012) "
                                      "with a step 0.84x its.")
    assert demo.verdict(results[:1]) == ""  # nothing to compare


def test_cli_rejects_unknown_configuration() -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--configs", "adamw,sgd"])


def test_python_dash_m_runs_the_demo() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    argv = ["demo", "--steps", "1", "--preset", "tiny", "--configs", "adamw", "--batch-size", "2", "--seq-len", "8"]
    completed = subprocess.run(
        [sys.executable, "-m", "dmuon", *argv], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert "adamw" in completed.stdout
