"""Records in the original schema: the project's word sets and generators, user data files, suite files."""

from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path
from typing import Any

from dllm.evals import tasks as T
from dllm.evals.io import read_jsonl, read_jsonl_lines, write_jsonl  # noqa: F401 - PB.read_jsonl, as before
from dllm.evals.parallelbench.metrics import METRICS, metric_for
from dllm.evals.parallelbench.parsing import parse_sudoku
from dllm.evals.parallelbench.prompts import messages_for, prompt_for
from dllm.evals.parallelbench.tasks import (
    ALIASES,
    DEFAULT_SEED,
    LATIN_POOL_FULL,
    STYLES,
    TASKS,
    DataNeeded,
    get_task,
    task_names,
)

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
    return len(T.parse_list(text, rules="parallelbench") or [])


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
                                                              "metadata": {"length": T.GRID_SIZE, **extra}}]},
                        "answer": m_ans, "metadata": {"length": T.GRID_SIZE, **extra}})
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
    cat, leaf = task.pb_name.split("/", 1)
    if task.needs_data:
        if data is None:
            raise DataNeeded(f"{task.pb_name} has no offline source: pass a data file ({DATA_HINT[task.pb_name]})")
        return load_text_data(task.pb_name, data, n=n, seed=seed)
    if cat == "waiting_line":
        return _wl_records(leaf, count, seed, style, index_base, sort_by)
    if task.pb_name == "puzzle/latin_square_n4":
        return _latin_records(count, seed, style)
    if task.pb_name == "puzzle/sudoku_n4_12":
        return _sudoku_records(count, seed, style, sudoku_givens)
    return _generate_w2s(leaf, count, seed)


DATA_HINT = {
    "paraphrase_summarize/samsum": "JSONL rows with 'dialogue' (or 'text') and 'summary', or original records",
    "paraphrase_summarize/chatgpt-paraphrases": "JSONL rows with 'text' (and optionally 'paraphrases'), or "
    "original records",
}


def load_text_data(name: str, path: str | Path, n: int | None = None, seed: int = DEFAULT_SEED, *,
                   template: str | None = None, metric: str | None = None,
                   template_source: str | None = None) -> list[dict]:
    """Records for the summarization / paraphrasing task from a user-supplied JSONL file.

    Accepted rows: original records (``input.text`` plus ``answer.summary`` / ``answer.text``), or flat rows
    as the public datasets ship them: ``{"dialogue" | "text", "summary"}`` for SAMSum-style summaries and
    ``{"text", "paraphrases" | "examples"}`` for paraphrases. With more rows than ``n`` (default 100), ``n``
    rows are drawn with a seeded RNG (file order kept). Every row is checked (:func:`check_records`) against
    ``template`` and ``metric`` (default: the task's built-in prompt and metric); a file without rows, or a row
    the prompt or the metric cannot use, raises ``ValueError`` naming the file and line.
    """
    task = get_task(name)
    path = Path(path)
    if not path.is_file():
        raise DataNeeded(f"{task.pb_name}: data file {str(path)!r} not found ({DATA_HINT.get(task.pb_name, '')})")
    numbered = read_jsonl_lines(path)
    rows, labels = [row for _, row in numbered], [f"{path}:{i}" for i, _ in numbered]
    if not rows:
        raise ValueError(f"{path}: no records for {task.pb_name}; the file is empty ({DATA_HINT[task.pb_name]})")
    records = []
    for where, row in zip(labels, rows):
        if "input" in row and "answer" in row:
            records.append(row)
            continue
        text = row.get("dialogue", row.get("text")) if task.metric == "summary_score" else row.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}: no text field for {task.pb_name} ({DATA_HINT[task.pb_name]})")
        if task.metric == "summary_score":
            if not isinstance(row.get("summary"), str):
                raise ValueError(f"{where}: no 'summary' field ({DATA_HINT[task.pb_name]})")
            answer = {"text": text, "summary": row["summary"]}
        else:
            answer = {"text": text}
            refs = row.get("paraphrases", row.get("examples"))
            if refs is not None:
                answer["examples"] = refs if isinstance(refs, str) else str(list(refs))
        records.append({"input": {"text": text}, "answer": answer, "metadata": {"length": 1}})
    check_records(task.pb_name, records, template=prompt_for(task.pb_name) if template is None else template,
                  metric=task.metric if metric is None else metric, labels=labels,
                  template_source=template_source, data_source=str(path))
    limit = task.num_samples if n is None else int(n)
    if len(records) > limit:
        keep = sorted(random.Random(f"dllm/parallelbench/{task.pb_name}/{int(seed)}").sample(range(len(records)), limit))
        records = [records[i] for i in keep]
    return records


