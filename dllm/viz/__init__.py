"""Trajectory pictures of a generation: which position was committed at which step, how confidently.

Every function takes a :class:`dllm.generate.GenerateOutput` (one row of it, ``row``; ``tokenizer=`` the model's
tokenizer for token text, else ids are shown) and reads
``stats.commit_step`` (the step each generated position was committed at), ``stats.commit_conf`` (its
probability, when generated with ``record_confidence=True``) and ``stats.trace`` (region bounds per step, early
commits, cache refreshes, AdaBlock's block decisions).

Every picture carries a caption and a legend. The caption reads what the output itself records (generation
length, block layout, steps, NFE, tokens per forward) plus what ``info=`` gives: ``prompt``, ``model``,
``sampler``, ``params`` (the sampler parameters set away from their defaults) and ``cache`` (see
:func:`run_info`). The legend explains every encoding the picture uses: the commit-step colour scale, the
confidence bar and its scale, block starts, and, where present, early commits (Prophet, a guided row's EOS),
steps with a full cache refresh and blocks AdaBlock closed at a delimiter.

Positions are laid out in lines of at most ``width`` positions, broken at block boundaries (a block longer than
``width`` is cut into lines of ``width``); each cell shows the whole token (wrapped; special tokens by name, e.g.
``<endoftext>``), the step it was committed at and its position on the axis under the line.

* :func:`heatmap` -> PNG of one generation.
* :func:`animate` -> GIF: the canvas filling in, one frame per step (Pillow writer).
* :func:`html` -> a self-contained page (inline CSS/JS, no network) with a step slider (``?step=K`` sets it), a
  tooltip and a side panel with each position's whole token, step and probability.
* :func:`compare` -> PNG, and :func:`compare_html` -> page: several generations of the same prompt (e.g.
  ``llada`` against ``fast-dllm``) on one colour scale, one panel each, with the commits per step of each run.
* :func:`render` picks by the file extension (``.png``, ``.gif``, ``.html``); :func:`render_compare` for
  ``.png`` / ``.html``.

matplotlib and Pillow are needed for PNG and GIF (``pip install "dllm[viz]"``); the page needs neither.
"""

from __future__ import annotations

import html as _html
import json
import math
from pathlib import Path

__all__ = ["animate", "caption", "compare", "compare_html", "heatmap", "html", "render", "render_compare",
           "run_info", "trajectory"]


# --------------------------------------------------------------------------------------------------- data


def trajectory(out, row: int = 0, tokenizer=None) -> dict:
    """The data every picture draws, for one row: ``tokens`` (decoded text per generated position), ``labels``
    (what a cell shows: the text with newlines and tabs made visible, special tokens by name), ``special``
    (whether a position holds a special token), ``ids``, ``step`` (commit step, -1 never), ``conf``
    (probability at commit or None), ``steps`` (the row's steps), ``starts`` (generation offsets where a region
    began), ``early`` (steps with an early commit), ``refresh`` (steps with a full cache refresh), ``delim``
    (offsets where a block begins because AdaBlock ended the one before at a delimiter), ``nfe`` (the row's
    forwards), ``tpf`` (its tokens per forward), ``counts`` (positions committed at each step 1..``steps``;
    index 0 unused) and ``ran`` (``{"sampler": name, "cache": name}``: what ``generate`` resolved and ran, from
    ``stats.sampler`` / ``stats.cache``; empty for outputs that do not record it)."""
    stats = getattr(out, "stats", None)
    if stats is None or not hasattr(stats, "commit_step"):
        raise TypeError(f"out is a {type(out).__name__}, which records no commit steps; pass the GenerateOutput of "
                        "dllm.generate (block-diffusion styles run by dllm.blockdiff have no trajectory record)")
    if not stats.commit_step:
        raise ValueError("this output has no commit_step record; generate it with this version of dllm.generate")
    if not 0 <= row < len(stats.commit_step):
        raise ValueError(f"row {row} is out of range; the output has {len(stats.commit_step)} rows")
    ids = out.sequences[row].tolist()
    step = stats.commit_step[row]
    conf = stats.commit_conf[row] if stats.commit_conf else [None] * len(ids)
    conf = [None if c is None or (isinstance(c, float) and math.isnan(c)) else c for c in conf]
    P = out.prompt_lengths and max(out.prompt_lengths)
    P = (stats.trace[0]["lo"][row] if stats.trace and "lo" in stats.trace[0] else P) or 0
    starts = _block_starts(stats.trace, row, P, len(ids), getattr(stats, "block_length", 0) or 0)
    early = [i + 1 for i, rec in enumerate(stats.trace) if rec.get("early_commit") and rec["early_commit"][row]]
    ran_cache = getattr(stats, "cache", "")
    # the cache that ran, where the output records it (a cached run whose every step is a full refresh still
    # refreshes); else the refresh layers tell (NoCache recomputes every step: layer 0 throughout)
    cached = (ran_cache != "none") if ran_cache else any(rec.get("refresh_layer", 0) != 0 for rec in stats.trace)
    refresh = [i + 1 for i, rec in enumerate(stats.trace) if cached and i > 0 and rec.get("refresh_layer") == 0]
    delim = sorted({rec["hi"][row] - P for rec in stats.trace  # AdaBlock ended a block at a delimiter
                    if rec.get("delimiter_block") and rec["delimiter_block"][row]
                    and 0 < rec["hi"][row] - P < len(ids)})
    nfe = stats.row_nfe[row] if stats.row_nfe and row < len(stats.row_nfe) else stats.nfe
    tokens, labels, special = _token_texts(tokenizer, ids)
    steps = max(max(step), 1)
    counts = [0] * (steps + 1)
    for s in step:
        if s > 0:
            counts[s] += 1
    return {"tokens": tokens, "labels": labels, "special": special, "ids": ids, "step": step, "conf": conf,
            "steps": steps, "starts": starts, "early": early, "refresh": refresh, "delim": delim,
            "nfe": nfe, "tpf": len(ids) / max(nfe, 1), "counts": counts,
            "ran": {k: v for k in ("sampler", "cache") if (v := getattr(stats, k, ""))}}


