"""Trajectory pictures of a generation: which position was committed at which step, how confidently.

Every function takes a :class:`dllm.generate.GenerateOutput` (one row of it, ``row``; ``tokenizer=`` the model's
tokenizer for token text, else ids are shown) and reads
``stats.commit_step`` (the step each generated position was committed at), ``stats.commit_conf`` (its
probability, when generated with ``record_confidence=True``) and ``stats.trace`` (region bounds per step, early
commits, cache refreshes). Long canvases wrap into lines of ``width`` positions.

* :func:`heatmap` -> PNG: a grid of the generated positions, colour = commit step, text = token, a bar under
  each cell = confidence at commit; block / region starts as vertical lines, early commits outlined in red,
  steps with a full cache refresh listed in the title.
* :func:`animate` -> GIF: the canvas filling in, one frame per step (Pillow writer).
* :func:`html` -> a self-contained page (inline CSS/JS, no network) with a step slider and the token text.
* :func:`compare` -> PNG: several generations of the same prompt stacked (e.g. llada vs threshold vs localleap).
* :func:`render` picks by the file extension (``.png``, ``.gif``, ``.html``).

matplotlib and Pillow are needed (``pip install "dllm[viz]"``).
"""

from __future__ import annotations

import html as _html
import json
import math
from pathlib import Path

__all__ = ["animate", "compare", "heatmap", "html", "render", "trajectory"]


def trajectory(out, row: int = 0, tokenizer=None) -> dict:
    """The data every picture draws, for one row: ``tokens`` (text per generated position), ``step`` (commit
    step, -1 never), ``conf`` (probability at commit or None), ``steps`` (the row's steps), ``starts`` (generation
    offsets where a region began), ``early`` (steps with an early commit) and ``refresh`` (steps with a full
    cache refresh)."""
    stats = out.stats
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
    starts = sorted({rec["lo"][row] - P for rec in stats.trace if "lo" in rec and 0 <= rec["lo"][row] - P < len(ids)})
    early = [i + 1 for i, rec in enumerate(stats.trace) if rec.get("early_commit") and rec["early_commit"][row]]
    cached = any(rec.get("refresh_layer", 0) != 0 for rec in stats.trace)  # NoCache recomputes every step
    refresh = [i + 1 for i, rec in enumerate(stats.trace) if cached and i > 0 and rec.get("refresh_layer") == 0]
    return {"tokens": _token_texts(tokenizer, ids), "step": step, "conf": conf, "steps": max(max(step), 1),
            "starts": starts, "early": early, "refresh": refresh}


def _token_texts(tok, ids: list[int]) -> list[str]:
    if tok is None:
        return [str(i) for i in ids]
    return [tok.decode([i]) for i in ids]


def _require_mpl():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError('trajectory pictures need matplotlib and Pillow: pip install "dllm[viz]"') from exc
    return plt


def _draw(ax, t: dict, width: int, upto: int | None = None, title: str = "") -> list:
    """Draw one trajectory on ``ax`` (positions committed after step ``upto`` are shown as masks). Returns the
    per-position ``(cell, bar, text)`` artists, which :func:`_show_upto` updates for another step."""
    from matplotlib.patches import Rectangle

    n = len(t["tokens"])
    rows = max(1, math.ceil(n / width))
    artists = []
    for i in range(n):
        r, col = divmod(i, width)
        y = rows - 1 - r
        cell = ax.add_patch(Rectangle((col, y), 1, 1, linewidth=1.2))
        c = t["conf"][i]
        bar = ax.add_patch(Rectangle((col + 0.05, y + 0.05), 0.9 * (c or 0.0), 0.1, facecolor="white", linewidth=0))
        text = ax.text(col + 0.5, y + 0.55, "", ha="center", va="center", fontsize=6)
        artists.append((cell, bar, text))
    for st in t["starts"]:
        r, col = divmod(st, width)
        ax.plot([col, col], [rows - 1 - r, rows - r], color="black", linewidth=2)
    ax.set_xlim(0, width)
    ax.set_ylim(0, rows)
    ax.set_xticks([])
    ax.set_yticks([])
    _show_upto(ax, t, artists, upto, title)
    return artists


def _show_upto(ax, t: dict, artists: list, upto: int | None, title: str = "") -> None:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    S = t["steps"]
    early = set(t["early"])
    for (cell, bar, text), tok, s, c in zip(artists, t["tokens"], t["step"], t["conf"]):
        shown = s >= 0 and (upto is None or s <= upto)
        cell.set_facecolor(cmap((s - 1) / max(S - 1, 1)) if shown else (0.92, 0.92, 0.92, 1.0))
        cell.set_edgecolor("red" if shown and s in early else "white")
        bar.set_visible(shown and c is not None)
        text.set_text((tok.replace("\n", "\\n").strip() or "·")[:6] if shown else "▒")
        text.set_color("white" if shown else "0.5")
    refresh = f"; full cache refresh at steps {t['refresh'][:12]}" if t["refresh"] else ""
    head = f"{title}: " if title else ""
    ax.set_title(f"{head}{len(t['tokens'])} positions, {S} steps{refresh}", fontsize=8)


def _figure(plt, rows: int, width: int, panels: int = 1):
    fig, axes = plt.subplots(panels, 1, figsize=(max(4.0, width * 0.42), 0.5 + panels * (0.45 * rows + 0.7)),
                             squeeze=False)
    fig.subplots_adjust(hspace=0.5)
    return fig, axes


