"""Reports of ParallelBench sweeps: per-task tables, PBx, AUP and a score-vs-tokens-per-step plot.

Definitions (``docs/parallelbench.md`` repeats them):

* Tokens per step (TPS) of a sample: ``gen_length / NFE`` (the original's ``max_tokens / NFE``: EOS
  padding counts as generated). A cell's TPS is the mean over its samples.
* Task-averaged score / TPS of a setting: the mean over the *common tasks*, those with an available score
  in every setting of the report (tasks whose text metrics are unavailable, or that some setting lacks, are
  listed apart and left out of every average).
* ``PBx`` of a curve (one method, its settings as points): the highest task-averaged TPS among its settings
  whose task-averaged score is at least ``x`` percent, as the original's leaderboard computes it ("-" when
  no setting reaches ``x``). ``PBx (interp.)``: the same on the piecewise-linear curve through the points
  sorted by TPS, i.e. the largest TPS at which the interpolated score is still >= ``x``.
* ``AUP`` of a curve: the trapezoid area under score (a fraction in [0, 1]) against TPS, with the first
  point extended as a rectangle to TPS 0: ``AUP = s_1 r_1 + sum_{i>=2} (r_i - r_{i-1}) (s_i + s_{i-1}) / 2``
  over the points sorted by TPS ``r`` (equal TPS: the best score is kept). It is in TPS units: a method
  that keeps a perfect score up to TPS ``r`` has ``AUP = r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dllm.evals import parallelbench as PB
from dllm.evals import stats
from dllm.evals.io import read_run_file
from dllm.evals.parallelbench.sweep import RUN_FILE, load_samples

__all__ = ["PB_LEVELS", "Cell", "Report", "aggregate", "aup", "build_report", "pb_score", "write_report"]

PB_LEVELS = (90, 80, 70)
CURVE_PLOT = "pb_curve.png"
TASKS_PLOT = "pb_tasks.png"


@dataclass
class Cell:
    """One (setting, task): means over its samples."""

    n: int = 0
    score: float | None = None  # percent; None when any sample's score is unavailable
    score_strict: float | None = None
    tps: float = 0.0
    nfe: float = 0.0
    output_length: float = 0.0
    time_s: float = 0.0
    unavailable: str = ""  # why the score is unavailable
    errors: int = 0  # samples not decoded (non-finite logits): not in the means
    components: dict[str, float] = field(default_factory=dict)  # text metrics' available components (%)


def _curve_name(line: dict) -> tuple[str, str]:
    suffix = f"+cache={line['cache']}" if line.get("cache") else ""
    return line["method"] + suffix, line["setting"] + suffix


def aggregate(lines: Sequence[dict]) -> tuple[dict[tuple[str, str], Cell], dict[str, str], list[str]]:
    """``({(setting, task): Cell}, {setting: curve}, tasks)`` with settings and tasks in first-seen order
    (tasks: the built-in order first)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    curves: dict[str, str] = {}
    for line in lines:
        curve, point = _curve_name(line)
        curves.setdefault(point, curve)
        groups.setdefault((point, line["task"]), []).append(line)
    seen = list(dict.fromkeys(t for _, t in groups))
    tasks = [t for t in PB.TASKS if t in seen] + [t for t in seen if t not in PB.TASKS]
    cells = {}
    for key, rows in groups.items():
        errors = sum("error" in r for r in rows)
        rows = [r for r in rows if "error" not in r]
        k = max(len(rows), 1)
        cell = Cell(errors=errors, n=len(rows), tps=sum(r["tokens_per_step"] for r in rows) / k,
                    nfe=sum(r["nfe"] for r in rows) / k,
                    output_length=sum(r.get("output_length", 0) for r in rows) / k,
                    time_s=sum(r.get("time_s", 0.0) for r in rows) / k)
        if rows and all(r.get("score") is not None for r in rows):
            cell.score = 100.0 * sum(r["score"] for r in rows) / k
            cell.score_strict = 100.0 * sum(r.get("score_strict", r["score"]) for r in rows) / k
        else:
            reasons = {r.get("unavailable_reason") or ", ".join(r.get("unavailable", [])) for r in rows
                       if r.get("score") is None}
            cell.unavailable = "; ".join(sorted(x for x in reasons if x)) or (
                "decoding failed (non-finite logits)" if errors else "score unavailable")
        comps: dict[str, list[float]] = {}
        for r in rows:
            for name, v in (r.get("metrics") or {}).items():
                if v is not None:
                    comps.setdefault(name, []).append(v)
        cell.components = {name: 100.0 * sum(v) / len(v) for name, v in comps.items() if len(v) == k}
        cells[key] = cell
    return cells, curves, tasks


