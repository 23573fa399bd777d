"""Sweeps of decoding settings over the ParallelBench suite, written one sample per line so they resume.

A *method spec* names a curve and the grid along it::

    topk:k=1,2,4,8                  fixed tokens per step: the family baseline sampler (llada / dream)
                                    with steps = gen_length / k (one block of gen_length, as the original)
    topk:k=1,2,4:sampler=llada-random   the same with another registered sampler
    threshold:tau=0.5,0.6,...,1.0   any registered sampler with a grid over its parameters
    factor:factor=0.7,1.0,...,1.9   (parameter names as the registry has them: ``dllm samplers``)
    llada:remasking=low_confidence,random:temperature=0,0.5   several parameters: the Cartesian product

Sections are separated by ``:``, values by ``,``; ``a,b,...,z`` expands to the arithmetic progression
``a, b, ..., z`` (step ``b - a``). Besides the sampler's own parameters every spec accepts
``block_length`` (semi-autoregressive blocks) and, except ``topk``, ``steps`` (both go to the sampler
instead when it has a parameter of that name, e.g. a preset's preferred ``block_length``). The curve (``method``) is
the spec's name plus its single-valued and non-numeric parameters (``sampler=``, ``remasking=`` ...);
each point (``setting``) adds the numbers swept along it (``k``, ``tau``, ``temperature`` ...).

:func:`run_sweep` writes ``<out>/samples.jsonl``: one line per (setting, task, sample) as soon as the
sample's batch is decoded, with the record, the prediction, ``score``/``score_strict``, ``nfe``,
``tokens_per_step`` (gen_length / NFE, ParallelBench's speed measure), ``output_length`` (tokens before
EOS) and ``time_s`` (the batch's wall time divided by its rows). A rerun with the same ``<out>`` skips the
lines already there (a torn last line from a crash is dropped first), so an interrupted sweep resumes
with nothing lost or duplicated; new settings or tasks extend the file. Each line's ``key`` hashes its
record, prompt, metric and resolved decode configuration (:mod:`dllm.evals.io`): a record that changed since
(a rewritten ``--data-dir`` file) is recomputed and its stale line dropped. ``<out>/run.json`` pins what must
not change between runs of one directory (model, data options, generation length override, cache, decoding
seed); another value is refused, or with ``overwrite`` the results there are discarded.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from dllm.config import GenerateConfig
from dllm.evals import parallelbench as PB
from dllm.evals.io import JsonlStore, content_key, pinned_state, read_numbered_lines, read_run_file
from dllm.evals.runner import generate_batches
from dllm.generate import answer_lengths

__all__ = ["SAMPLES_FILE", "RUN_FILE", "Setting", "SweepResult", "check_run_file", "check_settings", "load_samples",
           "parse_method", "parse_methods", "parse_values", "replay_plan", "replay_sample", "run_sweep",
           "sample_line_problem", "stored_sample", "subset_indices", "sweep_pinned"]

SAMPLES_FILE = "samples.jsonl"
RUN_FILE = "run.json"
log = logging.getLogger(__name__)
_CONFIG_KEYS = ("block_length", "steps")


# ----------------------------------------------------------------------------------------------------------
# Method specs


def parse_scalar(text: str) -> Any:
    """``"true"``/``"none"``/``"3"``/``"0.5"``/other text -> bool / None / int / float / str."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_values(text: str) -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]``; ``"0.5,0.6,...,1.0"`` -> ``[0.5, 0.6, ..., 1.0]`` (exact decimal steps)."""
    parts = [p.strip() for p in text.split(",")]
    if any(p == "" for p in parts):
        raise ValueError(f"empty value in {text!r}")
    if "..." not in parts:
        return [parse_scalar(p) for p in parts]
    i = parts.index("...")
    if parts.count("...") != 1 or i < 2 or i != len(parts) - 2:
        raise ValueError(f"a range is written 'a,b,...,z' (two values, '...', the last value); got {text!r}")
    try:
        a, b, z = (Decimal(parts[j]) for j in (i - 2, i - 1, i + 1))
    except InvalidOperation:
        raise ValueError(f"a range needs numbers; got {text!r}") from None
    step = b - a
    if step == 0 or (z - a) * step < 0:
        raise ValueError(f"the range {text!r} does not reach {parts[-1]} in steps of {step}")
    as_int = all(isinstance(parse_scalar(parts[j]), int) for j in (i - 2, i - 1, i + 1))
    vals = [parse_scalar(p) for p in parts[: i - 2]]
    v = a
    while (z - v) * step >= 0:
        vals.append(int(v) if as_int else float(v))
        v += step
    if v - step != z:
        raise ValueError(f"the range {text!r} does not end on {parts[-1]} in steps of {step}")
    return vals


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: Any) -> str:
    return repr(v) if isinstance(v, float) else str(v)


