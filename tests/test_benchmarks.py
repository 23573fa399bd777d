"""The benchmarks in ``benchmarks/`` run on the CPU at a small shape and print what they promise (the figures are
not checked as speed: on a CPU they are counts and tokens only). A benchmark that crashes, or whose counts change
meaning, fails here before a GPU run finds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_goals  # noqa: E402


def run(script: str, *args: str, tmp_path: Path) -> list | dict:
    out = tmp_path / f"{script}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    (tmp_path / f"{script}.log").write_text(p.stdout)
    return json.loads(out.read_text())


def judged_from_log(tmp_path: Path, script: str, log: str) -> list[dict]:
    """The goals table judged from ``script``'s printed output alone (saved by :func:`run`) under the name
    ``gpu_check.sh`` gives its log, as when its time limit stopped it before it wrote its figures file."""
    (tmp_path / "cut").mkdir(exist_ok=True)
    (tmp_path / "cut" / log).write_text((tmp_path / f"{script}.log").read_text())
    return gpu_goals.goals(tmp_path / "cut")


def goals_of(tmp_path: Path, name: str, figures) -> list[dict]:
    """The goals table (benchmarks/gpu_goals.py) of a folder holding only ``figures`` as ``name``."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / name).write_text(json.dumps(figures))
    return gpu_goals.goals(tmp_path / "out")


def test_bench_step_counts_one_host_sync_per_step(tmp_path):
    rows = run("bench_step.py", "--batch", "1", "2", "--modes", "base", "graph", "graph-late", "--caches", "none",
               "dual", "--blocks", "1", "--packing", "--spread", "--host-profile", tmp_path=tmp_path)
    floor = [r for r in rows if r["what"] == "floor"]
    assert len(floor) == 1 and floor[0]["floor_ms"] > 0
    steps = [r for r in rows if r["what"] == "step"]
    assert {(r["mode"], r["cache"], r["batch"]) for r in steps} == {
        (m, c, b) for m in ("base", "graph", "graph-late") for c in ("none", "dual") for b in (1, 2)}
    for r in steps:
        assert r["syncs_per_step"] == 1, r  # the decode loop's one sync, as a CUDA run takes it
        assert r["launches_per_step"] > r["forward_launches_per_layer"] * 2 > 0, r  # 2 layers and the loop's own
        assert r["ms_per_step"] > 0
        assert (r["ms_partial_step"] is not None and r["ms_partial_step"] > 0) == (r["cache"] == "dual"), r
        # the host's time from a synchronisation to the next graph's launch: only where the steps replay graphs (the
        # cached steps, and without a cache the full forwards; 0 where the next forward was launched before the
        # synchronisation, as within a block it is)
        replayed = r["mode"].startswith("graph")
        assert (r["host_gap_us"] is not None and r["host_gap_us"] >= 0) == replayed, r
        assert r["device_ms_per_step"] is None  # the profiler's device time: CUDA only
        assert r["host_us_per_step"] > 0, r  # the host's own work (on the CPU the whole step)
        # --host-profile: the host's hottest functions on the graph path at the smallest batch, while rows are left
        # (the CPU's short generation: without a cache)
        profiled = r["mode"].startswith("graph") and r["batch"] == 1 and r["cache"] == "none"
        assert ("host_profile" in r) == profiled, r
        if profiled:
            assert len(r["host_profile"]) == 15 and all(calls > 0 and ms >= 0 for _, calls, ms in r["host_profile"])
            assert any(".py:" in name for name, _, _ in r["host_profile"]), r["host_profile"]  # dllm's own

    def strict(constant):
        raise ValueError(f"{constant} is not JSON")

    json.loads((tmp_path / "bench_step.py.json").read_text(), parse_constant=strict)  # no NaN: strict parsers read it
    by = {(r["mode"], r["cache"], r["batch"]): r for r in steps}
    for b in (1, 2):  # a cached step computes fewer positions but launches the cache's own kernels too
        g = by[("graph", "dual", b)]["graphs"]
        assert g["replays"] > 0  # the graph path's CPU twin ran the cached steps
        # the warm-up generation saw every cached shape twice: the timed decoder captures nothing, it replays
        assert g.get("captures", 0) == 0 and g.get("eager:first sight", 0) == 0, g
        # the timed steps' next forwards were made ready before their synchronisations: all but a block's last
        ahead = by[("graph", "dual", b)]["ahead"]
        assert ahead["confirmed"] > 0 and ahead.get("missed", 0) <= ahead["confirmed"], ahead
        # and launched before it where the block went on (one token per step: the last step of a block is known)
        assert ahead["launched"] == ahead["confirmed"] and ahead.get("discarded", 0) == 0, ahead
        # graph-late: made ready and confirmed alike, launched after the synchronisation, and the same loop
        late = by[("graph-late", "dual", b)]
        assert late["ahead"]["confirmed"] == ahead["confirmed"] and late["ahead"].get("launched", 0) == 0, late
        assert late["host_gap_us"] > 0 and by[("graph", "dual", b)]["host_gap_us"] == 0
        assert late["forward_launches_per_layer"] == by[("graph", "dual", b)]["forward_launches_per_layer"]
    (pack,) = [r for r in rows if r["what"] == "packing"]  # 16 rows, one refreshing its canvas of 64
    assert pack["rows_computed_padded"] == 16 * 64 and pack["rows_computed_packed"] == 64 + 15 * 8
    assert pack["padded_ms"] > 0 and pack["packed_ms"] > 0
    # 16 rows over the 4 blocks of 8: each row's 8 columns, or every row over the union of the 4 blocks
    (spread,) = [r for r in rows if r["what"] == "spread"]
    assert spread["own_columns"] == 16 * 8 and spread["union_columns"] == 16 * 32 and spread["same_tokens"], spread
    assert spread["own_ms"] > 0 and spread["union_ms"] > 0
    # the goals table reads these figures: on the CPU the host syncs are judged, the timings are not
    by_goal = {g["goal"]: g for g in goals_of(tmp_path, "step.json", rows)}
    assert by_goal["host synchronisations per step"]["status"] == "met"
    assert by_goal["dual-cache step, batch 1, graph path"]["status"] == "not measured (CPU)"
    assert "x the floor" in by_goal["dual-cache step, batch 1, graph path"]["measured"]
    assert by_goal["kernels per layer, captured forward (32 layers)"]["status"] == "not measured (2 layers)"
    # every row is printed as it comes (the floor first): a run cut short is judged from its log as from its file
    assert judged_from_log(tmp_path, "bench_step.py", "bench_step.log") == list(by_goal.values())


