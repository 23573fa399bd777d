"""Helpers shared by the benchmarks: prompts of the synthetic tasks, the markdown table and the JSON dump of the rows
each benchmark prints."""

from __future__ import annotations

import json

from dllm.evals import tasks as T


def task_prompts(n: int, seed: int) -> list:
    """``n`` chat prompts (the last user message) of the synthetic tasks, prompts of different lengths; ``seed``:
    the first example's seed (held out from the training seeds), one more per prompt."""
    names = T.task_names("waiting_line")
    return [T.get_task(names[i % len(names)]).generate(1, seed + i)[0].messages[-1:] for i in range(n)]


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
