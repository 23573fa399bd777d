"""How long a trajectory GIF (``dllm.viz.animate``) takes on a long canvas: its frames composed from two drawings of
the figure against each frame drawn whole.

A frame of the GIF is the figure after one step. Drawn whole, each frame lays out and renders the text of every cell
of the canvas (seconds per frame at 1,024 positions); composed, the figure is drawn twice (every position masked,
every position committed) and each frame takes the cells committed by its step from the second drawing and draws its
header line alone. Printed: the seconds per frame of each way over the same steps (a ratio within one run), the
whole GIF's seconds (its frames composed, written with one palette) and whether every composed frame equals the one
drawn whole, pixel for pixel. On a synthetic record (token ids for text, ``--steps`` steps committing the positions
in turn), so it runs anywhere without a model.

    python benchmarks/bench_viz.py [--gen 1024] [--steps 256] [--frames 64] [--width 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from _common import positive, print_table, write_json

import dllm.viz as V
from dllm.generate import GenerateOutput, GenerateStats


def record(gen: int, steps: int) -> GenerateOutput:
    """A generation of ``gen`` positions in ``steps`` steps, position i committed at step ``i % steps + 1``."""
    commit = [i % steps + 1 for i in range(gen)]
    stats = GenerateStats(nfe=steps, row_nfe=[steps], tokens_per_forward=gen / steps, finish_step=[steps],
                          time_model=0, time_sampler=0, time_cache=0, time_total=0,
                          trace=[{"lo": [0], "hi": [gen]}] * steps, commit_step=[commit])
    return GenerateOutput(torch.randint(0, 50, (1, gen), generator=torch.Generator().manual_seed(0)), None, [0], stats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gen", type=positive, default=1024, help="positions on the canvas")
    ap.add_argument("--steps", type=positive, default=256, help="steps of the record (at most --gen)")
    ap.add_argument("--frames", type=positive, default=64,
                    help="frames timed each way, evenly spaced steps (at least 2: the first and the last; animate's "
                         "default 64)")
    ap.add_argument("--width", type=positive, default=32, help="cells per line, as animate's width")
    ap.add_argument("--json", help="write the row here")
    a = ap.parse_args()
    if a.steps > a.gen:
        ap.error(f"--steps {a.steps} is more than --gen {a.gen}: every step commits at least one position; "
                 f"give --steps at most {a.gen}")
    if a.frames < 2:
        ap.error(f"--frames {a.frames}: the frames run from the first step to the last, so at least 2; give --frames 2 "
                 f"or more")
    out = record(a.gen, a.steps)
    t = V.trajectory(out)
    S = t["steps"]
    ks = sorted({round(i * S / (a.frames - 1)) for i in range(a.frames)})
    plt = V._require_mpl()

    def figure():
        return V._figure(plt, [t], [None], [""], a.width, S, head=V._after("bench", S, S), upto=0)

    fig, (art,) = figure()
    t0 = time.perf_counter()
    whole = [V._drawing(fig, t, art, S, k, V._after("bench", k, S)) for k in ks]
    t_whole = time.perf_counter() - t0
    plt.close(fig)
    fig, (art,) = figure()
    t0 = time.perf_counter()
    composed = list(V._frames(fig, t, art, S, ks, "bench", palette=False))
    t_composed = time.perf_counter() - t0
    plt.close(fig)
    differ = sum(int((w != c).any(-1).sum()) for w, c in zip(whole, composed))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        V.animate(out, Path(d) / "bench.gif", width=a.width, max_frames=a.frames, title="bench")
        t_gif = time.perf_counter() - t0
    row = {"gen": a.gen, "steps": S, "frames": len(ks), "width": a.width, "pixels": int(whole[0][..., 0].size),
           "whole_s_per_frame": t_whole / len(ks), "composed_s_per_frame": t_composed / len(ks),
           "speedup": t_whole / t_composed, "gif_s": t_gif, "differing_pixels": differ}
    print(f"canvas of {a.gen} positions, {S} steps, {len(ks)} frames of {whole[0].shape[1]} x {whole[0].shape[0]} "
          f"pixels; times are this machine's (a ratio within one run)")
    print_table(["frames drawn whole, s/frame", "composed, s/frame", "composed speed-up", "GIF written, s",
                 "pixels differing"],
                [[f"{row['whole_s_per_frame']:.3f}", f"{row['composed_s_per_frame']:.3f}", f"{row['speedup']:.1f}x",
                  f"{t_gif:.2f}", differ]])
    write_json(a.json, row)


if __name__ == "__main__":
    main()
