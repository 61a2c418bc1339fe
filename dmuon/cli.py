"""The ``dmuon`` command line: one subcommand per module (``dmuon demo``, ``dmuon bench``).

Each subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``;
registering a new one is one entry in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dmuon import bench, demo, plan_cli

SUBCOMMANDS = {
    "demo": (demo, "compare AdamW, torch.optim.Muon and dmuon.Muon on a small model (CPU)"),
    "bench": (bench, "DDP and FSDP2 x AdamW, vanilla Muon and dmuon.Muon on gloo ranks it spawns"),
    "plan": (plan_cli, "dmuon's plan and predicted step time at N ranks"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="dmuon", description="Distributed Muon optimizer for PyTorch.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, summary) in SUBCOMMANDS.items():
        subparser = subparsers.add_parser(name, help=summary, description=summary)
        module.add_arguments(subparser)
        subparser.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dmuon`` console script and of ``python -m dmuon``; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args)