# ----------------------------------------------------------------------------------------------------------
# Checks: what the prompt and the metrics read from a record, checked when the data is read


_FIX_TEMPLATE = ("a prompt is a str.format template over the fields of each record's 'input'; write {{ and }} for "
                 "literal braces")


def template_fields(template: str) -> tuple[list[str], str | None]:
    """The record fields a prompt template reads (``{context}`` -> ``context``; ``{a.b}``, ``{a[0]}`` -> ``a``)
    and the template's syntax error, if any (``None``): positional fields (``{}``, ``{0}``) are errors too, as
    the template is filled with the record's named fields."""
    fields: list[str] = []
    problems: list[str] = []

    def walk(text: str, depth: int) -> None:
        for _literal, fname, spec, _conv in string.Formatter().parse(text):
            if fname is None:
                continue
            root = re.match(r"[^.\[]*", fname).group(0)
            if root == "" or root.isdigit():
                problems.append(f"positional field {{{fname}}}")
            elif root not in fields:
                fields.append(root)
            if spec and depth < 2:
                walk(spec, depth + 1)

    try:
        walk(template, 0)
    except ValueError as exc:  # unbalanced braces, a bad conversion ...
        problems.append(str(exc))
    return fields, "; ".join(problems) or None


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _example_problem(answer: Any) -> str | None:
    if isinstance(answer, str):
        return None
    if isinstance(answer, dict) and isinstance(answer.get("example"), str):
        return None
    return (f"'answer' must be the reference string, or an object with the reference under a string 'example', "
            f"got {_describe(answer)}")


def _describe(v: Any) -> str:
    if isinstance(v, dict):
        return f"an object with keys {sorted(v)}" if v else "an empty object"
    return f"{type(v).__name__} {json.dumps(v)[:60]}"


_SOURCE_LIST = "an object with 'input' (the source list: a JSON array of strings)"


def answer_problem(metric: str, answer: Any) -> str | None:
    """What keeps ``metric`` (:data:`~dllm.evals.parallelbench.METRICS`) from scoring against ``answer`` (a
    record's ``answer``), or ``None``: the types the metric reads (see the record schema)."""
    if metric == "list_match_score":
        return _example_problem(answer)
    if metric in ("list_shuffle_score", "list_random_insert_score", "list_random_remove_score",
                  "list_random_replace_score"):
        if not isinstance(answer, dict) or not _is_str_list(answer.get("input")):
            return f"'answer' must be {_SOURCE_LIST} for {metric}, got {_describe(answer)}"
        word = answer.get("word")
        if metric == "list_random_insert_score" and not (word is None or isinstance(word, str) or _is_str_list(word)):
            return f"'answer.word' must be a string (the name to insert) or an array of strings, got {_describe(word)}"
        if metric == "list_random_replace_score" and not (word is None or isinstance(word, str)):
            return f"'answer.word' must be a string (the new name), got {_describe(word)}"
        k = answer.get("n_words")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            return f"'answer.n_words' must be a positive integer, got {_describe(k)}"
        return None
    if metric == "latin_square_score":
        if not isinstance(answer, dict) or not (_is_str_list(answer.get("symbols")) or
                                                isinstance(answer.get("symbols"), str)) or not answer["symbols"]:
            return ("'answer' must be an object with 'symbols' (the square's symbols: an array of strings) for "
                    f"{metric}, got {_describe(answer)}")
        size = len(set(answer["symbols"]))
        first = answer.get("first_row")
        if first is not None and not _is_str_list(first):
            return f"'answer.first_row' must be an array of strings, got {_describe(first)}"
        givens = answer.get("givens")
        if givens is not None:
            if not isinstance(givens, dict):
                return f"'answer.givens' must be an object mapping cell numbers to symbols, got {_describe(givens)}"
            for cell, value in givens.items():
                if not (str(cell).isdigit() and int(cell) < size * size and isinstance(value, str)):
                    return (f"'answer.givens' must map cell numbers 0-{size * size - 1} to symbol strings, got "
                            f"{json.dumps(cell)}: {json.dumps(value)}")
        return None
    if metric == "sudoku_score":
        if not isinstance(answer, str) or parse_sudoku(answer, strict=True) is None:
            return (f"'answer' must be the solved grid for {metric}: a string of 4 lines of 4 digits, got "
                    f"{_describe(answer)}")
        return None
    need = {"sentence_to_words_score": ("words", "an array of strings (the words to use)", _is_str_list),
            "summary_score": ("summary", "a string (the reference summary)", lambda v: isinstance(v, str)),
            "paraphrase_score": ("text", "a string (the source text)", lambda v: isinstance(v, str))}.get(metric)
    if need is None:
        raise ValueError(f"unknown metric {metric!r}; known metrics: {', '.join(METRICS)}")
    key, what, ok = need
    if not isinstance(answer, dict) or not ok(answer.get(key)):
        return f"'answer' must be an object with {key!r}: {what}, for {metric}; got {_describe(answer)}"
    return None