def _block_starts(trace: list, row: int, P: int, n: int, fixed: int = 0) -> list[int]:
    """Generation offsets where a block begins. ``fixed`` (the output's ``stats.block_length``): the run's fixed
    block length, every block on its grid (a step's region may span more: Prophet's early commit decodes the rest of
    the generation at once). Otherwise where a region that ran began; when every region that ran is a block of one
    length ``L`` on the grid of ``L`` (the last may be cut by the generation's end), the blocks that never ran as a
    region (the row finished early: EOS early stop, an early commit) begin on that grid too."""
    if fixed > 0:
        return list(range(0, n, fixed))
    starts = sorted({rec["lo"][row] - P for rec in trace if "lo" in rec and 0 <= rec["lo"][row] - P < n})
    regions = sorted({(rec["lo"][row] - P, rec["hi"][row] - P) for rec in trace if "lo" in rec and "hi" in rec})
    if not regions or any(lo < 0 or hi > n or hi <= lo for lo, hi in regions):
        return starts
    sizes = {hi - lo for lo, hi in regions if hi < n} or {hi - lo for lo, hi in regions}
    if len(sizes) != 1:
        return starts
    (L,) = sizes
    if all(lo % L == 0 and (hi - lo == L or hi == n) for lo, hi in regions):
        return list(range(0, n, L))
    return starts


def _token_texts(tok, ids: list[int]) -> tuple[list[str], list[str], list[bool]]:
    if tok is None:
        return [str(i) for i in ids], [str(i) for i in ids], [False] * len(ids)
    specials = set(getattr(tok, "all_special_ids", None) or [])
    tokens, labels, special = [], [], []
    for i in ids:
        text = tok.decode([i])
        tokens.append(text)
        if i in specials:
            name = text.strip() or str(i)
            if name.startswith("<|") and name.endswith("|>"):
                name = name[2:-2]
            labels.append(f"<{name.strip('<>')}>")
            special.append(True)
        else:
            shown = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
            labels.append(shown if shown.strip() else "␣" * max(1, len(shown)))
            special.append(False)
    return tokens, labels, special


def run_info(prompt=None, model=None, sampler=None, params: dict | None = None, cache=None, **extra) -> dict:
    """The ``info=`` of a picture: the prompt (a string, a conversation or token ids), the model (a name or
    path), the sampler (a name or object) with ``params`` (the parameters set away from the defaults) and the
    cache; ``extra`` items are shown as ``key value``."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content", "")
    elif isinstance(prompt, list):
        prompt = f"{len(prompt)} token ids"
    if sampler is not None and not isinstance(sampler, str):
        sampler = getattr(sampler, "name", None) or type(sampler).__name__
    if cache is not None and not isinstance(cache, str):
        cache = getattr(cache, "name", None) or type(cache).__name__
    info = {"prompt": prompt, "model": None if model is None else str(model), "sampler": sampler,
            "params": dict(params or {}), "cache": cache, **extra}
    return {k: v for k, v in info.items() if v is not None}


def _short(text: str, n: int) -> str:
    text = text.replace("\r", "").replace("\n", " ↵ ")
    return text if len(text) <= n else text[: n - 1] + "…"


def _layout(t: dict) -> str:
    n = len(t["tokens"])
    bounds = [*t["starts"], n] if t["starts"] and t["starts"][0] == 0 else [0, *t["starts"], n]
    sizes = sorted({b - a for a, b in zip(bounds, bounds[1:]) if b > a})
    if len(sizes) <= 1:
        blocks = f"block {sizes[0] if sizes else n}"
    else:
        blocks = f"blocks of {sizes[0]}-{sizes[-1]} ({len(bounds) - 1} blocks)"
    return f"gen {n} / {blocks} / {t['steps']} steps"


def caption(t: dict, info: dict | None = None, label: str = "") -> list[str]:
    """The caption lines of one trajectory (``t`` from :func:`trajectory`, ``info`` from :func:`run_info`):
    the prompt (shortened), then model, sampler with its non-default parameters and cache, then generation /
    block length, steps, NFE and tokens per forward. The sampler and the cache are those the output records as
    run (``t["ran"]``: a block-diffusion model's block cache, a preset's own cache), else ``info``'s; a cache is
    named when one ran, or when ``info`` names it."""
    info = info or {}
    ran = t.get("ran") or {}
    cache = ran.get("cache") or info.get("cache")
    info = {**info, "sampler": ran.get("sampler") or info.get("sampler"),
            "cache": cache if cache != "none" or info.get("cache") else None}
    lines = []
    if info.get("prompt"):
        lines.append(f"prompt: “{_short(str(info['prompt']), 90)}”")
    who = []
    if label:
        who.append(label)
    if info.get("model"):
        who.append(f"model {info['model']}")
    if info.get("sampler"):
        params = ", ".join(f"{k}={v}" for k, v in (info.get("params") or {}).items())
        who.append(f"sampler {info['sampler']}" + (f" ({params})" if params else " (defaults)"))
    if info.get("cache"):
        who.append(f"cache {info['cache']}")
    who += [f"{k} {v}" for k, v in info.items() if k not in ("prompt", "model", "sampler", "params", "cache")]
    if who:
        lines.append(" · ".join(who))
    lines.append(f"{_layout(t)} · NFE {t['nfe']} · {t['tpf']:.2f} tokens/forward · at most {max(t['counts'])} "
                 f"committed in one step")
    return lines


def _lines(t: dict, width: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: lines of at most ``width`` positions holding whole blocks (a longer block is cut)."""
    n = len(t["tokens"])
    bounds = sorted({0, *t["starts"], n})
    out: list[tuple[int, int]] = []
    for a, b in zip(bounds, bounds[1:]):
        if out and b - out[-1][0] <= width and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
            continue
        for lo in range(a, b, width):
            out.append((lo, min(b, lo + width)))
    return out or [(0, 0)]


