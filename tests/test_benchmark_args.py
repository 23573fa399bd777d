"""The benchmarks' options: a value a benchmark cannot run is refused up front (argparse, exit 2, a message naming
the fix), ``--help`` describes the script without running it, and the figures printed mean what they say (small
CPU runs, counts and labels only, never timings)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))


def bench(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``benchmarks/<script> args`` in a subprocess, from the repository root, as tests/test_benchmarks.py runs them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def in_process(script: str, *args: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``script args`` where it exits in its argument parsing (a refusal, ``--help``),
    run in this process: its ``main`` with ``sys.argv`` set (an interpreter start would cost seconds)."""
    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = [script, *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
            importlib.import_module(Path(script).stem).main()  # benchmarks/ is on sys.path
    finally:
        sys.argv = argv
    return exit_.value.code or 0, out.getvalue(), err.getvalue()


def refused(script: str, *args: str) -> str:
    """The argparse error of ``script args`` (asserting exit code 2 and a ``usage:`` line)."""
    code, _, err = in_process(script, *args)
    assert code == 2, (code, err[-2000:])
    assert "usage:" in err and "error:" in err, err
    return err.split("error:", 1)[1]


def helped(script: str) -> str:
    """What ``script --help`` prints (asserting exit code 0)."""
    code, out, err = in_process(script, "--help")
    assert code == 0, err[-2000:]
    return out


# 1. dkv_variants.py


def test_dkv_variants_help_describes_without_running():
    out = helped("dkv_variants.py")
    assert "dKV-Cache-Decode variants" in out and "--tasks" in out and "--every" in out
    assert "prompts;" not in out  # nothing decoded


def test_dkv_variants_runs_on_the_synthetic_tasks_only():
    p = bench("dkv_variants.py", "--tasks", "waiting_line/copy", "--n", "1", "--every", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("1 prompts;"), p.stdout
    assert [ln.split(":")[0].split() for ln in lines[1:]] == [["block", "2"], ["global", "2"]], p.stdout
    err = refused("dkv_variants.py", "--tasks", "paraphrase_summarize")  # ParallelBench-only: no chat examples
    assert "paraphrase_summarize" in err and "waiting_line/copy" in err


def test_dkv_variants_default_tasks_all_have_chat_examples():
    from dllm.evals import tasks as T

    names = T.task_names()
    assert names and all(T.get_task(n).generate(1, 777) for n in names)


# 2. bench_serve.py


def test_bench_serve_one_row_reads_one_times():
    import bench_serve

    import dllm
    from dllm.assets import model_path

    torch.set_num_threads(1)
    model = dllm.load_model(str(model_path("llada-tiny")), dtype="float32")
    lines = bench_serve.batching_gains(model, 16, [1, 2], reps=1)
    assert len(lines) == 2 and lines[0].startswith("forward of 1 rows") and "at most 1.00x" in lines[0], lines
    # without a concurrency of 1 the one-row reference is measured too, and printed first
    lines = bench_serve.batching_gains(model, 16, [2], reps=1)
    assert len(lines) == 2 and "one-row reference" in lines[0] and lines[1].startswith("forward of 2 rows"), lines


def test_bench_serve_refuses_cuda_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the benchmark would run there")
    assert "--device cuda: no CUDA device here" in refused("bench_serve.py", "--device", "cuda")


# 3. quality_caches.py, quality_samplers.py: a rerun reports the request only (and 6: layouts, --curves)


def _sweep_result(settings, tasks):
    from dllm.evals.parallelbench.sweep import SweepResult

    return SweepResult(Path("x"), Path("x/samples.jsonl"), 0, 0, list(tasks), list(settings))


@pytest.mark.parametrize("script", ["quality_caches", "quality_samplers"])
def test_quality_tables_keep_the_requested_lines_only(script):
    from dllm.evals.parallelbench import get_task
    from dllm.evals.parallelbench.sweep import subset_indices

    mod = importlib.import_module(script)
    copy, rev = "waiting_line/copy", "waiting_line/reverse"
    total = get_task(copy).num_samples
    stored = [{"setting": s, "task": t, "index": i} for s in ("a", "b") for t in (copy, rev) for i in range(total)]
    kept = mod.requested(stored, _sweep_result(["a"], [copy]), 2)
    assert [(x["setting"], x["task"], x["index"]) for x in kept] == [("a", copy, i) for i in subset_indices(total, 2)]
    assert len(mod.requested(stored, _sweep_result(["a", "b"], [copy, rev]), None)) == len(stored)


def test_quality_samplers_rerun_with_fewer_samples_reports_those(tmp_path):
    import dllm
    from dllm.assets import model_path
    from dllm.evals.parallelbench.sweep import run_sweep

    out = tmp_path / "qs"
    # an earlier run into the same --out (as the script runs its curves), with two samples
    torch.set_num_threads(1)
    model = dllm.load_model(str(model_path("llada-tiny")), dtype="float32")
    run_sweep(model, out / "curves", ["threshold:tau=0.9"], tasks="waiting_line/copy", n=2, style="short",
              gen_length=16, batch_size=16, model_name="llada-tiny")
    # one sample, and a multi-block curve whose blocks of 32 cannot decode 16 tokens: skipped
    p = bench("quality_samplers.py", "--n", "1", "--tasks", "waiting_line/copy", "--gen-length", "16", "--curves-only",
              "--threads", "1", "--out", str(out), "--curves", "threshold:tau=0.9", "multiblock:threshold=0.9")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "skipping curve setting 'multiblock:threshold=0.9' at gen length 16" in p.stdout, p.stdout
    assert (out / "report.md").read_text().startswith("# ParallelBench report\n\n1 samples, 1 settings, 1 tasks")
    assert len((out / "curves" / "samples.jsonl").read_text().splitlines()) == 2  # the stored lines stay


def test_quality_samplers_refuses_empty_curves():
    err = refused("quality_samplers.py", "--curves", "--curves-only")
    assert "--curves" in err


def test_quality_samplers_skips_presets_whose_layout_refuses_the_length(capsys):
    import quality_samplers

    import dllm
    from dllm.assets import model_path

    model = dllm.load_model(str(model_path("llada-tiny")), dtype="float32")
    assert quality_samplers.runnable(model, ["llada", "multiblock", "threshold"], 16, "preset") == ["llada",
                                                                                                   "threshold"]
    assert "skipping preset setting 'multiblock' at gen length 16" in capsys.readouterr().out
    assert quality_samplers.runnable(model, ["llada", "multiblock"], 32, "preset") == ["llada", "multiblock"]


@pytest.mark.parametrize("script", ["quality_caches.py", "quality_samplers.py", "bench_samplers.py"])
def test_help_has_a_description(script):
    out = helped(script)
    first = (ROOT / "benchmarks" / script).read_text().split('"""')[1].splitlines()[0]
    assert first in out, out


# 4. eval_ar_tasks.py


def test_eval_ar_tasks_refuses_a_filter_matching_nothing():
    err = refused("eval_ar_tasks.py", "--tasks", "nomatch")
    assert "'nomatch'" in err and "waiting_line/copy" in err and "puzzle/sudoku" in err


# 5. bench_caches.py


def test_bench_caches_refuses_a_layout_it_cannot_decode():
    err = refused("bench_caches.py", "--gen", "32", "--block", "16", "--steps", "64")
    assert "--steps 64" in err and "--gen 32" in err
    err = refused("bench_caches.py", "--gen", "16", "--block", "32")
    assert "--block 32 must divide --gen 16" in err
    err = refused("bench_caches.py", "--gen", "32", "--block", "16", "--steps", "3")
    assert "multiple of the 2 blocks" in err


def test_bench_caches_refuses_a_negative_warmup():
    err = refused("bench_caches.py", "--warmup", "-1")
    assert "--warmup -1" in err and "0 or more" in err


def test_bench_caches_refuses_shape_options_with_a_checkpoint_and_block_diffusion_checkpoints():
    err = refused("bench_caches.py", "--checkpoint", "llada-tiny", "--layers", "4", "--vocab", "100")
    assert "--checkpoint llada-tiny" in err and "drop --layers, --vocab" in err
    err = refused("bench_caches.py", "--checkpoint", "sdar-tiny", "--caches", "dual", "--gen", "32")
    assert "block-diffusion checkpoint" in err and "bench_blockdiff.py" in err
    err = refused("bench_caches.py", "--checkpoint", "/nonexistent/model")
    assert "/nonexistent/model" in err and "does not exist" in err


def test_bench_caches_times_the_caches_on_a_trained_checkpoint(tmp_path):
    """``--checkpoint``: the caches on trained weights (the bundled tiny model), prompts the synthetic tasks'. There
    Elastic-Cache's drift test leaves the layers in reuse mode: one full forward (the first), unlike random weights."""
    out = tmp_path / "caches.json"
    p = bench("bench_caches.py", "--checkpoint", "llada-tiny", "--batch", "1", "--caches", "elastic", "--gen", "32",
              "--block", "16", "--json", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "model: llada-tiny, 4 layers, width 64" in p.stdout and "the synthetic tasks' prompts" in p.stdout
    rows = {r["cache"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"none", "elastic"} and rows["elastic"]["nfe"] == 32
    assert rows["elastic"]["full_refreshes"] == 1 and rows["elastic"]["token_layers"] < 0.6, rows["elastic"]


def test_bench_caches_refuses_the_block_cache():
    err = refused("bench_caches.py", "--caches", "none", "block")
    assert "block-diffusion" in err and "LLaDA-shaped" in err


def test_bench_caches_refuses_cache_parameters_the_cache_does_not_take():
    err = refused("bench_caches.py", "--caches", "elastic:gamma")
    assert "--caches elastic:gamma" in err and "KEY=VALUE" in err
    err = refused("bench_caches.py", "--caches", "elastic:gama=0")
    assert "no parameter(s) ['gama']" in err and "gamma" in err
    err = refused("bench_caches.py", "--caches", "dual", "elastic:gamma=2")
    assert "gamma=2 is out of range" in err
    err = refused("bench_caches.py", "--caches", "eastic:gamma=0")
    assert "unknown eastic:gamma=0" in err


# 7. bench_graph_keys.py


def test_bench_graph_keys_refuses_a_config_without_a_cache():
    err = refused("bench_graph_keys.py", "--configs", "llada")
    assert "'llada'" in err and "sampler:cache" in err


def test_bench_graph_keys_counts_only_graphs_held(tmp_path):
    out = tmp_path / "rows.json"
    p = bench("bench_graph_keys.py", "--calls", "2", "--batch", "1", "--gen", "16", "--block", "16", "--configs",
              "llada:dkv-decode", "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2
    for r in rows:
        assert r["graphs"] <= r["captures"] and r["graphs"] <= r["keys"], r
    exact = next(r for r in rows if r["shapes"] == "exact, own buffers")
    assert exact["captures"] == 0 and exact["graphs"] == 0 and exact["keys"] > 0, exact  # keys seen once only


# 8. bench_generate.py


def test_bench_generate_labels_the_requested_steps(monkeypatch, capsys):
    import bench_generate

    monkeypatch.setattr(bench_generate, "BUNDLED", {})
    bench_generate.part1(1)
    header = capsys.readouterr().out.splitlines()[1]
    assert "| steps requested |" in header and "| steps |" not in header
    out = helped("bench_generate.py")
    assert "Decode-loop benchmark" in out and "steps requested" in out


# 9. bench_guided.py, bench_samplers.py


def test_bench_guided_refuses_an_unknown_method():
    err = refused("bench_guided.py", "--methods", "threshold,foo")
    assert "'foo'" in err and "guided-det" in err


def test_bench_samplers_refuses_a_length_its_blocks_cannot_tile():
    err = refused("bench_samplers.py", "--samplers", "llada", "--gen", "16")
    assert "--gen 16" in err and "multiple of 32" in err


def test_bench_samplers_takes_any_registered_sampler_but_the_guided_one():
    err = refused("bench_samplers.py", "--samplers", "prophet,foo,guided")
    assert "['foo', 'guided']" in err and "prophet" in err.split("choose from")[1]


# 10. bench_kernels.py, bench_blockdiff.py


@pytest.mark.parametrize("script,option", [("bench_kernels.py", "--repeats"), ("bench_blockdiff.py", "--reps")])
def test_repeat_counts_below_one_are_refused(script, option):
    err = refused(script, option, "0")
    assert option in err and "not a positive integer" in err


# 11. bench_fast_layer.py


def test_bench_fast_layer_help_and_cuda_check():
    assert "fast layer path on CUDA" in helped("bench_fast_layer.py")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the benchmark would run")
    p = bench("bench_fast_layer.py", timeout=60)
    assert p.returncode != 0 and p.stdout == "", (p.stdout, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1 and "needs a CUDA device" in p.stderr, p.stderr


def test_bench_caches_defaults_are_cpu_sized_on_the_cpu(tmp_path):
    """Without shape options the CPU run is a small one (the GPU-sized defaults ran for minutes there)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU defaults apply where no GPU is")
    out = tmp_path / "caches.json"
    p = bench("bench_caches.py", "--batch", "1", "--caches", "dual", "--json", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "model: 2 layers, width 256" in p.stdout and "prompt 64, gen 64, block 32, steps 64" in p.stdout
    assert {r["cache"] for r in json.loads(out.read_text())} == {"none", "dual"}


# 12. bench_viz.py


def test_bench_viz_refuses_more_steps_than_positions_and_a_single_frame():
    assert "--steps 65 is more than --gen 64" in refused("bench_viz.py", "--gen", "64", "--steps", "65")
    assert "at least 2" in refused("bench_viz.py", "--frames", "1")
    assert "composed from two drawings" in helped("bench_viz.py")
