"""The ``dllm`` command line: ``generate | samplers | train-tiny | eval-tasks | eval | lm-eval | parallelbench | serve``.

One module per command group, each with ``add_parser(subparsers)``; the shared decoding options are in
:mod:`dllm.cli.common`.
"""

from __future__ import annotations

import argparse
import sys

from dllm.cli import eval as eval_commands
from dllm.cli import generate, parallelbench, serve, train


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dllm", description="Fast decoding for masked diffusion language models.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(sub)
    train.add_parser(sub)
    eval_commands.add_parser(sub)
    parallelbench.add_parser(sub)
    serve.add_parser(sub)
    return ap


def _message(exc: BaseException) -> str:
    """One line for a user error: an ``OSError`` as ``PATH: reason``, anything else as its message."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return f"{where}{exc.strerror}"
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return " ".join(text.split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error (a bad argument, a missing or unreadable file, a missing optional
    package) is printed as one ``error: ...`` line and returns 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, KeyError, ImportError) as exc:
        print(f"error: {_message(exc)}", file=sys.stderr)
        return 2

