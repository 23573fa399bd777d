"""The one task table of both evaluation suites, and the seeded synthetic tasks with their scorers.

:data:`TASKS` holds every task once (:class:`Task`). The synthetic suite (:func:`task_names`, the default)
is the tasks with chat-example generators, a ParallelBench-compatible subset sized for tiny models plus
addition; the ParallelBench suite (:mod:`dllm.evals.parallelbench`) is the 17 tasks of the original, under
its names (``task.pb_name``), with their metrics, prompt templates and output budgets. Both share one list
parser (:func:`parse_list`; ``rules="parallelbench"`` is the original's) and one name filter
(:func:`match_names`).

Families and tasks
------------------
* ``waiting_line``: ``copy``, ``reverse``, ``sort``, ``shuffle``, ``insert_index``, ``remove_index``,
  ``replace_index``, ``insert_random``, ``remove_random``, ``replace_random``. Lists of 3-6 full names
  ("First Last"), written as ``["Ann Lee", "Bob Stone"]`` (ParallelBench's ``list_to_str`` format).
* ``puzzle``: ``latin_square`` (4x4, any valid square over the given symbols) and ``sudoku``
  (4x4 with 2x2 boxes, unique solution, 4-12 given cells).
* ``arithmetic``: ``addition`` (2-4 digit operands).

Every example is a three-turn chat: one worked example of the same task (user turn + assistant answer),
then the real question as the last user turn. Prompts use ParallelBench's wording with the fluff removed
(``style="short"``, the default) so that a full chat stays around 100 tokens with the project tokenizer;
``style="full"`` reproduces ParallelBench's waiting-line wording.

Differences from the original, all explicit options:

* ``sort`` is sorted by last name (what the prompt asks). ``sort_by="first"`` reproduces the original
  data bug (labels sorted by the full string, i.e. by first name).
* Positions in ``*_index`` prompts are 1-based (``INDEX_BASE``); pass ``index_base=0`` for the paper data.
* Grids are written without separators for Sudoku (``1.34``; digits tokenize one per token) and with
  single spaces for Latin squares (``A B C D``); ParallelBench writes Sudoku with ``0`` blanks and Latin
  squares as CSV. The lenient scorers accept either layout.

Generation uses ``random.Random`` seeded from the task name and the seed only (never global state), so
``generate(n, seed)`` is reproducible across processes and different seeds give different examples.
"""

from __future__ import annotations

import fnmatch
import itertools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

__all__ = [
    "FAMILIES",
    "FIRST_NAMES",
    "INDEX_BASE",
    "LAST_NAMES",
    "LIST_RULES",
    "SUITES",
    "TASKS",
    "WAITING_LINE_OPS",
    "Example",
    "Task",
    "count_sudoku_solutions",
    "generate",
    "generate_addition",
    "generate_latin_square",
    "generate_sudoku",
    "generate_waiting_line",
    "get_task",
    "is_latin_square",
    "is_sudoku_solution",
    "list_to_str",
    "parse_grid",
    "parse_list",
    "prompt_words",
    "score",
    "score_strict",
    "sudoku_solutions",
    "suite_aliases",
    "suite_key",
    "suite_tasks",
    "task_names",
]

# ----------------------------------------------------------------------------------------------------------
# Name lists (the project's own; ordinary English names, all distinct)

FIRST_NAMES: tuple[str, ...] = (
    "Alice", "Brian", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack",
    "Karen", "Louis", "Maria", "Nathan", "Olivia", "Peter", "Rachel", "Samuel", "Teresa", "Victor",
    "Wendy", "Adam", "Bella", "Colin", "Diana", "Edward", "Fiona", "George", "Helen", "Isaac",
    "Julia", "Kevin", "Laura", "Martin", "Nora", "Oscar", "Paula", "Ralph", "Sarah", "Thomas",
)

LAST_NAMES: tuple[str, ...] = (
    "Adams", "Baker", "Carter", "Dixon", "Ellis", "Fisher", "Graham", "Harper", "Irving", "Jordan",
    "Keller", "Lawson", "Morgan", "Nolan", "Owens", "Parker", "Quinn", "Reed", "Spencer", "Turner",
    "Underwood", "Vaughn", "Walsh", "Young", "Bennett", "Cooper", "Dawson", "Foster", "Gordon", "Hughes",
    "Jensen", "Kimball", "Lambert", "Mason", "Norris", "Porter", "Russell", "Sutton", "Tucker", "Warren",
)

#: Default base of the positions written in ``*_index`` prompts (ParallelBench's paper data used 0).
INDEX_BASE = 1

WAITING_LINE_OPS: tuple[str, ...] = (
    "copy", "reverse", "sort", "shuffle", "insert_index", "remove_index", "replace_index",
    "insert_random", "remove_random", "replace_random",
)

LATIN_SYMBOLS = "ABCDEFGH"
GRID_SIZE = 4


# ----------------------------------------------------------------------------------------------------------
# Data classes


@dataclass(frozen=True)
class Example:
    """One chat example. ``messages`` = worked example (user, assistant) + the question (user).

    ``answer`` is the reference answer string, or for multi-answer tasks a dict describing what is valid
    (always with an ``"example"`` key holding one valid answer string).
    """

    task: str
    messages: list[dict]
    answer: str | dict
    metadata: dict = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """Content of the last user turn (the actual question)."""
        return self.messages[-1]["content"]

    @property
    def target(self) -> str:
        """One valid answer string (the reference, or ``answer["example"]``)."""
        return self.answer if isinstance(self.answer, str) else self.answer["example"]


SUITES = ("synthetic", "parallelbench", "all")


