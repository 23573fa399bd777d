"""lm-evaluation-harness code tasks (``humaneval``, ``mbpp``, their ``_instruct`` / ``_plus`` variants) scored in
the dllm sandbox.

lm_eval's code tasks score with ``evaluate.load("code_eval")`` (Hugging Face ``evaluate``'s metric, downloaded
from the Hub, which ``exec``-s programs behind a copy of human-eval's guard). Importing
:mod:`dllm.evals.standard.lm_eval_adapter` calls :func:`route_code_eval_to_sandbox`, after which that call returns
:class:`SandboxCodeEval`: the same ``compute`` signature and return value, each ``candidate + "\\n" + test``
run by :func:`dllm.evals.standard.sandbox.run_program` (isolation, limits, and a pass only when the tests returned).
It needs no network and no ``HF_ALLOW_CODE_EVAL``; every other ``evaluate.load`` is passed through unchanged.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dllm.evals.standard.sandbox import run_program

__all__ = ["SandboxCodeEval", "estimate_pass_at_k", "route_code_eval_to_sandbox"]

log = logging.getLogger(__name__)


def estimate_pass_at_k(n: np.ndarray, c: np.ndarray, k: int) -> np.ndarray:
    """Unbiased pass@k per problem from ``n`` samples with ``c`` correct: ``1 - C(n-c, k) / C(n, k)``."""
    out = np.ones(len(n), dtype=np.float64)
    for i, (ni, ci) in enumerate(zip(n, c)):
        if ni - ci >= k:
            out[i] = 1.0 - np.prod(1.0 - k / np.arange(ni - ci + 1, ni + 1))
    return out


class SandboxCodeEval:
    """Drop-in for ``evaluate.load("code_eval")``: ``compute(predictions, references, k, num_workers, timeout)``."""

    name = "code_eval"

    def __init__(self, memory_mb: int = 1024):
        self.memory_mb = memory_mb

    def compute(self, *, predictions, references, k=(1, 10, 100), num_workers: int = 4, timeout: float = 3.0):
        """``predictions``: per problem a list of candidate programs; ``references``: per problem the test code.
        Returns ``({"pass@k": mean}, {problem: [(candidate_id, {task_id, passed, result, completion_id,
        sandbox}), ...]})`` as ``code_eval`` does (pass@k only for k no larger than every problem's sample count)."""
        if len(predictions) != len(references):
            raise ValueError(f"code_eval: {len(predictions)} prediction lists for {len(references)} references")
        jobs = [(t, c, cand + "\n" + test) for t, (cands, test) in enumerate(zip(predictions, references))
                for c, cand in enumerate(cands)]

        def one(job):
            task_id, cand_id, program = job
            r = run_program(program, timeout=timeout, memory_mb=self.memory_mb)
            result = {"passed": "passed", "timeout": "timed out"}.get(r.status, f"failed: {r.detail}")
            return task_id, cand_id, {"task_id": task_id, "passed": r.passed, "result": result,
                                      "completion_id": cand_id, "sandbox": r.isolation}

        results: dict[int, list] = {t: [] for t in range(len(references))}
        with ThreadPoolExecutor(max_workers=max(1, int(num_workers))) as pool:
            for task_id, cand_id, res in pool.map(one, jobs):
                results[task_id].append((cand_id, res))
        total = np.array([len(r) for r in results.values()])
        correct = np.array([sum(x[1]["passed"] for x in r) for r in results.values()])
        ks = [k] if isinstance(k, int) else list(k)
        pass_at_k = {f"pass@{kk}": float(estimate_pass_at_k(total, correct, kk).mean())
                     for kk in ks if len(total) and (total >= kk).all()}
        return pass_at_k, results


def route_code_eval_to_sandbox() -> bool:
    """Make ``evaluate.load("code_eval")`` return :class:`SandboxCodeEval` (idempotent). ``False`` when the
    ``evaluate`` package is not installed (lm_eval's code tasks cannot load then anyway)."""
    try:
        import evaluate
    except ImportError:
        return False
    if getattr(evaluate.load, "_dllm_sandbox", False):
        return True
    original = evaluate.load

    def load(path, *args, **kwargs):
        if path == "code_eval":
            log.info("evaluate.load('code_eval'): scoring code in the dllm sandbox")
            return SandboxCodeEval()
        return original(path, *args, **kwargs)

    load._dllm_sandbox = True
    load.__wrapped__ = original
    evaluate.load = load
    return True
