"""Helpers shared by the benchmarks: prompts of the synthetic tasks, random-weight LLaDA-format models, the markdown
table and the JSON dump of the rows each benchmark prints."""

from __future__ import annotations

import argparse
import json

import torch

from dllm.evals import tasks as T
from dllm.models import LLADA, Transformer, TransformerConfig
from dllm.models.weights import init_weights


def task_prompts(n: int, seed: int) -> list:
    """``n`` chat prompts (the last user message) of the synthetic tasks, prompts of different lengths; ``seed``:
    the first example's seed (held out from the training seeds), one more per prompt."""
    names = T.task_names("waiting_line")
    return [T.get_task(names[i % len(names)]).generate(1, seed + i)[0].messages[-1:] for i in range(n)]


def random_llada(cfg: TransformerConfig, device, dtype, std: float) -> Transformer:
    """A LLaDA-format model of ``cfg`` with seeded random weights (``init_weights(std)``), built where it runs and in
    its dtype (LLaDA-8B's layers never pass through host memory); mask id the vocabulary's last, EOS 1, EOT 2."""
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Transformer(cfg, LLADA)
            init_weights(model, std=std)
    finally:
        torch.set_default_dtype(prev)
    model.mask_id, model.eos_id, model.eot_id, model.pad_id = cfg.vocab_size - 1, 1, 2, 1
    return model.eval().requires_grad_(False)


def print_table(header: list[str], cells: list[list]) -> None:
    """Print a markdown table: ``header`` and one row of ``cells`` per line (each cell as ``str`` gives it)."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in cells:
        print("| " + " | ".join(str(c) for c in row) + " |")


def write_json(path: str | None, rows) -> None:
    """``rows`` as indented JSON at ``path`` (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def positive(text: str) -> int:
    """An argparse ``type``: a positive integer, else the option's usage error."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is not a positive integer")
    return v