@dataclass(frozen=True)
class Task:
    """One row of the project's one task table (:data:`TASKS`): a task, what the synthetic suite needs to
    make and score chat examples of it, and what the ParallelBench suite needs to write and score its
    records.

    Synthetic suite (``generator`` set): a seeded chat-example generator and two scorers (lenient and
    strict), each returning 0.0 or 1.0. ParallelBench suite (``pb_name`` set): the original's task name,
    metric name, prompt template (``prompt``, the original wording; ``short_prompt``, the project's short
    wording, when one exists), output budget, sample count and number of worked examples. Most tasks are in
    both; ``arithmetic/addition`` is synthetic only, the words-to-sentence and text tasks ParallelBench only.
    """

    name: str
    family: str
    description: str = ""
    generator: Callable[..., list[Example]] | None = field(default=None, repr=False)
    scorer: Callable[[str, Example], float] | None = field(default=None, repr=False)
    strict_scorer: Callable[[str, Example], float] | None = field(default=None, repr=False)
    multi_answer: bool = False
    pb_name: str | None = None
    metric: str | None = None
    prompt: str | None = field(default=None, repr=False)
    short_prompt: str | None = field(default=None, repr=False)
    max_tokens: int = 64
    num_samples: int = 100
    icl: int = 1
    needs_data: bool = False
    aliases: tuple[str, ...] = ()

    @property
    def category(self) -> str:
        """The part of the name before ``/`` (ParallelBench's word for :attr:`family`)."""
        return self.family

    def in_suite(self, suite: str) -> bool:
        """Whether the task belongs to ``suite`` (``"synthetic"``, ``"parallelbench"`` or ``"all"``)."""
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r}; known suites: {', '.join(SUITES)}")
        return suite == "all" or (self.generator is not None if suite == "synthetic" else self.pb_name is not None)

    def generate(self, n: int, seed: int, **options: Any) -> list[Example]:
        """``n`` distinct examples from ``seed``; ``options`` go to the family generator."""
        if self.generator is None:
            raise ValueError(f"{self.name} has no chat-example generator (it is a ParallelBench-only task): "
                             "write its records with dllm.evals.parallelbench.generate_task")
        return self.generator(n, seed, **options)

    def score(self, prediction: str, example: Example) -> float:
        """Lenient score: the answer is extracted from surrounding text, quoting/whitespace tolerated."""
        return self.scorer(prediction, example)

    def score_strict(self, prediction: str, example: Example) -> float:
        """Strict score: the whole prediction (stripped) must be in the exact answer format."""
        return self.strict_scorer(prediction, example)


# ----------------------------------------------------------------------------------------------------------
# Lists


def list_to_str(items: list[str]) -> str:
    """ParallelBench list format: ``["a", "b", "c"]``."""
    return "[" + ", ".join(f'"{x}"' for x in items) + "]"


_QUOTES = "\"'`\u201c\u201d\u2018\u2019"
_STRICT_LIST = re.compile(r'\[(?:"[^"\[\]]*"(?:, "[^"\[\]]*")*)?\]')


LIST_RULES = ("dllm", "parallelbench")


def parse_list(text: str | None, strict: bool = False, rules: str = "dllm") -> list[str] | None:
    """Extract a list of names from model output; the one list parser of both suites.

    ``rules="dllm"`` (the synthetic suite's scorers):

    * lenient (default): the text after the last ``[`` up to the next ``]`` (or the end), split on commas,
      items stripped of quotes (straight, curly, back-ticks) and whitespace, inner whitespace collapsed,
      empty items dropped. None when there is no ``[``.
    * strict: the stripped text must be exactly ``["a", "b"]`` (double quotes, ``", "`` separators).

    ``rules="parallelbench"`` (the original's parsing, used by the ParallelBench metrics):

    * lenient: the text after the last ``[`` (if any) and before the next ``]`` (if any), split on commas,
      each item stripped of double quotes and spaces, empty items dropped; text without brackets is a bare
      list.
    * strict: both brackets present (text around them allowed), the inside exactly ``"a", "b"`` (``", "``
      separators, each item in double quotes with no quote inside); otherwise None.
    """
    if rules not in LIST_RULES:
        raise ValueError(f"unknown list rules {rules!r}; known: {', '.join(LIST_RULES)}")
    if rules == "parallelbench":
        return _parse_list_original(text, strict)
    if text is None:
        return None
    if strict:
        s = text.strip()
        if not _STRICT_LIST.fullmatch(s):
            return None
        inner = s[1:-1]
        return [] if not inner else [item[1:-1] for item in inner.split(", ")]
    start = text.rfind("[")
    if start < 0:
        return None
    end = text.find("]", start + 1)
    inner = text[start + 1:] if end < 0 else text[start + 1:end]
    items = []
    for raw in inner.split(","):
        item = " ".join(raw.strip().strip(_QUOTES).split())
        if item:
            items.append(item)
    return items


def _parse_list_original(text: str | None, strict: bool) -> list[str] | None:
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


def _as_list(value: str | list[str]) -> list[str]:
    if isinstance(value, str):
        parsed = parse_list(value)
        return parsed if parsed is not None else []
    return list(value)


# ----------------------------------------------------------------------------------------------------------
# Waiting line

SHORT_PROMPTS = {
    "copy": "Please copy the list exactly:\n{context}",
    "reverse": "Please reverse the order of the list:\n{context}",
    "sort": "Please sort the list alphabetically by last name:\n{context}",
    "shuffle": "Please randomly shuffle the list into a different order:\n{context}",
    "insert_index": 'Insert "{word}" at position {index}:\n{context}',
    "insert_random": 'Insert "{word}" at a random position:\n{context}',
    "remove_index": "Remove the person at position {index}:\n{context}",
    "remove_random": "Remove a random person:\n{context}",
    "replace_index": 'Replace the person at position {index} with "{word}":\n{context}',
    "replace_random": 'Replace a random person with "{word}":\n{context}',
}