def _viridis(S: int) -> list[str]:
    """The colour of steps 1..S (viridis), as hex."""
    from dllm.viz._palette import VIRIDIS

    cols = []
    for s in range(1, S + 1):
        x = (s - 1) / max(S - 1, 1) * (len(VIRIDIS) - 1)
        i = min(int(x), len(VIRIDIS) - 2)
        f = x - i
        rgb = [round(VIRIDIS[i][c] + f * (VIRIDIS[i + 1][c] - VIRIDIS[i][c])) for c in range(3)]
        cols.append("#" + "".join(f"{v:02x}" for v in rgb))
    return cols


def _ink(hexcol: str) -> str:
    """Black or white text, whichever reads on ``hexcol``."""
    r, g, b = (int(hexcol[i: i + 2], 16) / 255 for i in (1, 3, 5))
    return "#000000" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "#ffffff"


def _wrap(label: str, per_line: int, max_lines: int) -> str:
    parts = [label[i: i + per_line] for i in range(0, len(label), per_line)] or [""]
    if len(parts) > max_lines:
        parts = parts[:max_lines]
        parts[-1] = parts[-1][:-1] + "…"
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------------- arguments


def _check_width(width) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a whole number of cells per line, at least 1; got {width!r} (e.g. width=32)")


def _check_path(path, exts: tuple[str, ...], what: str) -> None:
    ext = Path(path).suffix.lower()
    if ext not in exts:
        raise ValueError(f"path {str(path)!r} has the extension {ext or 'none'!r}, but {what} writes "
                         f"{' or '.join(exts)}; name the file with {exts[0]!r}")


def _check_outs(outs) -> list:
    outs = list(outs)
    if not outs:
        raise ValueError("outs is empty: a comparison needs at least one output; pass a list of GenerateOutputs")
    return outs


# --------------------------------------------------------------------------------------------------- PNG / GIF


def _require_mpl():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError('trajectory pictures need matplotlib and Pillow: pip install "dllm[viz]"') from exc
    return plt


CELL_IN = 0.46  # inches per cell (and per vertical unit)
_PITCH = 1.75  # vertical units per line: cell 1.0, confidence track 0.2, position axis 0.55
_LEFT = 1.6  # units left of a line for its position range


def _box(x: float, y: float, w: float, h: float) -> list:
    return [(x, y), (x + w, y), (x + w, y + h), (x, y + h)]


def _draw(ax, t: dict, lines: list, width: int, S: int, upto: int | None = None) -> dict:
    """Draw one trajectory on ``ax`` in its ``lines`` (from :func:`_lines`) on a panel ``width`` cells wide (data
    units: one cell = 1; positions committed after step ``upto`` are shown as masks). Returns the artists, which
    :func:`_show_upto` updates for another step (one collection for the cells, one for the confidence bars: a
    long canvas draws in seconds)."""
    from matplotlib.collections import LineCollection, PolyCollection

    nl = len(lines)
    starts, refresh = set(t["starts"]), set(t["refresh"])
    n = len(t["tokens"])
    cells, tracks, bars, ticks, texts, nums, marks, spans = [], [], [], [], [], [], {}, []
    for li, (lo, hi) in enumerate(lines):
        y = (nl - 1 - li) * _PITCH + 0.75  # bottom of the cells of this line
        ax.text(-0.25, y + 0.5, f"pos\n{lo}–{hi - 1}", ha="right", va="center", fontsize=6, color="0.25")
        for i in range(lo, hi):
            x = i - lo
            # all that the cell's step changes (see _frames), its red outline's edge included
            spans.append((x - 0.1 * (i == lo), y - 0.24, x + 1 + 0.1 * (i == hi - 1), y + 1.1))
            cells.append(_box(x + 0.03, y, 0.94, 1.0))
            tracks.append(_box(x + 0.03, y - 0.22, 0.94, 0.16))
            bars.append(_box(x + 0.03, y - 0.22, 0.94 * (t["conf"][i] or 0.0), 0.16))
            texts.append(ax.text(x + 0.5, y + 0.6, "", ha="center", va="center", fontsize=5.2, linespacing=0.95))
            nums.append(ax.text(x + 0.93, y + 0.05, "", ha="right", va="bottom", fontsize=4.6))
            if t["step"][i] in refresh:
                marks[i] = ax.text(x + 0.07, y + 0.97, "↻", ha="left", va="top", fontsize=5.5, fontweight="bold")
            if i % 4 == 0 or i == hi - 1:
                ax.text(x + 0.5, y - 0.32, str(i), ha="center", va="top", fontsize=5, color="0.3")
                ticks.append([(x + 0.5, y - 0.3), (x + 0.5, y - 0.26)])
            if i in starts or i == 0:
                delim = i in t["delim"]
                ax.plot([x, x], [y - 0.25, y + 1.08], color="#d95f02" if delim else "black",
                        linewidth=2.2, linestyle=(0, (2, 1)) if delim else "solid", solid_capstyle="butt")
            elif i == lo:  # a long block wrapped onto this line: a thin dotted cut edge, no block start
                ax.plot([x, x], [y - 0.25, y + 1.08], color="0.6", linewidth=0.8, linestyle=(0, (1, 1.5)))
    ax.add_collection(PolyCollection(tracks, facecolors="0.88", linewidths=0))
    ax.add_collection(LineCollection(ticks, colors="0.3", linewidths=0.5))
    art = {"cells": ax.add_collection(PolyCollection(cells, linewidths=0)),
           "bars": ax.add_collection(PolyCollection(bars, linewidths=0)), "texts": texts, "nums": nums,
           "marks": marks, "n": n, "spans": spans, "ax": ax}
    ax.set_xlim(-_LEFT, width + 0.1)
    ax.set_ylim(0, nl * _PITCH)
    ax.axis("off")
    _show_upto(t, art, S, upto)
    return art


