"""AR-guided unmasking on the ParallelBench-compatible suite: score, dLLM forwards, AR forwards, wall time.

Methods (each over the same records of ``dllm parallelbench run --style short``, one prompt at a time):

* ``threshold``: the dLLM alone, threshold 0.9 (``dllm parallelbench run --method threshold``);
* ``guided-det`` / ``guided-topk``: the guided sampler, deterministic and top-k relative (k 2, r 0.5);
* ``ar``: the guide alone, greedy ``model.generate`` of transformers (one forward per token).

    OMP_NUM_THREADS=1 python benchmarks/bench_guided.py --model llada-tiny --guide ar-tiny \\
        --tasks waiting_line,puzzle --n 5 --gen-length 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _common import positive

from dllm import generate
from dllm.assets import model_path
from dllm.config import GenerateConfig
from dllm.evals import parallelbench as PB
from dllm.evals.parallelbench.sweep import subset_indices
from dllm.models import load_model
from dllm.samplers import get_sampler
from dllm.samplers.guided import guided_summary, load_guide

METHODS = ("threshold", "guided-det", "guided-topk", "ar")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-tiny")
    ap.add_argument("--guide", default="ar-tiny")
    ap.add_argument("--tasks", default="waiting_line,puzzle")
    ap.add_argument("--n", type=positive, default=5, help="records per task (spread evenly, as parallelbench run)")
    ap.add_argument("--seed", type=int, default=PB.DEFAULT_SEED)
    ap.add_argument("--gen-length", type=int, default=None, help="default: each task's budget")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from " + ", ".join(METHODS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        ap.error(f"--methods {args.methods!r}: " + (f"unknown {', '.join(map(repr, unknown))}; " if unknown else "")
                 + f"give comma-separated names from {', '.join(METHODS)}")
    if not PB.task_names(args.tasks):
        ap.error(f"--tasks {args.tasks!r} matches no task; known tasks: {', '.join(PB.task_names())}")
    torch.set_num_threads(args.threads)

    model = load_model(model_path(args.model), dtype="float32")
    guide, gtok = load_guide(args.guide)
    tok = model.tokenizer
    stops = [i for i in (model.eos_id, model.eot_id) if i is not None]
    samplers = {"threshold": lambda: get_sampler("threshold"),
                "guided-det": lambda: get_sampler("guided", guide=(guide, gtok), mode="deterministic"),
                "guided-topk": lambda: get_sampler("guided", guide=(guide, gtok), mode="topk")}
    work = []
    for name in PB.task_names(args.tasks):
        records = PB.generate_task(name, None, args.seed, style="short")
        template, metric = PB.prompt_for(name, "short"), PB.metric_for(name)
        G = args.gen_length or PB.max_tokens_for(name)
        for i in subset_indices(len(records), args.n):
            work.append((name, records[i], PB.messages_for(records[i], template), metric, G))

    results = {}
    preds: dict[str, list[str]] = {}
    for method in methods:
        tot = {"score": 0.0, "dllm_forwards": 0, "ar_forwards": 0, "seconds": 0.0, "accepted": 0, "verified": 0,
               "verifications": 0, "n": 0}
        per_task: dict[str, list[float]] = {}
        sampler = samplers[method]() if method != "ar" else None
        for name, record, msgs, metric, G in work:
            t0 = time.perf_counter()
            if method == "ar":
                ids = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)["input_ids"]
                out = guide.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=G, eos_token_id=stops, pad_token_id=model.eos_id)
                row = out[0, len(ids):].tolist()
                cut = next((j for j, t in enumerate(row) if t in stops), len(row))
                pred = tok.decode(row[:cut], skip_special_tokens=True)
                tot["ar_forwards"] += min(len(row), cut + 1)  # one forward per generated token
            else:
                res = generate(model, [msgs], GenerateConfig(gen_length=G), sampler=sampler)
                pred = res.texts[0]
                tot["dllm_forwards"] += res.stats.nfe
                if method.startswith("guided"):
                    s = guided_summary(res.stats)
                    tot["ar_forwards"] += s["ar_forwards"]
                    tot["accepted"] += s["drafts_accepted"]
                    tot["verified"] += s["drafts_verified"]
                    tot["verifications"] += s["verifications"]
            tot["seconds"] += time.perf_counter() - t0
            preds.setdefault(method, []).append(pred)
            sc = PB.score_prediction(name, record, pred, metric=metric)["score"] or 0.0
            tot["score"] += sc
            tot["n"] += 1
            per_task.setdefault(name, []).append(sc)
        n = max(tot["n"], 1)
        results[method] = {
            "score": tot["score"] / n, "dllm_nfe": tot["dllm_forwards"] / n, "ar_forwards": tot["ar_forwards"] / n,
            "seconds_per_sample": tot["seconds"] / n, "total_seconds": tot["seconds"], "samples": tot["n"],
            "acceptance_rate": tot["accepted"] / max(tot["verified"], 1) if method.startswith("guided") else None,
            "accepted_per_verification": (tot["accepted"] / max(tot["verifications"], 1)
                                          if method.startswith("guided") else None),
            "per_task": {k: sum(v) / len(v) for k, v in per_task.items()},
        }
    for method, r in results.items():  # fraction of samples whose text equals the guide's own greedy text
        r["same_text_as_ar"] = (sum(a == b for a, b in zip(preds[method], preds["ar"])) / max(len(preds["ar"]), 1)
                                if "ar" in preds else None)
    print("| method | score | dLLM NFE / sample | AR forwards / sample | acceptance | drafts accepted / verification "
          "| s / sample | text = AR's |")
    print("|---|---|---|---|---|---|---|---|")
    for m, r in results.items():
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        apv = "-" if r["accepted_per_verification"] is None else f"{r['accepted_per_verification']:.2f}"
        print(f"| {m} | {r['score']:.3f} | {r['dllm_nfe']:.1f} | {r['ar_forwards']:.1f} | {acc} | {apv} "
              f"| {r['seconds_per_sample']:.3f} | "
              + ("-" if r["same_text_as_ar"] is None else f"{r['same_text_as_ar']:.2f}") + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
