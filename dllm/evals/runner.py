"""Run synthetic tasks through ``dllm.generate`` and score them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from dllm.config import GenerateConfig
from dllm.evals import tasks as T
from dllm.evals.stats import mean_ci
from dllm.generate import GenerateOutput, NonFiniteLogitsError

#: with continuous batching, the prompts of one generate call as a multiple of the batch size: the rows decoding at
#: once stay ``batch_size``, results are written (and progress shown) once per call
CONTINUOUS_CHUNK = 8


def batching(batch_size: int, continuous: bool) -> tuple[int, int | None]:
    """``(prompts per generate call, its max_rows)`` for ``batch_size`` rows at once: ``batch_size`` prompts per call,
    or with continuous batching :data:`CONTINUOUS_CHUNK` times that, ``batch_size`` of them decoding at once."""
    return (batch_size * CONTINUOUS_CHUNK, batch_size) if continuous else (batch_size, None)


def generate_rows(model, prompts: Sequence, config: GenerateConfig, *, sampler=None, cache=None, row_ids=None,
                  max_rows: int | None = None) -> tuple[list[int], GenerateOutput | None, dict[int, str]]:
    """:func:`dllm.generate` on ``prompts``; a row whose logits turn non-finite (:class:`NonFiniteLogitsError`)
    is an error, not an answer: it is dropped and the other rows are decoded again. Returns ``(kept, output,
    errors)``: the indices of ``prompts`` that ``output`` covers (``None`` when none is left) and ``{index:
    message}`` for the failed ones. ``row_ids`` (one per prompt, e.g. sample ids) key each row's random stream,
    so a sample's output does not depend on its batch, the batch size or the number of processes. ``max_rows``:
    continuous batching (:func:`dllm.generate`'s), the same outputs."""
    from dllm.generate import generate  # looked up per call (tests and tools may wrap dllm.generate.generate)

    kept, errors = list(range(len(prompts))), {}
    while kept:
        try:
            ids = None if row_ids is None else [row_ids[i] for i in kept]
            return kept, generate(model, [prompts[i] for i in kept], config, sampler=sampler, cache=cache,
                                  row_ids=ids, max_rows=max_rows), errors
        except NonFiniteLogitsError as err:
            errors.update({kept[r]: str(err) for r in err.rows})
            kept = [i for r, i in enumerate(kept) if r not in err.rows]
    return kept, None, errors


def generate_batches(model, conversations: Sequence, config: GenerateConfig, *, sampler=None, cache=None,
                     batch_size: int = 16, row_ids: Sequence | None = None, continuous: bool = False
                     ) -> Iterator[tuple[list[int], GenerateOutput | None, dict[int, str]]]:
    """Run ``conversations`` through :func:`generate_rows` in consecutive chunks of ``batch_size`` (``continuous``:
    chunks of :data:`CONTINUOUS_CHUNK` times that, each decoded ``batch_size`` rows at a time with continuous
    batching, a finished row's place taken by the next prompt; the same outputs).

    Yields ``(rows, output, errors)`` per chunk: ``output`` covers ``conversations[i]`` for ``i`` in ``rows``
    (in order), ``errors`` maps the chunk's failed indices to their message. ``row_ids``: see
    :func:`generate_rows` (one per conversation)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n, max_rows = batching(batch_size, continuous)
    for start in range(0, len(conversations), n):
        ids = None if row_ids is None else list(row_ids[start : start + n])
        kept, out, errors = generate_rows(model, conversations[start : start + n], config, sampler=sampler,
                                          cache=cache, row_ids=ids, max_rows=max_rows)
        yield [start + i for i in kept], out, {start + i: m for i, m in errors.items()}


@dataclass
class TaskResult:
    task: str
    family: str
    n: int
    score: float
    score_strict: float
    nfe: float  # mean forwards per sample
    tokens_per_forward: float
    seconds: float
    samples: list[dict] = field(default_factory=list)
    errors: int = 0  # examples not decoded (non-finite logits): in ``samples`` with an ``error``, not scored

    @property
    def score_ci(self) -> tuple[float, float]:
        """95 % interval of ``score`` over the scored samples (Wilson for 0/1 scores)."""
        return mean_ci([x["score"] for x in self.samples if "score" in x])


def evaluate_tasks(model, names: list[str], n: int, seed: int, config: GenerateConfig, *, sampler=None,
                   cache=None, batch_size: int = 16, with_example: bool = True,
                   on_batch: Callable[[str, int], None] | None = None, continuous: bool = False) -> list[TaskResult]:
    """Score ``n`` held-out examples (``seed``) of each task with one sampler configuration (``continuous``:
    :func:`generate_batches`')."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer (examples per task), got {n!r}")
    results = []
    for name in names:
        task = T.get_task(name)
        examples = task.generate(n, seed)
        scores, strict, nfes, tpfs, secs, samples, errors = [], [], [], [], 0.0, [], 0
        convs = [ex.messages if with_example else ex.messages[-1:] for ex in examples]
        for rows, out, failed in generate_batches(model, convs, config, sampler=sampler, cache=cache,
                                                  batch_size=batch_size, continuous=continuous,
                                                  row_ids=[f"{name}:{seed}:{i}" for i in range(len(convs))]):
            errors += len(failed)
            samples += [{"prediction": None, "target": examples[i].target, "error": msg} for i, msg in failed.items()]
            if out is None:
                continue
            secs += out.stats.time_total
            for ex, text, rn in zip([examples[i] for i in rows], out.texts, out.stats.row_nfe):
                s, ss = task.score(text, ex), task.score_strict(text, ex)
                scores.append(s)
                strict.append(ss)
                nfes.append(rn)
                tpfs.append(config.gen_length / max(rn, 1))
                samples.append({"prediction": text, "target": ex.target, "score": s})
            if on_batch:
                on_batch(name, len(rows) + len(failed))
        k = max(len(scores), 1)
        results.append(TaskResult(name, task.family, len(scores), sum(scores) / k, sum(strict) / k,
                                  sum(nfes) / k, sum(tpfs) / k, secs, samples, errors))
    return results


def family_average(results: list[TaskResult]) -> dict[str, float]:
    """Mean score per family, plus ``"mean"``: the average over families (each family weighs the same)."""
    fams: dict[str, list[float]] = {}
    for r in results:
        fams.setdefault(r.family, []).append(r.score)
    out = {f: sum(v) / len(v) for f, v in fams.items()}
    out["mean"] = sum(out.values()) / max(len(out), 1)
    return out
