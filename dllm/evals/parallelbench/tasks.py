"""ParallelBench's view of the one task table (:data:`dllm.evals.tasks.TASKS`): its 17 tasks under the
original's names, with their metrics, prompt templates and output budgets."""

from __future__ import annotations

from dllm.evals import tasks as T
from dllm.evals.tasks import Task

DEFAULT_SEED = 12345
STYLES = ("full", "short")
WAITING_LINE_OPS = T.WAITING_LINE_OPS
LATIN_POOL_FULL = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"

#: ParallelBench's tasks is :class:`dllm.evals.tasks.Task` (the name is kept for callers).
PBTask = Task


class DataNeeded(FileNotFoundError):
    """A task has no offline source and no data file was given (summarization, paraphrasing)."""


#: The 17 tasks keyed by the original's names (a view of :data:`dllm.evals.tasks.TASKS`; ``task.pb_name``
#: is the key, ``task.name`` the project's name, which differs for the two puzzles).
TASKS: dict[str, Task] = T.suite_tasks("parallelbench")

CATEGORIES: dict[str, list[str]] = {}
for _name, _task in TASKS.items():
    CATEGORIES.setdefault(_task.category, []).append(_name)
del _name, _task

#: Other names of the tasks (the project's puzzle names, ``summarization``, ``paraphrasing``) -> original names.
ALIASES: dict[str, str] = T.suite_aliases("parallelbench")


def get_task(name: str) -> Task:
    """The ParallelBench task called ``name`` (the original's name or an alias: ``puzzle/latin_square``,
    ``puzzle/sudoku``, ``summarization``, ``paraphrasing``); KeyError lists the known names."""
    return T.get_task(name, suite="parallelbench")


def task_names(pattern: str | None = None) -> list[str]:
    """ParallelBench's task names, optionally filtered: comma-separated fnmatch patterns or category names
    (``"waiting_line,puzzle"``, ``"waiting_line/*_random"``); ``None``/``"all"`` gives all 17."""
    return T.task_names(pattern, suite="parallelbench")