def test_bench_caches_compares_every_cache_with_none(tmp_path):
    rows = run("bench_caches.py", "--layers", "2", "--width", "64", "--vocab", "256", "--prompt", "32", "--gen", "16",
               "--block", "8", "--steps", "16", "--batch", "1", "--caches", "none", "prefix", "dual", "elastic",
               "elastic:gamma=0", "--warmup", "1", tmp_path=tmp_path)
    # the baseline once, though named; a cache with parameters is timed as one of its own
    assert [r["cache"] for r in rows] == ["none", "prefix", "dual", "elastic", "elastic:gamma=0"]
    none, prefix, dual, elastic, never = rows
    # random weights: the drift test fails, and the layer after it computes every row; at gamma 0 it never does
    assert never["full_refreshes"] == elastic["full_refreshes"] == 1
    assert never["token_layers"] < elastic["token_layers"], (never, elastic)
    rows = rows[:3]
    assert none["speedup"] == 1.0 and none["same_tokens"] == 1.0 and none["token_layers"] == 1.0
    assert none["full_refreshes"] == none["nfe"] == 16
    for r in (prefix, dual):
        assert r["nfe"] == 16 and r["full_refreshes"] == 2  # one refresh per block of 8
        assert 0 < r["token_layers"] < 1 and 0 <= r["same_tokens"] <= 1
    assert dual["token_layers"] < prefix["token_layers"]  # the dual cache also skips the suffix
    for r in rows:  # LLaDA's even quota keeps a batch's rows in step: no padding
        assert r["token_layers_run"] == r["token_layers"], r
    (goal,) = [g for g in goals_of(tmp_path, "caches.json", json.loads((tmp_path / "bench_caches.py.json").read_text()))
               if g["goal"].startswith("every cache pays")]
    assert goal["status"] == "not measured (CPU)" and goal["measured"].startswith("prefix "), goal
    assert "; not judged: elastic:gamma=0 " in goal["measured"] and goal["measured"].count("elastic") == 2, goal
    assert goal in judged_from_log(tmp_path, "bench_caches.py", "bench_caches.log")


