"""Run a standard benchmark through :func:`dllm.generate`: resumable, sharded across processes.

Output directory layout (``out``):

* ``run.json`` — the settings of the run; a rerun with different settings into the same directory is refused.
* ``samples.jsonl`` — one line per scored sample (merged, in data order), written at the end of a run.
* ``samples.rank{R}.jsonl`` — while a run is going, each process appends (and flushes) one line per sample as
  soon as it is scored. A rerun reads every ``samples*.jsonl`` (any number of processes before), skips the
  samples already there and never writes a sample twice; a half-written last line from a killed run is
  ignored. The main process merges everything into ``samples.jsonl`` and removes the shard files.
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
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dllm.config import GenerateConfig
from dllm.evals.standard import Sample, StandardTask
from dllm.evals.standard_answers import truncate_at

log = logging.getLogger(__name__)

__all__ = ["EvalSummary", "read_done", "run_standard_eval", "summarize", "summary_markdown"]

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


def _read_lines(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # a half-written last line of a killed run
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s: skipping a malformed line", path)
    return rows


def read_done(out: Path) -> dict[str, dict]:
    """Samples already scored in ``out`` (merged file and any shard files), by id; first occurrence wins."""
    done: dict[str, dict] = {}
    for p in sorted(Path(out).glob("samples*.jsonl")):
        for row in _read_lines(p):
            done.setdefault(str(row["id"]), row)
    return done


def _check_settings(out: Path, settings: dict) -> None:
    path = out / "run.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            raise ValueError(f"{out} holds a run with different settings ({', '.join(diff)}: "
                             f"{[old.get(k) for k in diff]} there, {[settings.get(k) for k in diff]} now); "
                             "use another --out, or the same settings to resume")
    else:
        path.write_text(json.dumps(settings, indent=2) + "\n")


def run_standard_eval(model, task: StandardTask, samples: list[Sample], config: GenerateConfig, out, *,
                      prompts: list, sampler=None, cache=None, batch_size: int = 1, settings: dict | None = None,
                      accelerator=None, timeout: float = 10.0, memory_mb: int = 1024,
                      on_start: Callable[[int, int], None] | None = None,
                      on_sample: Callable[[dict], None] | None = None) -> EvalSummary | None:
    """Generate, score and record every sample of ``samples`` not yet in ``out``.

    ``prompts[i]`` is what :func:`dllm.generate` gets for ``samples[i]`` (a conversation, a string, or token
    ids). Returns the summary over all samples in ``out`` on the main process, ``None`` on the others.
    """
    from dllm.evals.runner import output_lengths
    from dllm.generate import generate

    if len(prompts) != len(samples):
        raise ValueError(f"{len(prompts)} prompts for {len(samples)} samples")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    main = rank == 0
    out = Path(out)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        _check_settings(out, settings or {})
    _barrier(accelerator)
    done = read_done(out)
    _barrier(accelerator)  # everyone has read the same state before anyone writes
    todo = [i for i, s in enumerate(samples) if s.id not in done]
    mine = todo[rank::world]
    if on_start is not None:
        on_start(len(mine), len(samples) - len(todo))
    log.info("rank %d/%d: %d samples to do, %d already in %s", rank, world, len(mine), len(samples) - len(todo), out)

    tok = getattr(model, "tokenizer", None)
    shard = out / f"samples.rank{rank}.jsonl"
    written = []
    _drop_partial_line(shard)
    with open(shard, "a", encoding="utf-8") as f:
        for b in range(0, len(mine), batch_size):
            idx = mine[b : b + batch_size]
            res = generate(model, [prompts[i] for i in idx], config, sampler=sampler, cache=cache)
            lengths = output_lengths(model, res.sequences)
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
                        "rank": rank}
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
                f.flush()
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
        merged = read_done(out)
        for line in gathered:
            merged.setdefault(str(line["id"]), line)
        order = {s.id: i for i, s in enumerate(samples)}
        rows = sorted(merged.values(), key=lambda r: (order.get(str(r["id"]), len(order)), str(r["id"])))
        tmp = out / f".{MERGED}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, out / MERGED)
        summary = summarize(task.name, [r for r in rows if str(r["id"]) in order])
        summary.written = len(gathered)
        summary.already_done = len(samples) - len(todo)
        (out / "summary.json").write_text(json.dumps({**asdict(summary), "settings": settings or {}}, indent=2) + "\n")
        (out / "summary.md").write_text(summary_markdown([summary]) + "\n")
    _barrier(accelerator)
    if main:
        for p in out.glob("samples.rank*.jsonl"):
            p.unlink()
    _barrier(accelerator)
    return summary


def _drop_partial_line(path: Path) -> None:
    """Cut a half-written last line (a killed run) so that appended lines start on a line of their own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def _barrier(accelerator) -> None:
    if accelerator is not None and accelerator.num_processes > 1:
        accelerator.wait_for_everyone()


def summarize(task: str, rows: list[dict]) -> EvalSummary:
    n = len(rows)
    correct = sum(bool(r["correct"]) for r in rows)
    nfe = sum(r["nfe"] for r in rows)
    toks = sum(r["tokens"] for r in rows)
    secs = sum(r["time"] for r in rows)
    k = max(n, 1)
    return EvalSummary(task=task, n=n, correct=correct, accuracy=correct / k, nfe=nfe / k,
                       tokens_per_forward=sum(r["tokens_per_forward"] for r in rows) / k, answer_tokens=toks,
                       answer_tokens_per_forward=toks / max(nfe, 1), gen_seconds=secs,
                       tokens_per_second=toks / secs if secs > 0 else 0.0)


def summary_markdown(summaries: list[EvalSummary]) -> str:
    lines = ["| task | n | accuracy % | NFE | tokens/forward | answer tokens/forward | answer tokens | "
             "gen time s | tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s.task} | {s.n} | {100 * s.accuracy:.1f} | {s.nfe:.1f} | {s.tokens_per_forward:.2f} | "
                     f"{s.answer_tokens_per_forward:.2f} | {s.answer_tokens} | {s.gen_seconds:.2f} | "
                     f"{s.tokens_per_second:.1f} |")
    return "\n".join(lines)
