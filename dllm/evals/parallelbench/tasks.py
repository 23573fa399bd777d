"""The ParallelBench task table: the 17 tasks, their metrics, prompt templates and output budgets."""

from __future__ import annotations

from dataclasses import dataclass

from dllm.evals import tasks as T

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
_WL_FULL = {op: T.FULL_PROMPTS[op] + ("" if op == "replace_random" else "\n") for op in WAITING_LINE_OPS}
_SUDOKU_FULL = T.SUDOKU_PROMPTS["full"].replace("{blank}", "0").replace("{grid}", "{sudoku}") + "\n"
_SUDOKU_SHORT = T.SUDOKU_PROMPTS["short"].replace("{grid}", "{sudoku}")
_LATIN_FULL = "Generate a Latin square of size {size} with the symbols {symbols}. Only output the final result as CSV."
_LATIN_SHORT = T.LATIN_PROMPTS["short"]
_W2S_PROMPT = "Construct a single, coherent sentence using the words {words}."
_SUMMARY_PROMPT = "Summarize the following conversation. Only output the final result.\n\n{text}\n\nSummary:"
_PARAPHRASE_PROMPT = "Paraphrase the following sentence. Only output the final result.\n\nSentence: {text}\n\nParaphrase:"

TASKS: dict[str, PBTask] = {}
for _op in WAITING_LINE_OPS:
    TASKS[f"waiting_line/{_op}"] = PBTask(
        f"waiting_line/{_op}", _LIST_METRIC.get(_op, "list_match_score"), _WL_FULL[_op], T.SHORT_PROMPTS[_op],
        32, 100, 1, description=T.DESCRIPTIONS[_op])
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

ALIASES = {
    "puzzle/latin_square": "puzzle/latin_square_n4", "puzzle/sudoku": "puzzle/sudoku_n4_12",
    "summarization": "paraphrase_summarize/samsum", "paraphrasing": "paraphrase_summarize/chatgpt-paraphrases",
}


def get_task(name: str) -> PBTask:
    """The built-in task called ``name`` (aliases: ``puzzle/latin_square``, ``puzzle/sudoku``,
    ``summarization``, ``paraphrasing``); KeyError lists the known names."""
    name = ALIASES.get(name, name)
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown ParallelBench task {name!r}; known tasks: {', '.join(TASKS)}") from None


def task_names(pattern: str | None = None) -> list[str]:
    """Built-in task names, optionally filtered: comma-separated fnmatch patterns or category names
    (``"waiting_line,puzzle"``, ``"waiting_line/*_random"``); ``None``/``"all"`` gives all 17."""
    return T.match_names(TASKS, pattern, ALIASES)
