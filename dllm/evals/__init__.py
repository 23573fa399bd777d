"""Evaluation: synthetic ParallelBench-style tasks and scorers (see :mod:`dllm.evals.tasks`)."""

from dllm.evals.tasks import FAMILIES, TASKS, Example, Task, get_task, parse_list, task_names

__all__ = ["FAMILIES", "TASKS", "Example", "Task", "get_task", "parse_list", "task_names"]