_FULL_HEAD = "You are managing a waiting line at a customer service desk.\n"
FULL_PROMPTS = {
    "copy": _FULL_HEAD + "You need to record the following people in the order they arrived:\n{context}\n"
    "Please copy the list exactly and provide only the final list.",
    "reverse": _FULL_HEAD + "The previous staff member put the waiting line in the wrong order.\n"
    "Please reverse the order of the following people in the waiting line to correct it:\n{context}\n"
    "Please reverse the order of the list and provide only the final list.",
    "sort": _FULL_HEAD + "The following people should be organized alphabetically by last name for "
    "efficient processing:\n{context}\nPlease sort the list in alphabetical order and provide only the "
    "final list.",
    "shuffle": _FULL_HEAD + "The waiting line should be randomly shuffled to ensure fair service "
    "distribution:\n{context}\nPlease randomly shuffle the list and provide only the final list.\n"
    "Ensure the sequence is different from the original.",
    "insert_index": _FULL_HEAD + 'A new person "{word}" is inserted into the line at position {index}:\n'
    "{context}\nPlease put the new person at the specified position and provide only the final list.",
    "insert_random": _FULL_HEAD + 'A new person "{word}" is inserted into the line at a random position:\n'
    "{context}\nPlease put the new person in the random position and provide only the final list.",
    "remove_index": _FULL_HEAD + "The person at position {index} has left the waiting line:\n{context}\n"
    "Please remove the person at the specified position and provide only the final list.",
    "remove_random": _FULL_HEAD + "One person has left the waiting line:\n{context}\n"
    "Please remove a random person and provide only the final list.",
    "replace_index": _FULL_HEAD + 'The person at position {index} must be replaced with "{word}":\n'
    '{context}\nPlease replace the person at the specified position with "{word}" and provide only the '
    "final list.",
    "replace_random": _FULL_HEAD + 'One person in the waiting line must be replaced with "{word}":\n'
    '{context}\nPlease replace one random person with "{word}" and provide only the final list.',
}

_PROMPT_STYLES = {"short": SHORT_PROMPTS, "full": FULL_PROMPTS}


def _sample_names(rng: random.Random, length: int) -> list[str]:
    firsts = rng.sample(FIRST_NAMES, length)
    lasts = rng.sample(LAST_NAMES, length)
    return [f"{f} {l}" for f, l in zip(firsts, lasts)]


def _new_name(rng: random.Random, names: list[str]) -> str:
    used_first = {n.split(" ")[0] for n in names}
    used_last = {n.split(" ")[1] for n in names}
    first = rng.choice([f for f in FIRST_NAMES if f not in used_first])
    last = rng.choice([l for l in LAST_NAMES if l not in used_last])
    return f"{first} {last}"


def _sort_key(sort_by: str) -> Callable[[str], Any]:
    if sort_by == "last":
        return lambda name: (name.split(" ")[-1], name)
    if sort_by == "first":
        return lambda name: name
    raise ValueError(f"sort_by must be 'last' or 'first', got {sort_by!r}")


def _waiting_line_instance(op: str, rng: random.Random, length: int, *, sort_by: str, index_base: int,
                           style: str) -> dict:
    """Draw one instance: prompt text, answer (str or dict), target string and metadata."""
    names = _sample_names(rng, length)
    word = None
    index0 = None
    if op == "copy":
        out = list(names)
    elif op == "reverse":
        out = names[::-1]
    elif op == "sort":
        out = sorted(names, key=_sort_key(sort_by))
    elif op == "shuffle":
        out = list(names)
        while out == names:
            rng.shuffle(out)
    elif op.startswith("insert"):
        word = _new_name(rng, names)
        index0 = rng.randint(0, length)
        out = names[:index0] + [word] + names[index0:]
    elif op.startswith("remove"):
        index0 = rng.randint(0, length - 1)
        out = names[:index0] + names[index0 + 1:]
    elif op.startswith("replace"):
        word = _new_name(rng, names)
        index0 = rng.randint(0, length - 1)
        out = names[:index0] + [word] + names[index0 + 1:]
    else:  # pragma: no cover - guarded by the registry
        raise ValueError(f"unknown waiting-line op {op!r}")
    random_op = op == "shuffle" or op.endswith("_random")
    shown_index = None if (index0 is None or random_op) else index0 + index_base
    context = list_to_str(names)
    prompt = _PROMPT_STYLES[style][op].format(context=context, word=word, index=shown_index)
    target = list_to_str(out)
    if random_op:
        answer: str | dict = {"input": list(names), "example": target}
        if word is not None:
            answer["word"] = word
    else:
        answer = target
    inputs: dict = {"context": context}
    if word is not None:
        inputs["word"] = word
    if shown_index is not None:
        inputs["index"] = shown_index
    metadata = {"length": length, "index": shown_index, "word": word, "input": inputs}
    return {"prompt": prompt, "answer": answer, "target": target, "metadata": metadata}


def _icl_record(shot: dict) -> dict:
    """The worked example's fields (``input``, ``answer``, ``metadata``), kept so that the example can be
    written out as a ParallelBench ``icl_examples`` entry (:mod:`dllm.evals.parallelbench`)."""
    meta = {k: v for k, v in shot["metadata"].items() if k != "input"}
    return {"input": dict(shot["metadata"]["input"]), "answer": shot["answer"], "metadata": meta}


def _check_lengths(lengths: tuple[int, int], lo: int = 2) -> tuple[int, int]:
    a, b = int(lengths[0]), int(lengths[1])
    if not lo <= a <= b <= min(len(FIRST_NAMES), len(LAST_NAMES)) - 1:
        raise ValueError(f"bad list lengths {lengths!r}")
    return a, b


