"""The ``dmuon`` command line: one subcommand per module (``dmuon demo``, ``dmuon bench``).

Each subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``, and may
provide ``check_arguments(args)``: the checks that span several arguments (a sequence length
against the chosen model's context, say), run before any work starts; it may also fill in
defaults that depend on other arguments. Registering a new subcommand is one entry in
``SUBCOMMANDS``.

Bad input ends with argparse's usage and one ``dmuon <command>: error: ...`` line on stderr,
exit status 2, before any rank is spawned or anything is measured: single values are checked
by the ``type=`` functions below, the rest by :class:`UsageError` from ``check_arguments``.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
from collections.abc import Callable, Iterable, Sequence

SUBCOMMANDS = {
    "demo": ("dmuon.tools.demo", "compare AdamW, torch.optim.Muon and dmuon.Muon on a small model (CPU)"),
    "bench": ("dmuon.tools.bench", "DDP and FSDP2 x AdamW, vanilla Muon and dmuon.Muon on gloo ranks it spawns"),
    "plan": ("dmuon.tools.plan_cli", "dmuon's plan and predicted step time at N ranks"),
    "quality": ("dmuon.tools.quality", "AdamW vs torch.optim.Muon vs dmuon.Muon on the standard library's source: "
                "validation loss, lr sweeps, steps to a target (CPU)"),
}


class UsageError(Exception):
    """Bad command-line input found by a subcommand's ``check_arguments``: the message names the
    option and its value; :func:`main` reports it like argparse does (exit status 2)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"argument {option}: {message}")


def check_plot(path: str | None) -> None:
    """A ``--plot`` that can be drawn: matplotlib importable (a :class:`UsageError` otherwise)."""
    if path:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            raise UsageError("--plot", "needs matplotlib: pip install 'dmuon[bench]'") from None


# ---------------------------------------------------------------------------- argument types


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a finite number")
    return value


def positive_int(text: str) -> int:
    """``type=`` of a count: an integer >= 1."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value}: must be an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    """``type=`` of a count that may be zero."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid value {value}: must be an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """``type=`` of a rate or size: a finite number > 0."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid value {value:g}: must be > 0")
    return value


def non_negative_float(text: str) -> float:
    """``type=`` of a finite number >= 0 (a weight decay, say)."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid value {value:g}: must be >= 0")
    return value


def fraction(text: str) -> float:
    """``type=`` of a share or utilization: a number in (0, 1]."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"invalid value {value:g}: must be in (0, 1]")
    return value


def name_list(valid: Iterable[str]) -> Callable[[str], list[str]]:
    """``type=`` of a comma-separated, non-empty list of names from ``valid`` (kept in order)."""
    valid = tuple(valid)

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in valid]
        if unknown or not names:
            what = f"unknown {', '.join(unknown)}" if unknown else "no names given"
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {what}; choose from {','.join(valid)}")
        return names

    parse.__name__ = "name list"
    return parse


def output_path(text: str) -> str:
    """``type=`` of a file to write at the end of a run: its folder must exist now, and the file
    must be writable there (tried now, by opening it to append: a run must not end in a path it
    cannot write; a file this creates is removed again)."""
    folder = os.path.dirname(text) or "."
    if not text or os.path.isdir(text) or not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"invalid path {text!r}: not a file in an existing folder")
    existed = os.path.exists(text)
    try:
        with open(text, "a"):
            pass
    except OSError as err:
        raise argparse.ArgumentTypeError(f"invalid path {text!r}: cannot be written ({err.strerror})") from None
    if not existed:
        os.remove(text)
    return text


def sample_seq_len(seq_len: int | None, name: str, config: object) -> int | None:
    """An embodied model's samples have a length of their own (image patches, prompt and action
    tokens): its length, with ``--seq-len`` left out (a :class:`UsageError` naming the parts
    otherwise); ``seq_len`` as given for other models."""
    from dmuon.tools.models import VLAConfig

    if not isinstance(config, VLAConfig):
        return seq_len
    if seq_len is not None:
        raise UsageError("--seq-len", f"a {name} sample is {config.max_seq_len} tokens ({config.vision.n_patches} "
                                      f"image patches, {config.text_tokens} prompt and {config.action_steps} action "
                                      "tokens): leave --seq-len out")
    return config.max_seq_len


def check_seq_len(seq_len: int, preset: str, max_seq_len: int) -> None:
    """A ``--seq-len`` that the ``--preset`` model can take (a :class:`UsageError` otherwise)."""
    if seq_len > max_seq_len:
        raise UsageError("--seq-len", f"invalid value {seq_len}: above the {preset} preset's max_seq_len {max_seq_len}")


def check_fits(needed: Callable[..., tuple[int, int]], options: dict[str, tuple[object, object]],
               available: int | None, where: str = "here", model: tuple[str, object] | None = None) -> None:
    """A :class:`UsageError` where a run needs more memory than ``available``. ``needed(**values)``
    gives (bytes of the parameters, gradients and optimizer states; bytes of the activations)
    for values of ``options`` (option → (its value, its default), by the keyword ``needed``
    takes: the option without its dashes); the error names the option whose default would save
    the most, or ``model`` (option, value: what picks the model) where no option's default
    would make the run fit."""
    values = {option.lstrip("-").replace("-", "_"): value for option, (value, _) in options.items()}
    total = sum(needed(**values))
    if available is None or total <= available:
        return

    def with_default(option: str) -> int:
        key = option.lstrip("-").replace("-", "_")
        return sum(needed(**{**values, key: options[option][1]}))

    blamed = min(options, key=with_default)
    value = options[blamed][0]
    if model is not None and with_default(blamed) > available:
        blamed, value = model  # the model itself is too large here, whatever the other options
    parameters, activations = needed(**values)
    gib = [f"{size / 2**30:,.1f} GiB" for size in (total, parameters, activations, available)]
    raise UsageError(blamed, f"invalid value {value}: the run would need at least {gib[0]} ({gib[1]} of "
                             f"parameters, gradients and optimizer states, {gib[2]} of activations), more than the "
                             f"{gib[3]} available {where}")


# ---------------------------------------------------------------------------- the parser


def _build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="dmuon", description="Distributed Muon optimizer for PyTorch.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    by_name = {}
    for name, (module_name, summary) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)  # here, not at the top: the modules use the types above
        subparser = subparsers.add_parser(name, help=summary, description=summary)
        module.add_arguments(subparser)
        subparser.set_defaults(run=module.run, check=getattr(module, "check_arguments", None))
        by_name[name] = subparser
    return parser, by_name


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    return _build_parsers()[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dmuon`` console script and of ``python -m dmuon``; returns the exit status."""
    parser, subparsers = _build_parsers()
    args = parser.parse_args(argv)
    check = vars(args).pop("check")
    if check is not None:
        try:
            check(args)
        except UsageError as err:
            subparsers[args.command].error(str(err))
    return args.run(args)
