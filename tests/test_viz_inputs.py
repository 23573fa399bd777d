"""dllm.viz: untrusted token text in the page, bad arguments, block starts and cache refreshes of real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dllm
import dllm.viz as V
from dllm.assets import model_path


@pytest.fixture(scope="module")
def tiny():
    return dllm.load_model(str(model_path("llada-tiny")), dtype="float32")


@pytest.fixture(scope="module")
def out(tiny):
    return dllm.generate(tiny, ["What is 12 + 30?"], gen_length=16, block_length=8, steps=16)


def _data_block(text: str) -> str:
    return text.split("const D=", 1)[1].split(";\n", 1)[0]


@pytest.mark.parametrize("prompt", ["Is <!-- <script> valid HTML? </script> & <b>", "What is 12 + 30?"])
def test_page_data_cannot_break_out_of_its_script(tiny, tmp_path, prompt):
    o = dllm.generate(tiny, [prompt], gen_length=16, steps=16)
    info = V.run_info(prompt, "llada-tiny", "llada")
    # token text with the same sequences, as a tokenizer could decode them
    tok = tiny.tokenizer

    class Evil:
        all_special_ids = tok.all_special_ids

        def decode(self, ids):
            return "<!-- <script>" if ids[0] % 2 else "</script><script>&amp;"

    for t in (tok, Evil()):
        text = Path(V.html(o, tmp_path / "p.html", tokenizer=t, info=info)).read_text(encoding="utf-8")
        blob = _data_block(text)
        assert "<" not in blob and ">" not in blob and "&" not in blob
        data = json.loads(blob)  # parses back to the data
        run = data["runs"][0]
        assert run["tokens"] == [t.decode([i]) for i in o.sequences[0].tolist()]
        assert run["caption"][0].startswith("prompt: “" + prompt[:10])
        assert text.count("<script") == 1 and text.count("</script>") == 1  # the page's own only


def test_bad_arguments_are_refused_before_drawing(out, tmp_path):
    from dllm.blockdiff import BlockDiffusionOutput

    cases = [
        (lambda: V.heatmap(out, tmp_path / "a.png", width=0), ValueError, "width"),
        (lambda: V.heatmap(out, tmp_path / "a.png", width=-3), ValueError, "width"),
        (lambda: V.html(out, tmp_path / "a.html", width=0), ValueError, "width"),
        (lambda: V.compare([out], tmp_path / "a.png", width=0), ValueError, "width"),
        (lambda: V.animate(out, tmp_path / "a.gif", max_frames=1), ValueError, "max_frames"),
        (lambda: V.animate(out, tmp_path / "a.gif", max_frames=0), ValueError, "max_frames"),
        (lambda: V.animate(out, tmp_path / "a.gif", fps=0), ValueError, "fps"),
        (lambda: V.compare([], tmp_path / "a.png"), ValueError, "outs is empty"),
        (lambda: V.compare_html([], tmp_path / "a.html"), ValueError, "outs is empty"),
        (lambda: V.heatmap(out, tmp_path / "a.jpg"), ValueError, ".png"),
        (lambda: V.animate(out, tmp_path / "a.png"), ValueError, ".gif"),
        (lambda: V.heatmap(BlockDiffusionOutput([[1, 2]], None, [3], [2]), tmp_path / "a.png"), TypeError,
         "GenerateOutput"),
    ]
    for fn, exc, word in cases:
        with pytest.raises(exc, match=word):
            fn()
    assert not list(tmp_path.iterdir())  # nothing written


def test_png_block_bar_only_at_block_starts(tiny, monkeypatch, tmp_path):
    o = dllm.generate(tiny, ["What is 12 + 30?"], gen_length=32, block_length=16, steps=32)
    figs = []
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "close", lambda fig: figs.append(fig))
    V.heatmap(o, tmp_path / "w.png", width=8)  # blocks of 16 in lines of 8: lines 2 and 4 are cut
    (fig,) = figs
    panel = fig.axes[1 + 1]  # head, caption, panel
    thick = [ln for ln in panel.lines if ln.get_linewidth() > 2]
    thin = [ln for ln in panel.lines if 0 < ln.get_linewidth() < 1]
    assert len(thick) == 2 and len(thin) == 2  # positions 0 and 16 start blocks; 8 and 24 only wrap


def test_early_finish_keeps_the_configured_blocks(tiny):
    o = dllm.generate(tiny, ["What is 12 + 30?"], gen_length=64, block_length=16, steps=64, eos_early_stop=True)
    assert max(o.stats.commit_step[0]) < 64  # it finished early
    t = V.trajectory(o)
    assert t["starts"] == [0, 16, 32, 48]
    assert "gen 64 / block 16 /" in V.caption(t)[-1]


def test_refresh_marks_when_every_cached_step_refreshes(tiny):
    o = dllm.generate(tiny, ["What is 12 + 30?"], gen_length=32, block_length=8, steps=4, sampler="fast-dllm")
    assert o.stats.cache not in ("", "none")
    assert all(rec.get("refresh_layer", 0) == 0 for rec in o.stats.trace)  # every step a full refresh
    t = V.trajectory(o)
    assert t["refresh"] == list(range(2, len(o.stats.trace) + 1))
    plain = dllm.generate(tiny, ["What is 12 + 30?"], gen_length=16, block_length=8, steps=16)
    assert plain.stats.cache == "none" and V.trajectory(plain)["refresh"] == []
