"""Standard benchmarks: GSM8K, MATH, HumanEval, MBPP (prompts, answer extraction and scoring), the code
sandbox, and the lm-evaluation-harness adapter.

Modules: :mod:`.tasks` (the four tasks, their prompts and data loading), :mod:`.answers` (answer extraction and
equivalence), :mod:`.runner` (resumable, multi-process evaluation), :mod:`.sandbox` (isolated program runs) and
:mod:`.code_eval`, :mod:`.lm_eval_adapter` (the ``dllm`` model for lm-eval). The command is ``dllm eval``
(:mod:`dllm.cli.eval`); ``docs/evaluation.md`` is the user guide.
"""

from dllm.evals.standard.tasks import (
    STANDARD_TASKS,
    Sample,
    StandardTask,
    build_prompts,
    get_standard_task,
    load_samples,
    read_jsonl,
)

__all__ = ["STANDARD_TASKS", "Sample", "StandardTask", "build_prompts", "get_standard_task", "load_samples", "read_jsonl"]
