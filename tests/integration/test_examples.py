"""The example training script (``examples/train_gpt.py``) and its plotting script, run as users
run them: under ``torchrun`` at 2 ranks (FSDP2 with checkpoint and exact resume; owner sharding
against one process) and as a single process; plus the distributed gradient clipping against
``torch.nn.utils.clip_grad_norm_`` on one process, at 2 ranks in every layout.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import dmuon
from dmuon.layout import owned_by
from dmuon.tools.models import Llama, SyntheticTokens, get_config
from tests.harness import run_on_ranks
from tests.helpers import torchrun_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TRAIN = EXAMPLES / "train_gpt.py"


def _load(name: str):
    """An example script as a module (``examples`` is no package); registered in sys.modules so
    that spawned test workers, which import this file again, find it too."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


train_gpt = _load("train_gpt")
plot_losses = _load("plot_losses")

# Small enough that a 2-rank torchrun job takes a few seconds on 2 cores.
RUN = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--grad-accum", "2", "--warmup", "2",
       "--lr", "0.01"]
STEPS = 4


def torchrun(args: list[str], cwd: Path, nproc: int = 2) -> None:
    """Run train_gpt.py under torchrun, as a user would."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    done = subprocess.run([*launcher, str(TRAIN), *args], cwd=cwd, env=torchrun_env(), capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, f"train_gpt.py {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def run_single_process(args: list[str], cwd: Path) -> None:
    """Run train_gpt.py without torchrun, inside this process (it forms a one-rank group of its
    own and destroys it): as ``python train_gpt.py`` does, without starting an interpreter."""
    assert not dist.is_initialized()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the torchrun runs compared with it
    try:
        train_gpt.main([*args, "--log-file", str(cwd / "log.jsonl")])
    finally:
        torch.set_num_threads(threads)


def read_log(path: Path) -> tuple[dict, list[dict]]:
    """(the config line, the step records) of a log."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    configs = [r["config"] for r in records if "config" in r]
    return (configs[0] if configs else {}), [r for r in records if "config" not in r]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> list[dict]:
    """The reference: one process, plain model."""
    tmp = tmp_path_factory.mktemp("single")
    run_single_process([*RUN, "--parallel", "none", "--steps", str(STEPS)], tmp)
    return read_log(tmp / "log.jsonl")[1]


# ------------------------------------------------------------------ the script end to end

def test_fsdp2_checkpoint_resume_continues_exactly(tmp_path):
    """2 ranks, FSDP2: a run resumed from its step-2 checkpoint logs the same losses, lrs,
    gradient norms and update RMS, bit for bit, as the uninterrupted run."""
    common = [*RUN, "--parallel", "fsdp2", "--steps", str(STEPS)]
    torchrun([*common, "--ckpt-dir", "ckpt", "--save-every", "2", "--log-file", "straight.jsonl"], tmp_path)
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == ["step_000002", "step_000004"]
    torchrun([*common, "--resume", "ckpt/step_000002", "--log-file", "resumed.jsonl"], tmp_path)

    config, straight = read_log(tmp_path / "straight.jsonl")
    assert config["world_size"] == 2 and config["parallel"] == "fsdp2"
    _, resumed = read_log(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in straight] == list(range(1, STEPS + 1))
    assert [r["step"] for r in resumed] == list(range(3, STEPS + 1))
    for before, after in zip(straight[2:], resumed):
        for key in ("loss", "lr", "lr/0", "grad_norm", "muon/update_rms/0"):
            assert before[key] == after[key], (before["step"], key, before[key], after[key])
    assert straight[-1]["loss"] < straight[0]["loss"]


def test_owner_sharding_matches_one_process(tmp_path, single_process):
    """2 ranks, owner-sharded, with gradient accumulation and clipping: the losses and gradient
    norms of one process (up to reduction order); the job's statistics count each matrix once."""
    torchrun([*RUN, "--parallel", "owner", "--steps", str(STEPS), "--log-all-ranks", "--log-file", "owner.jsonl"],
             tmp_path)
    _, owner = read_log(tmp_path / "owner.jsonl")
    assert len(owner) == STEPS
    for ours, reference in zip(owner, single_process):
        assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-4)
        assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-3)
        assert ours["lr"] == reference["lr"]
        assert ours["matrices"] == 2 * 7  # q, k, v, o, gate, up, down of 2 blocks, once in the job
        assert ours["owner_bytes_sent"] > 0
        assert ours["muon/update_rms/0"] == pytest.approx(reference["muon/update_rms/0"], rel=1e-2)