def _envelope(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    best: dict[float, float] = {}
    for r, s in points:
        best[r] = max(s, best.get(r, float("-inf")))
    return sorted(best.items())


def pb_score(points: Sequence[tuple[float, float]], x: float, interpolate: bool = False) -> float | None:
    """PBx of ``points`` = ``[(tps, score_percent), ...]``; None when no point (or no part of the
    interpolated curve) reaches ``x``."""
    pts = _envelope(points)
    if not interpolate:
        ok = [r for r, s in pts if s >= x]
        return max(ok) if ok else None
    best = None
    for i, (r, s) in enumerate(pts):
        if s >= x:
            best = r if best is None else max(best, r)
        if i + 1 < len(pts):
            r2, s2 = pts[i + 1]
            if s >= x > s2:  # crosses x going down between r and r2
                t = r + (s - x) / (s - s2) * (r2 - r)
                best = t if best is None else max(best, t)
    return best


def aup(points: Sequence[tuple[float, float]]) -> float | None:
    """Area under the score-vs-TPS curve (module docstring); ``points`` = ``[(tps, score_percent)]``."""
    pts = [(r, s / 100.0) for r, s in _envelope(points)]
    if not pts:
        return None
    area = pts[0][0] * pts[0][1]
    for (r1, s1), (r2, s2) in zip(pts, pts[1:]):
        area += (r2 - r1) * (s1 + s2) / 2
    return area


def bootstrap_curves(lines: Sequence[dict], settings_curve: dict[str, str], common: Sequence[str], *,
                     resamples: int = stats.RESAMPLES, seed: int = stats.SEED) -> dict | None:
    """Percentile-bootstrap draws of every figure, resampling the examples of each common task (the same
    examples for every setting: the comparisons are paired). Returns ``{"score": {setting: [B]}, "tps":
    {setting: [B]}, "AUP": {curve: [B]}, "PB70": {curve: [B]}, ...}`` (percent scores; NaN where a resample
    reaches no PBx), or None when some common task has no example scored in every setting."""
    settings = list(settings_curve)
    by: dict[tuple[str, str], dict] = {}
    for line in lines:
        if "error" in line or line.get("score") is None:
            continue
        _, point = _curve_name(line)
        cell = by.setdefault((point, line["task"]), {})
        cell[line.get("index", len(cell))] = (float(line["score"]), float(line["tokens_per_step"]))
    if not common:
        return None
    score = np.zeros((len(settings), resamples))
    tps = np.zeros((len(settings), resamples))
    for k, t in enumerate(common):
        keys = set.intersection(*(set(by.get((s, t), {})) for s in settings))
        if not keys:
            return None
        ids = sorted(keys, key=str)
        vals = np.array([[by[(s, t)][i] for i in ids] for s in settings])  # [settings, n, 2]
        idx = stats.bootstrap_indices(len(ids), resamples, seed + k)
        score += vals[:, idx, 0].mean(-1)
        tps += vals[:, idx, 1].mean(-1)
    score *= 100.0 / len(common)
    tps /= len(common)
    out: dict = {"score": {s: score[i] for i, s in enumerate(settings)}, "tps": {s: tps[i] for i, s in enumerate(settings)}}
    for name in dict.fromkeys(settings_curve.values()):
        rows = [i for i, s in enumerate(settings) if settings_curve[s] == name]
        draws: dict[str, list] = {"AUP": [], **{f"PB{x}": [] for x in PB_LEVELS}}
        for b in range(resamples):
            pts = [(tps[i, b], score[i, b]) for i in rows]
            draws["AUP"].append(aup(pts))
            for x in PB_LEVELS:
                v = pb_score(pts, x)
                draws[f"PB{x}"].append(np.nan if v is None else v)
        for key, v in draws.items():
            out.setdefault(key, {})[name] = np.asarray(v, dtype=float)
    return out


def _p_two_sided(diff: np.ndarray) -> float:
    """Bootstrap p-value of a zero difference: twice the smaller tail share (at most 1)."""
    return float(min(1.0, 2 * min(np.mean(diff <= 0), np.mean(diff >= 0))))


@dataclass
class Report:
    markdown: str
    settings: dict[str, dict]  # setting -> {"method", "score", "score_strict", "tps", "nfe", ...}
    curves: dict[str, dict]  # curve -> {"PB90": ..., "PB90_interp": ..., "AUP": ..., "points": [...]}
    common_tasks: list[str]
    excluded_tasks: dict[str, str]
    plots: list[Path]
    plot_note: str = ""


def _f(v: float | str | None, digits: int = 1) -> str:
    if isinstance(v, str):
        return v
    return "-" if v is None else f"{v:.{digits}f}"


def _plot(curves: dict[str, dict], cells, settings_curve, tasks, out_dir: Path) -> tuple[list[Path], str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plot not written: matplotlib is not installed (pip install matplotlib)"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, c in curves.items():
        pts = sorted(c["points"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for x in PB_LEVELS:
        ax.axhline(x, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step (gen_length / NFE)")
    ax.set_ylabel("task-averaged score (%)")
    ax.set_ylim(-2, 102)
    ax.set_title("ParallelBench: score vs. parallelism")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / CURVE_PLOT)
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    scored = [t for t in tasks if any(cells.get((s, t)) and cells[(s, t)].score is not None for s in settings_curve)]
    if scored:
        cols = min(4, len(scored))
        rows = (len(scored) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
        for ax, task in zip(axes.flat, scored):
            for name in curves:
                pts = sorted((cells[(s, task)].tps, cells[(s, task)].score) for s, cv in settings_curve.items()
                             if cv == name and (s, task) in cells and cells[(s, task)].score is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=name)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-2, 102)
            ax.set_title(task, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(scored):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=6)
        fig.supxlabel("tokens per step", fontsize=8)
        fig.supylabel("score (%)", fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / TASKS_PLOT)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths, ""


def _task_table(md: list[str], title: str, settings: Sequence[str], tasks: Sequence[str], cell, *,
                average: Sequence[str] | None = None, note: str = "") -> None:
    """A task x setting markdown table (``cell(setting, task) -> str``), with an optional average row."""
    md += [f"## {title}", ""] + ([note, ""] if note else [])
    md.append("| task | " + " | ".join(settings) + " |")
    md.append("|---|" + "---|" * len(settings))
    for t in tasks:
        md.append(f"| {t} | " + " | ".join(cell(s, t) for s in settings) + " |")
    if average is not None:
        md.append("| **average (common tasks)** | " + " | ".join(average) + " |")
    md.append("")


def build_report(lines: Sequence[dict], *, plot_dir: str | Path | None = None, title: str = "ParallelBench report",
                 sources: Sequence[str] = (), needs_data: dict[str, str] | None = None) -> Report:
    """The markdown report of sweep ``lines`` (and the plots, written to ``plot_dir`` when given)."""
    if not lines:
        raise ValueError("no samples to report on")
    cells, settings_curve, tasks = aggregate(lines)
    settings = list(settings_curve)
    excluded: dict[str, str] = {}
    for t in tasks:
        missing = [s for s in settings if (s, t) not in cells]
        unavailable = [cells[(s, t)].unavailable for s in settings if (s, t) in cells and cells[(s, t)].score is None]
        if unavailable:
            excluded[t] = "score unavailable: " + sorted(set(unavailable))[0]
        elif missing:
            excluded[t] = f"not run for {len(missing)} of {len(settings)} settings"
    common = [t for t in tasks if t not in excluded]
    max_n = {t: max(cells[(s, t)].n for s in settings if (s, t) in cells) for t in tasks}

    summary: dict[str, dict] = {}
    for s in settings:
        row = {"method": settings_curve[s], "score": None, "score_strict": None, "tps": None}
        if common:
            cs = [cells[(s, t)] for t in common]
            row.update(score=sum(c.score for c in cs) / len(cs), score_strict=sum(c.score_strict for c in cs) / len(cs),
                       tps=sum(c.tps for c in cs) / len(cs), nfe=sum(c.nfe for c in cs) / len(cs),
                       output_length=sum(c.output_length for c in cs) / len(cs),
                       time_s=sum(c.time_s for c in cs) / len(cs))
        summary[s] = row
    curves: dict[str, dict] = {}
    for name in dict.fromkeys(settings_curve.values()):
        pts = [(summary[s]["tps"], summary[s]["score"]) for s in settings
               if settings_curve[s] == name and summary[s]["score"] is not None]
        info: dict = {"points": pts, "AUP": aup(pts)}
        for x in PB_LEVELS:
            info[f"PB{x}"] = pb_score(pts, x)
            info[f"PB{x}_interp"] = pb_score(pts, x, interpolate=True)
        curves[name] = info
    all_pts = [p for c in curves.values() for p in c["points"]]
    boot = bootstrap_curves(lines, settings_curve, common)
    if boot is not None:
        for s in settings:
            summary[s]["score_ci"] = stats.percentile_ci(boot["score"][s])
        for name, info in curves.items():
            info["AUP_ci"] = stats.percentile_ci(boot["AUP"][name])
            for x in PB_LEVELS:
                info[f"PB{x}_ci"] = stats.percentile_ci(boot[f"PB{x}"][name])

    md: list[str] = [f"# {title}", ""]
    n_samples = len(lines)
    md.append(f"{n_samples} samples, {len(settings)} settings, {len(tasks)} tasks"
              + (f" (from {', '.join(sources)})" if sources else "") + ".")
    md.append("")
    md.append("## Summary per method")
    md.append("")
    head = (["method"] + [f"PB{x}" for x in PB_LEVELS] + [f"PB{x} (interp.)" for x in PB_LEVELS]
            + ["AUP", "AUP 95% CI", "settings"])
    md.append("| " + " | ".join(head) + " |")
    md.append("|" + "---|" * len(head))
    rows = list(curves.items())
    if len(curves) > 1:
        any_info = {f"PB{x}": pb_score(all_pts, x) for x in PB_LEVELS}
        any_info.update({f"PB{x}_interp": "" for x in PB_LEVELS})
        any_info.update(AUP="", AUP_ci=(float("nan"), float("nan")), points=all_pts)
        rows.append(("(best of all settings)", any_info))
    for name, c in rows:
        cells_ = ([_f(c[f"PB{x}"], 2) for x in PB_LEVELS] + [_f(c[f"PB{x}_interp"], 2) for x in PB_LEVELS]
                  + [_f(c["AUP"], 3), stats.fmt_ci(*c.get("AUP_ci", (float("nan"),) * 2), digits=3),
                     str(len(c["points"]))])
        md.append(f"| {name} | " + " | ".join(cells_) + " |")
    md.append("")
    md.append(f"Task-averaged over the {len(common)} common tasks: " + (", ".join(common) or "none") + ".")
    md.append("")
    md.append("## Settings (task-averaged)")
    md.append("")
    md.append("| method | setting | score % | 95% CI | strict % | tokens/step | NFE | output tokens | s/sample |")
    md.append("|---|---|---|---|---|---|---|---|---|")
    for s in settings:
        r = summary[s]
        ci = stats.fmt_ci(*r.get("score_ci", (float("nan"),) * 2))
        md.append(f"| {r['method']} | {s} | {_f(r['score'])} | {ci} | {_f(r['score_strict'])} | {_f(r['tps'], 2)} | "
                  f"{_f(r.get('nfe'))} | {_f(r.get('output_length'))} | {_f(r.get('time_s'), 4)} |")
    md.append("")
    if boot is not None and len(curves) > 1:
        md.append("## Differences between methods (AUP, paired bootstrap over examples)")
        md.append("")
        md.append("| method A | method B | AUP A - B | 95% CI | p | significant (5 %) |")
        md.append("|---|---|---|---|---|---|")
        names = list(curves)
        for i, a_ in enumerate(names):
            for b_ in names[i + 1:]:
                if curves[a_]["AUP"] is None or curves[b_]["AUP"] is None:
                    continue
                d = boot["AUP"][a_] - boot["AUP"][b_]
                lo, hi = stats.percentile_ci(d)
                p = _p_two_sided(d)
                md.append(f"| {a_} | {b_} | {curves[a_]['AUP'] - curves[b_]['AUP']:+.3f} | "
                          f"{stats.fmt_ci(lo, hi, digits=3)} | {p:.3f} | {'yes' if p < 0.05 else 'no'} |")
        md.append("")
    incomplete = False

    def cell_text(attr: str, digits: int):
        def text(s_: str, t: str) -> str:
            nonlocal incomplete
            c = cells.get((s_, t))
            if c is None:
                return ""
            v = getattr(c, attr)
            out = "n/a" if v is None else _f(v, digits)
            if c.n < max_n[t]:
                out += "*"
                incomplete = True
            return out
        return text

    for title_, attr, digits in (("Score (%) by task", "score", 1), ("Tokens per step by task", "tps", 2)):
        _task_table(md, title_, settings, tasks, cell_text(attr, digits),
                    average=[_f(summary[s][attr], digits) for s in settings])
    per_cell: dict[tuple[str, str], list[float]] = {}
    for line in lines:
        if "error" not in line and line.get("score") is not None:
            per_cell.setdefault((_curve_name(line)[1], line["task"]), []).append(float(line["score"]))
    _task_table(md, "Score 95% CI by task", settings, tasks,
                lambda s_, t: stats.fmt_ci(*stats.mean_ci(per_cell[(s_, t)]), digits=0, scale=100)
                if (s_, t) in per_cell else "",
                note="Wilson interval for 0/1 scores, percentile bootstrap otherwise (percent).")
    if incomplete:
        md.append("`*` fewer samples than the other settings of that task (an unfinished run).")
        md.append("")
    if excluded or needs_data:
        md.append("## Not in the averages")
        md.append("")
        for t, why in excluded.items():
            comps = {}
            for s in settings:
                c = cells.get((s, t))
                if c is not None:
                    for name, v in c.components.items():
                        comps.setdefault(name, []).append(f"{s}: {v:.1f}")
            extra = "".join(f"; {name} % - " + ", ".join(v) for name, v in comps.items())
            md.append(f"- {t}: {why}{extra}")
        for t, why in (needs_data or {}).items():
            if t not in excluded:
                md.append(f"- {t}: needs data ({why})")
        md.append("")
    plots: list[Path] = []
    note = ""
    if plot_dir is not None:
        plots, note = _plot(curves, cells, settings_curve, tasks, Path(plot_dir))
    md.append("## Plot")
    md.append("")
    if plots:
        md += [f"![{p.stem}]({p.name})" for p in plots]
    else:
        md.append(note or "plot not written (plotting was turned off)")
    md.append("")
    md.append("## Definitions")
    md.append("")
    md.append("- tokens per step = gen_length / NFE per sample (EOS padding counts, as in ParallelBench), "
              "averaged over samples, then over tasks.")
    md.append("- PBx = the highest task-averaged tokens per step among a method's settings whose task-averaged "
              "score is >= x %; (interp.) = the same on the piecewise-linear curve through the settings sorted "
              "by tokens per step. '-' = no setting reaches x %.")
    md.append(f"- 95% CI: percentile bootstrap over the examples of each common task ({stats.RESAMPLES} resamples, "
              f"seed {stats.SEED}; every setting resamples the same examples, so differences are paired); p: twice "
              "the smaller share of resampled differences on either side of 0.")
    md.append("- AUP = s1*r1 + sum over consecutive settings (r_i - r_{i-1}) * (s_i + s_{i-1}) / 2, with "
              "scores s as fractions and settings sorted by tokens per step r (trapezoid area under the curve, "
              "the first point extended to r = 0).")
    md.append("")
    return Report("\n".join(md), summary, curves, common, excluded, plots, note)


def write_report(sources: Sequence[str | Path] | str | Path, out: str | Path | None = None, *,
                 plot: bool = True) -> Report:
    """Report on the sweeps in ``sources`` (directories or ``samples.jsonl`` files) written to ``out``
    (default ``<first source>/report.md``) with the plots beside it."""
    srcs = [sources] if isinstance(sources, (str, Path)) else list(sources)
    if not srcs:
        raise ValueError("give at least one sweep directory")
    lines: list[dict] = []
    needs: dict[str, str] = {}
    for src in srcs:
        lines += load_samples(src)
        run = Path(src) / RUN_FILE if Path(src).is_dir() else Path(src).parent / RUN_FILE
        info = read_run_file(run) or {}
        if not isinstance(info.get("needs_data", {}), dict):
            raise ValueError(f"{run}: 'needs_data' must map task names to reasons; rerun the sweep")
        needs.update(info.get("needs_data", {}))
    first = Path(srcs[0])
    out_path = Path(out) if out is not None else (first if first.is_dir() else first.parent) / "report.md"
    report = build_report(lines, plot_dir=out_path.parent if plot else None, sources=[str(s) for s in srcs],
                          needs_data=needs)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(report.markdown, encoding="utf-8")
    return report
