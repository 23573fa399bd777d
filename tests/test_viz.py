"""Trajectory pictures (dllm.viz) from real generations of the bundled llada-tiny."""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import refused

import dllm
import dllm.viz as V
from dllm.assets import model_path
from dllm.cli import main as cli_main

PROMPT = 'Please reverse the order of the list:\n["Alice Adams", "Brian Baker", "Carol Carter"]'


@pytest.fixture(scope="module")
def tiny():
    return dllm.load_model(str(model_path("llada-tiny")), dtype="float32")


@pytest.fixture(scope="module")
def out(tiny):
    return dllm.generate(tiny, [PROMPT, "What is 12 + 30?"], gen_length=32, block_length=8, steps=32,
                         record_confidence=True)


def test_commit_steps_and_confidence_are_recorded(out):
    st = out.stats
    assert len(st.commit_step) == 2 and all(len(r) == 32 for r in st.commit_step)
    for row in range(2):  # one token per step: every step 1..32 commits exactly one position of each row
        assert sorted(st.commit_step[row]) == list(range(1, 33))
        assert all(0.0 < c <= 1.0 for c in st.commit_conf[row])
    # the block layout: block k (positions 8k..8k+7) is decoded at steps 8k+1..8k+8
    assert all(8 * (i // 8) < s <= 8 * (i // 8 + 1) for i, s in enumerate(st.commit_step[0]))


INFO = V.run_info(PROMPT, "llada-tiny", "llada", {"remasking": "low_confidence"})


def _page_data(text: str) -> dict:
    return json.loads(text.split("const D=", 1)[1].split(";\n", 1)[0])


def test_png_gif_html_from_a_real_generation(out, tiny, tmp_path):
    from PIL import Image

    png = V.heatmap(out, tmp_path / "t.png", tokenizer=tiny.tokenizer, info=INFO)
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 1500 and im.size[1] > 300
        drawn = im.info["Description"]  # every text drawn in the picture
    for text in ("prompt: “Please reverse the order of the list: ↵ [", "model llada-tiny",
                 "sampler llada (remasking=low_confidence)",
                 "gen 32 / block 8 / 32 steps · NFE 32 · 1.00 tokens/forward",
                 "colour = step the position was committed at", "step 1", "step 32",
                 "bar under a cell = p(token) when committed", "0.5", "thick line = a block starts",
                 "pos\n0–31", "<endoftext>"):
        assert text in drawn, text
    assert "early commit" not in drawn and "cache refresh" not in drawn  # legend items only where present
    gif = V.animate(out, tmp_path / "t.gif", tokenizer=tiny.tokenizer, info=INFO)
    with Image.open(gif) as im:
        assert im.format == "GIF" and im.n_frames == 33  # all masks, then one frame per step
    page = V.html(out, tmp_path / "t.html", tokenizer=tiny.tokenizer, info=INFO)
    text = Path(page).read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and "<script src" not in text  # self-contained
    assert "src=" not in text and "@import" not in text and "url(" not in text
    parser = html.parser.HTMLParser()
    parser.feed(text)  # parses
    run = _page_data(text)["runs"][0]
    tokens = [tiny.tokenizer.decode([i]) for i in out.sequences[0].tolist()]
    assert run["tokens"] == tokens and run["step"] == out.stats.commit_step[0]
    assert run["caption"][0].startswith("prompt: “Please reverse") and "NFE 32" in run["caption"][-1]
    assert run["lines"] == [[0, 32]] and run["starts"] == [0, 8, 16, 24]
    assert "colour = step the position was committed at" in text and "thick left edge = a block starts" in text
    with pytest.raises(ValueError, match="unknown picture type '.bmp'"):
        V.render(out, tmp_path / "t.bmp")
    with pytest.raises(ValueError, match="row 5 is out of range; the output has 2 rows"):
        V.heatmap(out, tmp_path / "x.png", row=5)


def test_whole_tokens_special_names_and_block_lines(out, tiny):
    t = V.trajectory(out, 0, tiny.tokenizer)
    eos = tiny.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    i = t["ids"].index(eos)
    assert t["special"][i] and t["labels"][i] == "<endoftext>" and t["tokens"][i] == "<|endoftext|>"
    assert "\n" not in "".join(t["labels"])  # newlines shown as \n
    # lines hold whole blocks: blocks of 8 in lines of 20 -> 16 + 16; a block longer than the width is cut
    assert V._lines(t, 20) == [(0, 16), (16, 32)]
    assert V._lines({**t, "starts": [0]}, 12) == [(0, 12), (12, 24), (24, 32)]


def test_compare_png_and_html_show_both_runs(tiny, tmp_path):
    from PIL import Image

    outs = [dllm.generate(tiny, [PROMPT], gen_length=32, block_length=8, steps=32, sampler=s, record_confidence=True)
            for s in ("llada", "fast-dllm")]
    infos = [V.run_info(PROMPT, "llada-tiny", "llada"), V.run_info(PROMPT, "llada-tiny", "fast-dllm", cache="dual")]
    one = V.heatmap(outs[0], tmp_path / "one.png", tokenizer=tiny.tokenizer, info=infos[0])
    path = V.compare(outs, tmp_path / "cmp.png", labels=["llada", "fast-dllm"], tokenizer=tiny.tokenizer, infos=infos)
    with Image.open(path) as im, Image.open(one) as im1:
        assert im.size[0] == im1.size[0] and im.size[1] > im1.size[1] + 150
        drawn = im.info["Description"]
    assert drawn.count("prompt: “") == 1  # the shared prompt once, each run its own caption
    assert "llada · model llada-tiny · sampler llada (defaults)" in drawn
    assert "fast-dllm · model llada-tiny · sampler fast-dllm (defaults) · cache dual" in drawn
    assert "NFE 32 · 1.00 tokens/forward · at most 1 committed in one step" in drawn
    assert "NFE 4 · 8.00 tokens/forward · at most 8 committed in one step" in drawn
    page = V.compare_html(outs, tmp_path / "cmp.html", labels=["llada", "fast-dllm"], tokenizer=tiny.tokenizer,
                          infos=infos)
    data = _page_data(page.read_text(encoding="utf-8"))
    assert data["steps"] == 32 and [r["label"] for r in data["runs"]] == ["llada", "fast-dllm"]
    assert data["runs"][1]["counts"][1:5] == [8, 8, 8, 8] and sum(data["runs"][0]["counts"]) == 32
    with pytest.raises(ValueError, match="2 labels for 1 outputs"):
        V.compare(outs[:1], tmp_path / "x.png", labels=["a", "b"])
    with pytest.raises(ValueError, match="unknown comparison picture type '.gif'"):
        V.render_compare(outs, tmp_path / "x.gif")


def test_legend_names_early_commits_where_present(tiny, tmp_path):
    from PIL import Image

    o = dllm.generate(tiny, [PROMPT], gen_length=32, sampler="prophet", record_confidence=True)
    assert V.trajectory(o, 0, tiny.tokenizer)["early"]  # the tiny model is sure at once: Prophet stops early
    V.heatmap(o, tmp_path / "prophet.png", tokenizer=tiny.tokenizer)
    with Image.open(tmp_path / "prophet.png") as im:
        assert "red outline = committed by an early commit (Prophet, guided EOS)" in im.info["Description"]
    o = dllm.generate(tiny, [PROMPT], gen_length=32, block_length=8, steps=32, cache="dual", record_confidence=True)
    assert V.trajectory(o, 0, tiny.tokenizer)["refresh"] == [9, 17, 25]  # a new block refreshes the whole cache
    V.heatmap(o, tmp_path / "dual.png", tokenizer=tiny.tokenizer)
    with Image.open(tmp_path / "dual.png") as im:
        assert "↻ = committed at a step with a full cache refresh" in im.info["Description"]


def test_every_text_lies_inside_the_picture_at_a_narrow_width(tiny, marked):
    """Lines of 8 cells: the legend (its longest labels included) still fits inside the figure."""
    plt = V._require_mpl()
    ts = [V.trajectory(o, 0, tiny.tokenizer) for o in marked]
    ts[1]["delim"] = [8]  # as if AdaBlock had ended the first block at a delimiter: the legend's longest label
    fig, _ = V._figure(plt, ts, [None, None], ["a", "b"], 8, max(t["steps"] for t in ts), head="h")
    fig.canvas.draw()
    right = fig.bbox.x1
    for ax in fig.axes:
        for text in ax.texts:
            assert text.get_window_extent().x1 <= right, text.get_text()
    plt.close(fig)


@pytest.fixture(scope="module")
def marked(tiny):
    """Generations whose pictures carry every mark: Prophet's early commit (red outlines, every position at its one
    step) and the dual cache's refreshes (the ↻ of a block's first step), with confidence bars."""
    return [dllm.generate(tiny, [PROMPT], gen_length=32, sampler="prophet", record_confidence=True),
            dllm.generate(tiny, [PROMPT], gen_length=48, block_length=8, steps=48, cache="dual",
                          record_confidence=True)]


@pytest.mark.parametrize("width", [32, 12])
def test_gif_frames_are_the_figure_drawn_whole_at_their_step(tiny, marked, width, tmp_path):
    """animate draws the figure twice (every position masked, every position committed) and composes each frame from
    the two: each frame equals, pixel for pixel, the whole figure drawn at its step (one line of 32 and lines of 12
    cells); the GIF written holds those frames in one palette."""
    import numpy as np
    from PIL import Image

    plt = V._require_mpl()
    for o in marked:
        t = V.trajectory(o, 0, tiny.tokenizer)
        S = t["steps"]
        ks = sorted({0, *range(1, S + 1, 5), S})
        fig, (art,) = V._figure(plt, [t], [None], [""], width, S, head="h", upto=0)
        if width == 12:  # a figure whose canvas has no pixels (another backend's): drawn on an Agg canvas
            from matplotlib.backends.backend_svg import FigureCanvasSVG

            FigureCanvasSVG(fig)
        composed = list(V._frames(fig, t, art, S, ks, "h", palette=False))
        for k, frame in zip(ks, composed, strict=True):
            whole = V._drawing(fig, t, art, S, k, V._after("h", k, S))
            assert np.array_equal(frame, whole), (S, k, int((frame != whole).any(-1).sum()))
        assert not np.array_equal(composed[0], composed[-1])
        plt.close(fig)
    gif = V.animate(marked[1], tmp_path / "m.gif", width=width, tokenizer=tiny.tokenizer, max_frames=4)
    t = V.trajectory(marked[1], 0, tiny.tokenizer)
    fig, (art,) = V._figure(plt, [t], [None], [""], width, 48, head="h", upto=0)
    paletted = [np.asarray(f.convert("RGB")) for f in V._frames(fig, t, art, 48, [0, 16, 32, 48],
                                                                   "decoding trajectory")]
    plt.close(fig)
    with Image.open(gif) as im:
        assert im.n_frames == 4
        for i, want in enumerate(paletted):
            im.seek(i)
            assert np.array_equal(np.asarray(im.convert("RGB")), want), i


def test_prophet_early_commit_keeps_the_block_layout(tiny):
    """Prophet's early commit decodes the rest of the generation in one step (its region spans it), yet the run's
    blocks are the fixed layout's, which the output records (``stats.block_length``)."""
    o = dllm.generate(tiny, [PROMPT], gen_length=32, block_length=8, steps=32, sampler="prophet")
    assert o.stats.block_length == 8
    assert any(rec["hi"][0] - rec["lo"][0] > 8 for rec in o.stats.trace)  # a region wider than a block
    t = V.trajectory(o, 0, tiny.tokenizer)
    assert t["early"] and t["starts"] == [0, 8, 16, 24]
    assert V.caption(t)[-1].startswith("gen 32 / block 8 / 1 steps")
    # regions laid out otherwise record none: the pictures read the regions that ran
    assert dllm.generate(tiny, [PROMPT], gen_length=32, block_length=8, steps=32,
                         block_policy=dllm.blocks.AdaBlock()).stats.block_length == 0


def test_adablock_decisions_are_drawn_and_named(tmp_path):
    """A record as AdaBlock leaves it (blocks of 5 and 11 ended at a delimiter, then a fallback block of 16): the
    boundaries it chose at a delimiter are named in the legend of both pictures."""
    from PIL import Image

    from dllm.generate import GenerateOutput, GenerateStats

    P, bounds = 10, [(0, 5, True), (5, 16, True), (16, 32, False)]
    trace, steps = [], []
    for lo, hi, at_delim in bounds:
        for k in range(hi - lo):
            trace.append({"lo": [P + lo], "hi": [P + hi], "block_start": [k == 0],
                          "delimiter_block": [k == 0 and at_delim]})
            steps.append(len(trace))
    stats = GenerateStats(nfe=32, row_nfe=[32], tokens_per_forward=1.0, finish_step=[32], time_model=0, time_sampler=0,
                          time_cache=0, time_total=0, trace=trace, commit_step=[steps])
    out = GenerateOutput(torch.arange(32).unsqueeze(0), None, [P], stats)
    t = V.trajectory(out)
    assert t["starts"] == [0, 5, 16] and t["delim"] == [5, 16]
    assert V.caption(t)[-1].startswith("gen 32 / blocks of 5-16 (3 blocks) / 32 steps")
    V.heatmap(out, tmp_path / "ada.png")
    with Image.open(tmp_path / "ada.png") as im:
        assert "dashed orange line = AdaBlock ended the block before it at a delimiter" in im.info["Description"]
    text = V.html(out, tmp_path / "ada.html").read_text(encoding="utf-8")
    assert "dashed orange edge = AdaBlock ended the block before it at a delimiter" in text


def test_long_canvas_renders_in_seconds(tmp_path):
    """A 1,024-token canvas (synthetic record of 256 steps) renders as PNG, HTML and GIF in seconds (the GIF's frames
    composed from two drawings); the GIF keeps at most max_frames frames."""
    from PIL import Image

    from dllm.generate import GenerateOutput, GenerateStats

    def record(G, S):
        steps = (torch.arange(G) % S + 1).tolist()
        stats = GenerateStats(nfe=S, row_nfe=[S], tokens_per_forward=G / S, finish_step=[S], time_model=0,
                              time_sampler=0, time_cache=0, time_total=0, trace=[{"lo": [0], "hi": [G]}] * S,
                              commit_step=[steps])
        return GenerateOutput(torch.randint(0, 50, (1, G)), None, [0], stats)

    out = record(1024, 256)
    t0 = time.perf_counter()
    V.heatmap(out, tmp_path / "long.png")
    V.html(out, tmp_path / "long.html")
    V.animate(out, tmp_path / "long.gif", max_frames=5)
    assert time.perf_counter() - t0 < 45
    with Image.open(tmp_path / "long.gif") as im:
        assert im.n_frames == 5


def test_cli_trace_out(tmp_path, capsys):
    rc = cli_main(["generate", PROMPT, "--gen-length", "16", "--block-length", "8", "--steps", "16",
                   "--trace-out", str(tmp_path / "cli.html")])
    assert rc == 0 and (tmp_path / "cli.html").exists()
    assert "trajectory of row 0" in capsys.readouterr().err
    cap = _page_data((tmp_path / "cli.html").read_text(encoding="utf-8"))["runs"][0]["caption"]
    assert cap[1] == "model llada-tiny · sampler llada (defaults)", cap
    rc = cli_main(["generate", PROMPT, "What is 1 + 2?", "--gen-length", "16", "--block-length", "16",
                   "--trace-out", str(tmp_path / "b.png")])
    assert rc == 0 and (tmp_path / "b-0.png").exists() and (tmp_path / "b-1.png").exists()


def test_captions_name_the_cache_that_ran(tmp_path, capsys):
    """The caption reads the sampler and the cache ``generate`` resolved (``stats.sampler`` / ``stats.cache``), not
    a guess from the options: a block-diffusion model decodes with its exact block cache by default."""
    def caption(*args):
        page = tmp_path / "t.html"
        assert cli_main(["generate", PROMPT, "--gen-length", "16", "--steps", "16", *args, "--trace-out",
                         str(page)]) == 0
        return _page_data(page.read_text(encoding="utf-8"))["runs"][0]["caption"][1]

    assert caption("--model", "sdar-tiny") == "model sdar-tiny · sampler llada (defaults) · cache block"
    assert caption("--cache", "dual", "--block-length", "8") == \
        "model llada-tiny · sampler llada (defaults) · cache dual"
    assert caption("--cache", "none") == "model llada-tiny · sampler llada (defaults) · cache none"  # as named
    out = dllm.generate(dllm.load_model("sdar-tiny"), [PROMPT], gen_length=16)
    assert (out.stats.sampler, out.stats.cache) == ("llada", "block")
    t = V.trajectory(out)
    assert t["ran"] == {"sampler": "llada", "cache": "block"}
    assert V.caption(t, V.run_info(PROMPT, "sdar-tiny", cache="dual"))[1].endswith("cache block")  # what ran wins


def test_cli_compare(tmp_path, capsys):
    from PIL import Image

    base = ["generate", PROMPT, "--gen-length", "16", "--block-length", "8", "--steps", "16", "--sampler", "llada",
            "--param", "remasking=low_confidence", "--compare", "fast-dllm"]
    assert cli_main([*base, "--trace-out", str(tmp_path / "c.html")]) == 0
    runs = _page_data((tmp_path / "c.html").read_text(encoding="utf-8"))["runs"]
    assert [r["label"] for r in runs] == ["llada", "fast-dllm"]
    assert "sampler llada (remasking=low_confidence)" in runs[0]["caption"][1]
    assert "sampler fast-dllm (defaults) · cache dual" in runs[1]["caption"][1]
    assert "--compare fast-dllm: nfe" in capsys.readouterr().err
    assert cli_main([*base, "--trace-out", str(tmp_path / "c.png")]) == 0
    with Image.open(tmp_path / "c.png") as im:
        assert "sampler fast-dllm (defaults)" in im.info["Description"]
    refused(capsys, [*base, "--trace-out", str(tmp_path / "c.gif")], "--compare draws FILE.png or FILE.html")
    refused(capsys, base, "give --trace-out")


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _headless(page: Path, *args: str, query: str = "") -> str:
    run = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1600,900", *args,
                          f"file://{page.resolve()}{query}"], capture_output=True, text=True, timeout=120)
    return run.stdout


