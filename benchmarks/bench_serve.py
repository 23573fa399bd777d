"""Serving throughput and latency: continuous batching (dllm.serve.Engine) against static batches and one
request at a time, in one run, at several concurrency levels.

``C`` closed-loop clients each send ``--requests`` requests back to back (the next one when the previous has
finished). Continuous: the engine's background loop, requests join and leave at step boundaries. Static: the
``C`` clients' requests are decoded together as one ``dllm.generate`` batch, and the next batch starts when
the whole batch is done. One at a time: ``dllm.generate`` per request, the clients' requests queued (a
request's latency includes its wait). Printed per mode and concurrency: answer
tokens per second (tokens before EOS), latency p50 / p99 to completion and, for the engine, to the first
streamed token; for the engine also how its steps ran (graphs) and the logits columns its steps computed per step
(each batch's rows times their windows: each row's own where the sampler takes per-row windows, else the union of
the rows' windows, where rows at different blocks widen each other's) against those in each row's own window.

    OMP_NUM_THREADS=1 python benchmarks/bench_serve.py --model llada-tiny --concurrency 1 4 16 --requests 8
    python benchmarks/bench_serve.py --device cuda --json serve.json      # a GPU: the engine's CUDA path
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from _common import task_prompts, write_json

import dllm
from dllm.assets import model_path
from dllm.generate import prepare_prompts
from dllm.serve import Engine


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def answer_tokens(model, seq) -> int:
    stops = {model.eos_id, model.eot_id}
    return next((i for i, t in enumerate(seq) if t in stops), len(seq))


def run_continuous(model, work, kw, max_rows):
    engine = Engine(model, max_rows=max_rows, max_queue=10_000, graphs=kw["graphs"])
    paths0 = {k: engine.stats()[k] for k in ("graphs", "step_graphs")}
    engine.start()
    lat, ttft, toks = [], [], 0
    lock = threading.Lock()

    def client(items):
        nonlocal toks
        for p in items:
            t0 = time.perf_counter()
            h = engine.submit(p, sampler=kw["sampler"], gen_length=kw["gen_length"], block_length=kw["block_length"],
                              cache=kw["cache"])
            first = None
            for _ in h.delta_ids():
                if first is None:
                    first = time.perf_counter() - t0
            r = h.result()
            with lock:
                lat.append(time.perf_counter() - t0)
                ttft.append(first if first is not None else lat[-1])
                toks += r.completion_tokens

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(items,)) for items in work]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    engine.stop()
    paths = {what: {k: v - was.get(k, 0) for k, v in engine.stats()[what].items() if v != was.get(k, 0)}
             for what, was in paths0.items()}
    s = engine.stats()
    paths["columns"] = {"logits": s["logits_columns"], "own": s["own_logits_columns"], "steps": s["steps"]}
    return wall, toks, lat, ttft, paths


def run_static(model, work, kw):
    lat, toks = [], 0
    t0 = time.perf_counter()
    for k in range(max(len(w) for w in work)):
        batch = [w[k] for w in work if k < len(w)]
        tb = time.perf_counter()
        out = dllm.generate(model, batch, sampler=kw["sampler"], gen_length=kw["gen_length"],
                            block_length=kw["block_length"], cache=kw["cache"], graphs=kw["graphs"])
        done = time.perf_counter() - tb
        lat += [done] * len(batch)  # every request of the batch waits for the whole batch
        toks += sum(answer_tokens(model, s) for s in out.sequences.tolist())
    return time.perf_counter() - t0, toks, lat, lat


def run_sequential(model, work, kw):
    lat, toks = [], 0
    t0 = time.perf_counter()
    for items in zip(*work):  # the clients' k-th requests, sent together, served one after another
        tb = time.perf_counter()
        for p in items:
            out = dllm.generate(model, [p], sampler=kw["sampler"], gen_length=kw["gen_length"],
                                block_length=kw["block_length"], cache=kw["cache"], graphs=kw["graphs"])
            lat.append(time.perf_counter() - tb)  # its wait behind the earlier ones included
            toks += answer_tokens(model, out.sequences[0].tolist())
    return time.perf_counter() - t0, toks, lat, lat


def forward_cost_per_row(model, length: int, rows: int, reps: int = 20) -> float:
    """Seconds per row of one model forward of ``rows`` rows of ``length`` tokens (median of ``reps``; on a GPU each
    forward timed to its end on the device)."""
    device = next(model.parameters()).device
    x = torch.full((rows, length), model.mask_id, dtype=torch.long, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    with torch.inference_mode():
        model(x)
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            model(x)
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / rows


def batching_gains(model, length: int, concurrency, reps: int = 20) -> list[str]:
    """The lines on what batching can gain: per concurrency level, the forward's cost per row and its ratio to the
    cost of a one-row forward (the concurrency 1 measurement itself when it is asked for, so that 1 row reads 1.00x;
    else one more measurement, printed first as the reference)."""
    costs = {c: forward_cost_per_row(model, length, c, reps) for c in dict.fromkeys(concurrency)}
    lines = []
    if 1 in costs:
        solo = costs[1]
    else:
        solo = forward_cost_per_row(model, length, 1, reps)
        lines.append(f"forward of 1 row x {length} tokens: {solo * 1e3:.3f} ms (the one-row reference)")
    for c in concurrency:
        lines.append(f"forward of {c} rows x {length} tokens: {costs[c] * 1e3:.3f} ms per row; batching gains at "
                     f"most {solo / costs[c]:.2f}x over one row at a time at this batch size")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-tiny")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--sampler", default="threshold")
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--block-length", type=int, default=8)
    ap.add_argument("--cache", default=None, help="cache for every mode (default: the preset's own, e.g. fast-dllm: dual)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--graphs", default="auto", choices=["auto", "on", "off"],
                    help="CUDA graphs for the cached steps (on: the static-buffer path on the CPU too, to count how "
                         "often a served batch's forward shape repeats)")
    ap.add_argument("--device", default="cpu", help="where the model runs (cuda: the engine's GPU path)")
    ap.add_argument("--json", help="write the rows (and the batching gains) here")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here; leave --device out to run on the CPU")
    torch.set_num_threads(args.threads)
    model = dllm.load_model(str(model_path(args.model)), dtype="float32", device=args.device)
    kw = dict(sampler=args.sampler, gen_length=args.gen_length, block_length=args.block_length, cache=args.cache,
              graphs=args.graphs)
    dllm.generate(model, task_prompts(2, 1000), **kw)  # warm-up
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"model {args.model} on {where}, sampler {args.sampler}, cache {args.cache or 'the preset default'}, gen "
          f"{args.gen_length}, block {args.block_length}, "
          f"{args.requests} requests per client, torch threads {torch.get_num_threads()}")
    length = max(len(p) for p in prepare_prompts(model, task_prompts(16, 1000), None, True)) + args.gen_length
    gains = batching_gains(model, length, args.concurrency)
    for line in gains:
        print(line)
    paths, rows = {}, []
    print("| clients | mode | answer tokens/s | latency p50 s | latency p99 s | first token p50 s | requests |")
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        ps = task_prompts(c * args.requests, 1000)
        work = [ps[i * args.requests:(i + 1) * args.requests] for i in range(c)]
        runs = {"continuous": (run_continuous, (model, work, kw, max(c, 1))),
                "static batches": (run_static, (model, work, kw)),
                "one at a time": (run_sequential, (model, work, kw))}
        for name, (fn, fargs) in runs.items():
            wall, toks, lat, ttft, *rest = fn(*fargs)
            print(f"| {c} | {name} | {toks / wall:.1f} | {statistics.median(lat):.3f} | {pct(lat, 0.99):.3f} | "
                  f"{statistics.median(ttft):.3f} | {len(lat)} |", flush=True)
            rows.append({"device": where, "clients": c, "mode": name, "tokens_per_s": toks / wall,
                         "latency_p50_s": statistics.median(lat), "latency_p99_s": pct(lat, 0.99),
                         "latency_max_s": max(lat), "first_token_p50_s": statistics.median(ttft),
                         "requests": len(lat)})
            if rest:
                paths[c] = rest[0]
    # how the continuous engine's forwards and its steps' work after them ran (the graph runner's counts; none
    # without a graph path, and no step graphs for samplers that are not graph-safe)
    for c, counts in paths.items():
        cols = counts["columns"]
        if cols["logits"]:
            # each step computes every row's logits at its own window (per-row windows) or over the rows' union
            print(f"continuous, {c} clients: logits columns computed per step {cols['logits'] / cols['steps']:.1f} "
                  f"(rows x their windows: own or the union), of which in each row's own window "
                  f"{cols['own'] / cols['steps']:.1f} ({cols['own'] / cols['logits']:.0%})")
            for row in rows:
                if row["clients"] == c and row["mode"] == "continuous":
                    row["own_logits_share"] = cols["own"] / cols["logits"]
        for what, name in (("graphs", "forwards"), ("step_graphs", "steps' sampler and bookkeeping")):
            print(f"continuous, {c} clients: {name} by path: "
                  + (", ".join(f"{k} {v}" for k, v in sorted(counts[what].items())) or "no graph path (graphs off, "
                     "CPU with auto, or a sampler that is not graph-safe)"))
    write_json(args.json, {"rows": rows, "batching_gains": gains})


if __name__ == "__main__":
    main()
