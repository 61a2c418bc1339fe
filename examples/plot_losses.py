"""Draw the loss curves of ``train_gpt.py`` runs (their ``--log-file`` JSON lines) into one PNG.

    python examples/plot_losses.py muon.jsonl adamw.jsonl --out losses.png

Each curve is labelled with its run's optimizer and parallel mode (from the log's first line),
or with ``--labels``. Needs matplotlib (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Curve:
    label: str
    steps: list[int]
    losses: list[float]


def read_curve(path: str | Path) -> Curve:
    """The (step, loss) points of one log; a resumed run's repeated steps keep their last value."""
    points: dict[int, float] = {}
    label = Path(path).stem
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "config" in record:
            config = record["config"]
            label = f"{config['optimizer']} ({config['parallel']}, {config['world_size']} ranks)"
        elif "loss" in record:
            points[int(record["step"])] = float(record["loss"])
    if not points:
        raise ValueError(f"{path}: no step records with a loss")
    steps = sorted(points)
    return Curve(label, steps, [points[s] for s in steps])


def plot(curves: list[Curve], out: str | Path, title: str | None = None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('plot_losses.py needs matplotlib: pip install matplotlib (or pip install -e ".[bench]")') \
            from None
    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for curve in curves:
        axes.plot(curve.steps, curve.losses, label=curve.label)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (nats/token)")
    axes.set_title(title or "train_gpt.py")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines logs of train_gpt.py")
    parser.add_argument("--out", required=True, metavar="PNG")
    parser.add_argument("--labels", nargs="+", help="one label per log (default: from each log)")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.logs):
        parser.error(f"{len(args.labels)} labels for {len(args.logs)} logs")
    curves = [read_curve(path) for path in args.logs]
    for curve, label in zip(curves, args.labels or []):
        curve.label = label
    plot(curves, args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
