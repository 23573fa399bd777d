"""Fast-dLLM v2 against its own code: logits of Fast_dLLM_QwenForCausalLM (the Hugging Face model file of
Fast_dLLM_v2_7B) and trajectories of ``batch_sample`` (NVlabs/Fast-dLLM ``v2/generation_functions.py``, the official
evaluation's decoder) and of the model file's ``generate``, recorded by ``benchmarks/golden/record_fastdllm2.py`` on
the random-weight checkpoint of ``golden_models.fastdllm2_tiny``: the same logits (float32, within 1e-5 of each
position's largest |logit|, ``golden_common.LOGITS_RTOL``; after the reference decoders' token shift), and the
same tokens, forward count, forward kinds and positions committed at every forward, greedy and seeded top-p sampling,
with and without the sub-block cache."""

from __future__ import annotations

import golden_common as gc
import golden_models as gm
import pytest
import torch

from dllm.blockdiff import block_diffusion_generate

FX = gc.load_fixture("fastdllm2_fastdllm2-tiny")


@pytest.fixture(scope="module")
def model():
    m = gm.fastdllm2_tiny(FX["model"]["seed"])
    assert gc.state_sha256(m) == FX["weights_sha256"], "the fixture was recorded with other weights"
    return m


@pytest.mark.parametrize("i", range(len(FX["logits"])))
def test_logits_equal_the_model_files_after_its_token_shift(model, i):
    rec = FX["logits"][i]
    raw = gc.decode_logits(rec)  # the reference's row i: its hidden row i
    want = torch.cat([raw[:1], raw[:-1]])  # the decoders' shift: position i from row i - 1 (position 0 from row 0)
    got = model(torch.tensor([rec["input_ids"]]), block_size=rec["block_length"])[0]
    gc.assert_logits_close(got, want)
    assert (got - raw).abs().max().item() > 1e-2  # unshifted they differ: the shift is tested


@pytest.mark.parametrize("case_id", [c["id"] for c in FX["cases"]])
def test_decoder_matches_the_reference(model, case_id):
    case = next(c for c in FX["cases"] if c["id"] == case_id)
    out = block_diffusion_generate(model, case["prompt_ids"], chat_template=False, **case["params"])
    assert out.sequences[0] == case["output"][0]
    assert out.nfe[0] == case["nfe"]
    ours = [{"kind": f["kind"], "block": f["block"], "committed": sorted(f["committed"])} for f in out.trace[0]]
    theirs = [{**f, "committed": sorted(f["committed"])} for f in case["forwards"]]
    assert ours == theirs


def test_fixture_covers_both_decoders_the_caches_sampling_and_the_stop_token():
    cases = FX["cases"]
    stop = cases[0]["params"]["stop_ids"][0]
    for ref in ("batch_sample", "generate"):
        mine = [c for c in cases if c["reference"] == ref]
        assert any(c["params"]["use_block_cache"] for c in mine) and not all(c["params"]["use_block_cache"]
                                                                             for c in mine)
        assert any(c["params"]["temperature"] > 0 for c in mine) and any(c["params"]["temperature"] == 0
                                                                        for c in mine)
        assert any(stop in c["output"][0] for c in mine)  # rows ending early on the stop token
    kinds = {f["kind"] for c in cases for f in c["forwards"]}
    assert kinds == {"prefill", "denoise", "subblock", "store"}
    assert any(len(f["committed"]) > 1 for c in cases for f in c["forwards"])  # the threshold commits several
    # batch_sample pads the rest of a finished block; generate cuts the row after the stop token
    pad = [c for c in cases if c["reference"] == "batch_sample" and stop in c["output"][0]]
    assert any(c["output"][0][c["output"][0].index(stop) + 1:] for c in pad)
    assert all(c["output"][0][-1] == stop for c in cases if c["reference"] == "generate" and stop in c["output"][0])
    # prompts shorter than a block, ending on a block boundary, and blocks over the reference's grid of 32
    lengths = {(len(c["prompt_ids"][0]), c["params"]["block_length"]) for c in cases}
    assert any(p < b for p, b in lengths) and any(p % b == 0 and p > b for p, b in lengths)
    assert any(b > 32 for _, b in lengths)
