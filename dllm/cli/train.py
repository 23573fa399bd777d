"""``dllm train-tiny``: train a tiny LLaDA-, Dream-, SDAR-, LLaDA2-, Fast-dLLM v2- or AR-format model on the synthetic tasks."""

from __future__ import annotations

import json
import math
import sys

DLLM_FAMILIES = ("llada", "dream", "sdar", "llada2", "fastdllm2")  # --family: these and the AR guide, "ar"
_DLLM_ONLY_TRAIN_OPTIONS = ("loss", "no_curriculum", "curriculum", "task_mix", "tasks", "eval_every", "eval_n",
                            "init_from_ar", "shuffle_targets", "edit_targets", "block_size")


def _check_train_args(args) -> None:
    """The numbers and the output directory, before any data is built or a step is taken."""
    from dllm.cli import checks

    checks.output_dir(args.out, "--out", hint="give the directory to write the checkpoint in")
    for option in ("steps", "batch_size", "d_model", "layers", "heads", "mlp", "eval_n"):
        checks.positive(getattr(args, option), f"--{option.replace('_', '-')}", allow_none=False)
    for option in ("threads", "block_size"):
        checks.positive(getattr(args, option), f"--{option.replace('_', '-')}")
    for option in ("save_every", "eval_every", "examples_per_task"):
        if getattr(args, option) < 0:
            raise ValueError(f"--{option.replace('_', '-')} must be >= 0, got {getattr(args, option)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be > 0 and finite, got {args.lr}; give a learning rate such as 2e-3")
    if args.time_budget is not None and not (math.isfinite(args.time_budget) and args.time_budget > 0):
        raise ValueError(f"--time-budget must be > 0 seconds and finite, got {args.time_budget}; "
                         "give the seconds to train for, or leave it out to run all --steps")
    from dllm.assets import model_path

    for option in ("init_from", "init_from_ar"):  # before the tokenizer is built or anything is written
        if getattr(args, option) is not None:
            checks.input_dir(model_path(getattr(args, option)), f"--{option.replace('_', '-')}")
    if args.d_model % args.heads:
        raise ValueError(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if (args.d_model // args.heads) % 2:  # every family (the ar guide too) rotates head-size pairs (RoPE)
        raise ValueError(f"--d-model {args.d_model} / --heads {args.heads} gives a head size of "
                         f"{args.d_model // args.heads}, but rotary position embeddings need an even head size; "
                         "choose --d-model and --heads whose quotient is even (e.g. --d-model "
                         f"{2 * args.heads * max(1, -(-args.d_model // (2 * args.heads)))} --heads {args.heads})")


def cmd_train_tiny(args) -> int:
    _check_train_args(args)
    if args.family == "ar":  # the AR guide (a transformers LlamaForCausalLM): dllm/train_ar.py
        from dllm.tiny.train_ar import ARTrainConfig
        from dllm.tiny.train_ar import train as train_ar

        # the options only the dLLM trainer reads, refused when changed from the parser's own default
        parser = args.train_tiny_parser
        given = [f"--{dest.replace('_', '-')}" for dest in _DLLM_ONLY_TRAIN_OPTIONS
                 if getattr(args, dest) != parser.get_default(dest)]
        if given:
            raise ValueError(f"{', '.join(given)} apply to the dLLM families only; the ar guide trains "
                             "on every task with next-token loss (evaluate it with benchmarks/eval_ar_tasks.py). "
                             f"Drop them or use a dLLM --family ({', '.join(DLLM_FAMILIES)})")

        cfg = ARTrainConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, mlp_hidden=args.mlp,
                            steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                            threads=args.threads, time_budget_s=args.time_budget, init_from=args.init_from,
                            examples_per_task=args.examples_per_task,
                            tokenizer_layout=args.tokenizer_layout, save_every=args.save_every)
        summary = train_ar(cfg, args.out, progress=lambda step, loss, secs: print(
            f"step {step}/{cfg.steps}  loss {loss:.4f}  {secs:.0f}s", file=sys.stderr, flush=True))
        print(json.dumps(summary, indent=2))
        return 0
    import logging

    from dllm.tiny.train import TrainConfig, train

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = TrainConfig(family=args.family, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      mlp_hidden=args.mlp, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      seed=args.seed, threads=args.threads, time_budget_s=args.time_budget,
                      init_from=args.init_from, init_from_ar=args.init_from_ar, task_curriculum=not args.no_curriculum,
                      loss=args.loss, task_mix=args.task_mix,
                      curriculum_name=args.curriculum, save_every=args.save_every,
                      tie_embeddings=args.tie_embeddings, examples_per_task=args.examples_per_task,
                      tasks=args.tasks, eval_every=args.eval_every, eval_n=args.eval_n,
                      tokenizer_layout=args.tokenizer_layout, shuffle_targets=args.shuffle_targets,
                      edit_targets=args.edit_targets, block_size=args.block_size)

    def progress(step, loss, secs):
        print(f"step {step}/{cfg.steps}  loss {loss:.4f}  {secs:.0f}s", file=sys.stderr, flush=True)

    summary = train(cfg, args.out, progress=progress)
    print(json.dumps(summary, indent=2))
    return 0


def add_parser(sub) -> None:
    t = sub.add_parser("train-tiny", help="train a tiny LLaDA-, Dream-, SDAR-, LLaDA2-, Fast-dLLM v2- or AR-format "
                                          "model on the synthetic tasks")
    t.add_argument("--block-size", type=int, default=None,
                   help="block-diffusion families (sdar, llada2, fastdllm2): the block size (default: 4 for sdar, 32 "
                        "for llada2 and fastdllm2)")
    t.add_argument("--family", choices=[*DLLM_FAMILIES, "ar"], required=True,
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
                        "the bundled models' layout), names (one token per name, the same in lists and instructions)")
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
