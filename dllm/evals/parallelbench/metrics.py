"""Scores: the list and puzzle metrics (0/1) and the text metrics with their optional backends."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

from dllm.evals import tasks as T
from dllm.evals.parallelbench.parsing import parse_sudoku
from dllm.evals.parallelbench.prompts import base_task

# ----------------------------------------------------------------------------------------------------------
# List and puzzle metrics: (prediction, record, strict) -> 0.0 / 1.0


def _list_match(pred: str, record: dict, strict: bool) -> float:
    got = T.parse_list(pred, strict, "parallelbench")
    if got is None:
        return 0.0
    answer = record["answer"]
    want = T.parse_list(answer if isinstance(answer, str) else answer["example"], rules="parallelbench")
    return float(got == want)


def _list_shuffle(pred: str, record: dict, strict: bool) -> float:
    got = T.parse_list(pred, strict, "parallelbench")
    source = list(record["answer"]["input"])
    return float(got is not None and sorted(got) == sorted(source) and got != source)


def _list_insert(pred: str, record: dict, strict: bool) -> float:
    got = T.parse_list(pred, strict, "parallelbench")
    if got is None:
        return 0.0
    words = record["answer"].get("word")
    source = list(record["answer"]["input"])
    if words is None:  # any one insertion: dropping one item of the prediction gives the input
        return float(len(got) == len(source) + 1 and any(got[:i] + got[i + 1:] == source for i in range(len(got))))
    for w in [words] if isinstance(words, str) else list(words):
        if w not in got:
            return 0.0
        got.remove(w)
    return float(got == source)


def _list_remove(pred: str, record: dict, strict: bool) -> float:
    got = T.parse_list(pred, strict, "parallelbench")
    if got is None:
        return 0.0
    source = list(record["answer"]["input"])
    k = int(record["answer"].get("n_words", 1))
    if len(got) != len(source) - k:
        return 0.0
    gone = set(source) - set(got)
    if len(gone) != k:
        return 0.0
    for w in gone:
        source.remove(w)
    return float(got == source)


def _list_replace(pred: str, record: dict, strict: bool) -> float:
    got = T.parse_list(pred, strict, "parallelbench")
    source = list(record["answer"]["input"])
    if got is None or len(got) != len(source):
        return 0.0
    word = record["answer"].get("word")
    if word is None:  # any one replacement
        return float(sum(a != b for a, b in zip(got, source)) == int(record["answer"].get("n_words", 1)))
    if word not in got:
        return 0.0
    source[got.index(word)] = word
    return float(got == source)


def _latin(pred: str, record: dict, strict: bool) -> float:
    """The original's rule (it has no strict variant, so ``score_strict == score``): keep the output lines
    whose cells form exactly the symbol set, need at least ``size`` of them, and the first ``size`` must form
    a Latin square (and match ``first_row`` / ``givens`` when the answer has them). Cells are separated by
    commas, or by whitespace in ``style: short`` records."""
    answer = record["answer"]
    symbols = set(answer["symbols"])
    size = len(symbols)
    short = (record.get("metadata") or {}).get("style") == "short"

    def cells(line: str) -> list[str]:
        return line.split() if short else [c.strip() for c in line.split(",")]

    lines = [ln.strip() for ln in ("" if pred is None else str(pred)).split("\n") if ln.strip()]
    rows = [cells(ln) for ln in lines if set(cells(ln)) == symbols]
    if len(rows) < size:
        return 0.0
    rows = rows[:size]
    if any(set(r) != symbols for r in rows) or any(set(c) != symbols for c in zip(*rows)):
        return 0.0
    if answer.get("first_row") is not None and rows[0] != list(answer["first_row"]):
        return 0.0
    for cell, value in (answer.get("givens") or {}).items():
        r, c = divmod(int(cell), size)
        if len(rows[r]) <= c or rows[r][c] != value:
            return 0.0
    return 1.0


def _sudoku(pred: str, record: dict, strict: bool) -> float:
    got = parse_sudoku(pred, strict)
    return float(got is not None and got == parse_sudoku(record["answer"], strict=True))


_FLOAT_METRICS: dict[str, Callable[[str, dict, bool], float]] = {
    "list_match_score": _list_match,
    "list_shuffle_score": _list_shuffle,
    "list_random_insert_score": _list_insert,
    "list_random_remove_score": _list_remove,
    "list_random_replace_score": _list_replace,
    "latin_square_score": _latin,
    "sudoku_score": _sudoku,
}


# ----------------------------------------------------------------------------------------------------------
# Text metrics and their optional backends

_BACKEND_NAMES = ("grammar", "rouge", "bertscore")
_user_backends: dict[str, Any] = {}
_probed: dict[str, tuple[Callable | None, str | None]] = {}


def set_text_backend(name: str, fn: Callable | bool | None) -> None:
    """Plug in a text-metric implementation, or reset it.

    ``name``: ``"grammar"`` (``fn(text) -> bool``, True when the text has no grammar error),
    ``"rouge"`` (``fn(prediction, reference) -> {"rouge1", "rouge2", "rougeL"}`` F-measures) or
    ``"bertscore"`` (``fn(prediction, reference) -> F1``). ``fn=False`` marks the metric unavailable;
    ``None`` goes back to the automatic probe (LanguageTool, ``rouge-score``, ``bert-score``).
    """
    if name not in _BACKEND_NAMES:
        raise ValueError(f"unknown text backend {name!r}; known: {', '.join(_BACKEND_NAMES)}")
    if fn is None:
        _user_backends.pop(name, None)
    else:
        _user_backends[name] = fn
    _probed.pop(name, None)


def _probe_grammar() -> Callable:
    import language_tool_python  # noqa: F401  (optional dependency)

    tool = language_tool_python.LanguageTool("en-US", config={"maxCheckThreads": 1, "maxSpellingSuggestions": 1})
    return lambda text: len(tool.check(text)) == 0


def _probe_rouge() -> Callable:
    from rouge_score import rouge_scorer  # optional dependency

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)

    def fn(prediction: str, reference: str) -> dict:
        s = scorer.score(reference, prediction)
        return {k: float(s[k].fmeasure) for k in ("rouge1", "rouge2", "rougeL")}

    return fn


def _probe_bertscore() -> Callable:
    import bert_score  # optional dependency

    scorer = bert_score.BERTScorer(lang="en")  # roberta-large, layer 17: what the original uses for lang="en"

    def fn(prediction: str, reference: str) -> float:
        return float(scorer.score([prediction], [reference])[2][0])

    return fn


_PROBES = {"grammar": (_probe_grammar, "LanguageTool (pip install language-tool-python; needs Java and its "
                                       "server download)"),
           "rouge": (_probe_rouge, "ROUGE (pip install rouge-score)"),
           "bertscore": (_probe_bertscore, "BERTScore (pip install bert-score; needs the roberta-large weights)")}


def _backend(name: str) -> tuple[Callable | None, str | None]:
    """(implementation, None) or (None, why it is unavailable); probed once per process."""
    if name in _user_backends:
        fn = _user_backends[name]
        return (None, "disabled") if fn is False else (fn, None)
    if name not in _probed:
        probe, what = _PROBES[name]
        try:
            _probed[name] = (probe(), None)
        except Exception as exc:  # noqa: BLE001 - any failure to load means "unavailable"
            _probed[name] = (None, f"{what}: {type(exc).__name__}: {exc}".strip())
    return _probed[name]


def text_backend_status() -> dict[str, str]:
    """``{"grammar" | "rouge" | "bertscore": "available" or the reason it is not}`` (probes them)."""
    return {name: (reason or "available") for name in _BACKEND_NAMES for _fn, reason in [_backend(name)]}


def _grammar(text: str) -> float | None:
    if not text.strip():
        return 0.0  # the original counts an empty text as ungrammatical, no checker needed
    fn, _ = _backend("grammar")
    return None if fn is None else float(bool(fn(text.strip())))


@functools.lru_cache(maxsize=2)
def _bleu_metric(smooth: bool):
    try:
        from sacrebleu.metrics import BLEU
    except ImportError:
        raise ImportError("BLEU needs the `sacrebleu` package: pip install sacrebleu (or the eval extra: "
                          "pip install -e '.[eval]')") from None
    if smooth:
        return BLEU(effective_order=True)  # what sacrebleu.sentence_bleu uses
    quiet = logging.getLogger("sacrebleu")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # it recommends effective order for sentences; here we mean not to
    try:
        return BLEU(smooth_method="none", effective_order=False)
    finally:
        quiet.setLevel(level)


def bleu(prediction: str, references: str | list[str], *, smooth: bool = True) -> float:
    """Sentence BLEU of ``prediction`` against ``references`` on a 0-1 scale (sacrebleu's score / 100; 13a
    tokenization, n-grams up to 4).

    ``smooth=True`` (default): sacrebleu's ``sentence_bleu`` (exponential smoothing, effective order), so a
    text shorter than four tokens is scored on the n-gram orders it has: ``bleu("hello world", ["hello world"])``
    is 1.0. ``smooth=False``: unsmoothed BLEU over all four orders, what the original ParallelBench computes
    (``evaluate``'s ``bleu``): 0 whenever one order has no match, so 0 for every text under four tokens.
    """
    refs = [references] if isinstance(references, str) else list(references)
    if not prediction.strip() or not refs:
        return 0.0
    return min(1.0, _bleu_metric(smooth).sentence_score(prediction, refs).score / 100.0)  # 100.00000000000004


def _product(parts: dict[str, float | None], allow_partial: bool) -> tuple[float | None, list[str]]:
    """Product of the factors; 0 if any known factor is 0; None if a factor is unknown (unless partial)."""
    missing = [k for k, v in parts.items() if v is None]
    known = [v for v in parts.values() if v is not None]
    if any(v == 0 for v in known):
        return 0.0, missing
    if missing and not allow_partial:
        return None, missing
    return float(math.prod(known)) if known else None, missing


def _w2s_metrics(pred: str, record: dict, allow_partial: bool) -> dict:
    words = record["answer"]["words"]
    inclusion = float(all(w in pred for w in words))
    grammar = _grammar(pred)
    score, missing = _product({"inclusion_score": inclusion, "grammar_score": grammar}, allow_partial)
    return {"metrics": {"inclusion_score": inclusion, "grammar_score": grammar}, "score": score,
            "missing": ["grammar"] if missing else []}


def _summary_metrics(pred: str, record: dict, allow_partial: bool) -> dict:
    pred = pred.strip()
    fn, _ = _backend("rouge")
    rouge = fn(pred, record["answer"]["summary"].strip()) if fn is not None else None
    grammar = _grammar(pred)
    metrics = {f"{k}_score": (None if rouge is None else rouge[k]) for k in ("rouge1", "rouge2", "rougeL")}
    metrics["grammar_score"] = grammar
    score, missing = _product({"rouge": metrics["rougeL_score"], "grammar": grammar}, allow_partial)
    return {"metrics": metrics, "score": score, "missing": missing}


def _paraphrase_metrics(pred: str, record: dict, allow_partial: bool) -> dict:
    pred = pred.strip()
    if not pred:
        zero = {"inv_bleu_score": 0.0, "bertscore_score": 0.0, "grammar_score": 0.0}
        return {"metrics": zero, "score": 0.0, "missing": []}
    text = record["answer"]["text"]
    fn, _ = _backend("bertscore")
    try:
        inv_bleu = 1.0 - bleu(pred, [text])
    except ImportError:
        inv_bleu = None
    metrics = {"inv_bleu_score": inv_bleu,
               "bertscore_score": None if fn is None else float(fn(pred, text)),
               "grammar_score": _grammar(pred)}
    parts = {"bleu": metrics["inv_bleu_score"], "bertscore": metrics["bertscore_score"],
             "grammar": metrics["grammar_score"]}
    score, missing = _product(parts, allow_partial)
    return {"metrics": metrics, "score": score, "missing": missing}


_TEXT_METRICS: dict[str, Callable[[str, dict, bool], dict]] = {
    "sentence_to_words_score": _w2s_metrics,
    "summary_score": _summary_metrics,
    "paraphrase_score": _paraphrase_metrics,
}

METRICS: tuple[str, ...] = tuple(_FLOAT_METRICS) + tuple(_TEXT_METRICS)


def metric_for(name: str, config: dict | None = None) -> str:
    """The original's metric name for a task (``task_config`` entry first, then the built-in table)."""
    if config and isinstance(config.get("metric"), str):
        return config["metric"]
    task = base_task(name)
    if task is None:
        raise KeyError(f"no metric known for task {name!r}; add a task_config.yaml with a 'metric' or add a "
                       f"'metric' key to the line (known metrics: {', '.join(METRICS)})")
    return task.metric


def score_prediction(name: str, record: dict, prediction: str | None, *, config: dict | None = None,
                     metric: str | None = None, allow_partial: bool = False) -> dict:
    """Score one prediction against one record.

    Returns ``{"score", "score_strict"}`` (0/1 for list and puzzle tasks; floats for text tasks, which have
    no strict variant, so ``score_strict == score``), plus for text tasks ``"metrics"`` (each component,
    ``None`` where unavailable) and, when a missing component leaves the score undecided,
    ``"unavailable"`` (its names) and ``"unavailable_reason"`` with ``score = None`` - or, with
    ``allow_partial``, the product of the components that are available and ``"partial": True``. A
    component that is 0 decides the score (0) whatever is unavailable.
    """
    metric = metric or metric_for(name, config)
    pred = "" if prediction is None else str(prediction)
    if metric in _FLOAT_METRICS:
        fn = _FLOAT_METRICS[metric]
        return {"score": fn(pred, record, False), "score_strict": fn(pred, record, True)}
    if metric not in _TEXT_METRICS:
        raise KeyError(f"unknown metric {metric!r}; known metrics: {', '.join(METRICS)}")
    res = _TEXT_METRICS[metric](pred, record, allow_partial)
    out = {"score": res["score"], "score_strict": res["score"], "metrics": res["metrics"]}
    if res["missing"] and (res["score"] is None or res["score"] != 0.0):  # a 0 factor decides without them
        reasons = {m: _backend(m)[1] for m in res["missing"] if m in _BACKEND_NAMES}
        out["unavailable"] = sorted(res["missing"])
        out["unavailable_reason"] = "; ".join(f"{k}: {v}" for k, v in reasons.items() if v)
        if allow_partial and res["score"] is not None:
            out["partial"] = True
    return out