def _shape_problem(record: Any, metric: str) -> str | None:
    """Fields every record needs: ``input`` (an object), ``answer`` (what the metric reads), ``metadata`` (an
    object, if present), ``input.icl_examples`` (an array of records with ``input`` and an answer, if present)."""
    if not isinstance(record.get("input"), dict):
        got = "no 'input' field" if "input" not in record else f"'input' is {_describe(record['input'])}"
        return f"{got}; each record needs 'input' (an object of the prompt's fields) and 'answer'"
    if "answer" not in record:
        return "no 'answer' field; each record needs 'input' (an object of the prompt's fields) and 'answer'"
    problem = answer_problem(metric, record["answer"])
    if problem is not None:
        return problem
    if record.get("metadata") is not None and not isinstance(record["metadata"], dict):
        return f"'metadata' must be an object, got {_describe(record['metadata'])}"
    shots = record["input"].get("icl_examples")
    if shots is None:
        return None
    if not isinstance(shots, list):
        return f"'input.icl_examples' must be an array of worked examples, got {_describe(shots)}"
    for j, shot in enumerate(shots):
        if not isinstance(shot, dict) or not isinstance(shot.get("input"), dict) or "answer" not in shot:
            return (f"input.icl_examples[{j}] must be an object with 'input' (an object of the prompt's fields) "
                    f"and 'answer', got {_describe(shot)}")
        problem = _example_problem(shot["answer"])
        if problem is not None:
            return f"input.icl_examples[{j}]: {problem}"
    return None


def check_records(name: str, records: list[dict], *, template: str, metric: str, labels: list[str] | None = None,
                  template_source: str | None = None, data_source: str | None = None) -> None:
    """Refuse records that task ``name``'s prompt ``template`` or its ``metric`` cannot use, before anything is
    generated: ``ValueError`` naming the record (``labels[i]``, e.g. ``file:line``), the field and the fix, or
    naming the template (``template_source``: the file it comes from) when the template itself is wrong: a syntax
    error, or a field no record has."""
    if metric not in METRICS:
        raise ValueError(f"{template_source or name}: unknown metric {metric!r} for {name}; known metrics: "
                         f"{', '.join(METRICS)}")
    labels = labels or [f"{data_source or name}: record {k}" for k in range(1, len(records) + 1)]
    for where, record in zip(labels, records):
        problem = _shape_problem(record, metric)
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
    prompt_src = template_source or f"the built-in prompt of {name}"
    fields, syntax = template_fields(template)
    inputs = [(where, f"input.icl_examples[{j}].input", shot["input"]) for where, r in zip(labels, records)
              for j, shot in enumerate(r["input"].get("icl_examples") or [])]
    inputs += [(where, "input", r["input"]) for where, r in zip(labels, records)]
    unknown = [f for f in fields if not any(f in inp for _, _, inp in inputs)]
    if unknown or syntax:
        have = sorted({k for _, _, inp in inputs for k in inp if k != "icl_examples"})
        parts = []
        if unknown:
            parts.append(f"it uses the field(s) {', '.join(map(repr, unknown))}, which no record"
                         + (f" of {data_source}" if data_source else "") + f" has in its input (the records' fields: "
                         f"{', '.join(have) or 'none'})")
        if syntax:
            parts.append(f"it is not a valid template ({syntax})")
        raise ValueError(f"{prompt_src}: the prompt of {name}: {'; '.join(parts)}; {_FIX_TEMPLATE}")
    for where, what, inp in inputs:
        missing = [f for f in fields if f not in inp]
        if missing:
            raise ValueError(f"{where}: {what} has no field {', '.join(map(repr, missing))}, which the prompt of "
                             f"{name} uses ({prompt_src}); add it to the record (its fields: "
                             f"{', '.join(sorted(k for k in inp if k != 'icl_examples')) or 'none'})")
    for where, record in zip(labels, records):
        try:
            messages_for(record, template)
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: the prompt of {name} ({prompt_src}) cannot be filled with this record's "
                             f"input ({type(exc).__name__}: {exc}); fix the record or the prompt") from None


# ----------------------------------------------------------------------------------------------------------
# Files


