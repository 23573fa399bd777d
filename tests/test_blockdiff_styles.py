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
