"""Milliseconds per decode step at LLaDA-8B's layer shape, against the weight-read floor.

Random weights with LLaDA-8B's shape (d 4096, 32 heads of 128, MLP 12,288, vocabulary 126,464; ``--layers``
default 32: 8.0B parameters), bf16, prompt 512 + generation 256 in blocks of 32 (LLaDA's even quota: one token per
step). For each cache (none / prefix / dual), batch (1, 4, 16) and execution mode (eager forwards; ``graph``: the
cached steps replayed as CUDA graphs, and a step's sampler and bookkeeping after its forward as one more graph;
``graph-late``: the same with each next forward launched after the step's synchronisation, not before it;
``graph-eager-sampler``: the graph path with the sampler's work run eagerly, kernel by kernel, as before the step
graphs; ``compile``: ``torch.compile`` of the model) it prints:

* ms per step over whole blocks (a block's first, full, forward included) and ms per partial (cached) step, the
  steps run back to back (one synchronisation of the device before the first);
* the weight-read floor: the bytes of the weights divided by the bytes per second a device-to-device copy moves
  (reads and writes counted), measured in the same run; the step's multiple of it;
* kernels launched per step and per layer, host synchronisations per step and the device's busy ms per step (from
  the profiler on CUDA, over four steps; on CPU the kernels the CUDA path would launch, ``tests/launch_counter.py``:
  ATen operators that are not views or allocations, and Triton launches when the kernels run under
  ``TRITON_INTERPRET=1 DLLM_KERNELS=triton``, plus the calls that would synchronise on CUDA), and on the CPU's graph
  path those the host launches itself (``host_launches_per_step``: a graph's kernels count as its one launch);
* on the graph path, the host's microseconds from a step's synchronisation to the next graph's launch
  (``host_gap_us``, the median over a block of steps: the device waits that long at each step; 0 for a step whose
  next forward was launched before its synchronisation), and how many of the timed steps' next forwards, made ready
  before their synchronisation, were launched there, confirmed, planned again, or launched and discarded
  (``ahead``);
* the host's own work per step (``host_us_per_step``: a step's time less the time the host spent blocked reading
  device data; above the device's busy time, the host bounds the step); with ``--host-profile``, the host's hottest
  functions on the graph path (``cProfile``, by own time, per step).

``--e2e`` adds whole generations (``--prompt`` / ``--gen``: 512 and 256 on a GPU by default, batch 1) with no cache,
prefix and dual cache (and the dual cache with each next forward launched after the synchronisation,
``dual-late``, the dual cache with its sampler's work eager, ``dual-eager-sampler``, and no cache with every
forward eager, ``none-eager``) and the speed-up of each over none (its full forwards from graphs on
CUDA; ``--e2e-profile`` adds, for none and dual, one more generation under the profiler: the device's busy time and
its idle time by the length of the gaps, where a whole generation's time goes); ``--breakdown`` (CUDA) the kernels
that take a full forward's and a cached step's device time, published layer against fast layer; ``--fastdllm DIR``
(a checkout of NVlabs/Fast-dLLM, its ``llada`` folder with ``generate.py`` and ``model/``) times Fast-dLLM's own
``generate_with_dual_cache`` on the same weights and steps; ``--packing`` one partial forward of a batch of 16 rows
out of step (one row refreshing its whole canvas, the others computing their block of the dual cache), padded (every
row computes the whole canvas) against packed (``query_tokens``: each row its own active rows), the fast layer as
``load_model`` runs it on CUDA; ``--spread`` the cached step of a batch of 16 rows whose blocks are spread over the
generation (served requests that joined at different times, or rows under a confidence threshold), the ``fast-dllm``
sampler and the dual cache on the graph path, each row's logits at its own window (per-row windows) against every row
over the union of the rows' windows: ms per step, logits columns per step, whether the tokens are the same.

    python benchmarks/bench_step.py                              # GPU: 32 layers, the shape above
    python benchmarks/bench_step.py --layers 8 --e2e --json out.json
    python benchmarks/bench_step.py                              # CPU: a small shape (the figures are counts)
    TRITON_INTERPRET=1 DLLM_KERNELS=triton python benchmarks/bench_step.py --modes graph   # CPU: the CUDA path's kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _common import random_llada  # noqa: E402

import dllm  # noqa: E402
from dllm.config import GenerateConfig  # noqa: E402
from dllm.generate import Decoder  # noqa: E402
from dllm.models import LLADA, Transformer, TransformerConfig  # noqa: E402
from dllm.models.fast import disable_fast_path, enable_fast_path  # noqa: E402
from dllm.recipes import resolve  # noqa: E402

MODES = ("base", "eager", "graph", "graph-late", "graph-eager-sampler", "compile")
GPU_SHAPE = dict(d=4096, heads=32, kv=32, mlp=12288, vocab=126464)
CPU_SHAPE = dict(d=128, heads=4, kv=4, mlp=352, vocab=512)


def build(layers: int, shape: dict, max_len: int, device: str, dtype) -> Transformer:
    cfg = TransformerConfig(vocab_size=shape["vocab"], d_model=shape["d"], n_layers=layers, n_heads=shape["heads"],
                            n_kv_heads=shape["kv"], mlp_hidden=shape["mlp"], max_seq_len=max(max_len, 4096))
    return random_llada(cfg, device, dtype, std=0.02)


def copy_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves (read + write counted)."""
    n = 1 << 30 if device == "cuda" else 1 << 26
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - t0)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decoder(model, B: int, a, cache: str, graphs: str):
    config = GenerateConfig(gen_length=a.gen, block_length=a.block, steps=getattr(a, "gen_steps", None) or a.gen,
                            graphs=graphs)
    sampler, cache_obj, policy, config = resolve(model, a.sampler, cache, None, config)
    g = torch.Generator().manual_seed(B)
    rows = torch.randint(3, model.config.vocab_size - 1, (B, a.prompt), generator=g).tolist()
    return Decoder(model, sampler, cache_obj, policy, config), rows