def _task_file(data_dir: Path, name: str) -> Path:
    return Path(data_dir) / f"{name}.jsonl"


_CONFIG_FIX = ("it must map each task name to its settings (prompt, metric, max_tokens ...), in YAML or JSON: fix "
               "it, or remove it to use the built-in prompts and metrics")


def _read_config_file(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); {_CONFIG_FIX}") from None
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML ships with transformers
        try:
            conf = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                             f"{_CONFIG_FIX}") from None
    else:
        try:
            conf = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
            raise ValueError(f"{path}: not valid YAML ({problem}{where}); {_CONFIG_FIX}") from None
    if conf is not None and not isinstance(conf, dict):
        raise ValueError(f"{path}: expected a mapping of task names to settings, got {type(conf).__name__}; "
                         f"{_CONFIG_FIX}")
    return conf or {}


def config_file(data_dir: str | Path, name: str) -> Path:
    """``<data_dir>/<category>/task_config.yaml``: where the prompt and metric of task ``name`` are configured."""
    return Path(data_dir) / name.split("/", 1)[0] / "task_config.yaml"


def load_task_config(data_dir: str | Path, name: str) -> dict | None:
    """The entry for ``name`` in ``<data_dir>/<category>/task_config.yaml`` (YAML or JSON), if any. A file that
    does not parse, an entry that is not a mapping, or a ``prompt`` / ``metric`` / ``max_tokens`` of the wrong
    type (or an unknown metric) raises ``ValueError`` naming the file."""
    path = config_file(data_dir, name)
    if not path.is_file():
        return None
    entry = _read_config_file(path).get(name)
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: the entry of {name} must be a mapping of its settings (prompt, metric, "
                         f"max_tokens ...), got {type(entry).__name__}")
    if entry.get("prompt") is not None and not isinstance(entry["prompt"], str):
        raise ValueError(f"{path}: {name}: 'prompt' must be a string (a str.format template over the record's "
                         f"input), got {type(entry['prompt']).__name__}")
    metric = entry.get("metric")
    if metric is not None and metric not in METRICS:
        raise ValueError(f"{path}: {name}: unknown metric {metric!r}; known metrics: {', '.join(METRICS)} (or "
                         "remove 'metric' to use the task's built-in metric)")
    tokens = entry.get("max_tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
        raise ValueError(f"{path}: {name}: 'max_tokens' must be a positive integer, got {tokens!r}")
    return entry


def prompt_source(data_dir: str | Path | None, name: str, config: dict | None) -> str:
    """Where task ``name``'s prompt comes from, for messages: its ``task_config.yaml``, or the built-in prompt."""
    if data_dir is not None and config and isinstance(config.get("prompt"), str):
        return str(config_file(data_dir, name))
    return f"the built-in prompt of {name}"


def available_tasks(data_dir: str | Path, pattern: str | None = None) -> list[str]:
    """Task names with a ``<category>/<task>.jsonl`` file under ``data_dir`` (built-in order first, then
    any other tasks found, e.g. the original's ``waiting_line_n15/*``), filtered by ``pattern``."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"data directory {str(root)!r} not found")
    found = sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob("*/*.jsonl"))
    found = [f for f in found if not f.split("/")[-1].startswith("_")]
    ordered = [t for t in TASKS if t in found] + [f for f in found if f not in TASKS]
    return T.match_names(ordered, pattern, ALIASES)


def load_records(data_dir: str | Path, name: str, style: str = "full") -> list[dict]:
    """Records of task ``name`` from ``<data_dir>/<name>.jsonl``, checked (:func:`check_records`) against the
    prompt and metric they run with (the directory's ``task_config.yaml`` entry, else the built-in ones of
    ``style``): an empty file, or a record the prompt or the metric cannot use, raises ``ValueError`` naming
    the file, the line and the field."""
    path = _task_file(Path(data_dir), name)
    if not path.is_file():
        raise FileNotFoundError(f"no file for task {name!r}: {str(path)!r} does not exist")
    numbered = read_jsonl_lines(path)
    records = [row for _, row in numbered]
    if not records:
        raise ValueError(f"{path}: task {name} has no samples (the file holds no records); add records, or remove "
                         "the file (or leave the task out of --tasks)")
    config = load_task_config(data_dir, name)
    check_records(name, records, template=prompt_for(name, style, config), metric=metric_for(name, config),
                  labels=[f"{path}:{i}" for i, _ in numbered], template_source=prompt_source(data_dir, name, config),
                  data_source=str(path))
    return records


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
    data = {get_task(k).pb_name: v for k, v in (text_data or {}).items()}
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
