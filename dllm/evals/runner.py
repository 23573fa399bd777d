"""Run synthetic tasks through ``dllm.generate`` and score them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dllm.config import GenerateConfig
from dllm.evals import tasks as T
from dllm.generate import generate


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


def evaluate_tasks(model, names: list[str], n: int, seed: int, config: GenerateConfig, *, sampler=None,
                   cache=None, batch_size: int = 16, with_example: bool = True,
                   on_batch: Callable[[str, int], None] | None = None) -> list[TaskResult]:
    """Score ``n`` held-out examples (``seed``) of each task with one sampler configuration."""
    results = []
    for name in names:
        task = T.get_task(name)
        examples = task.generate(n, seed)
        scores, strict, nfes, tpfs, secs, samples = [], [], [], [], 0.0, []
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            convs = [ex.messages if with_example else ex.messages[-1:] for ex in chunk]
            out = generate(model, convs, config, sampler=sampler, cache=cache)
            secs += out.stats.time_total
            for ex, text, rn in zip(chunk, out.texts, out.stats.row_nfe):
                s, ss = task.score(text, ex), task.score_strict(text, ex)
                scores.append(s)
                strict.append(ss)
                nfes.append(rn)
                tpfs.append(config.gen_length / max(rn, 1))
                samples.append({"prediction": text, "target": ex.target, "score": s})
            if on_batch:
                on_batch(name, len(chunk))
        k = max(len(scores), 1)
        results.append(TaskResult(name, task.family, len(scores), sum(scores) / k, sum(strict) / k,
                                  sum(nfes) / k, sum(tpfs) / k, secs, samples))
    return results


def family_average(results: list[TaskResult]) -> dict[str, float]:
    """Mean score per family, plus ``"mean"``: the average over families (each family weighs the same)."""
    fams: dict[str, list[float]] = {}
    for r in results:
        fams.setdefault(r.family, []).append(r.score)
    out = {f: sum(v) / len(v) for f, v in fams.items()}
    out["mean"] = sum(out.values()) / max(len(out), 1)
    return out
