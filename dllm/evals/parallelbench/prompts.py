"""Prompts, metric names and output budgets of a task (or of a task config file)."""

from __future__ import annotations

from dllm.evals.parallelbench.tasks import ALIASES, STYLES, TASKS, WAITING_LINE_OPS
from dllm.evals.tasks import Task

# ----------------------------------------------------------------------------------------------------------
# Prompts


def base_task(name: str) -> Task | None:
    """The built-in task a name from another data set corresponds to (``waiting_line_n15/copy`` ->
    ``waiting_line/copy``, ``words_to_sentence/easy_n3`` -> ``words_to_sentence/easy``)."""
    name = ALIASES.get(name, name)
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
    task = base_task(name)
    if task is None:
        raise KeyError(f"no prompt for task {name!r}: add a task_config.yaml with a 'prompt' to its data directory")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    return task.short_prompt if (style == "short" and task.short_prompt) else task.prompt


def max_tokens_for(name: str, config: dict | None = None) -> int:
    """Generation budget: the original's ``max_tokens`` (32 waiting line, 128 for its 15-name variant,
    64 otherwise)."""
    if config and isinstance(config.get("max_tokens"), int):
        return config["max_tokens"]
    if name.split("/", 1)[0] == "waiting_line_n15":
        return 128
    task = base_task(name)
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