def test_bench_continuous_computes_only_decoding_rows(tmp_path):
    rows = run("bench_continuous.py", "--prompts", "12", "--batch", "4", "--gen-length", "32", "--block-length", "8",
               tmp_path=tmp_path)
    by = {r["mode"]: r for r in rows}
    assert set(by) == {"static", "continuous"} and all(r["same_tokens"] for r in rows)
    s, c = by["static"], by["continuous"]
    assert s["decoding_rows"] == c["decoding_rows"] == c["row_forwards"] < s["row_forwards"]
    assert c["forwards"] < s["forwards"]  # the batch kept full: fewer forwards for the same rows
    assert c["own_logits"] == 1.0 > s["own_logits"]


def test_bench_padding_shows_rows_out_of_step_widen_the_batch_unless_packed(tmp_path):
    rows = run("bench_padding.py", "--batch", "1", "8", "--caches", "dual", tmp_path=tmp_path)
    by = {(r["sampler"], r["batch"], r["path"]): r for r in rows}
    assert set(by) == {(s, b, p) for s in ("llada", "fast-dllm") for b in (1, 8) for p in ("padded", "packed")}
    for r in rows:
        assert r["same_tokens"], r  # packing changes what runs, never a token
        assert r["run"] >= r["computed"] - 1e-6 and r["full_width"] >= 1, r  # the first forward is a full one
    for path in ("padded", "packed"):
        assert by[("llada", 8, path)]["run_per_computed"] == 1.0  # even quota: every row starts its blocks together
        assert by[("fast-dllm", 1, path)]["run_per_computed"] == 1.0  # one row: nothing to pad
    assert by[("fast-dllm", 8, "padded")]["run_per_computed"] > 1.2  # rows finish their blocks at their own steps
    assert by[("fast-dllm", 8, "packed")]["run_per_computed"] == 1.0  # ... and packed run only their own rows
    # the logits columns: all the rows' own at one row and in step, fewer where rows are in different blocks
    assert by[("fast-dllm", 1, "packed")]["own_logits"] == by[("llada", 8, "packed")]["own_logits"] == 1.0
    assert by[("fast-dllm", 8, "packed")]["own_logits"] < 1.0


def test_bench_detok_compares_incremental_and_whole_answer_detokenising(tmp_path):
    """bench_detok.py: the same text both ways (it refuses to print otherwise), and the incremental way decodes a
    bounded number of ids per token where decoding the whole answer at each piece grows with the answer."""
    rows = run("bench_detok.py", "--lengths", "64", "512", "--steps", "1", tmp_path=tmp_path)
    assert [(r["tokens"], r["per_piece"]) for r in rows] == [(64, 1), (512, 1)]
    assert all(r["ids_decoded_per_token"] < 40 for r in rows)
    assert rows[1]["whole_ids_decoded_per_token"] > 8 * rows[0]["ids_decoded_per_token"]


