"""``dllm parallelbench generate | score | run | report | tasks`` .

Only this module prints (results to stdout, progress and notes to stderr); heavy imports are deferred to
the handlers so ``dllm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from dllm.cli import checks
from dllm.cli.common import CACHE_HELP, CONTINUOUS_HELP, load_model_arg


def _pair(text: str) -> tuple[int, int]:
    parts = [p.strip() for p in text.split(",")]
    try:
        lo, hi = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (e.g. 4,12), got {text!r}") from None
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"expected LO,HI (e.g. 4,12), got {text!r}")
    return lo, hi


def _check_data_args(args) -> None:
    """The data options (before anything is generated or loaded): given data files exist, ``--n`` >= 1, a
    ``--tasks`` pattern matches a task (without ``--data-dir``, whose files may name other tasks)."""
    from dllm.evals import parallelbench as PB

    for option in ("samsum", "paraphrases"):
        if getattr(args, option, None):
            checks.input_file(getattr(args, option), f"--{option}")
    checks.positive(getattr(args, "n", None), "--n")
    if getattr(args, "data_dir", None) is None and args.tasks is not None and not PB.task_names(args.tasks):
        raise ValueError(f"--tasks {args.tasks}: no task matches; known tasks: {', '.join(PB.TASKS)}")


def _text_data(args) -> dict[str, str]:
    out = {}
    if getattr(args, "samsum", None):
        out["paraphrase_summarize/samsum"] = args.samsum
    if getattr(args, "paraphrases", None):
        out["paraphrase_summarize/chatgpt-paraphrases"] = args.paraphrases
    return out


def _add_data_args(p: argparse.ArgumentParser) -> None:
    from dllm.evals.parallelbench import DEFAULT_SEED

    p.add_argument("--tasks", default=None, help="comma-separated task patterns or categories (default: all 17)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"data seed (default {DEFAULT_SEED})")
    p.add_argument("--style", choices=["full", "short"], default=None,
                   help="full: the original prompts and formats; short: the project's short prompts (the bundled "
                        "tiny models are trained on these). Default: short for `run` with a bundled tiny model, "
                        "full otherwise")
    p.add_argument("--index-base", type=int, choices=[0, 1], default=1,
                   help="positions in *_index prompts: 1 (default) or 0 (the paper's data)")
    p.add_argument("--sort-by", choices=["last", "first"], default="last",
                   help="sort labels by last name (default, what the prompt asks) or by first name (the "
                        "original's data bug)")
    p.add_argument("--sudoku-givens", type=_pair, default=(4, 12), metavar="LO,HI",
                   help="given cells per Sudoku (default 4,12; the original's file uses 12,12)")
    p.add_argument("--samsum", metavar="FILE", help="data for paraphrase_summarize/samsum (JSONL: dialogue, summary)")
    p.add_argument("--paraphrases", metavar="FILE",
                   help="data for paraphrase_summarize/chatgpt-paraphrases (JSONL: text[, paraphrases])")


def _style(args) -> str:
    """``--style``, or its default: ``short`` (what they are trained on) for the bundled tiny models, else ``full``."""
    if args.style is not None:
        return args.style
    from dllm.assets import BUNDLED, model_path

    model = getattr(args, "model", False)
    if model is False:  # `generate`: no model
        return "full"
    path = Path(model_path(model)).resolve()
    if any(path == p.resolve() for p in BUNDLED.values()):
        print(f"[--style short: the prompts {path.name} is trained on (pass --style full for the original "
              "prompts)]", file=sys.stderr)
        return "short"
    return "full"


def cmd_generate(args) -> int:
    from dllm.evals import parallelbench as PB

    _check_data_args(args)
    checks.output_dir(args.out, "--out")
    args.style = _style(args)
    res = PB.write_suite(args.out, args.tasks, n=args.n, seed=args.seed, style=args.style, index_base=args.index_base,
                         sort_by=args.sort_by, sudoku_givens=args.sudoku_givens, text_data=_text_data(args))
    for name, where in res.items():
        if isinstance(where, Path):
            n = sum(1 for _ in open(where, encoding="utf-8"))
            print(f"{name}: {n} records -> {where}")
        else:
            print(f"{name}: {where}", file=sys.stderr)
    return 0


def _averages_table(rows: list[dict]) -> list[str]:
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r)
    out = ["| task | n | score % | strict % | note |", "|---|---|---|---|---|"]
    for task, rs in by_task.items():
        if all(r.get("score") is not None for r in rs):
            s = 100 * sum(r["score"] for r in rs) / len(rs)
            ss = 100 * sum(r["score_strict"] for r in rs) / len(rs)
            note = "partial text metrics" if any(r.get("partial") for r in rs) else ""
            out.append(f"| {task} | {len(rs)} | {s:.1f} | {ss:.1f} | {note} |")
        else:
            missing = sorted({m for r in rs for m in r.get("unavailable", [])})
            out.append(f"| {task} | {len(rs)} | unavailable | unavailable | needs {', '.join(missing)} |")
    return out


def cmd_score(args) -> int:
    from dllm.evals import parallelbench as PB

    src = checks.input_file(args.file, "the predictions file")
    if args.out:
        checks.output_file(args.out, "--out", make_parents=True)
    if args.data_dir:
        checks.input_dir(args.data_dir, "--data-dir")
    from dllm.evals.io import read_jsonl_lines

    numbered = read_jsonl_lines(src)
    rows = [row for _, row in numbered]
    if not rows:
        raise ValueError(f"{src}: no lines to score")
    configs: dict[str, dict | None] = {}
    metrics = []
    for where, row in ((f"{src}:{i}", row) for i, row in numbered):  # every line checked before any is scored
        for key in ("task", "prediction"):
            if key not in row:
                raise ValueError(f"{where}: no {key!r} field (each line: an original record plus 'task' and "
                                 "'prediction')")
        task = row["task"]
        if not isinstance(task, str):
            raise ValueError(f"{where}: 'task' must be a task name (a string), got {json.dumps(task)}")
        if row["prediction"] is not None and not isinstance(row["prediction"], str):
            raise ValueError(f"{where}: 'prediction' must be the model's output text (a string, or null for no "
                             f"output), got {type(row['prediction']).__name__} {json.dumps(row['prediction'])[:40]}")
        if task not in configs:
            configs[task] = PB.load_task_config(args.data_dir, task) if args.data_dir else None
        metric = row.get("metric")
        if metric is not None and metric not in PB.METRICS:
            raise ValueError(f"{where}: unknown metric {metric!r}; known metrics: {', '.join(PB.METRICS)} (or "
                             "remove 'metric' to use the task's)")
        try:
            metric = metric or PB.metric_for(task, configs[task])
        except KeyError as exc:
            raise ValueError(f"{where}: {exc.args[0]}") from None
        problem = (PB.answer_problem(metric, row["answer"]) if "answer" in row else
                   "no 'answer' field (each line: an original record plus 'task' and 'prediction')")
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        metrics.append(metric)
    for row, metric in zip(rows, metrics):
        for key in ("score", "score_strict", "metrics", "unavailable", "unavailable_reason", "partial"):
            row.pop(key, None)
        row.update(PB.score_prediction(row["task"], row, row["prediction"], metric=metric,
                                       allow_partial=args.partial_text_scores))
    dest = Path(args.out) if args.out else src
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, dest)
    print("\n".join(_averages_table(rows)))
    print(f"[{len(rows)} lines scored -> {dest}]", file=sys.stderr)
    return 0


def cmd_run(args) -> int:
    from tqdm import tqdm

    from dllm.assets import model_path
    from dllm.evals.parallelbench.report import write_report
    from dllm.evals.parallelbench.sweep import check_run_file, check_settings, parse_methods, run_sweep, sweep_pinned
    from dllm.recipes import check_cache_fits

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("parallelbench run is single-process: every process would run the whole sweep; start it "
                         "without torchrun / accelerate launch (several sweeps: one --out each)")
    # every argument is checked before the model loads
    settings = parse_methods(args.method)
    _check_data_args(args)
    checks.positive(args.batch_size, "--batch-size", allow_none=False)
    checks.positive(args.gen_length, "--gen-length")
    checks.cache_name(args.cache)
    checks.dtype_name(args.dtype)
    checks.device_name(args.device)
    try:  # its type and range, before the model loads
        from dllm.config import GenerateConfig

        GenerateConfig(seed=args.gen_seed)
    except ValueError as exc:
        raise ValueError(f"--gen-seed: {exc}") from None
    facts = checks.model_dir(args.model)
    check_cache_fits(args.cache, facts.block_size)
    if args.data_dir is not None:
        checks.input_dir(args.data_dir, "--data-dir")
    checks.output_dir(args.out, "--out", hint="give a new directory, or the directory of an earlier sweep to "
                                              "resume it")
    args.style = _style(args)
    model_name = str(Path(model_path(args.model)).resolve())
    data = {"data_dir": args.data_dir, "seed": args.seed, "style": args.style, "index_base": args.index_base,
            "sort_by": args.sort_by, "sudoku_givens": args.sudoku_givens, "text_data": _text_data(args)}
    # each setting's sampler built for each task's budget: a value it refuses, before the model loads
    check_settings(settings, facts.family, args.tasks, **data, gen_length=args.gen_length)
    # what the sweep pins in run.json is known here: a sweep it would refuse is refused before the model loads
    check_run_file(args.out, sweep_pinned(model_name, **data, gen_length=args.gen_length, cache=args.cache,
                                          gen_seed=args.gen_seed), args.overwrite)
    model = load_model_arg(args)
    bar = tqdm(total=0, desc="parallelbench", unit="sample", file=sys.stderr, dynamic_ncols=True)

    def on_start(todo: int, done: int) -> None:
        bar.total = todo
        bar.refresh()
        if done:
            bar.write(f"resuming: {done} samples already in {args.out}", file=sys.stderr)

    def on_sample(line: dict) -> None:
        bar.set_postfix_str(f"{line['setting']} {line['task']}", refresh=False)
        bar.update(1)

    try:
        res = run_sweep(model, args.out, settings, args.tasks, n=args.n, **data, gen_length=args.gen_length,
                        batch_size=args.batch_size, cache=args.cache, model_name=model_name,
                        allow_partial=args.partial_text_scores, gen_seed=args.gen_seed, overwrite=args.overwrite,
                        on_start=on_start, on_sample=on_sample, continuous=args.continuous)
    finally:
        bar.close()
    for name, why in res.needs_data.items():
        print(f"{name}: not run: {why}", file=sys.stderr)
    print(f"[{res.written} samples written, {res.already_done} already there -> {res.samples_path}]", file=sys.stderr)
    if not args.no_report and (res.written or res.already_done):
        report = write_report(args.out)
        print(report.markdown)
    return 0


def cmd_report(args) -> int:
    from dllm.evals.parallelbench.report import write_report

    if args.out:
        checks.output_file(args.out, "--out", make_parents=True)
    report = write_report(args.dirs, args.out, plot=not args.no_plot)
    print(report.markdown)
    where = Path(args.out) if args.out else Path(args.dirs[0]) / "report.md"
    print(f"[report -> {where}" + "".join(f", {p}" for p in report.plots) + "]", file=sys.stderr)
    if report.plot_note:
        print(report.plot_note, file=sys.stderr)
    return 0


def cmd_show(args) -> int:
    from dllm.evals.parallelbench.sweep import RUN_FILE, replay_plan, replay_sample
    from dllm.viz import render

    results = checks.input_dir(args.results, "the sweep directory")
    if not (results / RUN_FILE).is_file():
        raise ValueError(f"{args.results} is not a sweep directory (no {RUN_FILE}); give the --out directory of "
                         "`dllm parallelbench run`")
    if args.id < 0:
        raise ValueError(f"--id must be >= 0 (the sample's index in its task), got {args.id}")
    checks.picture_file(args.out, "--out")
    checks.dtype_name(args.dtype)
    if args.model is None:  # the model the sweep was run with
        try:
            run = json.loads((results / RUN_FILE).read_text(encoding="utf-8"))
            args.model = run["pinned"].get("model")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{results / RUN_FILE} is not a sweep's run file; pass --model, or rerun the "
                             "sweep") from None
    checks.device_name(args.device)
    facts = checks.model_dir(args.model)
    # the sample, its record and its setting, before loading
    replay_plan(args.results, args.id, task=args.task, setting=args.setting, family=facts.family)
    model = load_model_arg(args)
    res, line = replay_sample(model, args.results, args.id, task=args.task, setting=args.setting)
    text = res.texts[0] if res.texts else ""
    same = "the stored output" if text == line.get("prediction") else "NOT the stored output (another model?)"
    render(res, args.out, tokenizer=getattr(model, "tokenizer", None), **({"title": f"{line['task']} #{args.id}, "
                                                                               f"{line['setting']}"}
                                                                            if Path(args.out).suffix != ".gif" else {}))
    print(f"[{line['task']} #{args.id}, {line['setting']}: regenerated {same}; trajectory -> {args.out}]",
          file=sys.stderr)
    return 0


def cmd_tasks(args) -> int:
    from dllm.evals import parallelbench as PB

    print("| task | metric | samples | max tokens | worked examples | description |")
    print("|---|---|---|---|---|---|")
    for t in PB.TASKS.values():
        data = " (needs a data file)" if t.needs_data else ""
        print(f"| {t.pb_name} | {t.metric} | {t.num_samples} | {t.max_tokens} | {t.icl} | {t.description}{data} |")
    if args.backends:
        print()
        for name, status in PB.text_backend_status().items():
            print(f"{name}: {status}")
    return 0


def add_parser(sub) -> None:
    """Add ``parallelbench`` and its actions to the ``dllm`` sub-command parser."""
    pb = sub.add_parser("parallelbench", help="ParallelBench-compatible suite: generate | score | run | report | show | tasks",
                        description="ParallelBench-compatible suite (see docs/parallelbench.md).")
    acts = pb.add_subparsers(dest="pb_command", required=True, metavar="ACTION")

    g = acts.add_parser("generate", help="write one JSONL per task in the original record schema")
    g.add_argument("--out", required=True, help="output directory (<category>/<task>.jsonl + task_config.yaml)")
    g.add_argument("--n", type=int, default=None, help="records per task (default: 100; Sudoku 108)")
    _add_data_args(g)
    g.set_defaults(func=cmd_generate)

    s = acts.add_parser("score", help="score predictions made elsewhere (JSONL: record + task + prediction)")
    s.add_argument("file", help="JSONL, one original record per line plus 'task' and 'prediction'")
    s.add_argument("--out", default=None, help="write the scored lines here (default: rewrite FILE in place)")
    s.add_argument("--data-dir", default=None, help="read prompts/metrics of other task names from its task_config.yaml")
    s.add_argument("--partial-text-scores", action="store_true",
                   help="score text tasks on the metrics available instead of reporting them unavailable")
    s.set_defaults(func=cmd_score)

    r = acts.add_parser("run", help="sweep decoding settings over the tasks (resumable)")
    r.add_argument("--model", default=None, help="checkpoint directory or bundled name (default: llada-tiny)")
    r.add_argument("--method", action="extend", nargs="+", required=True, metavar="SPEC",
                   help="method spec(s), repeatable: topk:k=1,2,4,8 | threshold:tau=0.5,0.6,...,1.0 | "
                        "NAME:param=v1,v2 (any registered sampler, see `dllm samplers`)")
    r.add_argument("--out", required=True, help="output directory (samples.jsonl, run.json, report.md)")
    r.add_argument("--overwrite", action="store_true",
                   help="discard the results in --out when they were made with other settings (default: refuse)")
    r.add_argument("--cache", default=None, help=CACHE_HELP)
    r.add_argument("--data-dir", default=None, help="run on the JSONL files of this directory (ours or the original's)")
    r.add_argument("--n", type=int, default=None, help="samples per task, spread over the file (default: all)")
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--continuous", action="store_true", help=CONTINUOUS_HELP)
    r.add_argument("--gen-length", type=int, default=None,
                   help="generation budget for every task (default: 32 waiting line, 64 otherwise)")
    r.add_argument("--gen-seed", type=int, default=0, help="seed of the decoding's random draws")
    r.add_argument("--partial-text-scores", action="store_true")
    r.add_argument("--no-report", action="store_true", help="do not write report.md at the end")
    r.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    r.add_argument("--device", default=None)
    _add_data_args(r)
    r.set_defaults(func=cmd_run)

    p = acts.add_parser("report", help="markdown table, PB90/80/70, AUP and plot of one or more sweeps")
    p.add_argument("dirs", nargs="+", help="sweep directories (or samples.jsonl files)")
    p.add_argument("--out", default=None, help="markdown file (default: DIR/report.md; plots beside it)")
    p.add_argument("--no-plot", action="store_true")
    p.set_defaults(func=cmd_report)

    sh = acts.add_parser("show", help="picture of one sample's decoding trajectory (regenerated from its stored "
                                      "record and the sweep's settings): PNG, GIF or HTML")
    sh.add_argument("results", help="a sweep directory (dllm parallelbench run --out)")
    sh.add_argument("--id", type=int, required=True, help="the sample's index in its task")
    sh.add_argument("--task", default=None, help="the task, when the sweep has several")
    sh.add_argument("--setting", default=None, help="the setting label, when the sweep has several")
    sh.add_argument("--out", required=True, help="FILE.png, FILE.gif or FILE.html")
    sh.add_argument("--model", default=None, help="default: the model the sweep was run with")
    sh.add_argument("--dtype", default=None)
    sh.add_argument("--device", default=None)
    sh.set_defaults(func=cmd_show)

    t = acts.add_parser("tasks", help="list the 17 tasks")
    t.add_argument("--backends", action="store_true", help="also probe the grammar / ROUGE / BERTScore backends")
    t.set_defaults(func=cmd_tasks)