def test_single_process_schedule_and_ddp(tmp_path, single_process):
    """Without torchrun: DDP on a one-rank group trains exactly as the plain model; the lr
    follows warm-up then cosine in every dmuon param group (LambdaLR drives dmuon.Muon); the
    loss goes down."""
    run_single_process([*RUN, "--parallel", "ddp", "--steps", str(STEPS)], tmp_path)
    _, ddp = read_log(tmp_path / "log.jsonl")
    assert [r["loss"] for r in ddp] == [r["loss"] for r in single_process]
    for index, record in enumerate(single_process):
        expected = 0.01 * train_gpt.lr_factor(index, warmup=2, total=STEPS)
        assert record["lr"] == record["lr/0"] == pytest.approx(expected)
        assert "lr/1" not in record  # the model is one param group, routed per parameter inside
    assert single_process[-1]["loss"] < single_process[0]["loss"]


# ------------------------------------------------------------------ pieces

def test_lr_factor_warms_up_then_decays():
    factors = [train_gpt.lr_factor(step, warmup=4, total=20) for step in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert factors[20] == pytest.approx(0.1)


def test_byte_tokens(tmp_path):
    """Windows of the file, targets one byte later; a pure function of the step; the ranks'
    shares make up the global batch."""
    text = bytes(range(256)) * 4
    (tmp_path / "data.bin").write_bytes(text)
    data = train_gpt.ByteTokens(tmp_path / "data.bin", seed=3)
    inputs, targets = data.local_batch(7, 4, 16, rank=0, world_size=1)
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal((inputs[:, 1:] - inputs[:, :-1]) % 256, torch.ones(4, 15, dtype=torch.long))
    halves = [data.local_batch(7, 4, 16, rank, 2)[0] for rank in range(2)]
    assert torch.equal(torch.cat(halves), inputs)
    assert not torch.equal(data.local_batch(8, 4, 16, 0, 1)[0], inputs)


MAX_NORM = 0.1  # below the tiny model's gradient norm (about 0.6): the clipping is active
GLOBAL_BATCH, SEQ_LEN = 8, 16


def _full_gradient(p: torch.Tensor) -> torch.Tensor:
    """The whole gradient of ``p`` on every rank (collective)."""
    owned = owned_by(p)
    if owned is not None:
        grad = p.grad if owned.is_mine else torch.empty(p.shape, dtype=p.dtype)
        dist.broadcast(grad, src=owned.owner)
        return grad
    return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad


def clipped_on_ranks(parallel: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Worker: one backward of this rank's share of the batch, then the example's clipping."""
    config = get_config("tiny")
    model, _ = train_gpt.build_model(config, parallel, torch.device("cpu"), replicas=2)
    inputs, targets = SyntheticTokens(config.vocab_size, seed=0).local_batch(
        0, GLOBAL_BATCH, SEQ_LEN, dist.get_rank(), dist.get_world_size())
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    norm = dmuon.clip_grad_norm_(model.parameters(), MAX_NORM)
    grads = {name.removeprefix("module."): _full_gradient(p) for name, p in model.named_parameters()}
    return norm.item(), grads


@pytest.mark.parametrize("parallel", ["owner", "fsdp2", "hsdp", "ddp"])
def test_distributed_clipping_matches_one_process(parallel):
    """Each gradient element counted once in the job (owner-sharded ones by their owner, FSDP2
    shards everywhere, HSDP and DDP replicas once): the norm and clipped gradients of
    ``clip_grad_norm_`` on one process holding the global batch."""
    config = get_config("tiny")
    model = Llama(config, seed=0)
    inputs, targets = SyntheticTokens(config.vocab_size, seed=0).batch(0, GLOBAL_BATCH, SEQ_LEN)
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    assert expected_norm > MAX_NORM

    for norm, grads in run_on_ranks(2, clipped_on_ranks, parallel):
        assert norm == pytest.approx(expected_norm, rel=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    total = math.sqrt(sum(g.square().sum().item() for g in grads.values()))
    assert total == pytest.approx(MAX_NORM, rel=1e-4)


# ------------------------------------------------------------------ plotting

def test_plot_losses_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="plot_losses.py needs matplotlib (the 'bench' extra)")
    logs = []
    for name, losses in (("muon", [5.0, 4.0, 3.0]), ("adamw", [5.0, 4.5, 3.5])):
        lines = [{"config": {"optimizer": name, "parallel": "fsdp2", "world_size": 2}}]
        lines += [{"step": s + 1, "loss": loss} for s, loss in enumerate(losses)]
        lines += [{"step": 3, "loss": losses[-1] - 1}]  # a resumed run appends: the last value wins
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        logs.append(str(path))
    curve = plot_losses.read_curve(logs[0])
    assert (curve.label, curve.steps, curve.losses) == ("muon (fsdp2, 2 ranks)", [1, 2, 3], [5.0, 4.0, 2.0])
    plot_losses.main([*logs, "--out", str(tmp_path / "losses.png")])
    assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
