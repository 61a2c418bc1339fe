"""``dmuon quality``: the standard-library corpus, the steps-to-target reading, its arguments, and one
tiny run end to end through the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dmuon.tools import corpus, quality
from dmuon.tools.cli import main
from tests.tools.test_cli import rejects


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    """40 modules (two become validation), plus files the corpus must leave out."""
    files = {f"pkg{i % 3}/mod{i:02d}.py": f"def f{i}(x):\n    return x + {i}\n".encode() * 8 for i in range(40)}
    files.update({
        "site-packages/thirdparty/__init__.py": b"installed = True\n",
        "dist-packages/other.py": b"installed = True\n",
        "test/test_os.py": b"import os\n",
        "notes.txt": b"not python\n",
        "latin1.py": "# caf\xe9\n".encode("latin-1"),  # bytes, not text: any encoding is fine
    })
    return _tree(tmp_path / "lib", files)


def test_source_files_are_sorted_and_leave_out_installed_packages_and_tests(small_corpus):
    paths = corpus.source_files(str(small_corpus))
    assert paths == sorted(paths) and len(paths) == 41
    assert not any(p.startswith(("site-packages/", "dist-packages/", "test/")) or not p.endswith(".py")
                   for p in paths)


def test_corpus_is_deterministic_and_its_splits_disjoint(small_corpus):
    first, second = corpus.load_corpus(str(small_corpus)), corpus.load_corpus(str(small_corpus))
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    assert first.val_files == second.val_files and len(first.val_files) == 2  # 41 files, every 20th
    assert not set(first.train_files) & set(first.val_files)
    assert len(first.train_files) + len(first.val_files) == 41
    expected_val = b"".join((small_corpus / p).read_bytes() for p in first.val_files)
    assert bytes(first.val.tolist()) == expected_val


def test_standard_library_corpus_is_bytes_of_python_source():
    stdlib = corpus.load_corpus()
    assert stdlib.train.dtype == torch.uint8 and len(stdlib.train) > 10**6 and len(stdlib.val) > 10**5
    assert not set(stdlib.train_files) & set(stdlib.val_files)
    assert "os.py" in stdlib.train_files + stdlib.val_files
    assert int(stdlib.train.max()) < corpus.VOCAB_SIZE


def test_batches_are_reproducible_next_byte_windows():
    text = torch.arange(200, dtype=torch.uint8)
    inputs, targets = corpus.train_batch(text, step=3, batch_size=4, seq_len=16, seed=0)
    again, _ = corpus.train_batch(text, step=3, batch_size=4, seq_len=16, seed=0)
    other, _ = corpus.train_batch(text, step=4, batch_size=4, seq_len=16, seed=0)
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)
    assert torch.equal(targets[:, :-1], inputs[:, 1:]) and torch.equal(targets[:, -1], inputs[:, -1] + 1)
    val = corpus.val_batches(text, n_batches=2, batch_size=3, seq_len=16)
    starts = [int(b[0][i, 0]) for b in val for i in range(3)]
    assert starts[0] == 0 and starts[-1] == 200 - 17 and starts == sorted(starts)


CURVE = ((0, 0.0, 5.5), (25, 2.0, 3.1), (50, 4.0, 2.4), (75, 6.0, 2.5), (100, 8.0, 2.2))


@pytest.mark.parametrize(("target", "expected"), [
    (2.4, (50, 4.0)),  # reaching the target exactly counts
    (2.45, (50, 4.0)),
    (2.3, (100, 8.0)),  # the first point below, not the first after the curve dips
    (6.0, (0, 0.0)),
    (2.1, None),
])
def test_time_to_target(target, expected):
    assert quality.time_to_target(CURVE, target) == expected


def _run(name: str, lr: float, curve, diverged: bool = False) -> quality.Run:
    return quality.Run(name, lr, curve[-1][0], diverged, tuple(curve))


def test_best_lr_winner_and_summary_sentence():
    runs = [
        _run("adamw", 1e-3, CURVE),
        _run("adamw", 2e-3, ((0, 0.0, 5.5), (25, 1.0, 2.3), (50, 2.0, 2.0))),
        _run("dmuon", 1e-2, ((0, 0.0, 5.5), (25, 3.0, 2.6)), diverged=True),
        _run("dmuon", 5e-3, ((0, 0.0, 5.5), (25, 3.0, 1.9), (50, 6.0, 1.8))),
    ]
    best = quality.best_runs(runs)
    assert [(name, run.lr) for name, run in best.items()] == [("adamw", 2e-3), ("dmuon", 5e-3)]
    assert quality.winner(best, 2.0) == "dmuon"  # step 25 against adamw's 50
    sentence = quality.summary_sentence(runs, 2.0)
    assert sentence.startswith("dmuon reached validation loss 2 first") and "adamw at 50 (2 s)" in sentence
    assert "in training seconds adamw was first" in sentence
    assert quality.winner(best, 1.0) is None
    assert quality.summary_sentence(runs, 1.0).startswith("No optimizer reached validation loss 1 ")
    assert "diverged" in quality.format_runs(runs, 2.0) and "not reached" in quality.format_summary(runs, 1.0)
    # the same evaluation reaches the target: a tie in steps, broken by seconds, and said so
    tied = [*runs, _run("torch-muon", 1e-2, ((0, 0.0, 5.5), (25, 2.0, 1.95), (50, 4.0, 1.9)))]
    assert quality.winner(quality.best_runs(tied), 2.0) == "torch-muon"
    assert quality.summary_sentence(tied, 2.0).startswith(
        "torch-muon and dmuon reached validation loss 2 at the same evaluation, torch-muon first in seconds")


def test_seeds_are_averaged_per_optimizer_and_lr_and_their_range_is_shown():
    def seeded(name, lr, seed, losses, diverged=False):
        curve = tuple((step, float(step), loss) for step, loss in zip((0, 10, 20), losses))
        return quality.Run(name, lr, 20, diverged, curve, (seed,))

    runs = [seeded("adamw", 1e-3, 0, (5.0, 3.0, 2.0)), seeded("adamw", 1e-3, 1, (5.0, 3.2, 2.4)),
            seeded("dmuon", 1e-3, 0, (5.0, 2.0, 1.0)), seeded("dmuon", 1e-3, 1, (5.0, 2.6, 2.5), diverged=True)]
    adamw, dmuon = quality.mean_over_seeds(runs)
    assert (adamw.optimizer, adamw.seeds, adamw.finals) == ("adamw", (0, 1), (2.0, 2.4))
    assert [loss for *_, loss in adamw.curve] == pytest.approx([5.0, 3.1, 2.2])
    assert dmuon.diverged and dmuon.final_val_loss is None and dmuon.finals == ()
    assert quality.seed_range(adamw) == "2.0000-2.4000" and quality.seed_range(runs[0]) == "-"
    assert "2.0000-2.4000" in quality.format_summary([adamw, dmuon], 2.5)


def test_lr_factor_warms_up_and_decays_to_near_zero():
    factors = [quality.lr_factor(step, 100) for step in range(100)]
    assert factors[0] == pytest.approx(0.2) and factors[4:80] == [1.0] * 76
    assert factors[-1] == pytest.approx(0.05) and all(f > 0 for f in factors)


def _rejects(argv: list[str], capsys) -> str:
    return rejects(argv, capsys).strip().splitlines()[-1]


@pytest.fixture
def no_training(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("dmuon quality went on to train before rejecting its arguments")

    monkeypatch.setattr(quality, "train_run", forbidden)


BAD_INPUTS = [
    (["--steps", "0"], "--steps", "0"),
    (["--eval-every", "-1"], "--eval-every", "-1"),
    (["--target-loss", "0"], "--target-loss", "must be > 0"),
    (["--target-loss", "nan"], "--target-loss", "nan"),
    (["--dmuon-lrs", "1e-3,-2e-3"], "--dmuon-lrs", "-0.002"),
    (["--adamw-lrs", ","], "--adamw-lrs", "no learning rates"),
    (["--optimizers", "adamw,sgd"], "--optimizers", "sgd"),
    (["--dim", "100"], "--dim", "multiple of 32"),
    (["--json", "no-such-folder/q.json"], "--json", "no-such-folder"),
    (["--corpus", "no-such-folder"], "--corpus", "not an existing folder"),
    (["--workload", "vla", "--corpus", "."], "--corpus", "synthetic episodes"),
    (["--workload", "robot"], "--workload", "robot"),
    (["--seeds", "0"], "--seeds", "0"),
]


@pytest.mark.parametrize(("argv", "option", "detail"), BAD_INPUTS, ids=[" ".join(a) for a, _, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_error(argv, option, detail, capsys, no_training):
    last = _rejects(["quality", *argv], capsys)
    assert last.startswith("dmuon quality: error: ") and f"argument {option}: " in last and detail in last


def test_corpus_too_small_for_the_sequence_length(tmp_path, capsys, no_training):
    root = _tree(tmp_path, {f"m{i:02d}.py": b"x = 1\n" for i in range(20)})  # validation: 6 bytes
    last = _rejects(["quality", "--corpus", str(root), "--seq-len", "8"], capsys)
    assert "argument --corpus: " in last and "validation text" in last and "6 bytes" in last


def test_plot_without_matplotlib_is_a_usage_error(tmp_path, capsys, monkeypatch, no_training):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    last = _rejects(["quality", "--plot", str(tmp_path / "q.png")], capsys)
    assert "argument --plot: needs matplotlib" in last


def test_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main(["quality", "--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    blocks = " ".join(text.split()).split(" --")[1:]  # one per option after -h, wrapped lines joined
    assert any(b.startswith("target-loss ") for b in blocks) and any(b.startswith("dmuon-lrs ") for b in blocks)
    assert [b for b in blocks if "(default: " not in b] == ["help show this help message and exit"]


def test_tiny_run_end_to_end_writes_every_field(small_corpus, tmp_path, capsys):
    out = tmp_path / "quality.json"
    argv = ["quality", "--corpus", str(small_corpus), "--steps", "3", "--eval-every", "2", "--dim", "32",
            "--layers", "1", "--seq-len", "16", "--batch-size", "2", "--val-batches", "1", "--threads", "1",
            "--adamw-lrs", "1e-3", "--torch-muon-lrs", "1e-3", "--dmuon-lrs", "2e-3", "--target-loss", "5.5",
            "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["settings"]["steps"] == 3 and record["settings"]["target_loss"] == 5.5
    assert record["corpus"]["train_files"] == 39 and record["corpus"]["val_files"] == 2
    runs = record["runs"]
    assert [(r["optimizer"], r["lr"]) for r in runs] == [("adamw", 1e-3), ("torch-muon", 1e-3), ("dmuon", 2e-3)]
    for r in runs:
        assert r["best"] and not r["diverged"] and r["steps"] == 3
        assert [p["step"] for p in r["curve"]] == [0, 2, 3]
        assert r["final_val_loss"] == r["curve"][-1]["val_loss"]
        # the untrained byte model scores about log(256) = 5.55 nats; the tiny run just crosses 5.5 or not
        hit = quality.time_to_target([(p["step"], p["seconds"], p["val_loss"]) for p in r["curve"]], 5.5)
        assert (r["steps_to_target"], r["seconds_to_target"]) == (hit or (None, None))
    assert (record["winner"] is None) == all(r["steps_to_target"] is None for r in runs)
    assert "final val loss" in printed and printed.strip().splitlines()[-1].endswith(".")


def test_vla_workload_over_two_seeds_end_to_end(tmp_path, capsys):
    """The embodied model: the seeds' runs are averaged, the validation episodes are none a run
    trains on, and the JSON keeps every seed's final loss."""
    out = tmp_path / "vla.json"
    argv = ["quality", "--workload", "vla", "--optimizers", "adamw,dmuon", "--adamw-lrs", "4e-3", "--dmuon-lrs",
            "4e-3,8e-3", "--seeds", "2", "--steps", "4", "--eval-every", "2", "--batch-size", "4", "--val-batches",
            "1", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "synthetic episodes of vla-tiny" in printed and "seeds 0..1 (curves averaged)" in printed
    record = json.loads(out.read_text())
    assert record["corpus"] is None and record["settings"]["workload"] == "vla"
    assert record["settings"]["target_loss"] == quality.DEFAULT_TARGET_LOSS["vla"]
    runs = record["runs"]
    assert [(r["optimizer"], r["lr"], r["seeds"]) for r in runs] == [
        ("adamw", 4e-3, [0, 1]), ("dmuon", 4e-3, [0, 1]), ("dmuon", 8e-3, [0, 1])]
    for r in runs:
        assert len(r["seed_final_val_losses"]) == 2
        assert r["final_val_loss"] == pytest.approx(sum(r["seed_final_val_losses"]) / 2)
    # each seed is its own task and weights: the two seeds' losses differ
    assert len(set(runs[0]["seed_final_val_losses"])) == 2
