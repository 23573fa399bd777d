"""Records in the original schema: the project's word sets and generators, user data files, suite files."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from dllm.evals import tasks as T
from dllm.evals.io import read_jsonl, write_jsonl
from dllm.evals.parallelbench.prompts import prompt_for
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
        raise DataNeeded(f"{task.pb_name}: data file {str(path)!r} not found ({DATA_HINT.get(task.pb_name, '')})")
    rows = read_jsonl(path)
    records = []
    for i, row in enumerate(rows):
        if "input" in row and "answer" in row:
            records.append(row)
            continue
        text = row.get("dialogue", row.get("text")) if task.metric == "summary_score" else row.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{path}:{i + 1}: no text field for {task.pb_name} ({DATA_HINT[task.pb_name]})")
        if task.metric == "summary_score":
            if not isinstance(row.get("summary"), str):
                raise ValueError(f"{path}:{i + 1}: no 'summary' field ({DATA_HINT[task.pb_name]})")
            answer = {"text": text, "summary": row["summary"]}
        else:
            answer = {"text": text}
            refs = row.get("paraphrases", row.get("examples"))
            if refs is not None:
                answer["examples"] = refs if isinstance(refs, str) else str(list(refs))
        records.append({"input": {"text": text}, "answer": answer, "metadata": {"length": 1}})
    limit = task.num_samples if n is None else int(n)
    if len(records) > limit:
        keep = sorted(random.Random(f"dllm/parallelbench/{task.pb_name}/{int(seed)}").sample(range(len(records)), limit))
        records = [records[i] for i in keep]
    return records


# ----------------------------------------------------------------------------------------------------------
# Files


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
    return T.match_names(ordered, pattern, ALIASES)


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
