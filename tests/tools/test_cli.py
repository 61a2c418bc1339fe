"""The ``dmuon`` command line answers bad input with argparse's usage and one error line (exit
status 2) before it spawns a rank, trains or measures anything; ``--help`` shows every default.

Every test runs ``dmuon.tools.cli.main`` in-process with the expensive steps replaced by stubs that
fail the test if reached: spawning ranks (``bench``), training (``demo``), measuring this CPU
(``plan --hardware cpu``). So a check that comes too late fails fast instead of hanging
(``bench --world-size 0`` used to wait forever for results from no ranks).
"""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch

import dmuon.tools.bench
import dmuon.tools.demo
import dmuon.tools.hardware
import dmuon.tools.plan_cli
import dmuon.tools.quality
from dmuon.tools.cli import UsageError, build_parser, main
from dmuon.tools.hardware import PROFILES, OneRankSeconds


def _forbidden(what: str):
    def stub(*args, **kwargs):
        raise AssertionError(f"the command went on to {what} before rejecting its arguments")

    return stub


@pytest.fixture(autouse=True)
def no_expensive_work(monkeypatch):
    monkeypatch.setattr(dmuon.tools.bench, "run_config", _forbidden("spawn ranks"))
    monkeypatch.setattr(dmuon.tools.demo, "train", _forbidden("train"))
    monkeypatch.setattr(dmuon.tools.hardware, "measure_cpu_profile", _forbidden("measure the CPU profile"))
    monkeypatch.setattr(dmuon.tools.plan_cli, "measure_one_rank_seconds", _forbidden("time a training step"))