def _show_upto(t: dict, art: dict, S: int, upto: int | None) -> None:
    cols = _viridis(S)
    early = set(t["early"])
    face, edge, lw, barface = [], [], [], []
    for i, (lab, s, c, sp) in enumerate(zip(t["labels"], t["step"], t["conf"], t["special"])):
        shown = s >= 0 and (upto is None or s <= upto)
        col = cols[min(s, S) - 1] if shown else "#e6e6e6"
        ink = _ink(col) if shown else "#8c8c8c"
        face.append(col)
        edge.append("#e41a1c" if shown and s in early else col)
        lw.append(1.6 if shown and s in early else 0)
        barface.append("#222222" if shown and c is not None else "none")
        text, num = art["texts"][i], art["nums"][i]
        text.set_text(_wrap(lab, 9 if len(lab) <= 9 else 12, 3) if shown else "")
        text.set_fontsize(5.2 if not shown or len(lab) <= 9 else 4.3)
        text.set_style("italic" if shown and sp else "normal")
        text.set_color(ink)
        num.set_text(str(s) if shown else "")
        num.set_color(ink)
        if i in art["marks"]:
            art["marks"][i].set_visible(shown)
            art["marks"][i].set_color(ink)
    art["cells"].set_facecolors(face)
    art["cells"].set_edgecolors(edge)
    art["cells"].set_linewidths(lw)
    art["bars"].set_facecolors(barface)