def _collect(task: str, n: int, seed: int, make: Callable[[random.Random, int], Example]) -> list[Example]:
    """Draw ``n`` examples with distinct (question, target); duplicates allowed only if the space runs out."""
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = random.Random(f"dllm/{task}/{int(seed)}")
    out: list[Example] = []
    seen: set[tuple[str, str]] = set()
    attempts = 0
    while len(out) < n:
        ex = make(rng, len(out))
        key = (ex.prompt, ex.target)
        attempts += 1
        if key in seen and attempts < 50 * (n + 10):
            continue
        seen.add(key)
        out.append(ex)
    return out


def generate_waiting_line(op: str, n: int, seed: int, *, lengths: tuple[int, int] = (3, 6),
                          icl_lengths: tuple[int, int] = (3, 3), sort_by: str = "last",
                          index_base: int | None = None, style: str = "short") -> list[Example]:
    """Waiting-line examples for ``op``; list lengths cycle through ``lengths`` (balanced per length).

    ``sort_by="first"`` reproduces ParallelBench's sort-label bug; ``index_base`` defaults to
    ``INDEX_BASE``; ``style`` is ``"short"`` (default) or ``"full"`` (ParallelBench's wording).
    """
    if op not in WAITING_LINE_OPS:
        raise ValueError(f"unknown waiting-line op {op!r}; known: {', '.join(WAITING_LINE_OPS)}")
    if style not in _PROMPT_STYLES:
        raise ValueError(f"style must be one of {sorted(_PROMPT_STYLES)}, got {style!r}")
    base = INDEX_BASE if index_base is None else int(index_base)
    if base not in (0, 1):
        raise ValueError("index_base must be 0 or 1")
    _sort_key(sort_by)
    lo, hi = _check_lengths(lengths)
    ilo, ihi = _check_lengths(icl_lengths)
    options = {"sort_by": sort_by, "index_base": base, "style": style}
    name = f"waiting_line/{op}"

    def make(rng: random.Random, i: int) -> Example:
        length = lo + i % (hi - lo + 1)
        main = _waiting_line_instance(op, rng, length, **options)
        shot = _waiting_line_instance(op, rng, rng.randint(ilo, ihi), **options)
        messages = [{"role": "user", "content": shot["prompt"]},
                    {"role": "assistant", "content": shot["target"]},
                    {"role": "user", "content": main["prompt"]}]
        metadata = dict(main["metadata"], op=op, seed=int(seed), index_base=base, sort_by=sort_by,
                        style=style, icl=[_icl_record(shot)])
        return Example(task=name, messages=messages, answer=main["answer"], metadata=metadata)

    return _collect(name, n, seed, make)


def _score_waiting_line(prediction: str, example: Example, strict: bool) -> float:
    pred = parse_list(prediction, strict=strict)
    if pred is None:
        return 0.0
    op = example.task.split("/", 1)[1]
    answer = example.answer
    if isinstance(answer, str):
        return float(pred == _as_list(answer))
    source = list(answer["input"])
    if op == "shuffle":
        return float(sorted(pred) == sorted(source) and pred != source)
    if op == "insert_random":
        word = answer["word"]
        if len(pred) != len(source) + 1 or pred.count(word) != 1:
            return 0.0
        rest = list(pred)
        rest.remove(word)
        return float(rest == source)
    if op == "remove_random":
        if len(pred) != len(source) - 1:
            return 0.0
        return float(any(source[:i] + source[i + 1:] == pred for i in range(len(source))))
    if op == "replace_random":
        word = answer["word"]
        if len(pred) != len(source) or word in source:
            return 0.0
        diff = [i for i, (a, b) in enumerate(zip(pred, source)) if a != b]
        return float(len(diff) == 1 and pred[diff[0]] == word)
    raise ValueError(f"no multi-answer scorer for {example.task!r}")


# ----------------------------------------------------------------------------------------------------------
# Grids (Latin squares and Sudoku)

Grid = tuple[tuple[str, ...], ...]


def _grid_rows(cells: list[str] | tuple[str, ...], size: int = GRID_SIZE) -> Grid:
    return tuple(tuple(cells[r * size:(r + 1) * size]) for r in range(size))


def _format_grid(grid: Grid, sep: str) -> str:
    return "\n".join(sep.join(row) for row in grid)


def parse_grid(text: str | None, size: int = GRID_SIZE, symbols: str | None = None) -> Grid | None:
    """Leniently read a ``size`` x ``size`` grid of single-character cells from model output.

    A line counts as a row when, after dropping separators (spaces, commas, ``|``, tabs), it holds exactly
    ``size`` cells; with ``symbols`` given only those characters count as cells and every other character
    on the line must be a separator. The first ``size`` rows are returned (None if fewer).
    """
    if not text:
        return None
    rows: list[tuple[str, ...]] = []
    for line in text.splitlines():
        parts = [p for p in re.split(r"[\s,|;]+", line.strip()) if p]
        if not parts:
            continue
        cells = list("".join(parts)) if all(len(p) == 1 for p in parts) or len(parts) == 1 else None
        if cells is None or len(cells) != size:
            continue
        if symbols is not None and not all(c in symbols for c in cells):
            continue
        rows.append(tuple(cells))
        if len(rows) == size:
            return tuple(rows)
    return None


def is_latin_square(grid: Grid | None, symbols: str | list[str] | None = None) -> bool:
    """Every row and every column is a permutation of ``symbols`` (default: the first row's symbols)."""
    if grid is None or not grid:
        return False
    size = len(grid)
    want = set(symbols) if symbols is not None else set(grid[0])
    if len(want) != size or any(len(row) != size for row in grid):
        return False
    return all(set(row) == want for row in grid) and all(set(col) == want for col in zip(*grid))