def rejects(argv: list[str], capsys) -> str:
    """Run ``dmuon argv``: it must exit with status 2; its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"dmuon {argv[0]}: error: ")
    return err


BAD_INPUTS = [
    # (argv, option named in the error, text the error must contain)
    (["bench", "--preset", "vla", "--seq-len", "64"], "--seq-len", "leave --seq-len out"),
    (["plan", "--model", "vla", "--seq-len", "64"], "--seq-len", "leave --seq-len out"),
    (["plan", "--model", "pi0", "--world-size", "64", "--tp", "2"], "--tp/--pp/--ep", "data parallel only"),
    (["bench", "--world-size", "0"], "--world-size", "0"),
    (["bench", "--world-size", "-1"], "--world-size", "-1"),
    (["bench", "--batch-size", "0"], "--batch-size", "0"),
    (["bench", "--steps", "0"], "--steps", "0"),
    (["bench", "--warmup", "-1"], "--warmup", "-1"),
    (["bench", "--seq-len", "0"], "--seq-len", "0"),
    (["bench", "--threads", "0"], "--threads", "0"),
    (["bench", "--layers", "0"], "--layers", "0"),
    (["bench", "--lr", "0"], "--lr", "0"),
    (["bench", "--preset", "bench", "--seq-len", "4096"], "--seq-len", "max_seq_len 2048"),
    (["bench", "--comm-dtype", "fp8"], "--comm-dtype", "fp8"),
    (["bench", "--ns-coefficients", "nope"], "--ns-coefficients", "nope"),
    (["bench", "--configs", "ddp-adamw,ddp-sgd"], "--configs", "ddp-sgd"),
    (["bench", "--configs", ","], "--configs", "choose from ddp-adamw"),
    (["plan", "--layers", "0"], "--layers", "0"),
    (["plan", "--layers", "-2"], "--layers", "-2"),
    (["plan", "--model", "llama-9b"], "--model", "llama-3.1-8b"),  # lists the known presets
    (["plan", "--model", "missing.json"], "--model", "no such file"),
    (["plan", "--seq-len", "0"], "--seq-len", "0"),
    (["plan", "--model", "bench", "--seq-len", "4096"], "--seq-len", "max_seq_len 2048"),
    (["plan", "--mfu", "0"], "--mfu", "(0, 1]"),
    (["plan", "--mfu", "1.5"], "--mfu", "1.5"),
    (["plan", "--mfu", "nan"], "--mfu", "nan"),
    (["plan", "--bucket-bytes", "0"], "--bucket-bytes", "0"),
    (["plan", "--world-size", "0"], "--world-size", "0"),
    (["plan", "--threads", "0"], "--threads", "0"),
    (["plan", "--tokens-per-step", "0"], "--tokens-per-step", "0"),
    (["plan", "--world-size", "4", "--tokens-per-step", "2"], "--tokens-per-step", "2"),
    (["plan", "--model", "llama-3.1-8b", "--hardware", "cpu"], "--hardware", "--layers"),  # too big to time
    (["plan", "--tp", "0"], "--tp", "0"),
    (["plan", "--world-size", "6", "--tp", "4"], "--tp/--pp/--ep", "not a multiple of tp·pp = 4"),
    (["plan", "--world-size", "8", "--tp", "2", "--mode", "ddp"], "--tp/--pp/--ep", "under fsdp2 only"),
    (["plan", "--world-size", "8", "--ep", "2"], "--tp/--pp/--ep", "has no experts"),
    (["plan", "--model", "qwen3-30b-a3b", "--world-size", "8", "--ep", "3"], "--tp/--pp/--ep", "divide"),
    (["plan", "--model", "tiny", "--world-size", "8", "--pp", "4"], "--tp/--pp/--ep", "2 layers"),
    (["plan", "--model", "qwen3-30b-a3b", "--hardware", "cpu"], "--hardware", "mixture of experts"),
    (["plan", "--json", "no-such-folder/plan.json"], "--json", "no-such-folder"),
    (["plan", "--json", "/proc/dmuon-plan.json"], "--json", "cannot be written"),  # refused before the run
    (["bench", "--json", "/proc/dmuon-bench.json"], "--json", "cannot be written"),
    (["plan", "--world-size", "1000000"], "--world-size", "at most 65536"),  # would take ~9 GB
    (["bench", "--world-size", "100000"], "--world-size", "per CPU core"),
    (["demo", "--steps", "0"], "--steps", "0"),
    (["demo", "--batch-size", "0"], "--batch-size", "0"),
    (["demo", "--seq-len", "0"], "--seq-len", "0"),
    (["demo", "--seq-len", "1000"], "--seq-len", "max_seq_len 512"),
    (["demo", "--threads", "0"], "--threads", "0"),
    (["plan", "--layers", "1000000"], "--layers", "at most 1024"),  # refused at once, not after minutes
    # layouts the model cannot have: tensor parallel splits whole heads (32 query, 8 key/value heads)
    (["plan", "--model", "llama-3.1-8b", "--world-size", "64", "--tp", "16"], "--tp/--pp/--ep",
     "8 key/value heads do not divide by 16"),
    (["plan", "--model", "llama-3.1-8b", "--world-size", "65536", "--tp", "65536"], "--tp/--pp/--ep",
     "32 query heads, 8 key/value heads, 14336 MLP width do not divide by 65536"),
]

# runs larger than memory: refused before anything starts, naming the option (here 8 GiB are free)
TOO_LARGE = [
    (["bench", "--batch-size", "1000000000"], "--batch-size"),
    (["bench", "--layers", "100000"], "--layers"),
    (["bench", "--preset", "bench", "--tokens-per-step", "25600000000"], "--tokens-per-step"),
    (["quality", "--layers", "100000"], "--layers"),
    (["quality", "--dim", "65536"], "--dim"),
    (["demo", "--batch-size", "100000000"], "--batch-size"),
    (["bench", "--preset", "pi0"], "--preset"),  # too large whatever the other options: the model is blamed
]


@pytest.mark.parametrize(("argv", "option"), TOO_LARGE, ids=[" ".join(a) for a, _ in TOO_LARGE])
def test_a_run_larger_than_memory_is_refused_before_it_starts(argv, option, capsys, monkeypatch):
    for module in (dmuon.tools.bench, dmuon.tools.demo, dmuon.tools.quality):
        monkeypatch.setattr(module, "available_memory", lambda: 8 * 2**30)
    last = rejects(argv, capsys).strip().splitlines()[-1]
    assert f"argument {option}: " in last and "more than the 8.0 GiB available here" in last, last


@pytest.mark.parametrize("data,fits", [("text", True), ("synthetic", False)])
def test_the_demo_s_memory_check_counts_the_vocabulary_it_trains(data, fits, monkeypatch):
    """On text the demo trains a byte vocabulary (19.1 GiB for qwen2.5-1.5b at its defaults),
    on synthetic tokens the preset's (22.9 GiB): 21 GiB free fits the one and not the other."""
    monkeypatch.setattr(dmuon.tools.demo, "available_memory", lambda: 21 * 2**30)
    args = build_parser().parse_args(["demo", "--preset", "qwen2.5-1.5b", "--data", data])
    if fits:
        dmuon.tools.demo.check_arguments(args)
    else:
        with pytest.raises(UsageError, match="--preset"):
            dmuon.tools.demo.check_arguments(args)


