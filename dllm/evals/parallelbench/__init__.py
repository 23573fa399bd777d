"""ParallelBench-compatible suite: the 17 task types, the original JSONL record schema, and the scorers.

ParallelBench (Kang et al., 2025) measures what parallel decoding costs in quality on tasks whose output
tokens depend on each other. This package is an independent implementation that reads and writes the same
record schema, so files produced here run through the original's loader and the original's own data files
run here without conversion. Modules: :mod:`.tasks` (ParallelBench's view of the one task table, :data:`dllm.evals.tasks.TASKS`), :mod:`.data` (records and suite files), :mod:`.prompts`,
:mod:`.parsing`, :mod:`.metrics`, :mod:`.sweep` (resumable sweeps over decoding settings) and :mod:`.report`
(PBx, AUP, intervals, plots); the command is ``dllm parallelbench`` (:mod:`dllm.cli.parallelbench`).
``docs/parallelbench.md`` is the user guide. Every public name of the modules is importable from here.

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
Lenient and strict list parsing follow the original's rules (:func:`dllm.evals.tasks.parse_list` with
``rules="parallelbench"``); exact match for
deterministic lists; validity for multi-answer tasks (shuffle: same multiset, different order; random
insert/remove/replace: exactly one valid edit); Latin-square validity; Sudoku exact match (the solution is
unique); words-to-sentence inclusion (case-sensitive substring) and grammar; summaries ROUGE-L x grammar;
paraphrases (1 - BLEU) x BERTScore-F1 x grammar, with sentence BLEU from ``sacrebleu`` (smoothed, see
:func:`bleu`). Grammar (LanguageTool), ROUGE (``rouge-score``) and
BERTScore (``bert-score`` + its model) are used when importable and loadable, and reported as unavailable
(score ``None``, never 0) when not; :func:`set_text_backend` plugs in other implementations.
"""

from dllm.evals.parallelbench.data import *  # noqa: F403
from dllm.evals.parallelbench.metrics import *  # noqa: F403
from dllm.evals.parallelbench.parsing import *  # noqa: F403
from dllm.evals.parallelbench.prompts import *  # noqa: F403
from dllm.evals.parallelbench.tasks import *  # noqa: F403