def test_bench_serve_writes_rows_the_goals_table_reads(tmp_path):
    """bench_serve.py's rows (CPU: shown, not judged) carry what the serving goal reads: the 16-client continuous and
    one-at-a-time throughput, the continuous p99 and the longest solo request."""
    report = run("bench_serve.py", "--concurrency", "1", "16", "--requests", "1", "--gen-length", "8",
                 "--block-length", "8", tmp_path=tmp_path)
    rows = {(r["clients"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(c, m) for c in (1, 16) for m in ("continuous", "static batches", "one at a time")}
    assert all(r["device"] == "CPU" and r["requests"] == r["clients"] and r["tokens_per_s"] > 0 for r in rows.values())
    assert len(report["batching_gains"]) == 2
    # the engine's logits columns in the rows' own windows: all of them at one client (gen 8 = one block)
    assert rows[(1, "continuous")]["own_logits_share"] == 1.0
    assert 0 < rows[(16, "continuous")]["own_logits_share"] <= 1.0
    assert "of which in each row's own window 8.0 (100%)" in (tmp_path / "bench_serve.py.log").read_text()
    (goal,) = [g for g in goals_of(tmp_path, "serve.json", report) if g["goal"].startswith("continuous batching")]
    assert goal["status"] == "not measured (CPU)" and goal["measured"].endswith("; CPU)"), goal


def test_bench_viz_composes_the_frames_it_draws_whole(tmp_path):
    row = run("bench_viz.py", "--gen", "48", "--steps", "12", "--frames", "4", "--width", "16", tmp_path=tmp_path)
    assert row["frames"] == 4 and row["steps"] == 12 and row["pixels"] > 100_000, row
    assert row["differing_pixels"] == 0, row  # every composed frame is the figure drawn whole at its step
    assert "| frames drawn whole, s/frame |" in (tmp_path / "bench_viz.py.log").read_text()


def test_bench_graph_keys_counts_replays_with_bucketed_and_exact_shapes(tmp_path):
    rows = run("bench_graph_keys.py", "--calls", "3", "--batch", "1", "--gen", "32", "--block", "16", "--configs",
               "llada:dual", "llada:dkv-decode", tmp_path=tmp_path)
    by = {(r["cache"], r["shapes"]): r for r in rows}
    assert set(by) == {(c, s) for c in ("dual", "dkv-decode") for s in ("exact, own buffers", "bucketed, pooled")}
    for r in rows:
        assert r["same_tokens"], r  # the graph path (static buffers on the CPU) decodes the eager tokens
        assert r["replays"] + r["captures"] + r["first_sight"] + r["full"] + r["other_eager"] == r["forwards"], r
    exact, bucketed = by[("dkv-decode", "exact, own buffers")], by[("dkv-decode", "bucketed, pooled")]
    assert exact["replays"] == 0 and bucketed["replayed"] > 0.5  # its width falls every step: exact never repeats
    # dual: every call's fresh cache captures its own graph; pooled, the later calls replay the first's
    assert by[("dual", "exact, own buffers")]["captures"] == 3 and by[("dual", "bucketed, pooled")]["captures"] < 3


def test_bench_kernels_runs_every_kernel(tmp_path):
    report = run("bench_kernels.py", "--repeats", "1", tmp_path=tmp_path)
    assert report["device"].startswith("cpu")
    kinds = {r["kernel"] for r in report["rows"]}
    assert kinds == {"attention", "attention_mass", "attention_drift", "confidence_stats"}, kinds
    for r in report["rows"]:
        assert all(v > 0 for v in r["ms"].values()), r
    goals = goals_of(tmp_path, "kernels.json", report)
    conf = [g for g in goals if g["goal"].startswith("confidence statistics,")]
    assert conf and all(g["status"] == "not measured (CPU)" and g["measured"].endswith("x)") for g in conf)
    assert all("two launches, not the default" in g["measured"] for g in conf)  # both merges timed, the default judged
    assert all(set(r["ms"]) == {"torch", "reference", "triton", "triton-2launch"} for r in report["rows"]
               if r["kernel"] == "confidence_stats")
    assert all(set(r["ms"]) == {"reference", "triton"} for r in report["rows"] if r["kernel"] == "attention_drift")


def _gpu_figures(folder: Path, x_floor=1.4, fastdllm=2.5, splitk=0.025, caches=1.1,
                 tests="22 passed, 113 deselected in 40s", fastdllm_device="cuda", serve=(3.4, 1.5)):
    """The files gpu_check.sh writes, in the benchmarks' formats, with figures chosen by the test."""
    folder.mkdir(exist_ok=True)
    step = [{"what": "floor", "device": "NVIDIA H100 80GB HBM3", "layers": 32, "floor_ms": 5.33},
            {"what": "step", "mode": "graph", "cache": "dual", "batch": 1, "ms_partial_step": round(5.33 * x_floor, 2),
             "x_floor_partial": x_floor, "forward_launches_per_layer": 10.0, "syncs_per_step": 1},
            {"what": "step", "mode": "graph", "cache": "none", "batch": 1, "x_floor_partial": None,
             "forward_launches_per_layer": 9.0, "syncs_per_step": 1},
            {"what": "e2e", "cache": "none", "s": 7.5, "speedup_vs_none": 1.0},
            {"what": "e2e", "cache": "dual", "s": 2.0, "speedup_vs_none": 3.75},
            {"what": "e2e", "cache": "none-eager", "s": 15.0, "speedup_vs_none": 0.5},
            {"what": "fastdllm", "impl": "speed-up of dllm", "ratio": fastdllm, "same_tokens": 1.0,
             "ref_device": fastdllm_device}]
    att = {"kernel": "attention", "B": 1, "Hq": 32, "Hkv": 32, "Lq": 32, "Lk": 4096, "D": 128,
           "dtype": "torch.bfloat16", "auto_choice": "splitk",
           "ms": {"sdpa": 0.055, "triton": 0.048, "splitk": 0.07, "splitk4": 0.06, "auto": 0.055},
           "graph_ms": {"sdpa": 0.055, "triton": 0.048, "splitk": splitk, "splitk4": 0.03, "auto": 0.03}}
    conf = {"kernel": "confidence_stats", "N": 32, "V": 126464, "dtype": "torch.bfloat16",
            "ms": {"torch": 0.2, "reference": 0.2, "triton": 0.033}}
    caches = [{"batch": 1, "cache": c, "speedup": s, "device": "NVIDIA H100 80GB HBM3"}
              for c, s in (("none", 1.0), ("prefix", 2.4), ("dual", 3.2), ("dkv-decode", 1.5), ("dkv-greedy", 1.4),
                           ("freecache", 2.0), ("elastic", caches))]
    (folder / "step.json").write_text(json.dumps(step))
    (folder / "kernels.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "rows": [att, conf]}))
    (folder / "caches.json").write_text(json.dumps(caches))
    (folder / "gpu_tests.log").write_text(f"...\n{'=' * 10} {tests} {'=' * 10}\n")
    gain, tail = serve  # continuous against one at a time at 16 clients; its p99 against the longest solo request
    dev = "NVIDIA H100 80GB HBM3"
    (folder / "serve.json").write_text(json.dumps({"rows": [
        {"device": dev, "clients": 1, "mode": "one at a time", "tokens_per_s": 90.0, "latency_p99_s": 0.18,
         "latency_max_s": 0.2},
        {"device": dev, "clients": 16, "mode": "continuous", "tokens_per_s": 100.0 * gain,
         "latency_p99_s": 0.2 * tail, "latency_max_s": 0.2 * tail},
        {"device": dev, "clients": 16, "mode": "one at a time", "tokens_per_s": 100.0, "latency_p99_s": 3.0,
         "latency_max_s": 3.1}]}))
    return folder


def test_gpu_goals_judges_each_goal_against_its_target(tmp_path):
    good = gpu_goals.goals(_gpu_figures(tmp_path / "good"))
    status = {g["goal"]: g["status"] for g in good}
    assert set(status.values()) == {"met"}, status
    e2e = next(g["measured"] for g in good if g["goal"].startswith("dual cache against no cache"))
    assert e2e == "3.75x (2.0 s against 7.5 s; no cache with eager forwards 15.0 s (its graphs: 2.0x))", e2e
    assert len(status) == 11  # step, e2e, Fast-dLLM, kernels, syncs, split-K, dispatch, confidence, caches, serving,
    # tests
    serving = next(g["measured"] for g in good if g["goal"].startswith("continuous batching at 16 clients"))
    assert serving.startswith("3.4x the answer tokens/s; p99 0.300 s = 1.5x the longest solo request"), serving
    bad = {g["goal"]: g for g in gpu_goals.goals(_gpu_figures(
        tmp_path / "bad", x_floor=1.56, fastdllm=1.9, splitk=0.05, caches=0.8, tests="3 failed, 19 passed in 56s",
        serve=(2.9, 1.5)))}
    for goal in ("dual-cache step, batch 1, graph path", "against Fast-dLLM's generate_with_dual_cache, same weights",
                 "every cache pays at batch 1 (bench_caches.py)", "continuous batching at 16 clients (bench_serve.py)",
                 "gpu tests"):
        assert bad[goal]["status"] == "NOT met", bad[goal]
    slow_tail = {g["goal"]: g["status"] for g in gpu_goals.goals(_gpu_figures(tmp_path / "tail", serve=(3.4, 2.1)))}
    assert slow_tail["continuous batching at 16 clients (bench_serve.py)"] == "NOT met"  # throughput alone is not it
    # Fast-dLLM's model left in host memory (its wrapper builds it there) while dllm ran on the GPU: no comparison
    for dev, said in (("cpu", "Fast-dLLM ran on cpu"), (None, "Fast-dLLM ran on a device not recorded")):
        off = {g["goal"]: g for g in gpu_goals.goals(_gpu_figures(tmp_path / f"off-{dev}", fastdllm=75.4,
                                                                  fastdllm_device=dev))}
        assert off["against Fast-dLLM's generate_with_dual_cache, same weights"]["status"] == f"not measured ({said})"
    split = bad["split-K attention, Lq 32, Lk 4096, bf16, 32:32 heads"]
    assert split["status"] == "met" and split["measured"].startswith("1.83x (splitk4)")  # the better split count
    assert {g["status"] for g in gpu_goals.goals(tmp_path / "nothing")} == {"not measured"}
    out = tmp_path / "goals.json"
    assert gpu_goals.main([str(tmp_path / "bad"), "--json", str(out)]) == 0
    assert [g["status"] for g in json.loads(out.read_text())].count("NOT met") == 5
    assert "elastic 0.8x" in bad["every cache pays at batch 1 (bench_caches.py)"]["measured"]
    # a bench_caches run its time limit cut after some caches: judged on every cache, not on those it reached
    short = _gpu_figures(tmp_path / "short")
    rows = json.loads((short / "caches.json").read_text())
    (short / "caches.json").write_text(json.dumps([r for r in rows if r["cache"] in ("none", "prefix", "dual")]))
    (g,) = [g for g in gpu_goals.goals(short) if g["goal"].startswith("every cache pays")]
    assert g["status"] == "not measured", g
    assert g["measured"] == "prefix 2.4x, dual 3.2x; not reached: dkv-decode, dkv-greedy, freecache, elastic", g
    # a benchmark stopped by its time limit writes no figures file: the rows its log printed stand in for it
    cut = tmp_path / "cut"
    _gpu_figures(cut)
    for name, log in (("step.json", "bench_step.log"), ("caches.json", "bench_caches.log")):
        rows = json.loads((cut / name).read_text())
        (cut / log).write_text("== bench\n" + "".join(json.dumps(r) + "\n" for r in rows) + '{"what": "e2e", "error": '
                               '"timeout"}\n{"truncated\n')
        (cut / name).unlink()
    assert gpu_goals.goals(cut) == gpu_goals.goals(tmp_path / "good")


def test_gpu_goals_knows_every_cache_bench_caches_times():
    from dllm.caches import CACHES

    assert set(gpu_goals.EVERY_CACHE) == set(CACHES) - {"none", "block"}


def test_gpu_check_runs_its_parts_and_judges_what_they_wrote(tmp_path):
    """The GPU check's own plumbing, on the CPU: the parts asked for run, the goals table is written, every file is
    packed into one archive beside it (the device returns few files)."""
    import tarfile

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PARTS": "step", "QUICK": "1"}
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(f.name for f in out.iterdir()) == ["goals.md", "gpu-check.tgz"]
    with tarfile.open(out / "gpu-check.tgz") as tar:
        assert {"env.txt", "bench_step.log", "step.json", "goals.json"} <= set(tar.getnames())
    table = (out / "goals.md").read_text()
    assert "| host synchronisations per step | <= 1 | 1 at most (CPU) | met |" in table
    assert "| gpu tests | all pass | - | not measured |" in table  # a part not asked for
    assert "== done" in p.stdout


def test_gpu_check_skips_the_parts_its_deadline_leaves_no_time_for(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PARTS": "step kernels", "DEADLINE": "30"}
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "== step skipped" in p.stdout and "== kernels skipped" in p.stdout and "== done" in p.stdout
    assert "bench_step" not in p.stdout and (out / "goals.md").exists()


def test_bench_step_times_another_samplers_step_and_its_graph_saves_launches(tmp_path):
    """``--sampler``: the step tables of another sampler (CreditDecoding: its tables in the step graphs' bank); on the
    graph path the host launches fewer kernels per step than with the sampler's work eager (CPU counts, the CUDA
    path's)."""
    rows = run("bench_step.py", "--batch", "1", "--modes", "graph", "graph-eager-sampler", "--caches", "dual",
               "--sampler", "credit", tmp_path=tmp_path)
    steps = {r["mode"]: r for r in rows if r["what"] == "step"}
    assert set(steps) == {"graph", "graph-eager-sampler"} and all(r["sampler"] == "credit" for r in steps.values())
    assert all(r["syncs_per_step"] == 1 for r in steps.values()), steps
    assert steps["graph"]["host_launches_per_step"] * 2 < steps["graph-eager-sampler"]["host_launches_per_step"], steps


def test_bench_step_timeline_counts_overlapping_work_once_and_sorts_the_gaps():
    """``--e2e-profile``'s accounting of a generation's device time (its spans in microseconds): overlapping spans
    count once, and each idle gap goes to its kind by its length."""
    import bench_step

    spans = [(0, 10), (5, 20), (40, 50), (200, 300), (5000, 5001), (120, 130)]  # unsorted, two overlapping
    got = bench_step.timeline(spans)
    assert got["kernels"] == 6 and got["device_busy_s"] == round((20 + 10 + 10 + 100 + 1) / 1e6, 6)
    assert (got["idle_short_n"], got["idle_step_n"], got["idle_long_n"]) == (1, 2, 1)  # 20; 70 and 70; 4700
    assert got["idle_short_s"] == 20e-6 and got["idle_step_s"] == 140e-6 and got["idle_long_s"] == 4700e-6
