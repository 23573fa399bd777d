"""Speed of every cache policy against no cache, in one run, on a random-weight LLaDA-shaped model.

Every cache decodes the same prompts with LLaDA's even quota (a fixed number of steps, so every cache does
the same number of forwards); reported per cache and batch size: end-to-end time, speedup over no cache,
fraction of token-layers computed (from generate's per-step statistics), K/V memory held by the cache,
and the fraction of output tokens equal to the no-cache run (random weights: staleness shows up here far
more than on a trained model); on CUDA also the decode loop's clock (``stream_s``: the stream's seconds in the
cache's plan, the forwards and the sampler and loop, idle gaps included: where a step waits for the host).

    python benchmarks/bench_caches.py                        # GPU: 12 layers, width 1024, prompt 512, gen 256
    python benchmarks/bench_caches.py                        # CPU: 2 layers, width 256, prompt 64, gen 64 (minutes)
    python benchmarks/bench_caches.py --layers 8 --width 4096 --mlp 12288 --vocab 126464 --batch 1   # LLaDA-8B's layer
    python benchmarks/bench_caches.py --checkpoint /path/to/LLaDA-8B-Instruct --batch 1   # trained weights
    python benchmarks/bench_caches.py --caches dual elastic elastic:gamma=0 --batch 1      # a cache's parameters

Random weights are not trained ones: Elastic-Cache's attention-drift test, which decides how many layers recompute
every row, fires at nearly every step on them (a trained model's attention changes little from step to step), and
staleness shows in the tokens. A cache given with parameters, ``NAME:KEY=VALUE,...`` (its constructor's, as
``dllm.caches.get_cache`` takes them), is timed as a cache of its own: ``elastic:gamma=0``, whose drift test never
fails, times Elastic-Cache's machinery where a trained model's attention holds still, apart from what random
weights' drift costs. ``--checkpoint`` (a local LLaDA- or Dream-format directory, or a bundled name such as
``llada-tiny``) times the caches on a trained model instead, its prompts the synthetic tasks' (chat template applied,
their own lengths; the shape options do not apply).

The model runs as ``load_model`` runs it: the fast layer on CUDA (``--fast auto``), CUDA graphs for the cached
steps (``GenerateConfig.graphs="auto"``). Before its timed run each cache decodes the same prompts with three steps
per block and then (``--warmup``, default 2 on GPU) the whole generation twice, so that kernel compilation,
autotuning, the attention dispatch's timing and the graph captures of every step's shapes happen there, not in the
timed run: the timed run is what every later prompt of an evaluation's loop costs (a width that falls step by step,
dKV-Cache-Decode's, goes through about twenty graph shapes, each captured the second time it is seen).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _common import positive, print_table, random_llada, task_prompts, write_json

from dllm import generate, get_sampler, load_model
from dllm.assets import model_path
from dllm.caches import CACHES, get_cache
from dllm.cli.common import parse_params
from dllm.config import GRAPH_MODES
from dllm.graphs import GraphRunner
from dllm.models import Transformer, TransformerConfig
from dllm.models.fast import enable_fast_path, wants_fast
from dllm.models.loading import checkpoint_block_size


def build(layers: int, width: int, heads: int, vocab: int, max_len: int, device, dtype,
          mlp: int | None = None) -> Transformer:
    cfg = TransformerConfig(vocab_size=vocab, d_model=width, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                            mlp_hidden=mlp or (8 * width // 3 + 63) // 64 * 64, max_seq_len=max_len)
    return random_llada(cfg, device, dtype, std=0.5)


def cache_spec(text: str) -> tuple[str, dict]:
    """``NAME`` or ``NAME:KEY=VALUE,...`` (``--caches``) -> ``(name, params)``, the values read as numbers, flags or
    None where they are (``dllm.cli.common.parse_params``)."""
    name, _, rest = text.partition(":")
    items = [item for item in rest.split(",") if item]
    bad = [item for item in items if "=" not in item]
    if bad or (":" in text and not items):
        raise ValueError(f"give each parameter as KEY=VALUE after the colon, e.g. {name}:gamma=0 (got {text!r})")
    return name, parse_params(items)


def check_layout(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse (an argparse error naming the fix) a layout the runs cannot decode, before the model is built: the
    blocks must tile ``--gen``, ``--steps`` (1..gen) must split evenly over them, the warm-up's three steps per block
    must fit a block, the caches must be known with parameters their constructors take, and the LLaDA-shaped model
    takes no ``block`` cache."""
    if a.block > a.gen or a.gen % a.block:
        fit = max(d for d in range(1, min(a.block, a.gen) + 1) if a.gen % d == 0)
        p.error(f"--block {a.block} must divide --gen {a.gen}; e.g. --block {fit}, or a --gen that is a multiple of "
                f"{a.block}")
    blocks = a.gen // a.block
    if a.block < 3:
        p.error(f"--block {a.block}: give at least 3 (the warm-up decodes three steps per block)")
    if not 1 <= a.steps <= a.gen or a.steps % blocks:
        p.error(f"--steps {a.steps} must be between 1 and --gen {a.gen} and a multiple of the {blocks} blocks "
                f"(--gen / --block), e.g. --steps {min(a.gen, max(blocks, a.steps // blocks * blocks))}")
    specs = {}
    for c in a.caches:
        try:
            specs[c] = cache_spec(c)
        except ValueError as e:
            p.error(f"--caches {c}: {e}")
    unknown = [c for c in a.caches if specs[c][0] not in CACHES]
    if unknown:
        p.error(f"--caches: unknown {', '.join(unknown)}; choose from {', '.join(c for c in CACHES if c != 'block')} "
                "(parameters after a colon: elastic:gamma=0,track_num=2)")
    if any(name == "block" for name, _ in specs.values()):
        p.error("--caches block: 'block' is the exact cache of block-diffusion checkpoints (e.g. SDAR) and this "
                "benchmark's model is LLaDA-shaped; choose from "
                f"{', '.join(c for c in CACHES if c != 'block')}")
    for c, (name, params) in specs.items():
        try:
            get_cache(name, **params)  # its constructor checks the values
        except ValueError as e:
            p.error(f"--caches {c}: {e}")
    if a.checkpoint is not None:
        given = [f"--{n}" for n in ("layers", "width", "heads", "mlp", "prompt", "vocab") if getattr(a, n) is not None]
        if given:
            p.error(f"--checkpoint {a.checkpoint}: the checkpoint sets the model's shape and the prompts are the "
                    f"synthetic tasks'; drop {', '.join(given)}")
        try:  # from config.json alone, before any weight is read
            block_size = checkpoint_block_size(model_path(a.checkpoint))
        except (OSError, ValueError) as e:
            p.error(f"--checkpoint {a.checkpoint}: {e}")
        if block_size:
            p.error(f"--checkpoint {a.checkpoint} is a block-diffusion checkpoint (its cache is 'block', "
                    "bench_blockdiff.py times it); give a LLaDA- or Dream-format one")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive, default=None, help="default 12 on GPU, 2 on CPU")
    p.add_argument("--width", type=positive, default=None, help="default 1024 on GPU, 256 on CPU")
    p.add_argument("--heads", type=int, default=None, help="default width // 64")
    p.add_argument("--mlp", type=int, default=None, help="MLP width (default 8/3 of the width, rounded up to 64)")
    p.add_argument("--vocab", type=positive, default=None, help="default 4096")
    p.add_argument("--checkpoint", default=None,
                   help="a trained LLaDA- or Dream-format checkpoint (local directory or bundled name) in place of the "
                        "random-weight model")
    p.add_argument("--prompt", type=positive, default=None, help="default 512 on GPU, 64 on CPU")
    p.add_argument("--gen", type=positive, default=None, help="default 256 on GPU, 64 on CPU")
    p.add_argument("--block", type=positive, default=32)
    p.add_argument("--steps", type=positive, default=None, help="default --gen (one token per step)")
    p.add_argument("--batch", type=positive, nargs="+", default=[1, 4])
    # every cache of LLaDA-format models ("block" is the exact cache of block-diffusion checkpoints)
    p.add_argument("--caches", nargs="+", default=[c for c in CACHES if c not in ("none", "block")])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--fast", default="auto", choices=["auto", "on", "off"],
                   help="the fast layer path (auto: on CUDA, as load_model does)")
    p.add_argument("--graphs", default="auto", choices=list(GRAPH_MODES),
                   help="GenerateConfig.graphs: auto (CUDA graphs on CUDA), on (on the CPU: the static-buffer path, "
                        "whose token-layers run count Elastic-Cache's speculative layers), off (eager)")
    p.add_argument("--warmup", type=int, default=None,
                   help="whole generations each cache decodes before its timed run, after the three steps per block "
                        "(default 2 on GPU: a width that changes step by step, dKV-Cache-Decode's, is seen twice and "
                        "so captured; 0 on CPU)")
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    gpu = a.device == "cuda"
    if a.warmup is None:
        a.warmup = 2 if gpu else 0
    if a.warmup < 0:
        p.error(f"--warmup {a.warmup}: give 0 or more whole generations")
    for name, on_gpu, on_cpu in (("layers", 12, 2), ("width", 1024, 256), ("prompt", 512, 64), ("gen", 256, 64)):
        if getattr(a, name) is None and (a.checkpoint is None or name == "gen"):
            setattr(a, name, on_gpu if gpu else on_cpu)  # a GPU-sized run, or one the CPU finishes in minutes
    a.steps = a.gen if a.steps is None else a.steps
    check_layout(p, a)
    a.vocab = 4096 if a.vocab is None else a.vocab
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device == "cuda" else torch.float32)
    fast_opt = {"on": True, "off": False}.get(a.fast, a.fast)
    if a.checkpoint is not None:
        model = load_model(a.checkpoint, dtype=dtype, device=a.device, fast=fast_opt)
        fast = model.fast_path
        a.layers, a.width = model.config.n_layers, model.config.d_model
    else:
        model = build(a.layers, a.width, a.heads or max(a.width // 64, 1), a.vocab, a.prompt + a.gen, a.device,
                      dtype, a.mlp)
        fast = wants_fast(fast_opt, model)
        if fast:
            enable_fast_path(model)
    L = a.layers
    prompt_text = "the synthetic tasks' prompts" if a.checkpoint is not None else f"prompt {a.prompt}"
    print(f"model: {a.checkpoint + ', ' if a.checkpoint else ''}{L} layers, width {a.width}, "
          f"{sum(t.numel() for t in model.parameters()) / 1e6:.1f}M params, "
          f"{dtype}, {a.device}, {'fast' if fast else 'published'} layer; {prompt_text}, gen {a.gen}, block "
          f"{a.block}, steps {a.steps} "
          f"(LLaDA even quota: every cache does {a.steps} forwards)")
    rows = []
    for B in a.batch:
        if a.checkpoint is not None:  # a trained model's prompts: text, of different lengths
            prompts = task_prompts(B, 9000 + B)
            first = prompts[:1]
        else:
            g = torch.Generator().manual_seed(B)
            prompts = torch.randint(3, a.vocab - 1, (B, a.prompt), generator=g)
            first = prompts[:, :64]
        kw = dict(gen_length=a.gen, block_length=a.block, steps=a.steps, sampler=get_sampler("llada"), graphs=a.graphs)
        generate(model, first, **{**kw, "gen_length": a.block, "steps": a.block // (a.gen // a.steps)})
        base_t, base_seq = None, None
        # every block, three steps each: every block's shapes seen twice (a graph is captured the second time)
        warm = {**kw, "steps": 3 * (a.gen // a.block)}
        for name in ["none", *(c for c in a.caches if c != "none")]:  # none: the baseline, once
            policy, params = cache_spec(name)
            generate(model, prompts, cache=get_cache(policy, **params), **warm)  # compile, autotune, dispatch timing
            for _ in range(a.warmup):  # every step's shapes, seen twice: captured before the timed run
                generate(model, prompts, cache=get_cache(policy, **params), **kw)
            cache = get_cache(policy, **params)
            if a.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            runner = GraphRunner.of(model)
            ahead0 = dict(runner.ahead) if runner is not None else {}
            t0 = time.perf_counter()
            out = generate(model, prompts, cache=cache, **kw)
            if a.device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tr = out.stats.trace
            computed = sum(sum(r["computed"]) / len(r["computed"]) for r in tr) / len(tr)
            run = sum(r["run"] for r in tr) / len(tr)  # padding included: rows out of step widen the batch's forward
            if name == "none":
                base_t, base_seq = dt, out.sequences
            row = {"batch": B, "cache": name, "time_s": round(dt, 3), "speedup": round(base_t / dt, 2),
                   "token_layers": round(computed, 3), "token_layers_run": round(run, 3), "nfe": out.stats.nfe,
                   "full_refreshes": sum(r["refresh_layer"] == 0 for r in tr),
                   "kv_mib": round(out.stats.cache_bytes / 2**20, 1),
                   "same_tokens": round(float((out.sequences == base_seq).float().mean()), 3),
                   "graphs": out.stats.graphs}  # how the forwards ran (replays, captures, eager reasons)
            if runner is not None:  # the next forwards made ready ahead: launched before the sync, confirmed, ...
                row["ahead"] = {k: v - ahead0.get(k, 0) for k, v in runner.ahead.items() if v != ahead0.get(k, 0)}
            row["device"] = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
            if a.device == "cuda":
                row["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
                # the decode loop's clock (events on the stream): the stream's time from a step's start to its forward
                # (the cache's plan), through the forward, and after it (the sampler and the loop), idle gaps included:
                # a large share outside the model is a step bound by the host
                st = out.stats
                row["stream_s"] = {"cache": round(st.time_cache, 3), "model": round(st.time_model, 3),
                                   "sampler": round(st.time_sampler, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print_table(["batch", "cache", "time (s)", "speedup", "token-layers computed", "run (padding included)",
                 "full refreshes", "K/V MiB", "same tokens"],
                [[r["batch"], r["cache"], r["time_s"], f"{r['speedup']}x", f"{r['token_layers']:.1%}",
                  f"{r['token_layers_run']:.1%}", f"{r['full_refreshes']}/{r['nfe']}", r["kv_mib"],
                  f"{r['same_tokens']:.1%}"] for r in rows])
    write_json(a.json, rows)


if __name__ == "__main__":
    main()