def is_sudoku_solution(grid: Grid | None) -> bool:
    """A 4x4 grid over 1-4 whose rows, columns and 2x2 boxes each hold 1-4 once."""
    if not is_latin_square(grid, "1234"):
        return False
    for br in (0, 2):
        for bc in (0, 2):
            if {grid[br + r][bc + c] for r in (0, 1) for c in (0, 1)} != set("1234"):
                return False
    return True


def _matches_givens(grid: Grid, givens: dict) -> bool:
    return all(grid[int(k) // GRID_SIZE][int(k) % GRID_SIZE] == v for k, v in givens.items())


@cache
def _all_latin_squares() -> tuple[tuple[int, ...], ...]:
    """All 576 4x4 Latin squares over 0..3, as flat tuples, in a fixed order."""
    perms = list(itertools.permutations(range(GRID_SIZE)))
    out: list[tuple[int, ...]] = []

    def extend(rows: list[tuple[int, ...]]) -> None:
        if len(rows) == GRID_SIZE:
            out.append(tuple(v for row in rows for v in row))
            return
        for perm in perms:
            if all(perm[c] != row[c] for row in rows for c in range(GRID_SIZE)):
                extend(rows + [perm])

    extend([])
    return tuple(out)


@cache
def sudoku_solutions() -> tuple[str, ...]:
    """All 288 completed 4x4 Sudoku grids as 16-character strings over 1-4, in a fixed order."""
    out = []
    for flat in _all_latin_squares():
        grid = _grid_rows([str(v + 1) for v in flat])
        if is_sudoku_solution(grid):
            out.append("".join(v for row in grid for v in row))
    return tuple(out)


@cache
def _sudoku_masks() -> tuple[tuple[int, ...], ...]:
    """masks[cell][digit-1] = bitset of solutions having that digit in that cell."""
    sols = sudoku_solutions()
    masks = [[0] * GRID_SIZE for _ in range(GRID_SIZE * GRID_SIZE)]
    for i, s in enumerate(sols):
        for cell, ch in enumerate(s):
            masks[cell][int(ch) - 1] |= 1 << i
    return tuple(tuple(m) for m in masks)


def count_sudoku_solutions(givens: dict[int, str]) -> int:
    """Number of completed grids consistent with ``givens`` ({cell index 0-15: digit char})."""
    masks = _sudoku_masks()
    bits = (1 << len(sudoku_solutions())) - 1
    for cell, digit in givens.items():
        bits &= masks[int(cell)][int(digit) - 1]
    return (bits).bit_count()


def _sudoku_puzzle(rng: random.Random, n_given: int) -> tuple[str, dict[int, str]]:
    """A random solution and a unique-solution subset of ``n_given`` givens (greedy removal, retried)."""
    sols = sudoku_solutions()
    while True:
        sol = rng.choice(sols)
        givens = {i: sol[i] for i in range(GRID_SIZE * GRID_SIZE)}
        for cell in rng.sample(range(GRID_SIZE * GRID_SIZE), GRID_SIZE * GRID_SIZE):
            if len(givens) == n_given:
                break
            digit = givens.pop(cell)
            if count_sudoku_solutions(givens) != 1:
                givens[cell] = digit
        if len(givens) == n_given:
            return sol, givens


def _puzzle_text(givens: dict[int, str], blank: str, sep: str = "") -> str:
    cells = [givens.get(i, blank) for i in range(GRID_SIZE * GRID_SIZE)]
    return _format_grid(_grid_rows(cells), sep)


SUDOKU_PROMPTS = {
    "short": "Solve this 4x4 sudoku:\n{grid}",
    "full": "Fill the positions where the values are {blank} in a 4x4 grid with digits 1-4 so that each "
    "column, each row, and each of the four 2x2 subgrids that compose the grid contains all of the digits "
    "from 1 to 4.\n\nInput:\n{grid}\nOutput:",
}


def _check_givens(lo: int, hi: int, least: int) -> None:
    """``givens=(lo, hi)``: a range of given cells of the 4x4 grid, ``least <= lo <= hi <= 16``."""
    if lo > hi:
        raise ValueError(f"sudoku givens {lo},{hi}: LO ({lo}) > HI ({hi}); give LO,HI with LO <= HI, e.g. 4,12")
    if not least <= lo <= hi <= 16:
        raise ValueError(f"sudoku givens {lo},{hi}: they must lie in [{least}, 16] (given cells of the 4x4 grid)")


def generate_sudoku(n: int, seed: int, *, givens: tuple[int, int] = (4, 12), blank: str = ".",
                    style: str = "short") -> list[Example]:
    """4x4 Sudoku with a unique solution and a number of given cells drawn uniformly from ``givens``."""
    lo, hi = int(givens[0]), int(givens[1])
    _check_givens(lo, hi, 4)
    if len(blank) != 1 or blank in "1234":
        raise ValueError("blank must be one character other than 1-4")
    if style not in SUDOKU_PROMPTS:
        raise ValueError(f"style must be one of {sorted(SUDOKU_PROMPTS)}")
    name = "puzzle/sudoku"

    def instance(rng: random.Random, k: int) -> tuple[str, str, dict]:
        sol, given = _sudoku_puzzle(rng, k)
        puzzle = _puzzle_text(given, blank)
        prompt = SUDOKU_PROMPTS[style].format(grid=puzzle, blank=blank)
        target = _format_grid(_grid_rows(list(sol)), "")
        return prompt, target, {"puzzle": puzzle, "givens": {str(c): d for c, d in sorted(given.items())},
                                "length": k}

    def make(rng: random.Random, i: int) -> Example:
        k = lo + i % (hi - lo + 1)
        prompt, target, meta = instance(rng, k)
        shot_prompt, shot_target, shot_meta = instance(rng, rng.randint(lo, hi))
        messages = [{"role": "user", "content": shot_prompt},
                    {"role": "assistant", "content": shot_target},
                    {"role": "user", "content": prompt}]
        icl = {"input": {"sudoku": shot_meta["puzzle"]}, "answer": shot_target,
               "metadata": {"length": shot_meta["length"], "givens": shot_meta["givens"]}}
        metadata = dict(meta, seed=int(seed), blank=blank, style=style, input={"sudoku": meta["puzzle"]},
                        icl=[icl])
        return Example(task=name, messages=messages, answer=target, metadata=metadata)

    return _collect(name, n, seed, make)


def _score_sudoku(prediction: str, example: Example, strict: bool) -> float:
    if prediction is None:
        return 0.0
    givens = example.metadata["givens"]
    if strict:
        text = prediction.strip()
        if not re.fullmatch(r"[1-4]{4}(?:\n[1-4]{4}){3}", text):
            return 0.0
        grid = _grid_rows(list(text.replace("\n", "")))
    else:
        rows = []
        for line in prediction.splitlines():
            digits = re.sub(r"[^0-9]", "", line)
            if len(digits) == GRID_SIZE:
                rows.append(tuple(digits))
        if len(rows) != GRID_SIZE:
            return 0.0
        grid = tuple(rows)
    return float(is_sudoku_solution(grid) and _matches_givens(grid, givens))


LATIN_PROMPTS = {
    "short": "Generate a 4x4 Latin square with the symbols {symbols}:",
    "full": "Generate a Latin square of size 4 with the symbols [{symbols}]. Only output the final result.",
}


def generate_latin_square(n: int, seed: int, *, givens: tuple[int, int] = (0, 0),
                          symbols_pool: str = LATIN_SYMBOLS, blank: str = ".",
                          style: str = "short", sep: str = " ") -> list[Example]:
    """4x4 Latin squares over 4 symbols drawn from ``symbols_pool``; any valid square is accepted.

    With ``givens=(lo, hi)`` above zero the prompt also shows a partially filled grid (``blank`` marks
    the empty cells) and a valid answer must match the given cells. ``symbols_pool`` holds upper-case
    letters and/or digits (ParallelBench draws from ``A-Z0-9``); ``sep`` separates the cells of a row
    in the answer (``" "`` here, ``","`` for ParallelBench's CSV).
    """
    lo, hi = int(givens[0]), int(givens[1])
    _check_givens(lo, hi, 0)
    pool = "".join(dict.fromkeys(symbols_pool))
    if len(pool) < GRID_SIZE or not all(c.isdigit() or (c.isalpha() and c.isupper()) for c in pool):
        raise ValueError("symbols_pool needs at least 4 distinct upper-case letters or digits")
    if sep not in (" ", ","):
        raise ValueError(f"sep must be ' ' or ',', got {sep!r}")
    if len(blank) != 1 or blank in pool:
        raise ValueError("blank must be one character outside the symbol pool")
    if style not in LATIN_PROMPTS:
        raise ValueError(f"style must be one of {sorted(LATIN_PROMPTS)}")
    name = "puzzle/latin_square"
    squares = _all_latin_squares()

    def instance(rng: random.Random, k: int) -> tuple[str, str, dict]:
        symbols = rng.sample(pool, GRID_SIZE)
        flat = rng.choice(squares)
        cells = [symbols[v] for v in flat]
        given_cells = sorted(rng.sample(range(GRID_SIZE * GRID_SIZE), k))
        given = {c: cells[c] for c in given_cells}
        prompt = LATIN_PROMPTS[style].format(symbols=", ".join(symbols))
        if k:
            prompt += "\n" + _puzzle_text(given, blank, " ")
        target = _format_grid(_grid_rows(cells), sep)
        meta = {"symbols": list(symbols), "givens": {str(c): v for c, v in given.items()}, "length": k,
                "size": GRID_SIZE}
        return prompt, target, meta

    def make(rng: random.Random, i: int) -> Example:
        k = lo + i % (hi - lo + 1)
        prompt, target, meta = instance(rng, k)
        shot_prompt, shot_target, shot_meta = instance(rng, rng.randint(lo, hi))
        messages = [{"role": "user", "content": shot_prompt},
                    {"role": "assistant", "content": shot_target},
                    {"role": "user", "content": prompt}]
        answer = {"symbols": meta["symbols"], "givens": meta["givens"], "example": target}
        icl = {"input": {"size": GRID_SIZE, "symbols": "[" + ", ".join(shot_meta["symbols"]) + "]"},
               "answer": {"symbols": shot_meta["symbols"], "givens": shot_meta["givens"], "example": shot_target},
               "metadata": {"length": shot_meta["length"]}}
        metadata = dict(meta, seed=int(seed), style=style, sep=sep, icl=[icl],
                        input={"size": GRID_SIZE, "symbols": "[" + ", ".join(meta["symbols"]) + "]"})
        return Example(task=name, messages=messages, answer=answer, metadata=metadata)

    return _collect(name, n, seed, make)


def _score_latin(prediction: str, example: Example, strict: bool) -> float:
    if prediction is None:
        return 0.0
    symbols = "".join(example.answer["symbols"])
    givens = example.answer.get("givens", {})
    if strict:
        sep = example.metadata.get("sep", " ")
        text = prediction.strip()
        lines = text.split("\n")
        cell = r"[^\s,]"
        if len(lines) != GRID_SIZE or any(not re.fullmatch(f"{cell}({re.escape(sep)}{cell}){{3}}", ln) for ln in lines):
            return 0.0
        grid = tuple(tuple(ln.split(sep)) for ln in lines)
    else:
        grid = parse_grid(prediction, GRID_SIZE, symbols)
    return float(is_latin_square(grid, symbols) and _matches_givens(grid, givens))


# ----------------------------------------------------------------------------------------------------------
# Arithmetic

_ADDITION_PROMPT = "What is {a} + {b}?"


def generate_addition(n: int, seed: int, *, digits: tuple[int, int] = (2, 4)) -> list[Example]:
    """``a + b`` with each operand's digit count drawn from ``digits``; the answer is the decimal sum."""
    lo, hi = int(digits[0]), int(digits[1])
    if not 1 <= lo <= hi <= 18:
        raise ValueError("digits must lie in [1, 18]")
    name = "arithmetic/addition"

    def operand(rng: random.Random) -> int:
        d = rng.randint(lo, hi)
        return rng.randint(10 ** (d - 1) if d > 1 else 0, 10 ** d - 1)

    def make(rng: random.Random, i: int) -> Example:
        a, b = operand(rng), operand(rng)
        sa, sb = operand(rng), operand(rng)
        messages = [{"role": "user", "content": _ADDITION_PROMPT.format(a=sa, b=sb)},
                    {"role": "assistant", "content": str(sa + sb)},
                    {"role": "user", "content": _ADDITION_PROMPT.format(a=a, b=b)}]
        metadata = {"a": a, "b": b, "seed": int(seed), "input": {"a": a, "b": b}}
        return Example(task=name, messages=messages, answer=str(a + b), metadata=metadata)

    return _collect(name, n, seed, make)


def _score_addition(prediction: str, example: Example, strict: bool) -> float:
    if prediction is None:
        return 0.0
    if strict:
        return float(prediction.strip() == example.answer)
    numbers = re.findall(r"-?\d+(?:,\d{3})*", prediction)
    if not numbers:
        return 0.0
    return float(numbers[-1].replace(",", "") == example.answer)


# ----------------------------------------------------------------------------------------------------------
# Registry


def _make_task(name: str, family: str, gen: Callable[..., list[Example]],
               fn: Callable[[str, Example, bool], float], multi: bool, description: str, **pb: Any) -> Task:
    def lenient(prediction: str, example: Example) -> float:
        return fn(prediction, example, False)

    def strict(prediction: str, example: Example) -> float:
        return fn(prediction, example, True)

    return Task(name=name, family=family, generator=gen, scorer=lenient, strict_scorer=strict,
                multi_answer=multi, description=description, **pb)


def _waiting_line_generator(op: str) -> Callable[..., list[Example]]:
    def gen(n: int, seed: int, **options: Any) -> list[Example]:
        return generate_waiting_line(op, n, seed, **options)

    gen.__name__ = f"generate_{op}"
    return gen


DESCRIPTIONS = {
    "copy": "copy the list", "reverse": "reverse the list", "sort": "sort by last name",
    "shuffle": "any different order of the same names", "insert_index": "insert a name at a position",
    "remove_index": "remove the name at a position", "replace_index": "replace the name at a position",
    "insert_random": "insert a name anywhere", "remove_random": "remove any one name",
    "replace_random": "replace any one name",
}

# ParallelBench's metric names and prompt templates (its waiting-line prompts end with a newline, except
# replace_random's; its Sudoku writes blanks as 0 and names the grid {sudoku}).
_LIST_METRIC = {
    "shuffle": "list_shuffle_score", "insert_random": "list_random_insert_score",
    "remove_random": "list_random_remove_score", "replace_random": "list_random_replace_score",
}
_SUDOKU_PB = SUDOKU_PROMPTS["full"].replace("{blank}", "0").replace("{grid}", "{sudoku}") + "\n"
_LATIN_PB = "Generate a Latin square of size {size} with the symbols {symbols}. Only output the final result as CSV."
_W2S_PROMPT = "Construct a single, coherent sentence using the words {words}."
_SUMMARY_PROMPT = "Summarize the following conversation. Only output the final result.\n\n{text}\n\nSummary:"
_PARAPHRASE_PROMPT = "Paraphrase the following sentence. Only output the final result.\n\nSentence: {text}\n\nParaphrase:"

#: The one task table: every task of both suites, in report order.
TASKS: dict[str, Task] = {}
for _op in WAITING_LINE_OPS:
    TASKS[f"waiting_line/{_op}"] = _make_task(
        f"waiting_line/{_op}", "waiting_line", _waiting_line_generator(_op), _score_waiting_line,
        _op == "shuffle" or _op.endswith("_random"), DESCRIPTIONS[_op],
        pb_name=f"waiting_line/{_op}", metric=_LIST_METRIC.get(_op, "list_match_score"),
        prompt=FULL_PROMPTS[_op] + ("" if _op == "replace_random" else "\n"), short_prompt=SHORT_PROMPTS[_op],
        max_tokens=32)
TASKS["puzzle/latin_square"] = _make_task(
    "puzzle/latin_square", "puzzle", generate_latin_square, _score_latin, True,
    "any 4x4 Latin square over the symbols", pb_name="puzzle/latin_square_n4", metric="latin_square_score",
    prompt=_LATIN_PB, short_prompt=LATIN_PROMPTS["short"])
TASKS["puzzle/sudoku"] = _make_task(
    "puzzle/sudoku", "puzzle", generate_sudoku, _score_sudoku, False, "4x4 Sudoku with a unique solution",
    pb_name="puzzle/sudoku_n4_12", metric="sudoku_score", prompt=_SUDOKU_PB,
    short_prompt=SUDOKU_PROMPTS["short"].replace("{grid}", "{sudoku}"), num_samples=108)
TASKS["arithmetic/addition"] = _make_task("arithmetic/addition", "arithmetic", generate_addition,
                                          _score_addition, False, "multi-digit addition")
for _level, _desc in (("easy", "related"), ("medium", "loosely related"), ("hard", "unrelated")):
    TASKS[f"words_to_sentence/{_level}"] = Task(
        f"words_to_sentence/{_level}", "words_to_sentence", f"one sentence using four {_desc} words",
        multi_answer=True, pb_name=f"words_to_sentence/{_level}", metric="sentence_to_words_score",
        prompt=_W2S_PROMPT, icl=0)
TASKS["paraphrase_summarize/samsum"] = Task(
    "paraphrase_summarize/samsum", "paraphrase_summarize", "summarize a dialogue (SAMSum-style data file)",
    multi_answer=True, pb_name="paraphrase_summarize/samsum", metric="summary_score", prompt=_SUMMARY_PROMPT,
    icl=0, needs_data=True, aliases=("summarization",))
TASKS["paraphrase_summarize/chatgpt-paraphrases"] = Task(
    "paraphrase_summarize/chatgpt-paraphrases", "paraphrase_summarize", "paraphrase a sentence (data file)",
    multi_answer=True, pb_name="paraphrase_summarize/chatgpt-paraphrases", metric="paraphrase_score",
    prompt=_PARAPHRASE_PROMPT, icl=0, needs_data=True, aliases=("paraphrasing",))
del _op, _level, _desc


def suite_key(task: Task, suite: str) -> str:
    """The name ``task`` goes by in ``suite`` (ParallelBench's own name there, the project's elsewhere)."""
    return task.pb_name if suite == "parallelbench" and task.pb_name else task.name


def suite_tasks(suite: str = "synthetic") -> dict[str, Task]:
    """The tasks of ``suite`` keyed by the names they go by there (a view of :data:`TASKS`)."""
    return {suite_key(t, suite): t for t in TASKS.values() if t.in_suite(suite)}


def suite_aliases(suite: str = "synthetic") -> dict[str, str]:
    """Every other name of the tasks of ``suite`` (the other suite's name, ``aliases``) -> the suite's name."""
    out: dict[str, str] = {}
    for t in TASKS.values():
        if t.in_suite(suite):
            key = suite_key(t, suite)
            out.update({n: key for n in (t.name, t.pb_name, *t.aliases) if n and n != key})
    return out


#: Families of the synthetic suite: family -> task names.
FAMILIES: dict[str, list[str]] = {}
for _name, _task in suite_tasks("synthetic").items():
    FAMILIES.setdefault(_task.family, []).append(_name)
del _name, _task

#: ParallelBench's names of the two puzzles name the same tasks in the synthetic suite.
ALIASES = suite_aliases("synthetic")


def get_task(name: str | Task, suite: str = "all") -> Task:
    """The task called ``name`` in any suite (its name, ParallelBench's name or an alias; a Task passes
    through); ``suite`` limits the lookup. KeyError lists the known names."""
    if isinstance(name, Task):
        return name
    tasks, aliases = suite_tasks(suite), suite_aliases(suite)
    try:
        return tasks[aliases.get(name, name)]
    except KeyError:
        what = "task" if suite == "all" else f"{suite} task"
        raise KeyError(f"unknown {what} {name!r}; known tasks: {', '.join(tasks)}") from None


def match_names(names, pattern: str | None, aliases: dict[str, str] | None = None) -> list[str]:
    """The names matching ``pattern``: comma-separated names, aliases, categories (the part before ``/``) or
    fnmatch patterns, in the order of ``names``'s matches per pattern; ``None`` / ``""`` / ``"all"`` / ``"*"``:
    every name. The one name filter of both suites."""
    names = list(names)
    if pattern is None or pattern.strip() in ("", "all", "*"):
        return names
    out: list[str] = []
    for pat in (p.strip() for p in pattern.split(",")):
        if not pat:
            continue
        pat = (aliases or {}).get(pat, pat)
        hits = [n for n in names if n == pat or n.split("/", 1)[0] == pat or fnmatch.fnmatchcase(n, pat)]
        out += [h for h in hits if h not in out]
    return out


def task_names(pattern: str | None = None, suite: str = "synthetic") -> list[str]:
    """Names of the tasks of ``suite`` in table order, optionally filtered (:func:`match_names`:
    ``"waiting_line,puzzle"``, ``"waiting_line/*_random"``, ``"puzzle/sudoku_n4_12"``). The default suite is
    the synthetic one (the tasks with chat examples); ``"parallelbench"`` gives ParallelBench's names."""
    return match_names(suite_tasks(suite), pattern, suite_aliases(suite))


def generate(name: str, n: int, seed: int, **options: Any) -> list[Example]:
    """Shorthand for ``get_task(name).generate(n, seed, **options)``."""
    return get_task(name).generate(n, seed, **options)


def score(prediction: str, example: Example) -> float:
    """Lenient score of ``prediction`` against ``example`` (task looked up from the example)."""
    return get_task(example.task).score(prediction, example)


def score_strict(prediction: str, example: Example) -> float:
    """Strict (exact-format) score of ``prediction`` against ``example``."""
    return get_task(example.task).score_strict(prediction, example)


def prompt_words() -> list[str]:
    """Fixed words of the short prompts (handy for tokenizer checks)."""
    texts = list(SHORT_PROMPTS.values()) + [SUDOKU_PROMPTS["short"], LATIN_PROMPTS["short"],
                                             _ADDITION_PROMPT]
    words: list[str] = []
    for t in texts:
        for w in re.findall(r"[A-Za-z]+", re.sub(r"\{[a-z]+\}", " ", t)):
            if w not in words:
                words.append(w)
    return words
