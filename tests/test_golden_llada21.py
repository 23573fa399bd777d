"""LLaDA2.1 against its own code: logits of LLaDA2MoeModelLM (LLaDA2.1-mini's Hugging Face ``modeling_llada2_moe.py``)
and trajectories of its token-editing ``generate``, recorded by ``benchmarks/golden/record_llada21.py`` on the
random-weight LLaDA2-format checkpoint of ``golden_models.llada21_tiny`` (``llada2_tiny`` with a sharper head), with
generate's block mask made strict (docs/block-diffusion.md): the same logits (float32, within 1e-5 of each position's
largest |logit|, ``golden_common.LOGITS_RTOL``), and the same answer, forward count, and positions committed from
masks and edited at every forward; defaults, the model card's Q and S modes, ``max_post_steps`` 0 / 2 / 16,
``num_to_transfer`` 1-3, blocks of 4 and 8, greedy and seeded sampling, ``eos_early_stop``."""

from __future__ import annotations

import golden_common as gc
import golden_models as gm
import pytest
import torch

from dllm.blockdiff import block_diffusion_generate

FX = gc.load_fixture("llada21_llada2-tiny")


@pytest.fixture(scope="module")
def model():
    m = gm.llada21_tiny(FX["model"]["seed"])
    assert gc.state_sha256(m) == FX["weights_sha256"], "the fixture was recorded with other weights"
    return m


@pytest.mark.parametrize("i", range(len(FX["logits"])))
def test_logits_equal_llada21s_model_code(model, i):
    rec = FX["logits"][i]
    want = gc.decode_logits(rec)
    got = model(torch.tensor([rec["input_ids"]]), block_size=rec["block_length"])[0]
    gc.assert_logits_close(got, want)


def _run(model, case):
    p = case["params"]
    return block_diffusion_generate(model, case["prompt_ids"], chat_template=False, style="llada21",
                                    gen_length=p["gen_length"], block_length=p["block_length"],
                                    confidence_threshold=p["threshold"], editing_threshold=p["editing_threshold"],
                                    max_post_steps=p["max_post_steps"], num_to_transfer=p["num_to_transfer"],
                                    temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"],
                                    seed=p["seed"], stop_ids=[p["eos_id"]], eos_early_stop=p["eos_early_stop"])


@pytest.mark.parametrize("case_id", [c["id"] for c in FX["cases"]])
def test_llada21_style_decoding_matches_llada21s_generate(model, case_id):
    case = next(c for c in FX["cases"] if c["id"] == case_id)
    out = _run(model, case)
    P = len(case["prompt_ids"][0])
    got = [[[c - P for c in f["committed"]], [e - P for e in f["edited"]]] for f in out.trace[0]]
    assert got == case["forwards"]
    assert out.nfe[0] == case["nfe"]
    assert out.sequences[0] == case["output"][0]


def test_fixture_exercises_edits_post_steps_and_eos():
    cases = {c["id"]: c for c in FX["cases"]}
    params = [c["params"] for c in FX["cases"]]
    assert {p["max_post_steps"] for p in params} >= {0, 2, 16}
    assert {p["num_to_transfer"] for p in params} >= {1, 2}
    assert {p["block_length"] for p in params} == {4, 8}
    assert {(p["threshold"], p["editing_threshold"]) for p in params} >= {(0.95, 0.9), (0.7, 0.5), (0.5, 0.0)}
    # edits: in most runs, with the default thresholds too, and alongside mask commits
    edited = [c for c in FX["cases"] if any(f[1] for f in c["forwards"])]
    assert len(edited) > len(FX["cases"]) // 2
    assert any(c["params"]["editing_threshold"] == 0.9 for c in edited)
    assert any(f[0] and f[1] for c in edited for f in c["forwards"])
    # mask-free forwards that edit (the post steps)
    assert any(not f[0] and f[1] for c in edited for f in c["forwards"])
    # several commits in one forward, and EOS ending answers (cut after it)
    assert any(len(f[0]) > 1 for c in FX["cases"] for f in c["forwards"])
    ended = [c for c in FX["cases"] if c["params"]["eos_id"] in c["output"][0]]
    assert ended and all(c["output"][0][-1] == c["params"]["eos_id"] for c in ended)
    # eos_early_stop: fewer forwards than the same run without it
    assert any(cases[c["id"].replace("_eos_stop", "")]["nfe"] > c["nfe"] for c in FX["cases"]
               if c["params"]["eos_early_stop"] and c["id"].replace("_eos_stop", "") in cases)
    assert any(p["temperature"] > 0 for p in params)
    # the reference's mask quirk is large on this model (why the recording uses the strict mask)
    assert max(d for q in FX["mask_quirk"] for d in q["max_abs_diff_per_block"]) > 1.0


def test_llada21_decoder_checks_its_options():
    m = gm.llada2_tiny(0)
    kw = dict(gen_length=8, block_length=4, chat_template=False)
    for bad, match in (({"editing_threshold": 1.5}, "editing_threshold=1.5 must be a number in \\[0, 1\\]"),
                       ({"confidence_threshold": -0.1}, "confidence_threshold=-0.1 must be"),
                       ({"max_post_steps": -1}, "max_post_steps must be an integer >= 0"),
                       ({"max_post_steps": 2.0}, "max_post_steps must be an integer >= 0"),
                       ({"num_to_transfer": 0}, "num_to_transfer must be a positive integer"),
                       ({"temperature": -1.0}, "temperature=-1.0 must be a number >= 0"),
                       ({"denoising_steps": 4}, "no step budget or remasking rule"),
                       ({"remasking": "sequential"}, "no step budget or remasking rule"),
                       ({"minimal_topk": 2}, "never uses it"),
                       ({"small_block_length": 2}, "Fast-dLLM v2's"),
                       ({"eos_early_stop": 1}, "eos_early_stop must be True or False"),
                       ({"eos_early_stop": True, "stop_ids": []}, "eos_early_stop needs a stop token")):
        with pytest.raises(ValueError, match=match):
            block_diffusion_generate(m, [[5, 6, 7]], style="llada21", **bad, **kw)
    for style in ("sdar", "llada2", "fastdllm2", "fastdllm2_generate"):
        for bad in ({"editing_threshold": 0.5}, {"max_post_steps": 2}, {"num_to_transfer": 2}):
            with pytest.raises(ValueError, match="LLaDA2.1's generate options"):
                block_diffusion_generate(m, [[5, 6, 7]], style=style, **bad, **kw)


def test_a_greedy_block_that_would_repeat_forever_ends_with_its_masks():
    """At temperature 0 a masked position whose proposal is the mask token itself is "committed" again and again:
    the reference never ends. Here a block state (tokens and post-step count) seen before ends the block, its masks
    left; the forwards up to there are the reference's."""
    m = gm.llada21_tiny(0)
    # the mask token wins everywhere: its logit set to 1e3 at every position (the others are below 30)
    m.head.register_forward_hook(lambda _mod, _args, out: out.index_fill(-1, torch.tensor([m.mask_id]), 1e3))
    out = block_diffusion_generate(m, [[5, 6, 7]], style="llada21", gen_length=8, block_length=4,
                                   chat_template=False, stop_ids=[0])
    assert out.sequences[0] == [m.mask_id] * 8
    # per block: one forward that commits the mask token to every masked position, then the repeated state
    assert [f["committed"] for f in out.trace[0]] == [[3], [4, 5, 6, 7], [8, 9, 10, 11]]