def test_the_memory_floor_is_below_what_a_training_step_holds():
    """The floor that refuses runs (12 bytes per parameter, a few floats per token) is under
    what a step of the tiny Llama really holds: its parameters, gradients and AdamW's state,
    and the activations autograd saves (counted by a saved-tensors hook, parameters left out)."""
    from dmuon.tools.models import Llama, get_config, training_bytes
    from tests.helpers import held_and_saved_bytes

    config = get_config("tiny")
    x = torch.randint(0, config.vocab_size, (4, 64))
    held, saved = held_and_saved_bytes(Llama(config), (x, x))
    parameters, activations = training_bytes(config, 4, 64)
    assert parameters <= held and activations <= saved, (parameters, held, activations, saved)



@pytest.mark.parametrize(("argv", "option", "detail"), BAD_INPUTS, ids=[" ".join(a) for a, _, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_error(argv, option, detail, capsys):
    last = rejects(argv, capsys).strip().splitlines()[-1]
    assert f"argument {option}: " in last and detail in last


@pytest.mark.parametrize("content", [
    "{not json", json.dumps({"hidden_size": 64}), json.dumps([1, 2]),
    json.dumps({"hidden_size": 100, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 3,
                "vocab_size": 1000}),  # 3 heads do not divide a width of 100, and no head_dim is given
])
def test_unreadable_config_json_is_one_clear_error(tmp_path, capsys, content):
    path = tmp_path / "config.json"
    path.write_text(content)
    last = rejects(["plan", "--model", str(path)], capsys).strip().splitlines()[-1]
    assert "argument --model: " in last and str(path) in last and "config.json" in last


def _option_blocks(help_text: str) -> dict[str, str]:
    """Each option's entry in ``--help``: its first line (the flags) to its whole text."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            blocks[current] = line
        elif current is not None and line.startswith("      "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.parametrize("command", ["bench", "plan", "demo"])
def test_help_shows_every_default(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    blocks = _option_blocks(capsys.readouterr().out)
    assert "--seq-len" in blocks and "--json" in blocks
    for option, text in blocks.items():
        if option != "-h":
            assert "(default: " in text, f"dmuon {command} --help: {option} shows no default: {text!r}"


def _fake_cpu(monkeypatch, forward_backward: float) -> list[tuple[int, int]]:
    """``--hardware cpu`` without measuring: a made-up CPU profile, and a one-rank step that takes
    ``forward_backward`` seconds; the (batch, sequence length) it was asked to time, appended."""
    profile = dataclasses.replace(
        PROFILES["h100"], name="cpu", device_type="cpu", ranks_per_node=None, mfu=None, train_dtype=torch.float32,
        cores=2, threads=1, comm_overlaps_compute=False, source="a made-up CPU",
    )
    timed = []

    def one_rank(config, batch, seq_len, threads=1, reps=5):
        timed.append((batch, seq_len))
        return OneRankSeconds(forward_backward=forward_backward, optimizer_step=1e-2, newton_schulz=5e-3)

    monkeypatch.setattr(dmuon.tools.plan_cli, "get_profile", lambda name, threads=1: profile if name == "cpu"
                        else PROFILES[name])
    monkeypatch.setattr(dmuon.tools.plan_cli, "measure_one_rank_seconds", one_rank)
    return timed


def test_measured_mfu_above_one_goes_on_at_one_with_a_warning(tmp_path, capsys, monkeypatch):
    """A loaded machine can time the product rate low and the training step fast: the measured MFU
    then comes out above 1 (2.6 once). The plan goes on at MFU 1 and says why on stderr."""
    _fake_cpu(monkeypatch, forward_backward=1e-9)  # far faster than the profile's products allow
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "bench", "--layers", "1", "--world-size", "2", "--hardware", "cpu",
                 "--seq-len", "64", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    warning = captured.err.strip().splitlines()[-1]
    assert warning.startswith("dmuon plan: warning: the measured MFU came out") and "--mfu" in warning
    assert json.loads(out.read_text())["mfu"] == 1.0 and "at MFU 1.00" in captured.out
    # a measured MFU in range is kept as measured, without a warning
    _fake_cpu(monkeypatch, forward_backward=1.0)
    assert main(["plan", "--model", "bench", "--layers", "1", "--world-size", "2", "--hardware", "cpu",
                 "--seq-len", "64", "--json", str(out)]) == 0
    assert "warning" not in capsys.readouterr().err and 0 < json.loads(out.read_text())["mfu"] < 1


def test_default_seq_len_fits_the_model(tmp_path, capsys, monkeypatch):
    """``--seq-len`` defaults to 4096, capped at the model's max_seq_len (the bench preset's: 2048),
    so ``dmuon plan --model bench --hardware cpu`` times sequences the model can take."""
    timed = _fake_cpu(monkeypatch, forward_backward=1.0)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "bench", "--layers", "1", "--world-size", "2", "--hardware", "cpu",
                 "--json", str(out)]) == 0
    assert timed == [(4, 2048)]  # 8192 tokens per rank
    assert json.loads(out.read_text())["seq_len"] == 2048
    assert main(["plan", "--model", "bench", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["seq_len"] == 2048
    assert main(["plan", "--model", "qwen2.5-1.5b", "--layers", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["seq_len"] == 4096  # max_seq_len 32768
    capsys.readouterr()


def test_demo_progress_reaches_a_log_ten_times_per_configuration_with_the_time_left():
    """Not only on a terminal: a log or a pipe gets a line every tenth of the steps, so a slow run
    shows it is alive (a user waited 15 minutes in front of nothing)."""
    stream = io.StringIO()
    for step in range(1, 201):
        dmuon.tools.demo.report_progress(stream, "dmuon", step, 200, 1.5, seconds=step * 0.5)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[0] == "dmuon: step 20/200  loss 1.500  10 s, about 90 s left"
    assert lines[-1] == "dmuon: step 200/200  loss 1.500  100 s"


@pytest.mark.parametrize("cores,others,threads,why", [
    (2, 0.02, 2, "2 threads, one per core"),
    (2, 0.9, 1, "1 thread: other jobs use 0.9 of 2 cores"),
    (2, 1.9, 1, "1 thread: other jobs use 1.9 of 2 cores"),
    (8, 2.2, 6, "6 threads: other jobs use 2.2 of 8 cores"),
])
def test_demo_takes_the_cores_other_jobs_leave(cores, others, threads, why):
    assert dmuon.tools.demo.default_threads(cores, others) == (threads, why)


def test_plan_on_cpu_says_it_measures_first_and_names_small_models_in_millions(tmp_path, capsys, monkeypatch):
    _fake_cpu(monkeypatch, forward_backward=1.0)
    assert main(["plan", "--model", "demo", "--world-size", "2", "--hardware", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("dmuon plan: measuring this machine first")
    assert "dmuon plan: demo (919 k parameters, 786 k in 28 Muon parameters)" in captured.out


def test_the_api_reference_names_every_command_and_quotes_errors_as_raised():
    """docs/api.md against the code: the command list, and its example error messages."""
    import re
    from pathlib import Path

    from dmuon.tools.cli import SUBCOMMANDS

    api = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    listed = re.search(r"The command line is `dmuon ([a-z |]+)`", api).group(1).split(" | ")
    assert sorted(listed) == sorted(SUBCOMMANDS)
    flat = " ".join(api.split())  # the examples wrap across lines
    for options, group in (({"momentum": 1.0}, False), ({"momentum": 1.0}, True), ({"lr": float("inf")}, False)):
        param = torch.nn.Parameter(torch.zeros(3, 3))
        try:
            dmuon.Muon([{"params": [param], **options}] if group else [param], **({} if group else options))
        except ValueError as err:
            assert f"`{err}`" in flat, err
        else:
            raise AssertionError(f"{options} was accepted")


def test_demo_on_one_core_says_one_thread():
    assert dmuon.tools.demo.default_threads(1, 0.0) == (1, "1 thread, one per core")