def warm_steps(a) -> int:
    """Steps of a warm-up generation: three per block, so that each block's partial shape is seen twice (a graph is
    captured the second time its shape is seen) as well as compiled, autotuned and timed by the attention dispatch."""
    return 3 * (a.gen // a.block)


def time_steps(model, B: int, a, cache: str, graphs: str):
    """(ms per step over ``a.blocks`` whole blocks, ms per partial step) after one warm-up block. On the graph path a
    warm-up generation of every block runs first (:func:`warm_steps`), and gives its K/V buffers back to the pool,
    where the timed decoder takes them: every cached shape it meets has been captured (the prefix cache's width
    changes with every block).

    The steps run back to back, as in a generation: the device is synchronised once before the first, and a step's
    time is the host's time from the end of the step before it to its own end (each step ends with the loop's one
    synchronisation). A forward launched before a synchronisation (``Decoder._sync``) overlaps the host's work of
    the step that launched it, as it does in a generation; synchronising the device before every step would count
    that forward in no step's time."""
    warm, rows = decoder(model, B, argparse.Namespace(**{**vars(a), "gen_steps": warm_steps(a)}), cache, graphs)
    if warm.graphed:
        wst = warm.start(rows)
        while warm.step(wst):
            pass
        warm.release()
        del wst
    del warm
    dec, rows = decoder(model, B, a, cache, graphs)  # its graph statistics count from here
    ahead0 = dict(dec.graphs.ahead) if dec.graphs is not None else {}
    st = dec.start(rows)
    for _ in range(a.block if cache != "none" else 2):  # warm-up: the first block (autotuning, graph capture)
        dec.step(st)
    times, partial = [], []
    n = a.block * a.blocks if cache != "none" else a.none_steps
    sync(a.device)
    t_end = time.perf_counter()
    for _ in range(n):
        dec.step(st)
        t0, t_end = t_end, time.perf_counter()
        dt = (t_end - t0) * 1e3
        times.append(dt)
        if st.trace[-1].get("refresh_layer", 0) != 0:
            partial.append(dt)
    sync(a.device)
    # the next forwards made ready before the timed steps' synchronisations, confirmed or not (Decoder._prepare_next)
    dec.ahead_counts = ({k: v - ahead0.get(k, 0) for k, v in dec.graphs.ahead.items()} if dec.graphs is not None
                        else {})
    return statistics.mean(times), (statistics.median(partial) if partial else float("nan")), (dec, st)


def to_cached_step(dec, st, limit: int) -> None:
    """Step on until the next step is a partial (cached) forward as most of a block's are: the plan read in the last
    step's synchronisation says so, and where the decoder launches forwards before the synchronisation, the next
    step's forward was launched so (the first partial step after a full forward launches its own forward as well as
    the next one's). A cache without a plan (none) is left as it is."""
    for _ in range(limit):
        hint = st.plan_hint
        if hint is None:
            return
        ahead = getattr(st, "ahead", None)
        launched = ahead is not None and ahead.logits is not None
        if hint[3] and (launched or not (dec._pipelined and dec._early)):
            return
        dec.step(st)


def to_replayed_step(dec, st, limit: int) -> None:
    """On the step graphs' path, step on until a step's work replayed its graph (the key of a step's work includes the
    window and, for a sampler that keeps steps, the layout of what it kept, so a block's first steps may each be new:
    KLASS's), then to the next cached step (:func:`to_cached_step`), so that the counted step is what most of a
    block's steps are."""
    if dec.graphs is None or not dec._commit_graph:
        return
    for _ in range(limit):
        replays = dec.graphs.tail_stats["replays"]
        if not dec.step(st):
            return
        if dec.graphs.tail_stats["replays"] > replays:
            break
    to_cached_step(dec, st, limit)


def count_step(a, dec, st, steps: int = 4):
    """(kernels launched, host syncs, device ms, kernels the host launches) per step: on CUDA over ``steps`` more steps (a step launches the
    next forward, not its own, where the decoder launches ahead: one step alone would count the first of a block's
    partial steps twice over), with the device's busy time per step (the sum of the kernels' durations: with the
    step's time, whether the step waits for the device or the device for the host); on the CPU over one step (the
    kernels the CUDA path would launch; device time None; on the graph path, the kernels outside the graphs' runs
    and one per run: what the host launches on CUDA, where a graph's replay is one launch)."""
    if a.device != "cuda":
        import importlib

        from launch_counter import LaunchCounter
        from sync_counter import SyncCounter

        G = importlib.import_module("dllm.generate")  # the module (dllm.generate is also the function)
        free = G._host_check_free
        G._host_check_free = lambda t: False  # the path a CUDA run takes (on CPU some checks are free)
        from dllm.graphs import GraphRunner

        inside = [0, 0]  # kernels inside the graphs' runs (their CPU twins), the runs
        saved = GraphRunner._forward, GraphRunner._tail_body

        def counted(fn):
            def run(self, *args):
                before = launches.total
                try:
                    return fn(self, *args)
                finally:
                    inside[0] += launches.total - before
                    inside[1] += 1
            return run

        GraphRunner._forward, GraphRunner._tail_body = counted(saved[0]), counted(saved[1])
        try:
            with SyncCounter() as c, LaunchCounter() as launches:
                dec.step(st)
        finally:
            G._host_check_free = free
            GraphRunner._forward, GraphRunner._tail_body = saved
        host = launches.total - inside[0] + inside[1] if dec.graphs is not None else None
        return launches.total, c.count, None, host
    from torch.profiler import ProfilerActivity, profile

    sync("cuda")
    n = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            n += 1
            if not dec.step(st):
                break
        sync("cuda")
    cuda = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in cuda if not e.name.startswith(("Memcpy", "Memset"))]
    # every read of device data by the host is a device-to-host copy the host waits for; the profiler's and this
    # function's own synchronisations are not counted
    syncs = sum(1 for e in cuda if e.name.startswith("Memcpy DtoH"))
    busy_ms = sum(e.time_range.elapsed_us() for e in cuda) / 1e3
    return round(len(kernels) / n, 1), round(syncs / n, 2), round(busy_ms / n, 3), None