@dataclass(frozen=True)
class Setting:
    """One point of a sweep: a sampler with parameters and the generation settings it needs."""

    method: str  # the curve: spec name + single-valued and non-numeric parameters
    label: str  # unique: the curve + swept parameters
    name: str  # "topk" or a registered sampler
    params: tuple[tuple[str, Any], ...] = ()  # sampler parameters
    k: int | None = None  # topk: tokens per step
    base: str | None = None  # topk: the sampler (None: the model family's baseline)
    block_length: int | None = None
    steps: int | None = None

    def resolve(self, model, gen_length: int, seed: int | None = 0):
        """``(sampler, GenerateConfig)`` for a task with budget ``gen_length``."""
        from dllm.generate import default_sampler

        return self.build(default_sampler(model).name, gen_length, seed)

    def build(self, baseline: str, gen_length: int, seed: int | None = 0):
        """:meth:`resolve` without the model: ``baseline`` is the model family's baseline sampler (``topk``'s
        sampler when the spec names none), which :func:`check_settings` reads from config.json."""
        from dllm.samplers import get_sampler

        steps = self.steps
        if self.name == "topk":
            if gen_length % self.k:
                raise ValueError(f"{self.label}: gen_length {gen_length} is not a multiple of k={self.k}; "
                                 "top-k decodes exactly k tokens per step (use k dividing the budget)")
            steps = gen_length // self.k
            sampler = get_sampler(self.base or baseline, **dict(self.params))
        else:
            try:
                sampler = get_sampler(self.name, **dict(self.params))
            except ValueError as exc:  # a value the sampler refuses: name the setting it came from
                raise ValueError(f"{self.label}: {exc}") from None
        return sampler, GenerateConfig(gen_length=gen_length, block_length=self.block_length, steps=steps, seed=seed)

    def describe(self) -> dict:
        return {"method": self.method, "setting": self.label, "sampler": self.base if self.name == "topk" else self.name,
                "params": dict(self.params), "k": self.k, "block_length": self.block_length, "steps": self.steps}

    @classmethod
    def from_line(cls, line: dict) -> Setting:
        """The setting a result line was decoded with (the inverse of :meth:`describe`). Rebuilt from the line's
        own fields, not by parsing ``line["method"]``: the method is the curve, which leaves out the swept
        parameters (``threshold`` for the setting ``threshold:tau=0.5``)."""
        topk = line.get("k") is not None
        return cls(method=line["method"], label=line["setting"], name="topk" if topk else line["sampler"],
                   params=tuple((line.get("params") or {}).items()), k=line.get("k"),
                   base=line["sampler"] if topk else None, block_length=line.get("block_length"),
                   steps=line.get("steps"))