def heatmap(out, path, row: int = 0, width: int = 32, title: str = "", tokenizer=None):
    """PNG of the commit steps of one row (see the module docstring). Returns ``path``."""
    plt = _require_mpl()
    t = trajectory(out, row, tokenizer)
    rows = max(1, math.ceil(len(t["tokens"]) / width))
    fig, axes = _figure(plt, rows, width)
    _draw(axes[0, 0], t, width, title=title)
    _colorbar(plt, fig, axes[0, 0], t["steps"])
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _colorbar(plt, fig, ax, steps: int) -> None:
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    sm = ScalarMappable(norm=Normalize(1, max(steps, 2)), cmap=colormaps["viridis"])
    fig.colorbar(sm, ax=ax, orientation="horizontal", fraction=0.05, pad=0.02, label="commit step")


def compare(outs, path, labels=None, row: int = 0, width: int = 32, tokenizer=None):
    """One PNG with the trajectories of several generations of the same prompt, one panel each."""
    plt = _require_mpl()
    outs = list(outs)
    labels = list(labels) if labels is not None else [f"run {i}" for i in range(len(outs))]
    if len(labels) != len(outs):
        raise ValueError(f"{len(labels)} labels for {len(outs)} outputs")
    ts = [trajectory(o, row, tokenizer) for o in outs]
    rows = max(max(1, math.ceil(len(t["tokens"]) / width)) for t in ts)
    fig, axes = _figure(plt, rows, width, len(ts))
    for ax, t, label in zip(axes[:, 0], ts, labels):
        _draw(ax, t, width, title=label)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def animate(out, path, row: int = 0, width: int = 32, fps: int = 4, tokenizer=None, max_frames: int = 64):
    """Animated GIF of the canvas filling in: a frame shows what is committed after step ``k`` (the first: all
    masks; at most ``max_frames`` frames, evenly spaced steps, the last always included). Returns ``path``."""
    plt = _require_mpl()
    from matplotlib.animation import FuncAnimation, PillowWriter

    t = trajectory(out, row, tokenizer)
    rows = max(1, math.ceil(len(t["tokens"]) / width))
    fig, axes = _figure(plt, rows, width)
    ax = axes[0, 0]

    artists = _draw(ax, t, width, upto=0, title="step 0")

    def frame(k):
        _show_upto(ax, t, artists, k, title=f"step {k}")

    S = t["steps"]
    ks = sorted({round(i * S / (max_frames - 1)) for i in range(max_frames)}) if S + 1 > max_frames else range(S + 1)
    anim = FuncAnimation(fig, frame, frames=list(ks))
    anim.save(str(path), writer=PillowWriter(fps=fps), dpi=80)
    plt.close(fig)
    return path


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title><style>
body{{font-family:sans-serif;margin:1em}} #grid{{display:flex;flex-wrap:wrap;max-width:{px}px}}
.c{{width:4.2em;height:2.2em;margin:1px;font:11px monospace;display:flex;align-items:center;justify-content:center;
overflow:hidden;white-space:pre;border-radius:3px}} .m{{background:#ddd;color:#999}} .s{{border-left:3px solid #000}}
.e{{outline:2px solid red}}</style></head><body><h3>{title}</h3>
<label>step <input id="step" type="range" min="0" max="{steps}" value="{steps}"> <span id="k">{steps}</span> / {steps}</label>
<div id="grid"></div><p id="info"></p>
<script>
const T={data};
const g=document.getElementById('grid'),s=document.getElementById('step'),k=document.getElementById('k');
function col(v){{const h=240-200*(v-1)/Math.max(T.steps-1,1);return 'hsl('+h+',70%,45%)';}}
function show(n){{k.textContent=n;g.innerHTML='';let done=0;
 T.tokens.forEach((t,i)=>{{const d=document.createElement('div');const st=T.step[i];
  d.className='c'+(T.starts.includes(i)?' s':'');
  if(st>=0&&st<=n){{done++;d.style.background=col(st);d.style.color='#fff';d.textContent=t.replace(/\\n/g,'\\\\n')||'·';
   d.title='position '+i+', step '+st+(T.conf[i]==null?'':', p='+T.conf[i].toFixed(3));
   if(T.early.includes(st))d.className+=' e';}}
  else{{d.className+=' m';d.textContent='[mask]';d.title='position '+i;}}
  d.dataset.committed=(st>=0&&st<=n)?'1':'0';g.appendChild(d);}});
 document.getElementById('info').textContent=done+' of '+T.tokens.length+' positions committed';}}
s.addEventListener('input',()=>show(+s.value));
const q=new URLSearchParams(location.search).get('step');if(q!==null){{s.value=q;}}
show(+s.value);
</script></body></html>
"""


def html(out, path, row: int = 0, title: str = "dllm trajectory", tokenizer=None):
    """Self-contained HTML page (no network) with a step slider over the canvas; ``?step=K`` in the URL sets
    the slider. Returns ``path``."""
    t = trajectory(out, row, tokenizer)
    data = json.dumps(t).replace("</", "<\\/")
    page = _PAGE.format(title=_html.escape(title), steps=t["steps"], data=data, px=min(len(t["tokens"]), 32) * 62)
    Path(path).write_text(page, encoding="utf-8")
    return path


def render(out, path, **kw):
    """:func:`heatmap`, :func:`animate` or :func:`html` by the extension of ``path``."""
    ext = Path(path).suffix.lower()
    fn = {".png": heatmap, ".gif": animate, ".html": html, ".htm": html}.get(ext)
    if fn is None:
        raise ValueError(f"unknown picture type {ext!r} for {path}; use .png, .gif or .html")
    return fn(out, path, **kw)
