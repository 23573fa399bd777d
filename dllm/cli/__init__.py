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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