def _legend(ax, ts: list, S: int, width: int) -> None:
    """The legend, drawn in data units of one cell like the panels."""
    from matplotlib.patches import Rectangle

    cols = _viridis(S)
    ax.axis("off")
    ax.set_xlim(-_LEFT, width + 0.1)
    ax.set_ylim(0, 3.2)
    # commit-step colour scale
    n = min(S, 64)
    span = min(width * 0.5, 16.0)
    x0 = 0.0
    ax.text(x0, 2.95, "colour = step the position was committed at (its number in the cell's corner)",
            fontsize=6.5, va="top")
    for k in range(n):
        s = 1 + round(k * (S - 1) / max(n - 1, 1))
        ax.add_patch(Rectangle((x0 + k * span / n, 1.85), span / n, 0.55, facecolor=cols[s - 1], linewidth=0))
    for s in sorted({1, (S + 1) // 2, S}):
        xs = x0 + ((s - 1) / max(S - 1, 1)) * (span - span / n) + span / n / 2
        ax.text(xs, 1.8, f"step {s}", ha="center", va="top", fontsize=5.5)
    # confidence bar and its scale
    cx = x0 + span + 1.5
    ax.text(cx, 2.95, "bar under a cell = p(token) when committed", fontsize=6.5, va="top")
    ax.add_patch(Rectangle((cx, 2.05), 4.0, 0.2, facecolor="0.88", linewidth=0))
    ax.add_patch(Rectangle((cx, 2.05), 2.8, 0.2, facecolor="#222222", linewidth=0))
    for v in (0, 0.5, 1):
        ax.plot([cx + 4 * v] * 2, [1.95, 2.05], color="0.3", linewidth=0.5)
        ax.text(cx + 4 * v, 1.9, f"{v:g}", ha="center", va="top", fontsize=5.5)
    if all(c is None for t in ts for c in t["conf"]):
        ax.text(cx, 1.45, "(not recorded: record_confidence=False)", fontsize=5.5, va="top", color="0.4")
    # markers
    items = [("block", "black", "solid", "thick line = a block starts (its position is on the axis)")]
    if any(t["delim"] for t in ts):
        items.append(("block", "#d95f02", (0, (2, 1)),
                      "dashed orange line = AdaBlock ended the block before it at a delimiter"))
    if any(t["early"] for t in ts):
        items.append(("early", "#e41a1c", None, "red outline = committed by an early commit (Prophet, guided EOS)"))
    if any(t["refresh"] for t in ts):
        items.append(("refresh", None, None, "↻ = committed at a step with a full cache refresh"))
    items.append(("mask", None, None, "grey = not committed (yet)"))
    mx = cx + 6.5
    for k, (kind, colr, style, label) in enumerate(items):
        yy = 2.85 - k * 0.55
        if kind == "block":
            ax.plot([mx, mx], [yy - 0.35, yy + 0.05], color=colr, linewidth=2.2, linestyle=style)
        elif kind == "early":
            ax.add_patch(Rectangle((mx - 0.25, yy - 0.35), 0.5, 0.4, facecolor="white", edgecolor=colr,
                                   linewidth=1.6))
        elif kind == "refresh":
            ax.text(mx, yy - 0.15, "↻", ha="center", va="center", fontsize=7, fontweight="bold")
        else:
            ax.add_patch(Rectangle((mx - 0.25, yy - 0.35), 0.5, 0.4, facecolor="#e6e6e6", linewidth=0))
        ax.text(mx + 0.5, yy - 0.15, label, fontsize=6, va="center")


def _figure(plt, ts: list, infos: list, labels: list, width: int, S: int, head: str = "", upto: int | None = None):
    """A figure with a caption, one panel per trajectory (drawn by :func:`_draw`, showing step ``upto``) and the
    legend; returns ``(fig, artists)``, the artists of each panel."""
    lines = [_lines(t, width) for t in ts]
    cols = max(hi - lo for ls in lines for lo, hi in ls)
    width = max(cols, 30)  # room for the legend (its longest label ends 29 cells in)
    wu = _LEFT + width + 0.3  # width in units
    caps = [caption(t, info, label) for t, info, label in zip(ts, infos, labels)]
    shared = [ln for ln in caps[0] if ln.startswith("prompt:")] if len(ts) > 1 else []
    caps = [[ln for ln in cap if ln not in shared] for cap in caps]
    text_u = 0.42  # vertical units per caption line
    heights = [(len(shared) + (1 if head else 0)) * text_u + 0.2]
    for ls, cap in zip(lines, caps):
        heights += [len(cap) * text_u + 0.15, len(ls) * _PITCH]
    heights.append(3.1)
    hu = sum(heights)
    fig = plt.figure(figsize=(wu * CELL_IN, hu * CELL_IN))
    top = hu
    arts = []

    def box(h):
        nonlocal top
        top -= h
        return fig.add_axes([0, top / hu, 1, h / hu])

    ax = box(heights[0])
    ax.axis("off")
    head_lines = ([head] if head else []) + shared
    for k, ln in enumerate(head_lines):
        ax.text(0.012, 1 - (k + 0.5) / max(len(head_lines), 1) * 0.8, ln, fontsize=7.5 if k else 8.5,
                fontweight="bold" if k == 0 else "normal", va="center", transform=ax.transAxes)
    for t, ls, cap, hh in zip(ts, lines, caps, zip(heights[1::2], heights[2::2])):
        cax = box(hh[0])
        cax.axis("off")
        for k, ln in enumerate(cap):
            cax.text(0.012, 1 - (k + 0.6) / len(cap) * (1 - 0.15 / hh[0]), ln, fontsize=7,
                     fontweight="bold" if k == 0 and len(ts) > 1 else "normal", va="center", transform=cax.transAxes)
        arts.append(_draw(box(hh[1]), t, ls, width, S, upto))
    lax = box(heights[-1])
    _legend(lax, ts, S, width)
    return fig, arts


def heatmap(out, path, row: int = 0, width: int = 32, title: str = "", tokenizer=None, info: dict | None = None):
    """PNG of the commit steps of one row, with its caption and legend (see the module docstring). Returns
    ``path``."""
    _check_width(width)
    _check_path(path, (".png",), "heatmap")
    t = trajectory(out, row, tokenizer)
    plt = _require_mpl()
    fig, _ = _figure(plt, [t], [info], [""], width, t["steps"], head=title or "decoding trajectory")
    _save(fig, path)
    plt.close(fig)
    return path


def _save(fig, path) -> None:
    """PNG at 150 dpi; its ``Description`` holds every text drawn (caption and legend), for readers without
    sight of the picture, and no software version, so that the same run gives the same bytes."""
    texts = [t.get_text() for ax in fig.axes for t in ax.texts if t.get_text().strip()]
    fig.savefig(path, dpi=150, metadata={"Software": None, "Description": "\n".join(texts)})


def compare(outs, path, labels=None, row: int = 0, width: int = 32, tokenizer=None, infos=None, title: str = ""):
    """One PNG with the trajectories of several generations of the same prompt, one panel each, on one
    commit-step colour scale; each panel's caption gives its sampler, NFE and tokens per forward."""
    outs = _check_outs(outs)
    _check_width(width)
    _check_path(path, (".png",), "compare")
    plt = _require_mpl()
    ts, infos, labels = _runs(outs, labels, row, tokenizer, infos)
    S = max(t["steps"] for t in ts)
    fig, _ = _figure(plt, ts, infos, labels, width, S, head=title or "decoding trajectories compared")
    _save(fig, path)
    plt.close(fig)
    return path


def _runs(outs, labels, row, tokenizer, infos):
    labels = list(labels) if labels is not None else [f"run {i}" for i in range(len(outs))]
    if len(labels) != len(outs):
        raise ValueError(f"{len(labels)} labels for {len(outs)} outputs")
    infos = list(infos) if infos is not None else [None] * len(outs)
    if len(infos) != len(outs):
        raise ValueError(f"{len(infos)} infos for {len(outs)} outputs")
    return [trajectory(o, row, tokenizer) for o in outs], infos, labels


def animate(out, path, row: int = 0, width: int = 32, fps: int = 4, tokenizer=None, max_frames: int = 64,
            info: dict | None = None, title: str = ""):
    """Animated GIF of the canvas filling in: a frame shows what is committed after step ``k`` (the first: all
    masks; at most ``max_frames`` frames, evenly spaced steps, the last always included). Returns ``path``."""
    _check_width(width)
    _check_path(path, (".gif",), "animate")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise ValueError(f"fps must be a positive number of frames per second; got {fps!r} (e.g. fps=4)")
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 2:
        raise ValueError(f"max_frames must be a whole number of at least 2 (the first frame, all masks, and the "
                         f"last); got {max_frames!r} (e.g. max_frames=64)")
    t = trajectory(out, row, tokenizer)
    plt = _require_mpl()
    S = t["steps"]
    ks = sorted({round(i * S / (max_frames - 1)) for i in range(max_frames)}) if S + 1 > max_frames else range(S + 1)
    head = title or "decoding trajectory"
    fig, (art,) = _figure(plt, [t], [info], [""], width, S, head=_after(head, S, S), upto=0)
    try:
        frames = _frames(fig, t, art, S, list(ks), head)
        next(frames).save(str(path), save_all=True, append_images=frames, duration=round(1000 / fps), loop=0)
    finally:
        plt.close(fig)
    return path


_GIF_DPI = 100


def _after(head: str, k: int, S: int) -> str:
    return f"{head}: after step {k} of {S}"


def _drawing(fig, t: dict, art: dict, S: int, upto: int, header: str):
    """The whole figure drawn at the GIF's resolution, showing step ``upto`` under the header line ``header``: an RGB
    array. A frame drawn this way is the oracle of :func:`_frames`'s composed ones."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not isinstance(fig.canvas, FigureCanvasAgg):  # drawn into pixels whatever backend pyplot has chosen
        FigureCanvasAgg(fig)
    fig.set_dpi(_GIF_DPI)
    _show_upto(t, art, S, upto)
    fig.axes[0].texts[0].set_text(header)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def _frames(fig, t: dict, art: dict, S: int, ks: list[int], head: str, palette: bool = True):
    """The frames of :func:`animate`: the figure after each step of ``ks``, as palette images (``palette=False``:
    RGB arrays). The figure is drawn twice (:func:`_drawing`), every position masked and every position committed,
    both with an empty header; a frame is the first drawing with the cells committed by its step taken from the
    second (each cell's ``spans`` rectangle: its colour, text, step number, marks and confidence bar, nothing another
    cell draws) and its header line drawn alone. A drawing of a long canvas takes seconds; a frame, milliseconds.
    Every frame has the one palette made from both drawings (each pixel the index median cut gave it; the header
    lines' pixels the nearest colour's)."""
    import numpy as np
    from PIL import Image

    masked, full = _drawing(fig, t, art, S, 0, ""), _drawing(fig, t, art, S, S, "")
    canvas, head_ax = fig.canvas, fig.axes[0]
    empty_head = canvas.copy_from_bbox(head_ax.bbox)
    H = int(canvas.get_width_height()[1])
    (_, hy0), (_, hy1) = head_ax.bbox.get_points()
    head_rows = slice(max(0, math.floor(H - hy1)), min(H, math.ceil(H - hy0)))

    def rect(span):  # a cell's span in the buffer's rows (top first) and columns
        (x0, y0), (x1, y1) = art["ax"].transData.transform([span[:2], span[2:]])
        return slice(round(H - y1), round(H - y0)), slice(round(x0), round(x1))

    if palette:
        pal = Image.fromarray(np.concatenate([masked, full])).quantize(256, dither=Image.Dither.NONE)
        palette_rgb = pal.getpalette()
        colours = np.asarray(palette_rgb, dtype=np.int64).reshape(-1, 3)
        masked, full = np.split(np.asarray(pal), 2)

    def indices(rgb):  # the nearest palette colour of each pixel
        rgb = rgb.astype(np.int64)
        u, inv = np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2], return_inverse=True)
        u = np.stack([u >> 16, (u >> 8) & 255, u & 255], -1)
        return ((u[:, None] - colours[None]) ** 2).sum(-1).argmin(1).astype(np.uint8)[inv].reshape(rgb.shape[:2])

    order = sorted((s, i) for i, s in enumerate(t["step"]) if s >= 0)
    frame, nxt = masked.copy(), 0
    for k in ks:
        while nxt < len(order) and order[nxt][0] <= k:
            rows, cols = rect(art["spans"][order[nxt][1]])
            frame[rows, cols] = full[rows, cols]
            nxt += 1
        canvas.restore_region(empty_head)
        head_ax.texts[0].set_text(_after(head, k, S))
        head_ax.draw_artist(head_ax.texts[0])
        strip = np.asarray(canvas.buffer_rgba())[head_rows, :, :3]
        frame[head_rows] = indices(strip) if palette else strip
        if not palette:
            yield frame.copy()
            continue
        im = Image.fromarray(frame.copy(), "P")
        im.putpalette(palette_rgb)
        yield im


# --------------------------------------------------------------------------------------------------- HTML


def _page_data(ts, infos, labels) -> dict:
    S = max(t["steps"] for t in ts)
    cols = _viridis(S)
    runs = [{**t, "label": label, "caption": caption(t, info), "counts": t["counts"] + [0] * (S - t["steps"])}
            for t, info, label in zip(ts, infos, labels)]
    return {"steps": S, "colors": cols, "ink": [_ink(c) for c in cols], "runs": runs}


_CSS = """
body{font-family:system-ui,sans-serif;margin:1em 22em 1em 1em;color:#222}
h1{font-size:1.2em;margin:.2em 0} h2{font-size:1em;margin:1em 0 .2em}
.cap{margin:.1em 0;font-size:.9em} .cap.prompt{font-family:monospace;white-space:pre-wrap}
#legend{display:flex;flex-wrap:wrap;gap:.6em 2em;align-items:flex-start;font-size:.82em;border:1px solid #ccc;
 padding:.5em;margin:.6em 0;border-radius:4px}
#legend .item{display:flex;align-items:center;gap:.4em}
#scale{width:16em;height:1em;border-radius:2px} .ticks{display:flex;justify-content:space-between;width:16em}
.sw{display:inline-block;width:2.4em;height:1.2em;border-radius:2px;vertical-align:middle}
.line{display:flex;align-items:flex-start;margin:.25em 0 .5em} .blks{display:flex;flex-wrap:wrap;row-gap:.3em}
.ax{width:5.5em;font:10px monospace;color:#555;text-align:right;padding-right:.5em;padding-top:1em;flex:none}
.blk{display:flex;border-left:4px solid #000;padding-left:2px;margin-left:3px}
.blk.cut{border-left:1px dotted #999} .blk.delim{border-left:4px dashed #d95f02}
.cell{position:relative;flex:none;min-width:3.2em;max-width:7.5em;min-height:3.4em;margin:1px;padding:.9em .25em 1.5em;
 font:11px monospace;white-space:pre-wrap;word-break:break-all;text-align:center;border-radius:3px;
 box-sizing:border-box;cursor:pointer}
.cell .pos{position:absolute;left:2px;top:1px;font-size:8px;opacity:.75}
.cell .st{position:absolute;right:2px;bottom:5px;font-size:9px;font-weight:bold}
.cell .cf{position:absolute;left:0;bottom:0;height:4px;background:#222}
.cell .tr{position:absolute;left:0;right:0;bottom:0;height:4px;background:#d9d9d9}
.cell .rf{position:absolute;right:2px;top:0;font-size:10px;font-weight:bold}
.cell .mk{display:none;position:absolute;left:0;right:0;top:1.3em;font-style:italic}
.cell.m{background:#e6e6e6;color:#8c8c8c} .cell.m .tk{visibility:hidden} .cell.m .mk{display:block}
.cell.e{outline:2px solid #e41a1c;outline-offset:-2px}
.cell.sp .tk{font-style:italic} .cell.sel{box-shadow:0 0 0 2px #000}
.counts{display:flex;align-items:flex-end;height:40px;gap:1px;margin:.2em 0 0 6em}
.counts div{width:6px;background:#999} .counts div.now{background:#000}
#side{position:fixed;right:0;top:0;bottom:0;width:20em;overflow:auto;background:#f7f7f7;border-left:1px solid #ccc;
 padding:1em;font-size:.85em;box-sizing:border-box}
#side pre{white-space:pre-wrap;word-break:break-all;background:#fff;border:1px solid #ddd;padding:.3em}
"""

_JS = """
const R=D.runs,S=D.steps,sl=document.getElementById('step'),kk=document.getElementById('k');
function cellInfo(r,i){const t=R[r],s=t.step[i],p=t.conf[i];
 return 'position '+i+' · step '+(s<0?'never':s)+(p==null?'':' · p='+p.toFixed(3))+' · token '+
  JSON.stringify(t.tokens[i])+(t.special[i]?' (special, id '+t.ids[i]+')':' (id '+t.ids[i]+')')+
  (t.early.includes(s)?' · early commit':'')+(t.refresh.includes(s)?' · full cache refresh':'');}
function side(r,i){const t=R[r],s=t.step[i],p=t.conf[i];
 document.querySelectorAll('.cell.sel').forEach(c=>c.classList.remove('sel'));
 document.getElementById('c'+r+'_'+i).classList.add('sel');
 const el=document.getElementById('detail');el.innerHTML='';
 const add=(k,v)=>{const d=document.createElement('div');d.textContent=k+': '+v;el.appendChild(d);};
 if(R.length>1)add('run',t.label);add('position',i);add('committed at step',s<0?'never':s);
 add('p at commit',p==null?'not recorded':p.toFixed(4));add('token id',t.ids[i]+(t.special[i]?' (special token)':''));
 if(t.early.includes(s))add('early commit','yes');if(t.refresh.includes(s))add('full cache refresh','at this step');
 const pre=document.createElement('pre');pre.textContent=t.tokens[i];el.appendChild(pre);}
function build(){const host=document.getElementById('runs');
 R.forEach((t,r)=>{const sec=document.createElement('section');sec.className='run';
  if(R.length>1){const h=document.createElement('h2');h.textContent=t.label;sec.appendChild(h);}
  t.caption.forEach(c=>{if(R.length===1||c.startsWith('prompt:'))return;const p=document.createElement('p');
   p.className='cap';p.textContent=c;sec.appendChild(p);});
  const cnt=document.createElement('div');cnt.className='counts';cnt.title='positions committed per step';
  const mx=Math.max(...t.counts,1);
  for(let s=1;s<=S;s++){const b=document.createElement('div');b.style.height=(38*t.counts[s]/mx)+'px';
   b.title='step '+s+': '+t.counts[s]+' committed';cnt.appendChild(b);}
  sec.appendChild(cnt);
  const lab=document.createElement('div');lab.className='cap';lab.style.marginLeft='6em';
  lab.textContent='↑ positions committed at each step (one bar per step, 1 to '+S+')';sec.appendChild(lab);
  t.lines.forEach(([lo,hi])=>{const ln=document.createElement('div');ln.className='line';
   const ax=document.createElement('div');ax.className='ax';ax.textContent='pos '+lo+'–'+(hi-1);ln.appendChild(ax);
   const bs=document.createElement('div');bs.className='blks';ln.appendChild(bs);let blk=null;
   for(let i=lo;i<hi;i++){if(blk===null||t.starts.includes(i)){blk=document.createElement('div');
     blk.className='blk'+(t.delim.includes(i)?' delim':'')+(!t.starts.includes(i)&&i>0?' cut':'');bs.appendChild(blk);}
    const c=document.createElement('div');c.id='c'+r+'_'+i;c.className='cell';
    c.innerHTML='<span class="pos"></span><span class="tk"></span><span class="mk">mask</span><span class="st"></span>'+
     '<span class="tr"></span><span class="cf"></span><span class="rf"></span>';
    c.querySelector('.pos').textContent=i;c.querySelector('.tk').textContent=t.labels[i];c.title=cellInfo(r,i);
    c.addEventListener('mouseenter',()=>side(r,i));c.addEventListener('click',()=>side(r,i));blk.appendChild(c);}
   sec.appendChild(ln);});
  const done=document.createElement('p');done.className='cap done';sec.appendChild(done);
  host.appendChild(sec);});}
function show(n){n=Math.max(0,Math.min(S,n|0));kk.textContent=n;sl.value=n;sl.setAttribute('value',n);
 R.forEach((t,r)=>{let done=0;
  t.step.forEach((s,i)=>{const c=document.getElementById('c'+r+'_'+i),on=s>=0&&s<=n;
   c.dataset.committed=on?'1':'0';c.classList.toggle('m',!on);c.classList.toggle('sp',on&&t.special[i]);
   c.classList.toggle('e',on&&t.early.includes(s));
   c.style.background=on?D.colors[s-1]:'';c.style.color=on?D.ink[s-1]:'';
   c.querySelector('.st').textContent=on?s:'';
   const p=t.conf[i];c.querySelector('.cf').style.width=on&&p!=null?(100*p)+'%':'0';
   c.querySelector('.tr').style.display=on&&p!=null?'':'none';
   c.querySelector('.rf').textContent=on&&t.refresh.includes(s)?'↻':'';if(on)done++;});
  document.querySelectorAll('.run')[r].querySelector('.done').textContent=
   'after step '+n+': '+done+' of '+t.step.length+' positions committed';
  document.querySelectorAll('.run')[r].querySelectorAll('.counts div')
   .forEach((b,j)=>b.classList.toggle('now',j+1===n));});}
build();sl.addEventListener('input',()=>show(+sl.value));
const q=new URLSearchParams(location.search).get('step');show(q!==null&&q!==''?+q:S);
"""


def _page(ts, infos, labels, title: str, width: int) -> str:
    data = _page_data(ts, infos, labels)
    for run, t in zip(data["runs"], ts):
        run["lines"] = _lines(t, width)
    S = data["steps"]
    shared = [c for c in data["runs"][0]["caption"] if c.startswith("prompt:") or len(ts) == 1]
    grad = ", ".join(data["colors"][round(k * (S - 1) / 15)] for k in range(16)) if S > 1 else \
        f"{data['colors'][0]}, {data['colors'][0]}"
    ticks = "".join(f"<span>{s}</span>" for s in sorted({1, (S + 1) // 2, S}))
    legend = [
        f'<div class="item"><div><div id="scale" style="background:linear-gradient(to right, {grad})"></div>'
        f'<div class="ticks">{ticks}</div></div><div>colour = step the position was committed at<br>'
        f'(the bold number in the cell; steps 1 to {S})</div></div>',
        '<div class="item"><span class="sw" style="background:linear-gradient(to right,#222 70%,#d9d9d9 70%);'
        'height:4px"></span><div>bar at a cell\'s foot = p(token) when committed<br>(full cell width = 1.0; 70% '
        'shown)</div></div>',
        '<div class="item"><span class="sw" style="border-left:4px solid #000;background:#fff"></span>'
        '<div>thick left edge = a block starts</div></div>',
    ]
    if any(t["delim"] for t in ts):
        legend.append('<div class="item"><span class="sw" style="border-left:4px dashed #d95f02"></span>'
                      '<div>dashed orange edge = AdaBlock ended the block before it at a delimiter</div></div>')
    if any(t["early"] for t in ts):
        legend.append('<div class="item"><span class="sw" style="outline:2px solid #e41a1c;outline-offset:-2px">'
                      '</span><div>red outline = early commit (Prophet, guided EOS)</div></div>')
    if any(t["refresh"] for t in ts):
        legend.append('<div class="item"><b>↻</b><div>committed at a step with a full cache refresh</div></div>')
    legend.append('<div class="item"><span class="sw" style="background:#e6e6e6"></span><div>grey “mask” = not '
                  'committed yet · small number = position · <i>italic</i> = special token</div></div>')
    caps = "".join(f'<p class="cap{" prompt" if c.startswith("prompt:") else ""}">{_html.escape(c)}</p>'
                   for c in shared)
    # every <, > and & of the data as a JSON escape: no "</script", "<!--" or "<script" can reach the HTML parser
    # (a "<!--" followed by "<script" in a token would swallow the rest of the page)
    blob = json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    script = "const D=" + blob + ";\n" + _JS
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>{_html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body>\n<h1>{_html.escape(title)}</h1>{caps}\n"
            f'<div id="legend">{"".join(legend)}</div>\n'
            f'<label>after step <input id="step" type="range" min="0" max="{S}" value="{S}"> '
            f'<span id="k">{S}</span> / {S}</label> (drag, or open the page with ?step=K)\n'
            f'<div id="runs"></div>\n<aside id="side"><h2>position details</h2><p>Point at a cell to see its '
            f'whole token, step and probability.</p><div id="detail"></div></aside>\n'
            f"<script>\n{script}</script></body></html>\n")


def html(out, path, row: int = 0, title: str = "", tokenizer=None, info: dict | None = None, width: int = 32):
    """Self-contained HTML page (no network) with the caption, the legend, a step slider over the canvas
    (``?step=K`` in the URL sets it) and a side panel with the pointed position's whole token. Returns
    ``path``."""
    _check_width(width)
    t = trajectory(out, row, tokenizer)
    head = title or "Decoding trajectory" + (f" — {info['sampler']}" if info and info.get("sampler") else "")
    Path(path).write_text(_page([t], [info], [""], head, width), encoding="utf-8")
    return path


def compare_html(outs, path, labels=None, row: int = 0, tokenizer=None, infos=None, title: str = "",
                 width: int = 32):
    """:func:`compare` as a self-contained page: one step slider moves every run."""
    outs = _check_outs(outs)
    _check_width(width)
    ts, infos, labels = _runs(outs, labels, row, tokenizer, infos)
    head = title or "Decoding trajectories compared: " + " vs ".join(labels)
    Path(path).write_text(_page(ts, infos, labels, head, width), encoding="utf-8")
    return path


def render(out, path, **kw):
    """:func:`heatmap`, :func:`animate` or :func:`html` by the extension of ``path``."""
    ext = Path(path).suffix.lower()
    fn = {".png": heatmap, ".gif": animate, ".html": html, ".htm": html}.get(ext)
    if fn is None:
        raise ValueError(f"unknown picture type {ext!r} for {path}; use .png, .gif or .html")
    return fn(out, path, **kw)


def render_compare(outs, path, **kw):
    """:func:`compare` or :func:`compare_html` by the extension of ``path``."""
    ext = Path(path).suffix.lower()
    fn = {".png": compare, ".html": compare_html, ".htm": compare_html}.get(ext)
    if fn is None:
        raise ValueError(f"unknown comparison picture type {ext!r} for {path}; use .png or .html")
    return fn(outs, path, **kw)
