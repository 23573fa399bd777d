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


def test_png_gif_html_from_a_real_generation(out, tiny, tmp_path):
    from PIL import Image

    png = V.heatmap(out, tmp_path / "t.png", tokenizer=tiny.tokenizer)
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 50
    gif = V.animate(out, tmp_path / "t.gif", tokenizer=tiny.tokenizer)
    with Image.open(gif) as im:
        assert im.format == "GIF" and im.n_frames == 33  # all masks, then one frame per step
    page = V.html(out, tmp_path / "t.html", tokenizer=tiny.tokenizer)
    text = Path(page).read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and "<script src" not in text  # self-contained
    parser = html.parser.HTMLParser()
    parser.feed(text)  # parses
    data = json.loads(text.split("const T=", 1)[1].split(";\n", 1)[0])
    tokens = [tiny.tokenizer.decode([i]) for i in out.sequences[0].tolist()]
    assert data["tokens"] == tokens and data["step"] == out.stats.commit_step[0]
    both = V.compare([out, out], tmp_path / "c.png", labels=["a", "b"], tokenizer=tiny.tokenizer)
    with Image.open(both) as im:
        assert im.size[1] > Image.open(png).size[1]
    with pytest.raises(ValueError, match="unknown picture type '.bmp'"):
        V.render(out, tmp_path / "t.bmp")
    with pytest.raises(ValueError, match="row 5 is out of range; the output has 2 rows"):
        V.heatmap(out, tmp_path / "x.png", row=5)


def test_compare_samplers_on_one_prompt(tiny, tmp_path):
    outs = [dllm.generate(tiny, [PROMPT], gen_length=32, block_length=b, sampler=s, record_confidence=True)
            for s, b in (("llada", 8), ("threshold", 32), ("localleap", 32))]
    path = V.compare(outs, tmp_path / "cmp.png", labels=["llada", "threshold 0.9", "localleap"],
                     tokenizer=tiny.tokenizer)
    assert path.stat().st_size > 5000


def test_long_canvas_renders_in_seconds(tmp_path):
    """A 1,024-token canvas (synthetic record of 256 steps) renders as PNG and HTML in a few seconds; the GIF
    keeps at most max_frames frames."""
    from PIL import Image

    from dllm.generate import GenerateOutput, GenerateStats

    G, S = 1024, 256
    steps = (torch.arange(G) % S + 1).tolist()
    stats = GenerateStats(nfe=S, row_nfe=[S], tokens_per_forward=G / S, finish_step=[S], time_model=0, time_sampler=0,
                          time_cache=0, time_total=0, trace=[{"lo": [0], "hi": [G]}] * S, commit_step=[steps])
    out = GenerateOutput(torch.randint(0, 50, (1, G)), None, [0], stats)
    t0 = time.perf_counter()
    V.heatmap(out, tmp_path / "long.png")
    V.html(out, tmp_path / "long.html")
    assert time.perf_counter() - t0 < 30
    V.animate(out, tmp_path / "long.gif", max_frames=5)
    with Image.open(tmp_path / "long.gif") as im:
        assert im.n_frames == 5


def test_cli_trace_out(tmp_path, capsys):
    rc = cli_main(["generate", PROMPT, "--gen-length", "16", "--block-length", "8", "--steps", "16",
                   "--trace-out", str(tmp_path / "cli.html")])
    assert rc == 0 and (tmp_path / "cli.html").exists()
    assert "trajectory of row 0" in capsys.readouterr().err
    rc = cli_main(["generate", PROMPT, "What is 1 + 2?", "--gen-length", "16", "--block-length", "16",
                   "--trace-out", str(tmp_path / "b.png")])
    assert rc == 0 and (tmp_path / "b-0.png").exists() and (tmp_path / "b-1.png").exists()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)")
def test_html_slider_in_headless_chromium(out, tiny, tmp_path):
    """The page runs in a real browser: setting the slider (``?step=K``) changes how many positions show as
    committed."""
    page = V.html(out, tmp_path / "t.html", tokenizer=tiny.tokenizer)
    counts = []
    for k in (0, 5, 32):
        dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                              f"file://{Path(page).resolve()}?step={k}"], capture_output=True, text=True,
                             timeout=120).stdout
        counts.append(dom.count('data-committed="1"'))
    assert counts == [0, 5, 32]


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