def host_gap(dec, st, steps: int) -> float | None:
    """Median microseconds of host time from a step's synchronisation (the host's read of the step's numbers) to the
    launch of the next forward's graph, over ``steps`` more steps (None without a graph replayed after a
    synchronisation: the eager path; without a cache the full forwards' graphs count). On a GPU the device waits for
    that long at every step; on the CPU (the static-buffer path: the "launch" is the forward's start) it is the same
    host work. A forward launched before
    the synchronisation (``Decoder._sync``) counts 0: the device went on to it without waiting for the host."""
    if dec.graphs is None:
        return None
    marks, gaps = {}, []
    tolist, runner_forward = torch.Tensor.tolist, type(dec.graphs)._forward
    graph_replay = torch.cuda.CUDAGraph.replay
    sync = dec._sync

    def synced(t):
        out = tolist(t)
        if marks.pop("early", False):
            gaps.append(0.0)
        else:
            marks["sync"] = time.perf_counter()
        return out

    def in_sync(host, ahead):
        marks["in_sync"] = True
        try:
            return sync(host, ahead)
        finally:
            marks.pop("in_sync", None)

    def launched():
        if marks.get("in_sync"):  # launched before the synchronisation it precedes
            marks["early"] = True
            marks.pop("sync", None)
        elif "sync" in marks:
            gaps.append(time.perf_counter() - marks.pop("sync"))

    def replay(g):
        launched()
        return graph_replay(g)

    def forward(runner, g, cache):
        if g.graph is None and g.captured:  # capture=False: the replay runs the forward on the static buffers
            launched()
        return runner_forward(runner, g, cache)

    torch.Tensor.tolist, torch.cuda.CUDAGraph.replay, type(dec.graphs)._forward = synced, replay, forward
    dec._sync = in_sync
    try:
        for _ in range(steps):  # the first step's launch follows no measured synchronisation: not counted
            if not dec.step(st):
                break
    finally:
        torch.Tensor.tolist, torch.cuda.CUDAGraph.replay, type(dec.graphs)._forward = tolist, graph_replay, runner_forward
        del dec._sync
    return round(statistics.median(gaps) * 1e6, 1) if gaps else None


def host_work(dec, st, steps: int) -> tuple[float | None, bool]:
    """(median microseconds per step of the host's own work over ``steps`` more steps, whether rows are left): a
    step's time less the time the host spent blocked in reads of device data (``tolist``, ``item``, ``bool``, an
    event's or the device's ``synchronize``). Where it is below the device's busy time per step, the device bounds the
    step (the host waits for it); where it is above, the host does, and the device waits. On the CPU the reads do not
    block (the figure is the whole step, forward included: not a GPU figure)."""
    blocked = [0.0]
    names = [(torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch.Tensor, "__bool__"), (torch.cuda.Event,
             "synchronize"), (torch.cuda, "synchronize")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in names]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                blocked[0] += time.perf_counter() - t0
        return wrapper

    for owner, name, fn in saved:
        setattr(owner, name, timed(fn))
    work, going = [], True
    try:
        for _ in range(steps):
            blocked[0] = 0.0
            t0 = time.perf_counter()
            going = dec.step(st)
            work.append(time.perf_counter() - t0 - blocked[0])
            if not going:
                break
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return (round(statistics.median(work) * 1e6, 1) if work else None), going