def parse_method(spec: str) -> list[Setting]:
    """All settings of one method spec (see the module docstring); ValueError names what is wrong."""
    from dllm.samplers import SAMPLERS

    sections = [s.strip() for s in spec.strip().split(":")]
    name = sections[0]
    if not name:
        raise ValueError(f"empty method spec {spec!r}")
    grid: dict[str, list] = {}
    for sec in sections[1:]:
        if "=" not in sec:
            raise ValueError(f"{spec!r}: expected KEY=VALUES after ':', got {sec!r}")
        key, vals = (x.strip() for x in sec.split("=", 1))
        if key in grid:
            raise ValueError(f"{spec!r}: parameter {key!r} given twice")
        grid[key] = parse_values(vals)
    known_samplers = ", ".join(sorted(SAMPLERS))
    if name == "topk":
        if "k" not in grid:
            raise ValueError(f"{spec!r}: topk needs k, e.g. topk:k=1,2,4,8")
        if "steps" in grid:
            raise ValueError(f"{spec!r}: topk sets steps = gen_length / k; do not give steps")
        bases = grid.get("sampler", [None])
        for b in bases:
            if b is not None and b not in SAMPLERS:
                raise ValueError(f"{spec!r}: unknown sampler {b!r}; known samplers: {known_samplers}")
        for k in grid["k"]:
            if not isinstance(k, int) or k < 1:
                raise ValueError(f"{spec!r}: k must be a positive integer, got {k!r}")
        checks = sorted({c for b in bases for c in ([b] if b else ["llada", "dream"])})
    else:
        if name not in SAMPLERS:
            raise ValueError(f"unknown method {name!r}: use topk or a registered sampler ({known_samplers})")
        checks = [name]
    reserved = {"k", "sampler"} if name == "topk" else set()
    # topk without sampler=: the family baseline is known only with the model, so accept the parameters
    # of either baseline here; resolve() checks them against the one used.
    sampler_params: set[str] = set()
    for check in checks:
        sampler_params |= set(SAMPLERS[check].params())
    # block_length / steps go to the sampler when it has such a parameter (e.g. a preset's preferred block
    # length), else to GenerateConfig
    config_keys = [k for k in _CONFIG_KEYS if k not in sampler_params]
    bad = [k for k in grid if k not in sampler_params | set(config_keys) | reserved]
    if bad:
        raise ValueError(f"{spec!r}: unknown parameter(s) {bad}; parameters of {', '.join(sorted(set(checks)))}: "
                         f"{', '.join(sorted(sampler_params))} (and {', '.join(_CONFIG_KEYS)})")
    for key in config_keys:
        for v in grid.get(key, []):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{spec!r}: {key} must be a positive integer, got {v!r}")
    out = []
    keys = list(grid)
    for combo in itertools.product(*(grid[k] for k in keys)):
        values = dict(zip(keys, combo))
        label = ":".join([name] + [f"{k}={_fmt(values[k])}" for k in keys])
        # the curve: single-valued and categorical parameters; numbers swept over move along it
        method = ":".join([name] + [f"{k}={_fmt(values[k])}" for k in keys
                                    if len(grid[k]) == 1 or not _numeric(values[k])])
        params = tuple((k, v) for k, v in values.items() if k not in reserved and k not in config_keys)
        conf = {k: values.get(k) for k in config_keys}
        out.append(Setting(method=method, label=label, name=name, params=params, k=values.get("k"),
                           base=values.get("sampler"), block_length=conf.get("block_length"), steps=conf.get("steps")))
    return out


