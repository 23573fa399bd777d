"""ParallelBench-compatible suite: the 17 task types, the original JSONL record schema, and the scorers.

ParallelBench (Kang et al., 2025) measures what parallel decoding costs in quality on tasks whose output
tokens depend on each other. This module is an independent implementation that reads and writes the same
record schema, so files produced here run through the original's loader and the original's own data files
run here without conversion. Sweeps live in :mod:`dllm.evals.parallelbench_sweep`, reports (PBx, AUP,
plots) in :mod:`dllm.evals.parallelbench_report`; ``docs/parallelbench.md`` is the user guide.

Tasks (names as in the original)
--------------------------------
* ``waiting_line/{copy, sort, reverse, shuffle, insert_index, insert_random, remove_index, remove_random,
  replace_index, replace_random}``: lists of 3-6 full names, 25 per length, one worked example. The
  generator is :func:`dllm.evals.tasks.generate_waiting_line` (one piece of code for both suites).
* ``puzzle/latin_square_n4`` (any valid 4x4 Latin square over four given symbols) and
  ``puzzle/sudoku_n4_12`` (4x4 Sudoku with a unique solution; 4-12 given cells by default).
* ``words_to_sentence/{easy, medium, hard}``: four words (project-made sets, see :data:`W2S_THEMES`) to use
  in one sentence; easy = one theme, medium = two themes of one domain, hard = four domains.
* ``paraphrase_summarize/samsum`` and ``paraphrase_summarize/chatgpt-paraphrases``: no offline source
  exists, so these load from a user-supplied JSONL file (:func:`load_text_data`); without one they are
  reported as needing data (:class:`DataNeeded`).

Record schema (one JSON object per line)
----------------------------------------
``input`` (the prompt template's fields, plus ``icl_examples``: full records used as worked examples),
``answer`` (the reference string, or a dict for multi-answer tasks with one valid answer under
``"example"``), optional ``output_format`` (a ``[MASK]`` template of the answer), ``metadata``.
Records written here add a few metadata keys the original ignores (``index_base``, ``sort_by``,
``style``). A directory holds ``<category>/<task>.jsonl`` plus one ``<category>/task_config.yaml`` with
each task's ``prompt`` and ``metric`` (written as JSON, which YAML loaders read).

Scoring (per sample 0/1, or a float for text tasks; averages are reported in percent)
------------------------------------------------------------------------------------
Lenient and strict list parsing follow the original's rules (:func:`parse_list`); exact match for
deterministic lists; validity for multi-answer tasks (shuffle: same multiset, different order; random
insert/remove/replace: exactly one valid edit); Latin-square validity; Sudoku exact match (the solution is
unique); words-to-sentence inclusion (case-sensitive substring) and grammar; summaries ROUGE-L x grammar;
paraphrases (1 - BLEU) x BERTScore-F1 x grammar, with sentence BLEU from ``sacrebleu`` (smoothed, see
:func:`bleu`). Grammar (LanguageTool), ROUGE (``rouge-score``) and
BERTScore (``bert-score`` + its model) are used when importable and loadable, and reported as unavailable
(score ``None``, never 0) when not; :func:`set_text_backend` plugs in other implementations.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import math
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dllm.evals import tasks as T

__all__ = [
    "CATEGORIES",
    "DEFAULT_SEED",
    "METRICS",
    "STYLES",
    "TASKS",
    "W2S_THEMES",
    "DataNeeded",
    "PBTask",
    "available_tasks",
    "bleu",
    "generate_task",
    "get_task",
    "load_records",
    "load_task_config",
    "load_text_data",
    "max_tokens_for",
    "messages_for",
    "metric_for",
    "parse_list",
    "parse_sudoku",
    "prompt_for",
    "read_jsonl",
    "score_prediction",
    "set_text_backend",
    "task_names",
    "text_backend_status",
    "write_jsonl",
    "write_suite",
]

#: Default data seed (held out from the tiny models' training data, which uses seeds 1000+).
DEFAULT_SEED = 12345
STYLES = ("full", "short")
WAITING_LINE_OPS = T.WAITING_LINE_OPS
LATIN_POOL_FULL = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


class DataNeeded(FileNotFoundError):
    """A task has no offline source and no data file was given (summarization, paraphrasing)."""


# ----------------------------------------------------------------------------------------------------------
# Task table


@dataclass(frozen=True)
class PBTask:
    """One of the 17 tasks: its name, the original's metric name, prompt templates and output budget.

    ``prompt`` is the original wording (``style="full"``); ``short_prompt`` the project's short wording
    (``style="short"``, the prompts the bundled tiny models are trained on), when one exists.
    """

    name: str
    metric: str
    prompt: str
    short_prompt: str | None
    max_tokens: int
    num_samples: int
    icl: int
    needs_data: bool = False
    description: str = ""

    @property
    def category(self) -> str:
        return self.name.split("/", 1)[0]


_LIST_METRIC = {
    "shuffle": "list_shuffle_score", "insert_random": "list_random_insert_score",
    "remove_random": "list_random_remove_score", "replace_random": "list_random_replace_score",
}
# The original's waiting-line prompts end with a newline, except replace_random's.
_WL_FULL = {op: T._FULL_PROMPTS[op] + ("" if op == "replace_random" else "\n") for op in WAITING_LINE_OPS}
_SUDOKU_FULL = T._SUDOKU_PROMPTS["full"].replace("{blank}", "0").replace("{grid}", "{sudoku}") + "\n"
_SUDOKU_SHORT = T._SUDOKU_PROMPTS["short"].replace("{grid}", "{sudoku}")
_LATIN_FULL = "Generate a Latin square of size {size} with the symbols {symbols}. Only output the final result as CSV."
_LATIN_SHORT = T._LATIN_PROMPTS["short"]
_W2S_PROMPT = "Construct a single, coherent sentence using the words {words}."
_SUMMARY_PROMPT = "Summarize the following conversation. Only output the final result.\n\n{text}\n\nSummary:"
_PARAPHRASE_PROMPT = "Paraphrase the following sentence. Only output the final result.\n\nSentence: {text}\n\nParaphrase:"

TASKS: dict[str, PBTask] = {}
for _op in WAITING_LINE_OPS:
    TASKS[f"waiting_line/{_op}"] = PBTask(
        f"waiting_line/{_op}", _LIST_METRIC.get(_op, "list_match_score"), _WL_FULL[_op], T._SHORT_PROMPTS[_op],
        32, 100, 1, description=T._DESCRIPTIONS[_op])
TASKS["puzzle/latin_square_n4"] = PBTask("puzzle/latin_square_n4", "latin_square_score", _LATIN_FULL, _LATIN_SHORT,
                                         64, 100, 1, description="any 4x4 Latin square over the symbols")
TASKS["puzzle/sudoku_n4_12"] = PBTask("puzzle/sudoku_n4_12", "sudoku_score", _SUDOKU_FULL, _SUDOKU_SHORT, 64, 108, 1,
                                      description="4x4 Sudoku with a unique solution")
for _level, _desc in (("easy", "related"), ("medium", "loosely related"), ("hard", "unrelated")):
    TASKS[f"words_to_sentence/{_level}"] = PBTask(
        f"words_to_sentence/{_level}", "sentence_to_words_score", _W2S_PROMPT, None, 64, 100, 0,
        description=f"one sentence using four {_desc} words")
TASKS["paraphrase_summarize/samsum"] = PBTask(
    "paraphrase_summarize/samsum", "summary_score", _SUMMARY_PROMPT, None, 64, 100, 0, needs_data=True,
    description="summarize a dialogue (SAMSum-style data file)")
TASKS["paraphrase_summarize/chatgpt-paraphrases"] = PBTask(
    "paraphrase_summarize/chatgpt-paraphrases", "paraphrase_score", _PARAPHRASE_PROMPT, None, 64, 100, 0,
    needs_data=True, description="paraphrase a sentence (data file)")
del _op, _level, _desc

CATEGORIES: dict[str, list[str]] = {}
for _name in TASKS:
    CATEGORIES.setdefault(_name.split("/", 1)[0], []).append(_name)
del _name

_ALIASES = {
    "puzzle/latin_square": "puzzle/latin_square_n4", "puzzle/sudoku": "puzzle/sudoku_n4_12",
    "summarization": "paraphrase_summarize/samsum", "paraphrasing": "paraphrase_summarize/chatgpt-paraphrases",
}


def get_task(name: str) -> PBTask:
    """The built-in task called ``name`` (aliases: ``puzzle/latin_square``, ``puzzle/sudoku``,
    ``summarization``, ``paraphrasing``); KeyError lists the known names."""
    name = _ALIASES.get(name, name)
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown ParallelBench task {name!r}; known tasks: {', '.join(TASKS)}") from None


def _match(names: Iterable[str], pattern: str | None) -> list[str]:
    names = list(names)
    if pattern is None or pattern.strip() in ("", "all", "*"):
        return names
    out: list[str] = []
    for pat in (p.strip() for p in pattern.split(",")):
        if not pat:
            continue
        pat = _ALIASES.get(pat, pat)
        hits = [n for n in names if n == pat or n.split("/", 1)[0] == pat or fnmatch.fnmatchcase(n, pat)]
        out += [h for h in hits if h not in out]
    return out


def task_names(pattern: str | None = None) -> list[str]:
    """Built-in task names, optionally filtered: comma-separated fnmatch patterns or category names
    (``"waiting_line,puzzle"``, ``"waiting_line/*_random"``); ``None``/``"all"`` gives all 17."""
    return _match(TASKS, pattern)


# ----------------------------------------------------------------------------------------------------------
# Words-to-sentence word sets (the project's own): 6 domains x 4 themes x 8 concrete nouns, all distinct,
# none a substring of another (the inclusion check is a substring test).

W2S_THEMES: dict[str, dict[str, tuple[str, ...]]] = {
    "outdoors": {
        "beach": ("sand", "wave", "shell", "towel", "umbrella", "crab", "surfboard", "lighthouse"),
        "forest": ("oak", "owl", "mushroom", "squirrel", "trail", "cabin", "deer", "pinecone"),
        "mountain": ("peak", "glacier", "climber", "rope", "tent", "eagle", "boulder", "summit"),
        "garden": ("flower", "shovel", "seed", "bee", "fence", "hose", "tomato", "butterfly"),
    },
    "home": {
        "kitchen": ("oven", "spoon", "kettle", "knife", "plate", "recipe", "apron", "fridge"),
        "bedroom": ("pillow", "blanket", "lamp", "closet", "mattress", "alarm", "slipper", "curtain"),
        "bathroom": ("soap", "mirror", "sponge", "bathtub", "toothbrush", "shampoo", "faucet", "comb"),
        "living room": ("sofa", "television", "carpet", "fireplace", "bookshelf", "remote", "cushion", "clock"),
    },
    "travel": {
        "airport": ("airplane", "pilot", "ticket", "suitcase", "runway", "passport", "gate", "luggage"),
        "railway": ("locomotive", "platform", "conductor", "whistle", "track", "schedule", "bench", "tunnel"),
        "street": ("bicycle", "traffic", "sidewalk", "taxi", "corner", "bus", "crosswalk", "streetlight"),
        "harbor": ("boat", "anchor", "sailor", "dock", "ferry", "buoy", "seagull", "cargo"),
    },
    "work": {
        "school": ("teacher", "pencil", "notebook", "classroom", "homework", "chalk", "student", "backpack"),
        "office": ("computer", "meeting", "printer", "desk", "manager", "email", "stapler", "coffee"),
        "hospital": ("doctor", "nurse", "patient", "bandage", "medicine", "ambulance", "stethoscope", "wheelchair"),
        "farm": ("tractor", "barn", "cow", "farmer", "hay", "chicken", "field", "goat"),
    },
    "leisure": {
        "music": ("guitar", "drum", "singer", "concert", "piano", "melody", "violin", "choir"),
        "sport": ("ball", "goal", "team", "referee", "stadium", "coach", "helmet", "trophy"),
        "bakery": ("bread", "flour", "cake", "baker", "dough", "cookie", "sugar", "pie"),
        "art": ("painter", "paintbrush", "canvas", "easel", "sculpture", "museum", "gallery", "crayon"),
    },
    "world": {
        "space": ("rocket", "planet", "astronaut", "star", "moon", "telescope", "comet", "satellite"),
        "weather": ("rain", "cloud", "storm", "thunder", "snow", "wind", "fog", "hail"),
        "zoo": ("lion", "elephant", "giraffe", "zookeeper", "monkey", "cage", "penguin", "tiger"),
        "restaurant": ("waiter", "menu", "table", "chef", "bill", "dessert", "soup", "napkin"),
    },
}

_W2S_SENTENCES = (
    "I saw the {0}, the {1}, the {2} and the {3} on the same afternoon.",
    "The story was about the {0}, the {1}, the {2} and the {3}.",
    "She drew a picture of the {0} next to the {1}, with the {2} and the {3} behind them.",
    "We talked about the {0} and the {1} while the {2} stood near the {3}.",
)


def _w2s_words(rng: random.Random, level: str) -> list[str]:
    domains = list(W2S_THEMES)
    if level == "easy":
        theme = W2S_THEMES[rng.choice(domains)]
        return rng.sample(theme[rng.choice(list(theme))], 4)
    if level == "medium":
        themes = W2S_THEMES[rng.choice(domains)]
        a, b = rng.sample(list(themes), 2)
        words = rng.sample(themes[a], 2) + rng.sample(themes[b], 2)
    elif level == "hard":
        words = []
        for dom in rng.sample(domains, 4):
            themes = W2S_THEMES[dom]
            words.append(rng.choice(themes[rng.choice(list(themes))]))
    else:
        raise ValueError(f"unknown words-to-sentence level {level!r}; known: easy, medium, hard")
    rng.shuffle(words)
    return words


def _join_words(words: list[str]) -> str:
    """``a, b, c, and d`` (the original's serialisation of the word list)."""
    return ", ".join(words[:-1]) + ", and " + words[-1] if len(words) > 1 else words[0]


def _generate_w2s(level: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(f"dllm/parallelbench/words_to_sentence/{level}/{int(seed)}")
    out: list[dict] = []
    seen: set[frozenset] = set()
    while len(out) < n:
        words = _w2s_words(rng, level)
        key = frozenset(words)
        if key in seen:
            continue
        seen.add(key)
        example = rng.choice(_W2S_SENTENCES).format(*words)
        out.append({"input": {"words": _join_words(words)},
                    "answer": {"words": words, "example": example}, "metadata": {"length": len(words)}})
    return out


# ----------------------------------------------------------------------------------------------------------
# Generation (records in the original schema)


def _mask_format(n: int) -> str:
    return T.list_to_str(["[MASK]"] * n)


def _wl_meta(op: str, meta: dict) -> dict:
    out: dict[str, Any] = {"length": meta["length"]}
    if op.split("_")[0] in ("insert", "remove", "replace"):
        out["index"] = meta.get("index")
        if op.split("_")[0] != "remove":
            out["word"] = meta.get("word")
    return out


def _answer_len(answer: str | dict) -> int:
    text = answer if isinstance(answer, str) else answer["example"]
    return len(parse_list(text) or [])


def _wl_records(op: str, n: int, seed: int, style: str, index_base: int, sort_by: str) -> list[dict]:
    icl_lengths = (3, 6) if style == "full" else (3, 3)
    exs = T.generate_waiting_line(op, n, seed, lengths=(3, 6), icl_lengths=icl_lengths, sort_by=sort_by,
                                  index_base=index_base, style=style)
    extra: dict[str, Any] = {}
    if op.endswith("_index"):
        extra["index_base"] = index_base
    if op == "sort":
        extra["sort_by"] = sort_by
    if style != "full":
        extra["style"] = style
    records = []
    for ex in exs:
        icl = []
        for shot in ex.metadata["icl"]:
            icl.append({"input": shot["input"], "answer": shot["answer"],
                        "output_format": _mask_format(_answer_len(shot["answer"])),
                        "metadata": {**_wl_meta(op, shot["metadata"]), **extra}})
        records.append({"input": {**ex.metadata["input"], "icl_examples": icl}, "answer": ex.answer,
                        "output_format": _mask_format(_answer_len(ex.answer)),
                        "metadata": {**_wl_meta(op, ex.metadata), **extra}})
    return sorted(records, key=lambda r: r["metadata"]["length"])  # buckets in ascending length


def _latin_records(n: int, seed: int, style: str) -> list[dict]:
    full = style == "full"
    exs = T.generate_latin_square(n, seed, symbols_pool=LATIN_POOL_FULL if full else T.LATIN_SYMBOLS,
                                  sep="," if full else " ", style=style)
    extra = {} if full else {"style": style}

    def fields(inp: dict, answer: dict) -> tuple[dict, dict]:
        symbols = inp["symbols"] if full else ", ".join(answer["symbols"])
        ans = {"symbols": list(answer["symbols"]), "example": answer["example"]}
        if answer.get("givens"):
            ans["givens"] = answer["givens"]
        return {"size": inp["size"], "symbols": symbols}, ans

    records = []
    for ex in exs:
        shot = ex.metadata["icl"][0]
        s_in, s_ans = fields(shot["input"], shot["answer"])
        m_in, m_ans = fields(ex.metadata["input"], ex.answer)
        records.append({"input": {**m_in, "icl_examples": [{"input": s_in, "answer": s_ans,
                                                              "metadata": {"length": T._SIZE, **extra}}]},
                        "answer": m_ans, "metadata": {"length": T._SIZE, **extra}})
    return records


def _sudoku_records(n: int, seed: int, style: str, givens: tuple[int, int]) -> list[dict]:
    exs = T.generate_sudoku(n, seed, givens=givens, blank="0" if style == "full" else ".", style=style)
    extra = {} if style == "full" else {"style": style}
    records = []
    for ex in exs:
        shot = ex.metadata["icl"][0]
        icl = {"input": dict(shot["input"]), "answer": shot["answer"],
               "metadata": {"length": shot["metadata"]["length"], **extra}}
        records.append({"input": {**ex.metadata["input"], "icl_examples": [icl]}, "answer": ex.answer,
                        "metadata": {"length": ex.metadata["length"], **extra}})
    return sorted(records, key=lambda r: r["metadata"]["length"])


def generate_task(name: str, n: int | None = None, seed: int = DEFAULT_SEED, *, style: str = "full",
                  index_base: int = T.INDEX_BASE, sort_by: str = "last", sudoku_givens: tuple[int, int] = (4, 12),
                  data: str | Path | None = None) -> list[dict]:
    """Records of task ``name`` in the original schema; seeded and deterministic.

    Args:
        n: number of records (default: the original's count, 100; 108 for Sudoku).
        style: ``"full"`` (the original prompts and formats: CSV Latin squares over ``A-Z0-9``, ``0`` for
            empty Sudoku cells, worked examples of 3-6 names) or ``"short"`` (the project's short prompts
            and formats, exactly what :mod:`dllm.evals.tasks` produces for the same seed).
        index_base: 0 (the paper's data) or 1 (the original's later releases; the default) for the
            positions of ``*_index`` tasks.
        sort_by: ``"last"`` (what the prompt asks, the default) or ``"first"`` (the original's labels, which
            are sorted by the full string, i.e. by first name: a known data bug).
        sudoku_givens: range of given cells (the original's file has 12 givens in every puzzle).
        data: the user's data file for the summarization and paraphrasing tasks (:func:`load_text_data`).

    Raises:
        DataNeeded: a summarization/paraphrasing task without ``data``.
    """
    task = get_task(name)
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    count = task.num_samples if n is None else int(n)
    if count < 0:
        raise ValueError("n must be >= 0")
    cat, leaf = task.name.split("/", 1)
    if task.needs_data:
        if data is None:
            raise DataNeeded(f"{task.name} has no offline source: pass a data file ({_DATA_HINT[task.name]})")
        return load_text_data(task.name, data, n=n, seed=seed)
    if cat == "waiting_line":
        return _wl_records(leaf, count, seed, style, index_base, sort_by)
    if task.name == "puzzle/latin_square_n4":
        return _latin_records(count, seed, style)
    if task.name == "puzzle/sudoku_n4_12":
        return _sudoku_records(count, seed, style, sudoku_givens)
    return _generate_w2s(leaf, count, seed)


_DATA_HINT = {
    "paraphrase_summarize/samsum": "JSONL rows with 'dialogue' (or 'text') and 'summary', or original records",
    "paraphrase_summarize/chatgpt-paraphrases": "JSONL rows with 'text' (and optionally 'paraphrases'), or "
    "original records",
}


def load_text_data(name: str, path: str | Path, n: int | None = None, seed: int = DEFAULT_SEED) -> list[dict]:
    """Records for the summarization / paraphrasing task from a user-supplied JSONL file.

    Accepted rows: original records (``input.text`` plus ``answer.summary`` / ``answer.text``), or flat rows
    as the public datasets ship them: ``{"dialogue" | "text", "summary"}`` for SAMSum-style summaries and
    ``{"text", "paraphrases" | "examples"}`` for paraphrases. With more rows than ``n`` (default 100), ``n``
    rows are drawn with a seeded RNG (file order kept).
    """
    task = get_task(name)
    path = Path(path)
    if not path.is_file():
        raise DataNeeded(f"{task.name}: data file {str(path)!r} not found ({_DATA_HINT.get(task.name, '')})")
    rows = read_jsonl(path)
    records = []
    for i, row in enumerate(rows):
        if "input" in row and "answer" in row:
            records.append(row)
            continue
        text = row.get("dialogue", row.get("text")) if task.metric == "summary_score" else row.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{path}:{i + 1}: no text field for {task.name} ({_DATA_HINT[task.name]})")
        if task.metric == "summary_score":
            if not isinstance(row.get("summary"), str):
                raise ValueError(f"{path}:{i + 1}: no 'summary' field ({_DATA_HINT[task.name]})")
            answer = {"text": text, "summary": row["summary"]}
        else:
            answer = {"text": text}
            refs = row.get("paraphrases", row.get("examples"))
            if refs is not None:
                answer["examples"] = refs if isinstance(refs, str) else str(list(refs))
        records.append({"input": {"text": text}, "answer": answer, "metadata": {"length": 1}})
    limit = task.num_samples if n is None else int(n)
    if len(records) > limit:
        keep = sorted(random.Random(f"dllm/parallelbench/{task.name}/{int(seed)}").sample(range(len(records)), limit))
        records = [records[i] for i in keep]
    return records


# ----------------------------------------------------------------------------------------------------------
# Files


def read_jsonl(path: str | Path) -> list[dict]:
    """All JSON objects of a JSONL file (blank lines skipped); errors name the file and line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
    return out


def write_jsonl(path: str | Path, records: Iterable[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def _task_file(data_dir: Path, name: str) -> Path:
    return Path(data_dir) / f"{name}.jsonl"


def _read_config_file(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML ships with transformers
        conf = json.loads(text)
    else:
        conf = yaml.safe_load(text)
    if conf is not None and not isinstance(conf, dict):
        raise ValueError(f"{path}: expected a mapping of task names to settings")
    return conf or {}


def load_task_config(data_dir: str | Path, name: str) -> dict | None:
    """The entry for ``name`` in ``<data_dir>/<category>/task_config.yaml`` (YAML or JSON), if any."""
    path = Path(data_dir) / name.split("/", 1)[0] / "task_config.yaml"
    if not path.is_file():
        return None
    entry = _read_config_file(path).get(name)
    return entry if isinstance(entry, dict) else None


def available_tasks(data_dir: str | Path, pattern: str | None = None) -> list[str]:
    """Task names with a ``<category>/<task>.jsonl`` file under ``data_dir`` (built-in order first, then
    any other tasks found, e.g. the original's ``waiting_line_n15/*``), filtered by ``pattern``."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"data directory {str(root)!r} not found")
    found = sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob("*/*.jsonl"))
    found = [f for f in found if not f.split("/")[-1].startswith("_")]
    ordered = [t for t in TASKS if t in found] + [f for f in found if f not in TASKS]
    return _match(ordered, pattern)


def load_records(data_dir: str | Path, name: str) -> list[dict]:
    """Records of task ``name`` from ``<data_dir>/<name>.jsonl``."""
    path = _task_file(Path(data_dir), name)
    if not path.is_file():
        raise FileNotFoundError(f"no file for task {name!r}: {str(path)!r} does not exist")
    return read_jsonl(path)


def write_suite(out_dir: str | Path, pattern: str | None = None, *, n: int | None = None, seed: int = DEFAULT_SEED,
                style: str = "full", index_base: int = T.INDEX_BASE, sort_by: str = "last",
                sudoku_givens: tuple[int, int] = (4, 12),
                text_data: dict[str, str | Path] | None = None) -> dict[str, Path | str]:
    """Write one JSONL per task (``<out>/<category>/<task>.jsonl``) and a ``task_config.yaml`` per category.

    Returns ``{task: path}``; tasks that need a data file that was not given map to a message instead
    (nothing is written for them). ``text_data`` maps task names (or aliases) to data files.
    """
    out = Path(out_dir)
    names = task_names(pattern)
    if not names:
        raise ValueError(f"no task matches {pattern!r}; known tasks: {', '.join(TASKS)}")
    data = {get_task(k).name: v for k, v in (text_data or {}).items()}
    result: dict[str, Path | str] = {}
    configs: dict[str, dict] = {}
    for name in names:
        task = TASKS[name]
        try:
            records = generate_task(name, n, seed, style=style, index_base=index_base, sort_by=sort_by,
                                    sudoku_givens=sudoku_givens, data=data.get(name))
        except DataNeeded as exc:
            result[name] = f"needs data: {exc}"
            continue
        result[name] = write_jsonl(_task_file(out, name), records)
        entry: dict[str, Any] = {"name": name, "metric": task.metric, "prompt": prompt_for(name, style),
                                 "num_samples": len(records), "icl_example_count": task.icl,
                                 "max_tokens": task.max_tokens, "seed": seed, "generator": "dllm", "style": style}
        if name.endswith("_index"):
            entry["index_base"] = index_base
        if name == "waiting_line/sort":
            entry["sort_by"] = sort_by
        if task.needs_data:
            entry["source"] = str(data[name])
        configs.setdefault(task.category, {})[name] = entry
    for cat, entries in configs.items():
        path = out / cat / "task_config.yaml"
        merged = _read_config_file(path) if path.is_file() else {}  # keep the entries of other tasks
        merged.update(entries)
        path.write_text(json.dumps(merged, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return result


# ----------------------------------------------------------------------------------------------------------
# Prompts


def _base_task(name: str) -> PBTask | None:
    """The built-in task a name from another data set corresponds to (``waiting_line_n15/copy`` ->
    ``waiting_line/copy``, ``words_to_sentence/easy_n3`` -> ``words_to_sentence/easy``)."""
    name = _ALIASES.get(name, name)
    if name in TASKS:
        return TASKS[name]
    cat, _, leaf = name.partition("/")
    if cat.startswith("waiting_line") and leaf in WAITING_LINE_OPS:
        return TASKS[f"waiting_line/{leaf}"]
    if leaf.startswith("latin_square"):
        return TASKS["puzzle/latin_square_n4"]
    if leaf.startswith("sudoku"):
        return TASKS["puzzle/sudoku_n4_12"]
    if cat == "words_to_sentence":
        level = leaf.split("_")[0]
        return TASKS.get(f"words_to_sentence/{level}", TASKS["words_to_sentence/easy"])
    if "samsum" in leaf or "summar" in leaf:
        return TASKS["paraphrase_summarize/samsum"]
    if "paraphrase" in leaf:
        return TASKS["paraphrase_summarize/chatgpt-paraphrases"]
    return None


def prompt_for(name: str, style: str = "full", config: dict | None = None) -> str:
    """The prompt template: the data directory's ``task_config`` entry when given, else the built-in
    template of ``style`` (``short`` falls back to ``full`` for tasks without a short wording)."""
    if config and isinstance(config.get("prompt"), str):
        return config["prompt"]
    task = _base_task(name)
    if task is None:
        raise KeyError(f"no prompt for task {name!r}: add a task_config.yaml with a 'prompt' to its data directory")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    return task.short_prompt if (style == "short" and task.short_prompt) else task.prompt


def metric_for(name: str, config: dict | None = None) -> str:
    """The original's metric name for a task (``task_config`` entry first, then the built-in table)."""
    if config and isinstance(config.get("metric"), str):
        return config["metric"]
    task = _base_task(name)
    if task is None:
        raise KeyError(f"no metric known for task {name!r}; add a task_config.yaml with a 'metric' or add a "
                       f"'metric' key to the line (known metrics: {', '.join(METRICS)})")
    return task.metric


def max_tokens_for(name: str, config: dict | None = None) -> int:
    """Generation budget: the original's ``max_tokens`` (32 waiting line, 128 for its 15-name variant,
    64 otherwise)."""
    if config and isinstance(config.get("max_tokens"), int):
        return config["max_tokens"]
    if name.split("/", 1)[0] == "waiting_line_n15":
        return 128
    task = _base_task(name)
    return task.max_tokens if task is not None else 64


def _render(template: str, fields: dict) -> str:
    return template.format(**fields).replace("\\n", "\n")


def messages_for(record: dict, template: str) -> list[dict]:
    """The chat: one (user, assistant) pair per ``icl_examples`` entry, then the question, as the original
    builds it (``template.format(**input)``, literal ``\\n`` turned into newlines)."""
    msgs: list[dict] = []
    for shot in record["input"].get("icl_examples") or []:
        answer = shot["answer"] if isinstance(shot["answer"], str) else shot["answer"]["example"]
        msgs.append({"role": "user", "content": _render(template, shot["input"])})
        msgs.append({"role": "assistant", "content": answer})
    msgs.append({"role": "user", "content": _render(template, record["input"])})
    return msgs


# ----------------------------------------------------------------------------------------------------------
# Parsing


def parse_list(text: str | None, strict: bool = False) -> list[str] | None:
    """The original's list parsing (not :func:`dllm.evals.tasks.parse_list`, which is more forgiving).

    Lenient: keep the text after the last ``[`` (if any) and before the next ``]`` (if any), split on
    commas, strip double quotes and spaces from each item, drop empty items. Text without brackets is
    parsed as a bare list. Strict: both brackets must be present (text around them is allowed); the inside
    must be ``"a", "b"`` exactly (``", "`` separators, each item in double quotes with no quote inside);
    otherwise None.
    """
    s = "" if text is None else str(text)
    if "[" in s:
        s = s.rsplit("[", 1)[1]
    elif strict:
        return None
    if "]" in s:
        s = s.split("]", 1)[0]
    elif strict:
        return None
    if not strict:
        return [item.strip('" ') for item in s.strip("[]").split(",") if item.strip()]
    items = []
    for item in s.split(", "):
        if not (item.startswith('"') and item.endswith('"')) or '"' in item[1:-1]:
            return None
        items.append(item[1:-1])
    return items


def parse_sudoku(text: str | None, strict: bool = False, n: int = 4) -> list[list[int]] | None:
    """Read an ``n`` x ``n`` digit grid.

    Lenient: drop spaces and commas; every non-empty line with exactly ``n`` digits is a row; there must be
    exactly ``n`` such rows. Strict: exactly ``n`` non-empty lines of exactly ``n`` digits each.
    """
    s = ("" if text is None else str(text)).strip()
    if not strict:
        s = s.replace(" ", "").replace(",", "")
        rows = []
        for line in s.split("\n"):
            if not line.strip():
                continue
            digits = re.findall(r"\d", line)
            if len(digits) == n:
                rows.append([int(d) for d in digits])
        return rows if len(rows) == n else None
    lines = [ln.strip() for ln in s.split("\n") if ln.strip()]
    if len(lines) != n or any(len(ln) != n or not ln.isdigit() for ln in lines):
        return None
    return [[int(c) for c in ln] for ln in lines]


# ----------------------------------------------------------------------------------------------------------
# List and puzzle metrics: (prediction, record, strict) -> 0.0 / 1.0


def _list_match(pred: str, record: dict, strict: bool) -> float:
    got = parse_list(pred, strict)
    if got is None:
        return 0.0
    answer = record["answer"]
    want = parse_list(answer if isinstance(answer, str) else answer["example"])
    return float(got == want)


def _list_shuffle(pred: str, record: dict, strict: bool) -> float:
    got = parse_list(pred, strict)
    source = list(record["answer"]["input"])
    return float(got is not None and sorted(got) == sorted(source) and got != source)


def _list_insert(pred: str, record: dict, strict: bool) -> float:
    got = parse_list(pred, strict)
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
    got = parse_list(pred, strict)
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
    got = parse_list(pred, strict)
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
