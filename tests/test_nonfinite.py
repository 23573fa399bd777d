"""Non-finite logits never decode silently: generate raises NonFiniteLogitsError naming the rows and step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ragged_prompts, random_model

import dllm
from dllm import NonFiniteLogitsError

SAMPLERS = ["llada", "dream", "threshold", "fast-dllm", "credit", "localleap", "klass", "prophet", "eoser-ass",
            "factor", "adablock"]


def _poison(model, kind: str, row: int, from_call: int = 0):
    """A forward hook that makes the logits of batch row ``row`` non-finite from the ``from_call``-th forward."""
    calls = {"n": 0}

    def hook(_m, _args, out):
        calls["n"] += 1
        if calls["n"] <= from_call:
            return out
        out = out.clone()
        if kind == "nan-column":
            out[row, :, 5] = float("nan")
        elif kind == "all-nan":
            out[row] = float("nan")
        elif kind == "all-neginf":
            out[row] = float("-inf")
        elif kind == "posinf":
            out[row, :, 7] = float("inf")
        return out

    return model.register_forward_hook(hook)


@pytest.mark.parametrize("kind", ["nan-column", "all-nan", "all-neginf", "posinf"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_non_finite_logits_raise_naming_row_and_step(sampler, kind):
    family = "dream" if sampler == "dream" else "llada"
    model = random_model(family)
    handle = _poison(model, kind, row=1, from_call=2)
    try:
        with pytest.raises(NonFiniteLogitsError, match=r"step 3: row 1 at \[") as err:
            dllm.generate(model, ragged_prompts(3), gen_length=16, block_length=16, steps=16, sampler=sampler)
    finally:
        handle.remove()
    assert err.value.rows == [1] and err.value.step == 3 and err.value.positions[0]
    assert "dtype='float32'" in str(err.value)


def test_finite_logits_with_inf_entries_still_decode():
    """A -inf entry (a suppressed token) is not an error: only NaN, +inf or no finite value at a position is."""
    model = random_model("llada")

    def hook(_m, _args, out):
        out = out.clone()
        out[..., 5] = float("-inf")
        return out

    handle = model.register_forward_hook(hook)
    try:
        out = dllm.generate(model, ragged_prompts(2), gen_length=8, block_length=8, steps=8)
    finally:
        handle.remove()
    assert not (out.sequences == 5).any() and not (out.sequences == model.mask_id).any()


def _poison_batches_of(model, size: int, row: int):
    """NaN logits for batch row ``row`` of every forward over a batch of ``size`` rows: once that row is dropped
    (the batch shrinks) the rest decodes normally."""

    def hook(_m, _args, out):
        if out.shape[0] != size:
            return out
        out = out.clone()
        out[row] = float("nan")
        return out

    return model.register_forward_hook(hook)


def test_generate_rows_drops_the_failing_row_and_decodes_the_others():
    from dllm.evals.runner import generate_rows

    model = random_model("llada")
    prompts = ragged_prompts(3)
    handle = _poison_batches_of(model, 3, 1)
    try:
        kept, out, errors = generate_rows(model, prompts, dllm.GenerateConfig(gen_length=8, block_length=8))
    finally:
        handle.remove()
    assert kept == [0, 2] and list(errors) == [1] and "non-finite" in errors[1]
    alone = dllm.generate(model, [prompts[0], prompts[2]], gen_length=8, block_length=8)
    assert torch.equal(out.sequences, alone.sequences)


def test_evaluations_record_non_finite_samples_as_errors(tmp_path):
    """eval-tasks, dllm eval and the ParallelBench report: a sample whose logits turn NaN is an error (kept out
    of the accuracy), the other samples of its batch are decoded and scored, and the run goes on."""
    from dllm.assets import model_path
    from dllm.evals.parallelbench.report import aggregate
    from dllm.evals.runner import evaluate_tasks
    from dllm.evals.standard import build_prompts, get_standard_task, load_samples
    from dllm.evals.standard.runner import run_standard_eval
    from dllm.models import load_model

    tiny = load_model(model_path("llada-tiny"))
    cfg = dllm.GenerateConfig(gen_length=16, block_length=16)
    handle = _poison_batches_of(tiny, 4, 2)
    try:
        res = evaluate_tasks(tiny, ["waiting_line/copy"], 4, 1, cfg, batch_size=4)[0]
    finally:
        handle.remove()
    assert res.errors == 1 and res.n == 3
    assert [("error" in s) for s in res.samples] == [True, False, False, False]

    task = get_standard_task("gsm8k")
    fixtures = Path(__file__).resolve().parent / "fixtures" / "eval" / "gsm8k.jsonl"
    samples, pool = load_samples(task, str(fixtures), shots=1)
    samples = samples[:3]
    handle = _poison_batches_of(tiny, 3, 1)
    try:
        summary = run_standard_eval(tiny, task, samples, cfg, tmp_path, prompts=build_prompts(task, samples, pool, 1),
                                    settings={"k": 1}, batch_size=3)
    finally:
        handle.remove()
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [ln.get("status") == "error" for ln in lines] == [False, True, False]
    assert summary.errors == 1 and summary.n == 2

    good = {"task": "waiting_line/copy", "method": "x", "setting": "x", "tokens_per_step": 1.0, "nfe": 8, "score": 1.0}
    cells, _, _ = aggregate([good, {**good, "error": "non-finite"}])
    (cell,) = cells.values()
    assert cell.errors == 1 and cell.n == 1 and cell.score == 100.0


def test_per_row_windows_name_the_rows_own_positions():
    """With per-row windows (the threshold sampler, rows in different blocks) a bad row's positions are its own
    block's generation offsets, wherever the other rows' blocks are."""
    model = dllm.load_model("llada-tiny")
    kw = dict(gen_length=32, block_length=8, sampler="threshold")
    prompts = ['Copy the list: ["Ann Lee"]', "Name three colours.",
               'Reverse the list: ["Kevin Irving", "Ann Lee", "Paula Parker"]', "What is 407 + 2185?"]
    out = dllm.generate(model, prompts, **kw)
    clean = out.stats.trace
    P = clean[0]["lo"][0]  # the generation's first canvas column
    # a step where row 1 is ahead of a row (its union window would start before its block)
    step = next(i for i, r in enumerate(clean) if min(r["lo"]) < r["lo"][1] < P + 32)
    handle = _poison(model, "all-nan", row=1, from_call=step)
    try:
        with pytest.raises(NonFiniteLogitsError) as err:
            dllm.generate(model, prompts, **kw)
    finally:
        handle.remove()
    lo = clean[step]["lo"][1] - P
    assert err.value.rows == [1] and err.value.step == step + 1
    assert err.value.positions == [list(range(lo, lo + 8))]