def parse_methods(specs: Sequence[str] | str) -> list[Setting]:
    """Settings of several specs, duplicates (same label) dropped, order kept."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    if not specs:
        raise ValueError("give at least one method spec, e.g. topk:k=1,2,4,8")
    out: dict[str, Setting] = {}
    for spec in specs:
        for s in parse_method(spec):
            out.setdefault(s.label, s)
    return list(out.values())


# ----------------------------------------------------------------------------------------------------------
# Running


@dataclass
class SweepResult:
    out_dir: Path
    samples_path: Path
    written: int  # lines written by this call
    already_done: int  # lines found from earlier runs (of the settings and tasks asked for)
    tasks: list[str]
    settings: list[str]
    needs_data: dict[str, str] = field(default_factory=dict)  # task -> why it was not run


def subset_indices(total: int, n: int | None) -> list[int]:
    """``n`` indices spread evenly over ``range(total)`` (all when ``n`` is None or >= total): files are
    ordered by list length, so a prefix would hold only the shortest lists."""
    if n is None or n >= total:
        return list(range(total))
    if n < 0:
        raise ValueError("n must be >= 0")
    return [(i * total) // n for i in range(n)]


def load_samples(path: str | Path) -> list[dict]:
    """Sample lines of a sweep (a ``samples.jsonl`` or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / SAMPLES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no sweep results at {str(path)!r}")
    numbered = read_numbered_lines(path, strict=True)  # a torn last line is not read
    for i, line in numbered:
        problem = sample_line_problem(line)
        if problem is not None:
            raise ValueError(f"{path}:{i}: not a result line of `dllm parallelbench run` ({problem}); remove the "
                             "line, or rerun the sweep into a new --out")
    return [line for _, line in numbered]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def sample_line_problem(line: Any) -> str | None:
    """What a report cannot use in a result line of ``samples.jsonl`` (``None`` when it is fine): the strings
    ``task``, ``method`` and ``setting``, and for a decoded line (no ``error``) the numbers ``tokens_per_step``
    and ``nfe``, and ``score`` (a number, or null when unavailable) and ``score_strict`` (the same, if present)."""
    if not isinstance(line, dict):
        return f"a JSON {type(line).__name__}, not an object"
    for key in ("task", "method", "setting"):
        if not isinstance(line.get(key), str):
            return f"no {key!r} field" if key not in line else f"{key!r} is not a string"
    if "error" in line:
        return None
    for key in ("tokens_per_step", "nfe"):
        if not _number(line.get(key)):
            return f"no {key!r} field" if key not in line else f"{key!r} is not a number"
    if "score" not in line:
        return "no 'score' field"
    for key in ("score", "score_strict"):
        if line.get(key) is not None and not _number(line[key]):
            return f"{key!r} is not a number"
    return None


@dataclass
class _TaskData:
    name: str
    records: list[dict]
    indices: list[int]
    template: str
    metric: str
    config: dict | None
    max_tokens: int


def _resolve_tasks(tasks, data_dir, n, seed, style, index_base, sort_by, sudoku_givens, text_data):
    needs: dict[str, str] = {}
    out: list[_TaskData] = []
    pattern = ",".join(tasks) if isinstance(tasks, (list, tuple)) else tasks
    text_data = {PB.get_task(k).pb_name: v for k, v in (text_data or {}).items()}
    if data_dir is not None:
        names = PB.available_tasks(data_dir, pattern)
        for t in PB.task_names(pattern):
            if t not in names:
                if t in text_data:
                    names.append(t)
                else:
                    needs[t] = f"no {t}.jsonl in {data_dir}" + (
                        f" ({PB.DATA_HINT[t]})" if PB.TASKS[t].needs_data else "")
    else:
        names = PB.task_names(pattern)
    if not names and not needs:
        known = PB.available_tasks(data_dir) if data_dir is not None else list(PB.TASKS)
        raise ValueError(f"no task matches {pattern!r}; known tasks: {', '.join(known)}")
    for name in names:
        config = PB.load_task_config(data_dir, name) if data_dir is not None else None
        template, metric = PB.prompt_for(name, style, config), PB.metric_for(name, config)
        try:
            if name in text_data:  # a user's file: checked against the prompt and metric it runs with
                records = PB.load_text_data(name, text_data[name], seed=seed, template=template, metric=metric,
                                            template_source=PB.prompt_source(data_dir, name, config))
            elif data_dir is not None:
                records = PB.load_records(data_dir, name, style)
            else:
                records = PB.generate_task(name, None, seed, style=style, index_base=index_base, sort_by=sort_by,
                                           sudoku_givens=sudoku_givens)
        except PB.DataNeeded as exc:
            needs[name] = str(exc)
            continue
        out.append(_TaskData(name, records, subset_indices(len(records), n), template, metric, config,
                             PB.max_tokens_for(name, config)))
    return out, needs


def sweep_pinned(model_name: str | None, *, data_dir: str | Path | None, seed: int, style: str, index_base: int,
                 sort_by: str, sudoku_givens: tuple[int, int], text_data: dict[str, str | Path] | None,
                 gen_length: int | None, cache: str | None, gen_seed: int | None) -> dict:
    """What a sweep pins in its ``run.json`` (:func:`run_sweep`'s arguments of the same names): the model, the data
    options, the generation length override, the cache and the decoding seed."""
    # a data directory's records carry no prompt: its task_config.yaml's, else the built-in one of ``style``
    data = ({"data_dir": str(Path(data_dir).resolve()), "style": style} if data_dir is not None else
            {"seed": seed, "style": style, "index_base": index_base, "sort_by": sort_by,
             "sudoku_givens": list(sudoku_givens)})
    data["text_data"] = {k: str(Path(v).resolve()) for k, v in sorted((text_data or {}).items())}
    return {"model": model_name, "data": data, "gen_length": gen_length, "cache": cache, "gen_seed": gen_seed}


def check_run_file(out: str | Path, pinned: dict, overwrite: bool) -> tuple[str | None, dict | None]:
    """Read-only: what a sweep with ``pinned`` (:func:`sweep_pinned`) does with ``out``, and its run file when
    it resumes: ``(None, None)`` (no earlier sweep), ``("resume", run file)`` or ``("discard", None)`` (other
    settings, or a run file that is not a sweep's, and ``overwrite``). Without ``overwrite`` other settings raise
    :class:`~dllm.evals.io.ConfigChanged`, a run file that is not a sweep's a ``ValueError``."""
    out = Path(out)
    try:
        old = read_run_file(out / RUN_FILE)
        if old is not None and not isinstance(old.get("pinned"), dict):
            raise ValueError("no pinned settings")
    except ValueError:
        if not overwrite:
            raise ValueError(f"--out {out}: its {RUN_FILE} is not a sweep's run file; use another --out directory "
                             "or --overwrite") from None
        return "discard", None
    if old is not None:
        data, now = old["pinned"].get("data"), pinned.get("data") or {}
        if isinstance(data, dict) and "data_dir" in data and "style" not in data and "style" in now:
            # a data-directory sweep from before its style was pinned: it resumes under the style given now (each
            # line's key holds its prompt, so a line made with another prompt is decoded again)
            old = {**old, "pinned": {**old["pinned"], "data": {**data, "style": now["style"]}}}
    state = pinned_state(None if old is None else old["pinned"], pinned, out, overwrite=overwrite,
                         what="sweep settings")
    return state, old if state == "resume" else None


def _open_run_file(out: Path, pinned: dict, store: JsonlStore, overwrite: bool) -> dict:
    state, old = check_run_file(out, pinned, overwrite)
    if state == "resume":
        return old
    if state == "discard":
        log.warning("%s: other sweep settings (or an unreadable %s) there; discarding the results (overwrite)",
                    out, RUN_FILE)
        store.clear()
    return {"pinned": pinned, "tasks": [], "settings": []}


def check_settings(settings: Sequence[Setting], family: str, tasks: str | Sequence[str] | None = None, *,
                   data_dir: str | Path | None = None, seed: int = PB.DEFAULT_SEED, style: str = "full",
                   index_base: int = 1, sort_by: str = "last", sudoku_givens: tuple[int, int] = (4, 12),
                   text_data: dict[str, str | Path] | None = None, gen_length: int | None = None) -> None:
    """Build every setting's sampler and decode configuration for every task's budget, as :func:`run_sweep` does
    (the same arguments), without a model: a value its sampler refuses (``threshold:tau=2``) or a ``topk`` k that
    does not divide a budget raises here, before the model loads and before ``--out`` is made, and so does a data
    file the tasks' prompts or metrics cannot use (:func:`dllm.evals.parallelbench.check_records`). ``family``: the
    model family (config.json's), whose baseline sampler ``topk`` uses when the spec names none."""
    from dllm.recipes import baseline_name

    # the tasks' records are read (and checked) whatever the budget: a bad data file fails here, not after loading
    task_data, _ = _resolve_tasks(tasks, data_dir, None, seed, style, index_base, sort_by, sudoku_givens, text_data)
    lengths = {gen_length} if gen_length is not None else {td.max_tokens for td in task_data}
    for s in settings:
        for G in sorted(lengths):
            s.build(baseline_name(family), G)


def run_sweep(model, out_dir: str | Path, methods: Sequence[str | Setting] | str, tasks: str | Sequence[str] | None = None,
              *, data_dir: str | Path | None = None, n: int | None = None, seed: int = PB.DEFAULT_SEED,
              style: str = "full", index_base: int = 1, sort_by: str = "last",
              sudoku_givens: tuple[int, int] = (4, 12), text_data: dict[str, str | Path] | None = None,
              gen_length: int | None = None, batch_size: int = 16, cache: str | None = None,
              model_name: str | None = None, allow_partial: bool = False, gen_seed: int | None = 0,
              overwrite: bool = False, on_start: Callable[[int, int], None] | None = None,
              on_sample: Callable[[dict], None] | None = None, continuous: bool = False) -> SweepResult:
    """Run every setting of ``methods`` on every task of ``tasks`` and append the samples to
    ``<out_dir>/samples.jsonl`` (resuming: lines already there are not redone).

    Args:
        model: a loaded model (with its tokenizer).
        methods: method specs (strings, see :func:`parse_method`) or :class:`Setting` objects.
        tasks: a pattern for :func:`dllm.evals.parallelbench.task_names` (default: all 17).
        data_dir: run on the records of ``<data_dir>/<category>/<task>.jsonl`` (ours, or the original's own
            data directory) instead of generating them; prompts come from its ``task_config.yaml`` if any.
        n: samples per task, spread evenly over the task's records (default: all).
        seed, style, index_base, sort_by, sudoku_givens, text_data: data options (see
            :func:`dllm.evals.parallelbench.generate_task`).
        gen_length: generation budget for every task (default: the original's per-task ``max_tokens``).
        cache: a cache policy name passed to :func:`dllm.generate`.
        model_name: recorded in ``run.json``; a rerun with another name is refused.
        overwrite: when ``run.json`` pins other settings, discard the results in ``out_dir`` instead of refusing.
        allow_partial: text tasks are scored on the metrics available (see ``score_prediction``).
        on_start: called once with (lines to do, lines already done).
        on_sample: called after each line is written (progress bars; an exception stops the sweep, and
            the lines written so far stay).
    """
    settings = [m if isinstance(m, Setting) else None for m in ([methods] if isinstance(methods, str) else methods)]
    specs = [m for m in ([methods] if isinstance(methods, str) else methods) if isinstance(m, str)]
    settings = [s for s in settings if s is not None] + (parse_methods(specs) if specs else [])
    if not settings:
        raise ValueError("give at least one method spec, e.g. topk:k=1,2,4,8")
    if style not in PB.STYLES:
        raise ValueError(f"style must be one of {PB.STYLES}, got {style!r}")
    task_data, needs = _resolve_tasks(tasks, data_dir, n, seed, style, index_base, sort_by, sudoku_givens, text_data)
    # resolve every (setting, task) up front so that a bad spec fails before any work (and before out_dir is made)
    built = {(s.label, td.name): s.resolve(model, gen_length or td.max_tokens, gen_seed)
             for s in settings for td in task_data}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pinned = sweep_pinned(model_name, data_dir=data_dir, seed=seed, style=style, index_base=index_base,
                          sort_by=sort_by, sudoku_givens=sudoku_givens, text_data=text_data, gen_length=gen_length,
                          cache=cache, gen_seed=gen_seed)
    store = JsonlStore(out, ident=lambda x: (x["setting"], x["task"], int(x["index"])), name=SAMPLES_FILE)
    run_info = _open_run_file(out, pinned, store, overwrite)
    if model_name is None and run_info["pinned"].get("model") is not None:
        pinned["model"] = run_info["pinned"]["model"]
    samples_path = store.path

    # key every line by its record, prompt, metric and decode configuration
    plan, expected = [], {}
    for s in settings:
        for td in task_data:
            sampler, config = built[(s.label, td.name)]
            convs = {i: PB.messages_for(td.records[i], td.template) for i in td.indices}
            decode = [s.describe(), asdict(config), repr(sampler), pinned]
            for i in td.indices:
                expected[(s.label, td.name, i)] = content_key(td.records[i], convs[i], td.metric, decode)
            plan.append((s, td, sampler, config, convs))
    lines = store.read()
    done, others, stale = store.current(expected, lines)
    if stale:  # drop the stale lines now, so that the file (and its reports) hold current results only
        log.warning("%s: %d stored line(s) no longer match their record or settings; recomputing them", out, stale)
        kept = {id(x) for x in [*done.values(), *others]}
        store.rewrite(x for x in lines if id(x) in kept)
    plan = [(s, td, sampler, config, convs, [i for i in td.indices if (s.label, td.name, i) not in done])
            for s, td, sampler, config, convs in plan]
    todo = sum(len(p[-1]) for p in plan)
    already = sum(len(p[1].indices) - len(p[-1]) for p in plan)

    run_info["tasks"] = list(dict.fromkeys(run_info.get("tasks", []) + [td.name for td in task_data]))
    run_info["settings"] = list(dict.fromkeys(run_info.get("settings", []) + [s.label for s in settings]))
    run_info["pinned"] = pinned
    earlier = {t: why for t, why in run_info.get("needs_data", {}).items() if t not in run_info["tasks"]}
    run_info["needs_data"] = {**earlier, **needs}
    (out / RUN_FILE).write_text(json.dumps(run_info, indent=2) + "\n", encoding="utf-8")
    if on_start is not None:
        on_start(todo, already)

    written = 0
    with store.append() as f:
        for s, td, sampler, config, convs, pending in plan:
            if not pending:
                continue
            for kept, res, failed in generate_batches(model, [convs[i] for i in pending], config, sampler=sampler,
                                                      cache=cache, batch_size=batch_size, continuous=continuous,
                                                      row_ids=[f"{td.name}:{i}" for i in pending]):
                for k, msg in failed.items():  # non-finite logits: an error line, not a wrong answer
                    idx = pending[k]
                    line = {"task": td.name, "index": idx, **s.describe(), "cache": cache,
                            "gen_length": config.gen_length, "steps": config.steps, "prediction": None,
                            "error": msg, "metric": td.metric, "key": expected[(s.label, td.name, idx)]}
                    f.write(line)
                    written += 1
                    if on_sample is not None:
                        on_sample(line)
                if res is None:
                    continue
                rows = [pending[k] for k in kept]
                lengths = answer_lengths(model, res.sequences)
                per_row = res.stats.time_total / len(rows)
                for j, idx in enumerate(rows):
                    record = td.records[idx]
                    pred = res.texts[j] if res.texts is not None else ""
                    sc = PB.score_prediction(td.name, record, pred, metric=td.metric, allow_partial=allow_partial)
                    nfe = int(res.stats.row_nfe[j])
                    line = {"task": td.name, "index": idx, **s.describe(), "cache": cache,
                            "gen_length": config.gen_length, "steps": config.steps, "prediction": pred, **sc,
                            "metric": td.metric, "nfe": nfe, "tokens_per_step": config.gen_length / max(nfe, 1),
                            "output_length": lengths[j], "time_s": per_row,
                            "batch_size": min(batch_size, len(rows)) if continuous else len(rows),
                            **{k: record[k] for k in ("input", "answer", "output_format", "metadata") if k in record},
                            "key": expected[(s.label, td.name, idx)]}
                    f.write(line)
                    written += 1
                    if on_sample is not None:
                        on_sample(line)
                f.sync()
    return SweepResult(out, samples_path, written, already, [td.name for td in task_data],
                       [s.label for s in settings], needs)


def stored_sample(out_dir: str | Path, index: int, task: str | None = None, setting: str | None = None) -> dict:
    """The result line of the decoded sample ``index`` of a sweep (of ``task`` / ``setting`` where the sweep has
    several); reads no model, so a command checks it before loading one. A ``task`` or ``setting`` the sweep does
    not hold is refused with the list of those it holds."""
    out = Path(out_dir)
    store = JsonlStore(out, ident=lambda x: (x["setting"], x["task"], int(x["index"])), name=SAMPLES_FILE)
    decoded = [ln for ln in store.read() if "error" not in ln]
    for option, value, key in (("task", task, "task"), ("setting", setting, "setting")):
        known = sorted({ln[key] for ln in decoded})
        if value is not None and value not in known:
            raise ValueError(f"no decoded sample of {option} {value!r} in {store.path}; its {option}s: "
                             f"{', '.join(known) or '(none)'}")
    lines = [ln for ln in decoded if int(ln["index"]) == index and (task is None or ln["task"] == task)
             and (setting is None or ln["setting"] == setting)]
    if not lines:
        raise ValueError(f"no decoded sample with index {index}" + (f" of task {task}" if task else "")
                         + (f" and setting {setting}" if setting else "") + f" in {store.path}")
    if len({(ln["task"], ln["setting"]) for ln in lines}) > 1:
        which = sorted({f"{ln['task']} / {ln['setting']}" for ln in lines})
        raise ValueError(f"index {index} exists for several task / setting pairs; pick one with --task and "
                         f"--setting: {', '.join(which)}")
    return lines[0]


@dataclass
class ReplayPlan:
    """What :func:`replay_sample` decodes, read without a model (:func:`replay_plan`)."""

    line: dict  # the stored result line
    messages: list[dict]  # the sample's chat, rebuilt from its record and the sweep's data options
    setting: Setting
    pinned: dict  # the sweep's run.json "pinned"


def replay_plan(out_dir: str | Path, index: int, task: str | None = None, setting: str | None = None, *,
                family: str | None = None) -> ReplayPlan:
    """Everything :func:`replay_sample` needs but the model, checked: the stored line (:func:`stored_sample`), the
    sweep's ``run.json``, the task's records (read and checked as the sweep read them) and the setting; with the
    model ``family`` (config.json's), the setting's sampler is built too. A command calls it before loading a
    model: what is wrong raises ``ValueError`` naming the file."""
    out = Path(out_dir)
    line = stored_sample(out, index, task, setting)
    where = f"{out / SAMPLES_FILE}: sample {index} of {line['task']} / {line['setting']}"
    run = read_run_file(out / RUN_FILE)
    pinned = run.get("pinned") if run is not None else None
    data = pinned.get("data") if isinstance(pinned, dict) else None
    keys = ("data_dir",) if isinstance(data, dict) and "data_dir" in data else (
        "seed", "style", "index_base", "sort_by", "sudoku_givens")
    if not isinstance(data, dict) or any(k not in data for k in keys):
        raise ValueError(f"{out / RUN_FILE}: not a sweep's run file (no pinned data options); rerun the sweep")
    if "data_dir" in data:
        # a run.json without the style (written before it was pinned): the built-in full prompts, as before
        task_data, _ = _resolve_tasks(line["task"], data["data_dir"], None, 0, data.get("style", "full"), 0, "last",
                                      (4, 12), data.get("text_data"))
    else:
        task_data, _ = _resolve_tasks(line["task"], None, None, data["seed"], data["style"], data["index_base"],
                                      data["sort_by"], tuple(data["sudoku_givens"]), data.get("text_data"))
    if not task_data:
        raise ValueError(f"{where}: its task's data is no longer there ({out / RUN_FILE} pins its data options)")
    td = task_data[0]
    if index >= len(td.records):
        raise ValueError(f"{where}: the task's data now has {len(td.records)} records, so its record {index} is "
                         "gone (the data changed since the sweep)")
    gen_length = line.get("gen_length")
    if not isinstance(gen_length, int) or isinstance(gen_length, bool) or gen_length < 1:
        raise ValueError(f"{where}: no positive integer 'gen_length' in the line; rerun the sweep")
    if not isinstance(line.get("params") or {}, dict) or (line.get("k") is None and not isinstance(
            line.get("sampler"), str)):
        raise ValueError(f"{where}: the line does not say its sampler ('sampler', 'params', 'k'); rerun the sweep")
    s = Setting.from_line(line)
    if family is not None:
        from dllm.recipes import baseline_name

        s.build(baseline_name(family), gen_length)
    return ReplayPlan(line, PB.messages_for(td.records[index], td.template), s, pinned)


def replay_sample(model, out_dir: str | Path, index: int, task: str | None = None, setting: str | None = None,
                  record_confidence: bool = True):
    """Decode one stored sample of a sweep again, for a picture of its trajectory (``dllm parallelbench show``).

    The result lines keep the record, not the per-step trajectory; the sample (:func:`stored_sample`) is
    regenerated from its stored record, the sweep's pinned data options (prompt style and template) and its
    setting's decode configuration (deterministic at temperature 0, and with the sweep's seed otherwise)
    (:func:`replay_plan`). Returns ``(GenerateOutput, line)``; ``line["prediction"]`` is the stored output, which
    the regenerated text should equal.
    """
    from dllm.generate import generate

    plan = replay_plan(out_dir, index, task, setting)
    line = plan.line
    sampler, config = plan.setting.resolve(model, line["gen_length"], plan.pinned.get("gen_seed", 0))
    config = dataclasses.replace(config, record_confidence=record_confidence)
    res = generate(model, [plan.messages], config, sampler=sampler, cache=plan.pinned.get("cache"))
    return res, line