@pytest.mark.skipif(_browser() is None, reason="no headless browser found (chromium, chromium-browser or "
                    "google-chrome); .ci/run installs chromium with apt-get")
def test_html_in_headless_chromium(out, tiny, tmp_path):
    """The page runs in a real browser: it draws (a non-empty screenshot), shows the caption and the legend, and
    the slider (set by ``?step=K``) changes how many positions show as committed; the comparison page moves
    both runs."""
    from PIL import Image

    page = V.html(out, tmp_path / "t.html", tokenizer=tiny.tokenizer, info=INFO)
    shot = tmp_path / "shot.png"
    _headless(page, f"--screenshot={shot}", query="?step=12")
    with Image.open(shot) as im:
        assert im.size == (1600, 900)
        colours = im.convert("RGB").getcolors(1 << 20)
        assert colours is not None and len(colours) > 50  # drawn, not a blank page
    counts = []
    for k in (0, 5, 32):
        dom = _headless(page, "--dump-dom", query=f"?step={k}")
        counts.append(dom.count('data-committed="1"'))
        assert f'id="step" type="range" min="0" max="32" value="{k}"' in dom
        assert f"after step {k}: {counts[-1]} of 32 positions committed" in dom
    assert counts == [0, 5, 32]
    assert "colour = step the position was committed at" in dom and "model llada-tiny" in dom
    assert "NFE 32 · 1.00 tokens/forward" in dom and "&lt;endoftext&gt;" in dom
    outs = [out, dllm.generate(tiny, [PROMPT, "What is 12 + 30?"], gen_length=32, block_length=8, sampler="fast-dllm")]
    both = V.compare_html(outs, tmp_path / "c.html", labels=["llada", "fast-dllm"], tokenizer=tiny.tokenizer)
    dom = _headless(both, "--dump-dom", query="?step=2")
    assert "after step 2: 2 of 32 positions committed" in dom and "after step 2: 16 of 32 positions committed" in dom


def test_parallelbench_show_regenerates_a_stored_sample(tmp_path, capsys):
    out = tmp_path / "pb"
    assert cli_main(["parallelbench", "run", "--out", str(out), "--tasks", "waiting_line/reverse", "--n", "2",
                     "--method", "threshold:tau=0.9", "--method", "topk:k=1"]) == 0
    capsys.readouterr()
    idx = json.loads((out / "samples.jsonl").read_text().splitlines()[0])["index"]
    rc = cli_main(["parallelbench", "show", str(out), "--id", str(idx), "--setting", "topk:k=1",
                   "--out", str(tmp_path / "s.html")])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "regenerated the stored output" in err and (tmp_path / "s.html").exists()
    from dllm.evals.parallelbench.sweep import replay_sample

    tiny = dllm.load_model(str(model_path("llada-tiny")), dtype="float32")
    with pytest.raises(ValueError, match="pick one with --task and --setting"):
        replay_sample(tiny, out, idx)
    with pytest.raises(ValueError, match="no decoded sample with index 999"):
        replay_sample(tiny, out, 999)
