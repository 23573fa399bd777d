"""Command line: ``dllm generate | samplers | train-tiny | eval-tasks | parallelbench | eval | lm-eval``."""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from pathlib import Path

from dllm.evals.parallelbench_sweep import parse_scalar


def parse_params(items: list[str] | None) -> dict:
    """``["k=v", ...]`` -> dict with ints/floats/bools/None recognised."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"error: --param expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = parse_scalar(v.strip())
    return out


def _add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or bundled name (default: llada-tiny)")
    p.add_argument("--sampler", default=None, help="sampler name (see `dllm samplers`; default: the family baseline)")
    p.add_argument("--param", action="append", metavar="K=V", help="sampler parameter, repeatable")
    p.add_argument("--cache", default=None, help="cache policy name (default: none)")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--block-length", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="decoding steps (default: gen-length)")
    p.add_argument("--cfg-scale", type=float, default=0.0)
    p.add_argument("--eos-early-stop", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    p.add_argument("--device", default=None)
    p.add_argument("--guide", default=None, metavar="PATH",
                   help="AR-guided unmasking: a causal LM checkpoint directory with the model's tokenizer, or the "
                        "bundled 'ar-tiny' (implies --sampler guided)")
    p.add_argument("--guide-mode", choices=["deterministic", "topk"], default=None,
                   help="guided verification rule (default deterministic; topk: k=2, r=0.5, set with --param)")


def _load(args):
    from dllm.assets import model_path
    from dllm.models import load_model

    return load_model(model_path(args.model), dtype=args.dtype, device=args.device)


def _decode_setup(args):
    from dllm.config import GenerateConfig
    from dllm.samplers import get_sampler

    config = GenerateConfig(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                            cfg_scale=args.cfg_scale, eos_early_stop=args.eos_early_stop, seed=args.seed)
    params = parse_params(args.param)
    guide, mode = getattr(args, "guide", None), getattr(args, "guide_mode", None)
    if guide is not None or mode is not None:
        if args.sampler not in (None, "guided"):
            raise SystemExit(f"error: --guide/--guide-mode need the guided sampler, not --sampler {args.sampler}")
        args.sampler = "guided"
        params = {**params, **({"guide": guide} if guide is not None else {}), **({"mode": mode} if mode else {})}
    sampler = get_sampler(args.sampler, **params) if args.sampler else None
    if params and sampler is None:
        raise SystemExit("error: --param needs --sampler")
    return config, sampler


def _batch_line(line: str, where: str):
    """One ``--batch-file`` line: ``{"prompt": ...}`` (a string, a conversation or token ids); a JSON list of
    ``{"role", "content"}`` messages (a conversation) or of integers (token ids); anything else is plain text
    (``[INST] ...`` included)."""
    text = line.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: a line starting with '{{' must be a JSON object ({exc.msg}); e.g. "
                             '{"prompt": "..."}') from None
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise ValueError(f'{where}: a JSON object line needs a "prompt" key, e.g. {{"prompt": "..."}}')
        return obj["prompt"]
    if text.startswith("["):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return line
        if obj and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in obj):
            return obj
        if obj and all(isinstance(t, int) and not isinstance(t, bool) for t in obj):
            return obj
    return line


def _unescape(text: str) -> str:
    """Backslash escapes (``\\n``, ``\\t``, ``\\u00e9``) decoded; every other character kept as it is."""
    return codecs.decode(text.encode("latin-1", "backslashreplace"), "unicode_escape")


def cmd_generate(args) -> int:
    from dllm.generate import generate

    prompts = list(args.prompt or [])
    if args.batch_file:
        lines = Path(args.batch_file).read_text(encoding="utf-8").splitlines()
        prompts += [_batch_line(ln, f"{args.batch_file}:{i}") for i, ln in enumerate(lines, 1) if ln.strip()]
    prompts = [_unescape(p) if args.escapes and isinstance(p, str) else p for p in prompts]
    if not prompts:
        raise SystemExit("error: give a PROMPT or --batch-file")
    model = _load(args)
    config, sampler = _decode_setup(args)
    if args.trace_out:
        import dataclasses

        config = dataclasses.replace(config, record_confidence=True)
    out = generate(model, prompts, config, sampler=sampler, cache=args.cache)
    s = out.stats
    if args.trace_out:
        from dllm.viz import render

        for row in range(len(prompts)):
            path = Path(args.trace_out)
            if len(prompts) > 1:
                path = path.with_name(f"{path.stem}-{row}{path.suffix}")
            render(out, path, row=row, tokenizer=getattr(model, "tokenizer", None))
            print(f"[trajectory of row {row}: {path}]", file=sys.stderr)
    guided = None
    if getattr(sampler, "name", None) == "guided" or args.sampler == "guided":
        from dllm.samplers.guided import guided_summary

        guided = guided_summary(s)
    if args.json:
        print(json.dumps({
            "sequences": out.sequences.tolist(), "texts": out.texts, "nfe": s.nfe, "row_nfe": s.row_nfe,
            "tokens_per_forward": s.tokens_per_forward, "finish_step": s.finish_step,
            "time": {"model": s.time_model, "sampler": s.time_sampler, "cache": s.time_cache, "total": s.time_total},
            **({"guided": guided} if guided is not None else {}),
        }))
    else:
        for text in out.texts:
            print(text)
        extra = ""
        if guided is not None:
            extra = (f", AR forwards {guided['ar_forwards']}, {guided['accepted_per_verification']:.2f} drafts "
                     f"accepted/verification, acceptance {guided['acceptance_rate']:.2f}")
        print(f"[nfe {s.nfe}, {s.tokens_per_forward:.2f} tokens/forward, {s.time_total:.2f}s{extra}]", file=sys.stderr)
    return 0


def cmd_samplers(args) -> int:
    from dllm.samplers import list_samplers

    for e in list_samplers():
        print(f"{e.name}: {e.description}")
        for k, v in e.params().items():
            print(f"    {k} = {v!r}")
    return 0


_DLLM_ONLY_TRAIN_OPTIONS = ("loss", "no_curriculum", "curriculum", "task_mix", "tasks", "eval_every", "eval_n",
                            "init_from_ar", "shuffle_targets", "edit_targets")


def cmd_train_tiny(args) -> int:
    if args.family == "ar":  # the AR guide (a transformers LlamaForCausalLM): dllm/train_ar.py
        from dllm.train_ar import ARTrainConfig
        from dllm.train_ar import train as train_ar

        # the options only the dLLM trainer reads, refused when changed from the parser's own default
        parser = args.train_tiny_parser
        given = [f"--{dest.replace('_', '-')}" for dest in _DLLM_ONLY_TRAIN_OPTIONS
                 if getattr(args, dest) != parser.get_default(dest)]
        if given:
            raise SystemExit(f"error: {', '.join(given)} apply to the dLLM families only; the ar guide trains "
                             "on every task with next-token loss (evaluate it with benchmarks/eval_ar_tasks.py). "
                             "Drop them or use --family llada|dream")

        cfg = ARTrainConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, mlp_hidden=args.mlp,
                            steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                            threads=args.threads, time_budget_s=args.time_budget, init_from=args.init_from,
                            list_item_tokens=args.list_item_tokens, examples_per_task=args.examples_per_task,
                            tokenizer_layout=args.tokenizer_layout, save_every=args.save_every)
        summary = train_ar(cfg, args.out, progress=lambda step, loss, secs: print(
            f"step {step}/{cfg.steps}  loss {loss:.4f}  {secs:.0f}s", file=sys.stderr, flush=True))
        print(json.dumps(summary, indent=2))
        return 0
    import logging

    from dllm.train import TrainConfig, train

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = TrainConfig(family=args.family, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      mlp_hidden=args.mlp, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      seed=args.seed, threads=args.threads, time_budget_s=args.time_budget,
                      init_from=args.init_from, init_from_ar=args.init_from_ar, task_curriculum=not args.no_curriculum,
                      list_item_tokens=args.list_item_tokens, loss=args.loss, task_mix=args.task_mix,
                      curriculum_name=args.curriculum, save_every=args.save_every,
                      tie_embeddings=args.tie_embeddings, examples_per_task=args.examples_per_task,
                      tasks=args.tasks, eval_every=args.eval_every, eval_n=args.eval_n,
                      tokenizer_layout=args.tokenizer_layout, shuffle_targets=args.shuffle_targets,
                      edit_targets=args.edit_targets)

    def progress(step, loss, secs):
        print(f"step {step}/{cfg.steps}  loss {loss:.4f}  {secs:.0f}s", file=sys.stderr, flush=True)

    summary = train(cfg, args.out, progress=progress)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_eval_tasks(args) -> int:
    from tqdm import tqdm

    from dllm.evals import tasks as T
    from dllm.evals.runner import evaluate_tasks, family_average

    if args.n < 1:
        raise ValueError(f"--n must be >= 1 (examples per task), got {args.n}")
    model = _load(args)
    config, sampler = _decode_setup(args)
    names = T.task_names(args.tasks)
    if not names:
        raise SystemExit(f"error: no task matches {args.tasks!r}; known tasks: {', '.join(T.task_names())}")
    bar = tqdm(total=len(names) * args.n, desc="eval", file=sys.stderr)
    res = evaluate_tasks(model, names, args.n, args.seed_data, config, sampler=sampler, cache=args.cache,
                         batch_size=args.batch_size, on_batch=lambda name, k: bar.update(k))
    bar.close()
    print("| task | score | strict | NFE | tokens/forward |")
    print("|---|---|---|---|---|")
    for r in res:
        print(f"| {r.task} | {r.score:.3f} | {r.score_strict:.3f} | {r.nfe:.1f} | {r.tokens_per_forward:.2f} |")
    fam = family_average(res)
    print()
    print("| family | score |")
    print("|---|---|")
    for k, v in fam.items():
        print(f"| {k} | {v:.3f} |")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dllm", description="Fast decoding for masked diffusion language models.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text with a model (default: the bundled llada-tiny)")
    g.add_argument("prompt", nargs="*", help="prompt text(s); the chat template is applied")
    g.add_argument("--batch-file", help="file with one prompt per line: plain text, {\"prompt\": ...}, or a JSON "
                   "list of chat messages or of token ids (other lines starting with '[' are plain text)")
    g.add_argument("--escapes", action="store_true", help=r"interpret backslash escapes such as \n in prompts")
    g.add_argument("--json", action="store_true", help="print sequences, texts, nfe and timing as JSON")
    g.add_argument("--trace-out", metavar="FILE", default=None,
                   help="draw the decoding trajectory to FILE.png, FILE.gif or FILE.html (one file per prompt: "
                        "FILE-0.png, ... when there are several)")
    _add_decode_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("samplers", help="list samplers with their parameters and defaults")
    s.set_defaults(func=cmd_samplers)

    t = sub.add_parser("train-tiny", help="train a tiny LLaDA- or Dream-format model on the synthetic tasks")
    t.add_argument("--family", choices=["llada", "dream", "ar"], required=True,
                   help="ar: the tiny autoregressive guide for --guide (a transformers LlamaForCausalLM)")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=4000)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--d-model", type=int, default=128)
    t.add_argument("--layers", type=int, default=6)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--mlp", type=int, default=384)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    t.add_argument("--init-from", default=None, help="continue training from this checkpoint")
    t.add_argument("--init-from-ar", default=None,
                   help="start from a causal LM of the same shape and tokenizer (e.g. the ar guide): Dream's recipe "
                        "(LLaDA too: its unshifted head then learns the shift); its key/value heads are taken over (give --tie-embeddings for a tied one, like ar-tiny)")
    t.add_argument("--list-item-tokens", action="store_true",
                   help="tokenizer with one token per list item (['[\"Kevin', ' Irving\",', ...]: every list token "
                        "distinct, see docs/tiny-models.md); not the bundled checkpoints' tokenizer: train the "
                        "dLLMs and the ar guide with the same choice")
    t.add_argument("--loss", choices=["weighted", "mean"], default="weighted",
                   help="weighted: LLaDA's 1/t-weighted estimator (default); mean: plain mean over masked tokens")
    t.add_argument("--no-curriculum", action="store_true",
                   help="train on every task from the start (default: copy, then copy/reverse, then the list "
                        "operations, then every task; each stage until its tasks are learned)")
    t.add_argument("--curriculum", choices=["bare", "chat"], default="bare",
                   help="bare: bare lists first, then chat copy (default); chat: single-turn chat copy first")
    t.add_argument("--task-mix", choices=["uniform", "family", "adaptive"], default="uniform",
                   help="uniform: every task of a stage equally often (default); family: each task family equally; "
                        "adaptive: each family equally, its tasks weighted by how far their last --eval-every score "
                        "is from 1")
    t.add_argument("--save-every", type=int, default=0, help="also write the checkpoint every N steps")
    t.add_argument("--tokenizer-layout", choices=["gpt2", "list-items", "names"], default=None,
                   help="how names and lists are tokenized: gpt2 (GPT-2 split), list-items (one token per list item, "
                        "= --list-item-tokens), names (one token per name, the same in lists and instructions)")
    t.add_argument("--examples-per-task", type=int, default=4000,
                   help="fixed training pool per task; 0: fresh examples every draw (streamed from new seeds)")
    t.add_argument("--tasks", default=None, help="train on these tasks only (fnmatch pattern or family; no curriculum)")
    t.add_argument("--eval-every", type=int, default=0,
                   help="every N steps, greedy one-token-per-step accuracy on held-out examples (logged, training.json)")
    t.add_argument("--eval-n", type=int, default=8, help="examples per task in that evaluation")
    t.add_argument("--shuffle-targets", choices=["random", "rotation"], default="random",
                   help="training target of waiting_line/shuffle: random (a uniformly random different order, the "
                        "task's own; default) or rotation (the list rotated by 1..n-1 places: still a valid, "
                        "multi-answer shuffle that one committed name pins down; docs/tiny-models.md)")
    t.add_argument("--edit-targets", choices=["random", "last"], default="random",
                   help="training target of waiting_line/{insert,remove,replace}_random: random (a random position, "
                        "the task's own; default) or last (always the last position: one valid answer, no longer "
                        "multi-answer; docs/tiny-models.md)")
    t.add_argument("--tie-embeddings", action="store_true",
                   help="the output head shares the input embedding matrix (LLaDA weight_tying, Dream "
                        "tie_word_embeddings); copying a prompt token then needs no per-token output weights. The ar "
                        "guide is always tied")
    t.set_defaults(func=cmd_train_tiny, train_tiny_parser=t)

    e = sub.add_parser("eval-tasks", help="score a model on the synthetic tasks (held-out seed)")
    e.add_argument("--tasks", default=None, help="fnmatch pattern or family (default: all)")
    e.add_argument("--n", type=int, default=50, help="examples per task")
    e.add_argument("--seed-data", type=int, default=12345, help="data seed (training uses 1000+)")
    e.add_argument("--batch-size", type=int, default=25)
    _add_decode_args(e)
    e.set_defaults(func=cmd_eval_tasks, gen_length=32)

    from dllm.evals.parallelbench_cli import add_parser as add_parallelbench

    add_parallelbench(sub)
    from dllm.evals.eval_cli import add_parser as add_standard_eval

    add_standard_eval(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