def host_profile(dec, st, steps: int, top: int = 15) -> list:
    """The host's hottest functions over ``steps`` more steps under ``cProfile``, by their own time: ``[file:line
    function, calls, ms per step]`` (the CUDA launch costs land in the torch functions that launch; time blocked in a
    synchronisation lands in ``tolist`` / ``synchronize``)."""
    import cProfile
    import pstats

    prof, n = cProfile.Profile(), 0
    for _ in range(steps):
        n += 1
        prof.enable()
        going = dec.step(st)
        prof.disable()
        if not going:
            break
    stats = pstats.Stats(prof).stats
    return [[f"{Path(f).name}:{line} {fn}", calls, round(tt * 1e3 / n, 3)]
            for (f, line, fn), (_, calls, tt, _, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]]


def forward_launches(a, dec, st) -> int:
    """Kernels (CUDA) or aten operators (CPU) of the model forward alone: the last captured graph replayed, else one
    forward on the step's inputs (the cache's current plan)."""
    from torch.profiler import ProfilerActivity, profile

    last = dec.graphs.last if dec.graphs is not None else None  # the graph this cache's last cached step ran
    if last is not None and last[0] == id(dec.cache) and last[1].graph is not None:
        fn = last[1].graph.replay
    else:
        lo, hi = st.window
        rows = getattr(dec.cache, "_rows", None)
        B = st.x.shape[0]

        def fn():
            kw = dict(positions=st.positions, attn_mask=st.key_mask, logits_idx=dec.cols_all[lo:hi].expand(B, -1))
            if rows is not None:
                kw.update(cache=dec.cache, query_idx=rows)
            dec.model(st.x, **kw)
    if a.device != "cuda":
        from launch_counter import LaunchCounter

        with LaunchCounter() as launches:
            fn()
        return launches.total
    sync(a.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(a.device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


def breakdown(model, a, B: int = 1, top: int = 12):
    """Where one full forward's (no cache) and one cached step's (dual cache) device time goes, in the published
    layer (base) and the fast layer: the ``top`` kernels by total time, from the profiler (on CPU the operators'
    CPU time: a check of the code path, not a figure)."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for mode in ("base", "fast"):
        (disable_fast_path if mode == "base" else enable_fast_path)(model)
        for cache in ("none", "dual"):
            _, _, (dec, st) = time_steps(model, B, a, cache, "auto" if mode == "fast" else "off")
            to_cached_step(dec, st, a.block)
            gpu = a.device == "cuda"
            kind = torch.autograd.DeviceType.CUDA if gpu else torch.autograd.DeviceType.CPU
            sync(a.device)
            with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
                dec.step(st)
                sync(a.device)
            events = [e for e in prof.key_averages() if e.device_type == kind and (gpu or e.key.startswith("aten::"))]
            t = (lambda e: e.self_device_time_total) if gpu else (lambda e: e.self_cpu_time_total)
            events.sort(key=lambda e: -t(e))
            r = {"what": "breakdown", "mode": mode, "cache": cache, "batch": B,
                 "device_ms": round(sum(t(e) for e in events) / 1e3, 3),
                 "kernels": [{"name": e.key[:90], "calls": e.count, "ms": round(t(e) / 1e3, 3)} for e in events[:top]]}
            rows.append(r)
            print(json.dumps(r), flush=True)
            dec.release()  # its K/V buffers back to the graph path's pool (none off it)
            del dec, st
    return rows


def packing(model, a, B: int = 16, reps: int = 5):
    """ms of one partial forward with rows out of step (row 0 refreshes its whole canvas, the others compute their
    current block), padded and packed, and their ratio."""
    from dllm.caches import get_cache
    from dllm.caches.base import padded_rows

    enable_fast_path(model)
    T, lo, hi = a.prompt + a.gen, a.prompt, a.prompt + a.block
    g = torch.Generator().manual_seed(3)
    x = torch.randint(3, model.config.vocab_size - 1, (B, T), generator=g).to(a.device)
    cache = get_cache("dual")
    cache.reset(B, T)
    with torch.no_grad():
        model(x, cache=cache, logits_idx=torch.arange(lo, hi, device=a.device).expand(B, -1))  # fills the K/V
    mask = torch.zeros(B, T, dtype=torch.bool, device=a.device)
    mask[0] = True
    mask[1:, lo:hi] = True
    counts = mask.sum(-1)
    rows = padded_rows(mask, counts)[:, :T]
    logits_idx = torch.arange(lo, hi, device=a.device).expand(B, -1)
    n = int(counts.sum())
    ms = {}
    for name, tokens in (("padded", None), ("packed", n)):
        def fn(tokens=tokens):
            with torch.no_grad():
                model(x, cache=cache, query_idx=rows, logits_idx=logits_idx, query_tokens=tokens)
        for _ in range(2):
            fn()
        times = []
        for _ in range(reps):
            sync(a.device)
            t0 = time.perf_counter()
            fn()
            sync(a.device)
            times.append((time.perf_counter() - t0) * 1e3)
        ms[name] = statistics.median(times)
    row = {"what": "packing", "batch": B, "rows_computed_padded": B * T, "rows_computed_packed": n,
           "padded_ms": round(ms["padded"], 3), "packed_ms": round(ms["packed"], 3),
           "speedup": round(ms["padded"] / ms["packed"], 2)}
    print(json.dumps(row), flush=True)
    return [row]


def spread(model, a, B: int = 16):
    """ms per cached step of ``B`` rows whose regions are spread over the generation's blocks (row ``b`` in block ``b``
    modulo the blocks, the blocks before it filled with random tokens), ``fast-dllm``'s sampler, the dual cache on the
    graph path ("auto"): each row's logits at its own window (``Decoder.row_windows``) against every row over the union
    of the rows' windows (``row_windows`` off), their ratio, the logits columns per step and whether the canvases after
    the timed steps are the same (in bf16 the output head's rounding may differ with its shape). With random weights
    the threshold commits one token per row and step (the most confident): the rows stay in their blocks."""
    enable_fast_path(model)
    args = argparse.Namespace(**{**vars(a), "sampler": "fast-dllm"})
    blocks, steps = max(1, a.gen // a.block), max(2, min(16, a.block - 6))
    ms, columns, canvas = {}, {}, {}
    for how in ("own", "union"):
        dec, rows = decoder(model, B, args, "dual", "auto")
        dec.row_windows = how == "own"
        st = dec.start(rows)
        T, dev = st.x.shape[1], st.x.device
        k = torch.arange(B, device=dev) % blocks  # each row's block
        cols = torch.arange(T, device=dev)[None]
        before = (cols >= st.P) & (cols < st.P + k[:, None] * a.block)
        g = torch.Generator().manual_seed(5)
        fill = torch.randint(3, model.config.vocab_size - 1, st.x.shape, generator=g).to(dev)
        st.x = torch.where(before, fill, st.x)
        st.lo = st.P + k * a.block
        st.hi = (st.lo + a.block).clamp_max(T)
        st.n_start = st.hi - st.lo
        dec.host_window(st)
        for _ in range(5):  # the full forward that fills the cache, then the cached steps' graphs captured
            dec.step(st)
        c0 = dec.logits_columns
        sync(a.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            dec.step(st)
        sync(a.device)
        ms[how] = (time.perf_counter() - t0) * 1e3 / steps
        columns[how] = (dec.logits_columns - c0) / steps
        canvas[how] = st.x.clone()
        dec.release()
        del dec, st
    row = {"what": "spread", "batch": B, "blocks": blocks, "steps": steps, "own_ms": round(ms["own"], 3),
           "union_ms": round(ms["union"], 3), "speedup": round(ms["union"] / ms["own"], 2),
           "own_columns": columns["own"], "union_columns": columns["union"],
           "same_tokens": bool(torch.equal(canvas["own"], canvas["union"]))}
    print(json.dumps(row), flush=True)
    return [row]


def e2e(model, a, B: int = 1):
    """Whole generations with no cache, the dual cache, the prefix cache, the dual cache once more with each next
    forward launched after the step's synchronisation (``dual-late``, ``Decoder.launch_early`` off), and no cache with
    every forward eager (``none-eager``, ``graphs="off"``: what the full forwards' graphs save). The speed-ups are
    over the first row: no cache on the default path (its full forwards replayed from graphs on CUDA)."""
    rows = []
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, model.config.vocab_size - 1, (B, a.prompt), generator=g)
    base = None
    # dual second: a run cut by its time limit still has the goal's ratio
    for name, cache in (("none", "none"), ("dual", "dual"), ("prefix", "prefix"), ("dual-late", "dual"),
                        ("dual-eager-sampler", "dual"), ("none-eager", "none")):
        kw = dict(gen_length=a.gen, block_length=a.block, steps=a.gen, sampler="llada", cache=cache,
                  graphs="off" if name == "none-eager" else "auto")
        Decoder.launch_early = name != "dual-late"
        Decoder.step_graphs = name != "dual-eager-sampler"
        try:
            # warm-up: the same prompt and length with three steps per block, so every block's shapes (a prefix
            # cache's active width shrinks from block to block) are compiled, autotuned, timed by the dispatch and
            # captured before the run (a shape is captured the second time it is seen; the pool hands the run the
            # same buffers)
            dllm.generate(model, prompts, **{**kw, "steps": warm_steps(a)})
            sync(a.device)
            t0 = time.perf_counter()
            out = dllm.generate(model, prompts, **kw)
            sync(a.device)
            dt = time.perf_counter() - t0
        finally:
            Decoder.launch_early = Decoder.step_graphs = True
        base = base or dt
        rows.append({"what": "e2e", "cache": name, "batch": B, "s": round(dt, 3), "nfe": out.stats.nfe,
                     "ms_per_forward": round(dt * 1e3 / out.stats.nfe, 2), "speedup_vs_none": round(base / dt, 2),
                     "graphs": out.stats.graphs,
                     # the decode loop's own clock (CUDA events on the stream: the spans between its marks, waits
                     # for the host included), to set against the steps bench_step times alone
                     **{f"{k}_s": round(getattr(out.stats, f"time_{k}"), 3) for k in ("model", "sampler", "cache")}})
        if a.e2e_profile and a.device == "cuda" and name in ("none", "dual"):
            rows[-1].update(device_timeline(lambda kw=kw: dllm.generate(model, prompts, **kw)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def device_timeline(run) -> dict:
    """Where a whole generation's time goes on the device (CUDA, one more generation under the profiler): its wall
    time there (the profiler's own overhead included), the device's busy time (kernels and copies, overlaps counted
    once), and the idle time between them: in gaps of at most 50 us (launch spacing), of 50 us to 1 ms (the host
    keeping the device waiting at a step) and longer (the host's work outside the steps), with the count of each."""
    from torch.profiler import ProfilerActivity, profile

    sync("cuda")
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        sync("cuda")
    wall = time.perf_counter() - t0
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"profiled_s": round(wall, 3), **timeline(spans)}


def timeline(spans) -> dict:
    """Busy and idle time of a device from its work's ``(start, end)`` spans in microseconds (overlaps counted
    once): ``device_busy_s``, ``kernels`` and, per kind of gap between the spans (at most 50 us, 50 us to 1 ms,
    longer), its total seconds and count."""
    busy, gaps, end = 0.0, [], None
    for a0, a1 in sorted(spans):
        if end is None or a0 > end:
            if end is not None:
                gaps.append(a0 - end)
            busy += a1 - a0
            end = a1
        elif a1 > end:
            busy += a1 - end
            end = a1
    out = {"device_busy_s": round(busy / 1e6, 6), "kernels": len(spans)}
    for name, lo, hi in (("short", 0, 50), ("step", 50, 1000), ("long", 1000, float("inf"))):
        g = [x for x in gaps if lo < x <= hi]
        out[f"idle_{name}_s"], out[f"idle_{name}_n"] = round(sum(g) / 1e6, 6), len(g)
    return out


def fastdllm_model(modeling, conf, model, device):
    """Fast-dLLM's ``LLaDAModelLM`` (its modeling file) holding ``model``'s weights, every tensor on ``device``.

    Its wrapper builds the inner model with ``init_device = "cpu"`` whatever the default device is, so a model built
    under ``torch.device("cuda")`` keeps its parameters in host memory and the whole reference decode runs on the
    CPU: the inner model is built here, on ``device``, and handed to the wrapper. The weights are ``model``'s own
    tensors (``assign=True``: no second copy of 16 GB), and every parameter and buffer is checked to be on
    ``device`` before anything is timed."""
    hf = LLADA.config_to_hf(model.config, {"mask_id": model.mask_id, "eos_id": model.eos_id, "pad_id": model.pad_id})
    config = conf.LLaDAConfig(**hf)
    inner_config = modeling.create_model_config_from_pretrained_config(config)
    inner_config.init_device = str(device)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)
    try:
        with torch.device(device):
            inner = modeling.LLaDAModel(inner_config, init_params=False)
            ref = modeling.LLaDAModelLM(config, model=inner, init_params=False)
    finally:
        torch.set_default_dtype(prev)
    km = LLADA.key_map(model.config)
    weights = {km[k]: v for k, v in model.state_dict().items() if k in km}
    missing, unexpected = ref.load_state_dict(weights, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"Fast-dLLM's model does not take these weights: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    want = torch.device(device)
    stray = {n: t.device for n, t in [*ref.named_parameters(), *ref.named_buffers()]
             if t.device.type != want.type or (want.index is not None and t.device.index != want.index)}
    if stray:
        raise RuntimeError(f"Fast-dLLM's model has tensors off {device}: {dict(list(stray.items())[:4])}")
    return ref.eval().requires_grad_(False)


def fastdllm(model, a, B: int = 1):
    """Fast-dLLM's generate_with_dual_cache on the same weights (their modeling file), against dllm's dual cache."""
    llada = Path(a.fastdllm) / "llada"
    sys.path.insert(0, str(llada))
    import importlib

    fd = importlib.import_module("generate")
    conf = importlib.import_module("model.configuration_llada")
    modeling = importlib.import_module("model.modeling_llada")
    ref = fastdllm_model(modeling, conf, model, a.device)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, model.config.vocab_size - 1, (B, a.prompt), generator=g).to(a.device)
    out, seqs = [], []
    warm = warm_steps(a)
    for name, run in (
        ("fast-dllm generate_with_dual_cache", lambda warm_up=False: fd.generate_with_dual_cache(
            ref, prompt, steps=warm if warm_up else a.gen, gen_length=a.gen, block_length=a.block,
            temperature=0.0, remasking="low_confidence", mask_id=model.mask_id)),
        ("dllm dual cache", lambda warm_up=False: dllm.generate(
            model, prompt, gen_length=a.gen, block_length=a.block, steps=warm if warm_up else a.gen,
            sampler="llada", cache="dual")),
    ):
        run(warm_up=True)  # warm-up: three steps per block (every block's shapes, seen twice)
        sync(a.device)
        t0 = time.perf_counter()
        res = run()
        sync(a.device)
        dt = time.perf_counter() - t0
        seqs.append(res[0][:, -a.gen:] if isinstance(res, tuple) else res.sequences)
        out.append({"what": "fastdllm", "impl": name, "batch": B, "s": round(dt, 3),
                    "ms_per_forward": round(dt * 1e3 / a.gen, 2)})
        print(json.dumps(out[-1]), flush=True)
    same = float((seqs[0].to(seqs[1].device) == seqs[1]).float().mean())
    out.append({"what": "fastdllm", "impl": "speed-up of dllm", "ratio": round(out[0]["s"] / out[1]["s"], 2),
                "same_tokens": round(same, 3), "ref_device": str(next(ref.parameters()).device.type),
                "ref_tokens_device": str(seqs[0].device.type)})
    print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=None, help="default 32 on GPU, 2 on CPU")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 4 16 on GPU, 1 4 on CPU")
    p.add_argument("--caches", nargs="+", default=["none", "prefix", "dual"])
    p.add_argument("--sampler", default="llada",
                   help="the sampler (a registered name or preset) of the step tables; default LLaDA's baseline")
    p.add_argument("--modes", nargs="+", default=None,
                   help="base eager graph graph-late compile (default base eager graph)")
    p.add_argument("--prompt", type=int, default=None, help="default 512 on GPU, 32 on CPU")
    p.add_argument("--gen", type=int, default=None, help="default 256 on GPU, 32 on CPU")
    p.add_argument("--block", type=int, default=None, help="default 32 on GPU, 8 on CPU")
    p.add_argument("--blocks", type=int, default=1, help="blocks timed per cached setting (after one warm-up)")
    p.add_argument("--none-steps", type=int, default=4, help="steps timed without a cache")
    p.add_argument("--e2e", action="store_true",
                   help="whole generations: none / dual / prefix / dual-late / none-eager, batch 1")
    p.add_argument("--e2e-profile", action="store_true",
                   help="with --e2e on CUDA: one more generation of none and dual under the profiler, its device's "
                        "busy and idle time (where a whole generation's time goes)")
    p.add_argument("--fastdllm", default=None, help="a Fast-dLLM checkout: time its generate_with_dual_cache")
    p.add_argument("--packing", action="store_true",
                   help="one partial forward of 16 rows out of step, padded against packed (query_tokens)")
    p.add_argument("--spread", action="store_true",
                   help="a cached step of 16 rows spread over the blocks: per-row windows against the union window")
    p.add_argument("--breakdown", action="store_true",
                   help="the kernels taking a full forward's and a cached step's time, base and fast layer")
    p.add_argument("--host-profile", action="store_true",
                   help="the host's hottest functions (cProfile, by own time) over a block of steps of each "
                        "graph-path setting at the smallest batch, in its row and after the table")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    gpu = a.device == "cuda"
    a.layers = a.layers or (32 if gpu else 2)
    a.batch = a.batch or ([1, 4, 16] if gpu else [1, 4])
    a.modes = a.modes or ["base", "eager", "graph"]
    unknown = sorted(set(a.modes) - set(MODES))
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}")
    a.prompt, a.gen, a.block = a.prompt or (512 if gpu else 32), a.gen or (256 if gpu else 32), a.block or (32 if gpu else 8)
    dtype = torch.bfloat16 if gpu else torch.float32
    shape = GPU_SHAPE if gpu else CPU_SHAPE
    if not gpu:  # the samplers' CUDA path (every window position scored: no data-dependent shape), whose work is counted
        dllm.ops.dense_window = lambda logits: True
    model = build(a.layers, shape, a.prompt + a.gen, a.device, dtype)
    wb = weight_bytes(model)
    bw = copy_bandwidth(a.device)
    floor_ms = wb / bw * 1e3
    dev = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"device: {dev}; torch {torch.__version__}; kernels: {dllm.kernels.get_backend()}")
    print(f"model: {a.layers} layers, d {shape['d']}, {shape['heads']} heads, MLP {shape['mlp']}, vocabulary "
          f"{shape['vocab']}: {wb / 1e9:.2f} GB of weights ({dtype}); device copy {bw / 1e12:.2f} TB/s; "
          f"weight-read floor {floor_ms:.2f} ms")
    print(f"prompt {a.prompt}, gen {a.gen}, block {a.block}; sampler {a.sampler}" +
          (" (LLaDA's even quota: one token per step)" if a.sampler == "llada" else ""))
    rows = [{"what": "floor", "device": dev, "layers": a.layers, "weight_gb": round(wb / 1e9, 3),
             "copy_tb_s": round(bw / 1e12, 3), "floor_ms": round(floor_ms, 3)}]
    print(json.dumps(rows[0]), flush=True)  # every row as it comes: a run stopped by its time limit is still judged
    compiled = None
    for mode in a.modes:
        # base: the layer as published (separate projections, eager norms and RoPE), eager forwards; eager: the
        # fast layer (fused projections and kernels), eager forwards; graph: the fast layer, cached steps as CUDA
        # graphs; graph-late: the same, each next forward launched after the step's synchronisation instead of
        # before it (Decoder.launch_early); compile: torch.compile of the fast model
        (disable_fast_path if mode == "base" else enable_fast_path)(model)
        Decoder.launch_early = mode != "graph-late"
        Decoder.step_graphs = mode != "graph-eager-sampler"
        if mode == "compile":
            compiled = compiled or torch.compile(model)
        m = compiled if mode == "compile" else model
        for cache in a.caches:
            for B in a.batch:
                graphs = "auto" if mode.startswith("graph") else "off"
                if mode.startswith("graph") and not gpu:
                    graphs = "on"  # the static-buffer path without capture: counts only
                try:
                    step_ms, partial_ms, (dec, st) = time_steps(m, B, a, cache, graphs)
                    to_cached_step(dec, st, a.block)  # the counts are a cached step's (with a cache)
                    to_replayed_step(dec, st, a.block)  # whose work replays its graph where a step's work may
                    launches, syncs, device_ms, host_launches = count_step(a, dec, st)
                    fwd = forward_launches(a, dec, st)
                    gap = host_gap(dec, st, a.block)
                    # the host's own work per step, over a block of steps (without a cache, each a full forward:
                    # as many as are timed)
                    n = a.block if cache != "none" else a.none_steps
                    host_us, going = host_work(dec, st, n)
                    # the host's hottest functions (--host-profile: the graph path at the smallest batch)
                    top = host_profile(dec, st, n) if a.host_profile and going and \
                        mode.startswith("graph") and B == min(a.batch) else None
                except Exception as exc:  # one failing setting does not lose the others' figures
                    print(json.dumps({"what": "step", "mode": mode, "cache": cache, "batch": B,
                                      "error": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)
                    continue
                r = {"what": "step", "mode": mode, "cache": cache, "batch": B, "sampler": a.sampler,
                     "ms_per_step": round(step_ms, 3),
                     "ms_partial_step": round(partial_ms, 3) if partial_ms == partial_ms else None,  # none: null
                     "x_floor": round(step_ms / floor_ms, 2),
                     "x_floor_partial": round(partial_ms / floor_ms, 2) if partial_ms == partial_ms else None,
                     "launches_per_step": launches, "launches_per_layer": round(launches / a.layers, 1),
                     "forward_launches_per_layer": round(fwd / a.layers, 1),
                     "syncs_per_step": syncs, "device_ms_per_step": device_ms, "host_gap_us": gap,
                     "host_launches_per_step": host_launches,
                     "host_us_per_step": host_us}
                if top is not None:
                    r["host_profile"] = top
                if dec.graphs is not None:
                    r["graphs"] = {k: v - dec._graph_stats0.get(k, 0) for k, v in dec.graphs.stats.items()}
                    r["ahead"] = dec.ahead_counts
                rows.append(r)
                print(json.dumps(r), flush=True)
                dec.release()
                del dec, st
    Decoder.launch_early = Decoder.step_graphs = True
    # Fast-dLLM's own code first: of the whole generations it is the figure a short lease most needs
    for flag, fn in ((a.fastdllm, fastdllm), (a.e2e, e2e), (a.packing, packing), (a.spread, spread),
                     (a.breakdown, breakdown)):
        if flag:
            t0 = time.perf_counter()
            try:
                rows += fn(model, a)
            except Exception as exc:
                print(json.dumps({"what": fn.__name__, "error": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)
            print(f"({fn.__name__}: {time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    print(f"| mode | cache | batch | ms / step | ms / cached step | x floor ({floor_ms:.2f} ms; cached step, else step) | "
          "launches / step | "
          "per layer | forward's per layer | host syncs / step | device ms / step | host us, sync to launch | "
          "host's own work, us / step | host launches / step (CPU count) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["what"] == "step":
            cached = r['ms_partial_step'] if r['ms_partial_step'] is not None else "-"
            print(f"| {r['mode']} | {r['cache']} | {r['batch']} | {r['ms_per_step']} | {cached} | "
                  f"{r['x_floor_partial'] if r['x_floor_partial'] is not None else r['x_floor']} | "
                  f"{r['launches_per_step']} | {r['launches_per_layer']} | {r['forward_launches_per_layer']} | "
                  f"{r['syncs_per_step']} | "
                  f"{r['device_ms_per_step'] if r['device_ms_per_step'] is not None else '-'} | "
                  f"{r['host_gap_us'] if r.get('host_gap_us') is not None else '-'} | "
                  f"{r['host_us_per_step'] if r.get('host_us_per_step') is not None else '-'} | "
                  f"{r['host_launches_per_step'] if r.get('host_launches_per_step') is not None else '-'} |")
    for r in rows:
        if r.get("host_profile"):
            print(f"\nthe host's hottest functions, {r['mode']} {r['cache']} batch {r['batch']} (ms per step, own time):")
            for name, calls, ms in r["host_profile"]:
                print(f"  {ms:8.3f}  {calls:6d}  {name}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
