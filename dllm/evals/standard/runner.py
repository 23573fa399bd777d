"""Run a standard benchmark through :func:`dllm.generate`: resumable, sharded across processes.

Output directory layout (``out``):

* ``run.json`` — the settings of the run. A rerun with different decode settings into the same directory is
  refused (naming what changed), unless ``overwrite`` (``--overwrite``) discards the results there.
* ``samples.jsonl`` — one line per scored sample (merged, in data order), written at the end of a run.
* ``samples.rank{R}.jsonl`` — while a run is going, each process appends (and flushes) one line per sample as
  soon as it is scored. A rerun reads every ``samples*.jsonl`` (any number of processes before), skips the
  samples already there and never writes a sample twice; a half-written last line from a killed run is
  ignored. The main process merges everything into ``samples.jsonl`` and removes the shard files.
* Each line's ``key`` hashes the sample's record, its prompt (token ids, few-shot examples included) and the
  pinned settings (:mod:`dllm.evals.io`): a sample whose record or prompt changed since (a rewritten ``--data``
  or ``--fewshot-data`` file) is recomputed and its stale line dropped from ``samples.jsonl``.
* ``summary.json`` and ``summary.md`` — accuracy, NFE, tokens per forward, answer tokens and tokens/s.

Throughput counts *answer tokens*: generated tokens before the first EOS/EOT (padding after the answer is not
counted, nor is the prompt); when a stop string cuts the answer, the tokens of the kept text. Time is the
generation wall time (:attr:`GenerateStats.time_total`); a batch's time is split evenly over its rows.
Overall tokens/s = total answer tokens / total generation time (per process: what one GPU sustains).

Multi-process: pass an ``accelerate.Accelerator``; samples still to do are split round-robin over its
processes (``accelerate launch --num_processes N`` or ``torchrun``), each process runs its own model, and the
main process merges. Library code: progress goes to the ``on_sample`` callback and :mod:`logging`, never to
stdout.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dllm.config import GenerateConfig
from dllm.evals.io import JsonlStore, content_key, pinned_state, read_run_file
from dllm.evals.standard import Sample, StandardTask
from dllm.evals.standard.answers import truncate_at
from dllm.evals.stats import fmt_ci, proportion_ci

log = logging.getLogger(__name__)

__all__ = ["EvalSummary", "check_settings", "pinned_settings", "read_done", "run_standard_eval", "summarize",
           "summary_markdown"]

MERGED = "samples.jsonl"


@dataclass
class EvalSummary:
    task: str
    n: int
    correct: int
    accuracy: float
    nfe: float  # mean forwards per sample
    tokens_per_forward: float  # mean gen_length / NFE (what generate() reports)
    answer_tokens: int  # total answer tokens
    answer_tokens_per_forward: float  # total answer tokens / total NFE
    gen_seconds: float  # total generation wall time (summed over processes)
    tokens_per_second: float  # answer tokens / generation seconds
    written: int = 0  # samples scored by this run
    already_done: int = 0  # samples found in --out from an earlier run
    errors: int = 0  # samples not decoded (non-finite logits), left out of the accuracy
    accuracy_ci: tuple[float, float] = (float("nan"), float("nan"))  # 95 % Wilson interval of the accuracy


UNPINNED = ("data", "fewshot_data")  # recorded in run.json, not compared: samples are keyed by their content


def _store(out: Path) -> JsonlStore:
    return JsonlStore(out, ident=lambda row: str(row["id"]), name=MERGED)


def read_done(out: Path) -> dict[str, dict]:
    """Sample lines in ``out`` (merged file and any shard files), by id, whatever their key; first occurrence wins."""
    done: dict[str, dict] = {}
    for row in _store(Path(out)).read():
        done.setdefault(str(row["id"]), row)
    return done


def _compared(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k not in UNPINNED}


def _shown(old: dict, new: dict) -> tuple[dict, dict]:
    """:func:`_compared` of both runs' settings, less the keys that only copy a ``generate_config`` field in both
    (the command line's ``steps``, ``gen_length``, ...): a difference there is named once, as
    ``generate_config.steps`` (the samples' keys keep :func:`_compared`, so that earlier results stay valid)."""
    old, new = _compared(old), _compared(new)

    def mirrors(d: dict, k: str) -> bool:
        config = d.get("generate_config")
        return isinstance(config, dict) and k in config and k in d and d[k] == config[k]

    dup = {k for k in set(old) | set(new) if mirrors(old, k) and mirrors(new, k)}
    return ({k: v for k, v in old.items() if k not in dup}, {k: v for k, v in new.items() if k not in dup})


def pinned_settings(task: StandardTask, config: GenerateConfig, *, settings: dict | None = None, sampler=None,
                    cache=None, timeout: float = 10.0, memory_mb: int = 1024) -> dict:
    """What :func:`run_standard_eval` pins in ``run.json``: ``settings`` plus the task, the decode configuration,
    the sampler, the cache and the scoring limits (all known before the model loads)."""
    return {**(settings or {}), "task": task.name, "generate_config": asdict(config),
            "sampler_config": repr(sampler) if sampler is not None else None,
            "cache_config": cache if cache is None or isinstance(cache, str) else repr(cache),
            "timeout": timeout, "memory_mb": memory_mb}


def check_settings(out: str | Path, pinned: dict, overwrite: bool) -> str | None:
    """Read-only: what a run with ``pinned`` (:func:`pinned_settings`) does with ``out``: ``None`` (no earlier
    run), ``"resume"`` or ``"discard"`` (other settings, ``overwrite``). Other settings without ``overwrite``
    raise :class:`~dllm.evals.io.ConfigChanged`, a malformed ``run.json`` a ``ValueError``."""
    out = Path(out)
    try:
        old = read_run_file(out / "run.json")
    except ValueError as exc:
        raise ValueError(f"{exc}; use another --out directory or delete that run.json (the results there can then "
                         "not be checked against it)") from None
    if old is None:
        return None
    return pinned_state(*_shown(old, pinned), out, overwrite=overwrite, what="settings")


def _check_settings(out: Path, pinned: dict, overwrite: bool) -> None:
    if check_settings(out, pinned, overwrite) == "discard":
        log.warning("%s: settings changed; discarding the results there (overwrite)", out)
        _store(out).clear()
        for name in ("summary.json", "summary.md"):
            (out / name).unlink(missing_ok=True)
    (out / "run.json").write_text(json.dumps(pinned, indent=2) + "\n")


def _plain(prompt):
    return prompt.tolist() if hasattr(prompt, "tolist") else prompt


def run_standard_eval(model, task: StandardTask, samples: list[Sample], config: GenerateConfig, out, *,
                      prompts: list, sampler=None, cache=None, batch_size: int = 1, settings: dict | None = None,
                      accelerator=None, timeout: float = 10.0, memory_mb: int = 1024, overwrite: bool = False,
                      on_start: Callable[[int, int], None] | None = None,
                      on_sample: Callable[[dict], None] | None = None, continuous: bool = False) -> EvalSummary | None:
    """Generate, score and record every sample of ``samples`` not yet in ``out`` (with its current content).

    ``prompts[i]`` is what :func:`dllm.generate` gets for ``samples[i]`` (a conversation, a string, or token
    ids). ``settings`` (plus ``config``, ``sampler`` and ``cache``) is pinned in ``out/run.json``: a run with
    other settings is refused, or with ``overwrite`` the results there are discarded first. Returns the
    summary over all samples in ``out`` on the main process, ``None`` on the others. ``continuous``: the samples
    decoded ``batch_size`` rows at a time with continuous batching (a finished row's place taken by the next
    sample; :data:`~dllm.evals.runner.CONTINUOUS_CHUNK` times ``batch_size`` samples per generate call), the same
    outputs.
    """
    from dllm.evals.runner import batching, generate_rows
    from dllm.generate import answer_lengths

    if len(prompts) != len(samples):
        raise ValueError(f"{len(prompts)} prompts for {len(samples)} samples")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    main = rank == 0
    out = Path(out)
    pinned = pinned_settings(task, config, settings=settings, sampler=sampler, cache=cache, timeout=timeout,
                             memory_mb=memory_mb)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        _check_settings(out, pinned, overwrite)
    _barrier(accelerator)
    decode = _compared(pinned)
    keys = {s.id: content_key(s.row, _plain(p), decode) for s, p in zip(samples, prompts)}
    store = _store(out)
    done, _, stale = store.current(keys)
    _barrier(accelerator)  # everyone has read the same state before anyone writes
    todo = [i for i, s in enumerate(samples) if s.id not in done]
    mine = todo[rank::world]
    if on_start is not None:
        on_start(len(mine), len(samples) - len(todo))
    if main and stale:
        log.warning("%s: %d stored result(s) no longer match their record or prompt; recomputing them", out, stale)
    log.info("rank %d/%d: %d samples to do, %d already in %s", rank, world, len(mine), len(samples) - len(todo), out)

    tok = getattr(model, "tokenizer", None)
    written = []
    with store.append(store.shard(rank)) as f:
        step, max_rows = batching(batch_size, continuous)
        for b in range(0, len(mine), step):
            chunk = mine[b : b + step]
            kept, res, failed = generate_rows(model, [prompts[i] for i in chunk], config, sampler=sampler,
                                              cache=cache, row_ids=[samples[i].id for i in chunk],
                                              max_rows=max_rows)
            for k, msg in failed.items():  # non-finite logits: an error line, not a wrong answer
                i = mine[b + k]
                s = samples[i]
                line = {"id": s.id, "index": i, "task": task.name, "output": None, "correct": False, "status": "error",
                        "error": msg, "reference": s.reference, "nfe": 0, "tokens": 0, "time": 0.0,
                        "tokens_per_forward": 0.0, "rank": rank, "key": keys[s.id]}
                f.write(line)
                written.append(line)
                if on_sample is not None:
                    on_sample(line)
            if res is None:
                continue
            idx = [mine[b + k] for k in kept]
            lengths = answer_lengths(model, res.sequences)
            share = res.stats.time_total / len(idx)
            for j, i in enumerate(idx):
                s = samples[i]
                text, cut = truncate_at(res.texts[j], task.stops)
                n_tok = lengths[j]
                if cut and tok is not None:
                    n_tok = min(n_tok, len(tok(text, add_special_tokens=False)["input_ids"]))
                scored = task.score(s, text, timeout=timeout, memory_mb=memory_mb)
                line = {"id": s.id, "index": i, "task": task.name, "output": text, **scored,
                        "reference": s.reference, "nfe": res.stats.row_nfe[j], "tokens": n_tok,
                        "time": share, "tokens_per_forward": config.gen_length / max(res.stats.row_nfe[j], 1),
                        "rank": rank, "key": keys[s.id]}
                f.write(line)
                written.append(line)
                if on_sample is not None:
                    on_sample(line)

    # Merge: every process's lines of this run reach the main process (no shared filesystem needed for them).
    if accelerator is not None and world > 1:
        from accelerate.utils import gather_object

        gathered = gather_object(written)
    else:
        gathered = written
    summary = None
    if main:
        current, others, _ = store.current(keys, store.read() + gathered)
        rows = [current[s.id] for s in samples if s.id in current] + sorted(others, key=lambda r: str(r["id"]))
        store.rewrite(rows)
        summary = summarize(task.name, [current[s.id] for s in samples if s.id in current])
        summary.written = len(gathered)
        summary.already_done = len(samples) - len(todo)
        (out / "summary.json").write_text(json.dumps({**asdict(summary), "settings": settings or {}}, indent=2) + "\n")
        (out / "summary.md").write_text(summary_markdown([summary]) + "\n")
    _barrier(accelerator)
    if main:
        for p in store.shards():
            p.unlink()
    _barrier(accelerator)
    return summary


def _barrier(accelerator) -> None:
    if accelerator is not None and accelerator.num_processes > 1:
        accelerator.wait_for_everyone()


def summarize(task: str, rows: list[dict]) -> EvalSummary:
    """Accuracy and speed over the decoded samples; samples whose decoding failed (``error``: non-finite logits)
    are counted in ``errors``, not as wrong answers."""
    errors = sum("error" in r for r in rows)
    rows = [r for r in rows if "error" not in r]
    n = len(rows)
    correct = sum(bool(r["correct"]) for r in rows)
    nfe = sum(r["nfe"] for r in rows)
    toks = sum(r["tokens"] for r in rows)
    secs = sum(r["time"] for r in rows)
    k = max(n, 1)
    return EvalSummary(task=task, n=n, correct=correct, accuracy=correct / k, nfe=nfe / k,
                       tokens_per_forward=sum(r["tokens_per_forward"] for r in rows) / k, answer_tokens=toks,
                       answer_tokens_per_forward=toks / max(nfe, 1), gen_seconds=secs,
                       tokens_per_second=toks / secs if secs > 0 else 0.0, errors=errors,
                       accuracy_ci=proportion_ci(correct, n))


def summary_markdown(summaries: list[EvalSummary]) -> str:
    """The summary table; the accuracy with its 95 % Wilson interval."""
    lines = ["| task | n | accuracy % | 95% CI | NFE | tokens/forward | answer tokens/forward | answer tokens | "
             "gen time s | tokens/s | errors |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s.task} | {s.n} | {100 * s.accuracy:.1f} | {fmt_ci(*s.accuracy_ci, scale=100)} | "
                     f"{s.nfe:.1f} | {s.tokens_per_forward:.2f} | "
                     f"{s.answer_tokens_per_forward:.2f} | {s.answer_tokens} | {s.gen_seconds:.2f} | "
                     f"{s.tokens_per_second:.1f} | {s.errors} |")
    return "\n".join(lines)
