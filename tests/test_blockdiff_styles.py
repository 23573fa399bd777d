"""``block_diffusion_generate``'s style must fit the checkpoint: the Fast-dLLM v2 styles read shifted logits
(token i from row i - 1), the others unshifted ones; a style of the other kind is refused before decoding (it
gave an IndexError deep in the model, or silently decoded junk)."""

from __future__ import annotations

import pytest

from dllm import load_model
from dllm.blockdiff import STYLES, block_diffusion_generate, model_styles

FD2 = ("fastdllm2", "fastdllm2_generate")
OTHERS = ("sdar", "llada2", "llada21")


@pytest.fixture(scope="module")
def models():
    return {name: load_model(name) for name in ("sdar-tiny", "llada2-tiny", "fastdllm2-tiny")}


def test_each_model_gets_the_styles_of_its_logits(models):
    assert model_styles(models["fastdllm2-tiny"]) == FD2
    assert model_styles(models["sdar-tiny"]) == model_styles(models["llada2-tiny"]) == OTHERS
    assert set(FD2) | set(OTHERS) == set(STYLES)


@pytest.mark.parametrize("name,style", [("sdar-tiny", s) for s in FD2] + [("llada2-tiny", s) for s in FD2]
                         + [("fastdllm2-tiny", s) for s in OTHERS])
def test_a_style_of_the_other_kind_is_refused(models, name, style):
    model = models[name]
    fitting = " or ".join(repr(s) for s in model_styles(model))
    with pytest.raises(ValueError) as info:
        block_diffusion_generate(model, ["hi"], style=style)
    msg = str(info.value)
    assert f"style {style!r} does not fit a {model.spec.family} checkpoint" in msg and f"use style={fitting}" in msg


@pytest.mark.parametrize("name,style", [("sdar-tiny", "sdar"), ("llada2-tiny", "llada2"), ("llada2-tiny", "sdar"),
                                        ("fastdllm2-tiny", "fastdllm2"), ("fastdllm2-tiny", "fastdllm2_generate")])
def test_fitting_styles_decode(models, name, style):
    kw = {"top_k": 1} if style == "sdar" else {}
    gen_length = 32 if style.startswith("fastdllm2") else 8  # Fast-dLLM v2 decodes whole blocks of 32
    out = block_diffusion_generate(models[name], ["hi"], style=style, gen_length=gen_length, **kw)
    assert len(out.sequences) == 1 and out.texts is not None


def test_arguments_are_checked_before_any_row_decodes(models, monkeypatch):
    """A zero block length or step count is refused (it was taken as the default), so are seeds and stop ids of
    the wrong kind; a prompt beyond the context is refused before the rows before it are decoded."""
    import dllm.blockdiff as bd

    sdar = models["sdar-tiny"]
    for bad, needle in (({"block_length": 0}, "block_length must be a positive integer"),
                        ({"denoising_steps": 0}, "denoising_steps must be a positive integer"),
                        ({"seed": 2 ** 70}, "seed must be an integer"), ({"seed": 1.7}, "seed must be an integer"),
                        ({"stop_ids": 5}, "stop_ids must be a list of token ids")):
        with pytest.raises(ValueError, match=needle):
            block_diffusion_generate(sdar, ["hi"], gen_length=16, top_k=1, **bad)
    decoded = []
    real = bd._decode_row
    monkeypatch.setattr(bd, "_decode_row", lambda *a, **k: decoded.append(1) or real(*a, **k))
    with pytest.raises(ValueError, match=r"prompt 2: .* more than the model's context"):
        block_diffusion_generate(sdar, ["hi", "hello", "word " * 600], gen_length=64, top_k=1)
    assert decoded == []
    assert block_diffusion_generate(sdar, ["hi"], gen_length=16, top_k=1, stop_ids=(sdar.eos_id,)).sequences
