"""What ``dllm.generate`` takes as model, sampler, prompts and flags: a wrong argument is refused up front, with
a message naming it and the fix, instead of an AttributeError / TypeError deep in the loop or a silent
conversion (on the bundled tiny models)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dllm import GenerateConfig, generate, get_sampler, load_model
from dllm.blockdiff import block_diffusion_generate


@pytest.fixture(scope="module")
def tiny():
    return load_model("llada-tiny")


@pytest.mark.parametrize("prompts,needles", [
    ([1, 2, 3], ["prompt 0 is the token id 1", "wrap a single prompt's ids in a list: [[1, 2, 3]]"]),
    ([None], ["prompt 0 is None", "a string, a chat conversation", "a list of token ids"]),
    ([[10, 20], 7], ["prompt 1 is the token id 7", "[[1, 2, 3]]"]),
    ([[10.9, 20.2]], ["prompt 0: item 0 is 10.9 (float), not a token id", "integers"]),
    ([[10, 20], ["10", "20"]], ["prompt 1: item 0 is '10' (str)", "one string prompt"]),
    ([[True, 20]], ["prompt 0: item 0 is True (bool)", "not bools"]),
    ([[10, np.float32(2.0)]], ["prompt 0: item 1", "not a token id"]),
    (torch.tensor([[1.0, 2.0]]), ["integer dtype", "torch.float32"]),
])
def test_token_id_prompts_accept_integers_only(tiny, prompts, needles):
    with pytest.raises(ValueError) as info:
        generate(tiny, prompts, gen_length=4)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_integer_ids_of_any_integer_type_are_accepted(tiny):
    """numpy and 0-d torch integers are ids as before; the same prompt whatever the container."""
    plain = generate(tiny, [[10, 20, 30]], gen_length=4).sequences.tolist()
    for p in ([np.int64(10), np.int32(20), 30], np.array([10, 20, 30]), [torch.tensor(10), 20, torch.tensor(30)],
              (10, 20, 30)):
        assert generate(tiny, [p], gen_length=4).sequences.tolist() == plain


@pytest.mark.parametrize("conversation,needle", [
    ([{"role": "user"}], "message 0 ({'role': 'user'})"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}], "message 1"),
    ([{"role": 1, "content": "hi"}], "message 0"),
    ([{"role": "user", "content": "hi"}, "hello"], "message 1 ('hello')"),
])
def test_conversations_need_string_role_and_content(tiny, conversation, needle):
    for prompts, where in ((conversation, "prompt 0"), (["ok", conversation], "prompt 1")):
        with pytest.raises(ValueError) as info:
            generate(tiny, prompts, gen_length=4)
        msg = str(info.value)
        assert msg.startswith(where) and needle in msg and 'a string "role" and a string "content"' in msg, msg


def test_model_must_be_a_loaded_model(tiny):
    with pytest.raises(TypeError, match=r"model is 'llada-tiny', a name or path.*dllm.load_model\('llada-tiny'\)"):
        generate("llada-tiny", ["hi"], gen_length=4)
    with pytest.raises(TypeError, match=r"model is a int, not a dllm model: pass dllm.load_model\(path\)"):
        generate(3, ["hi"], gen_length=4)
    with pytest.raises(TypeError, match="a name or path"):
        block_diffusion_generate("sdar-tiny", ["hi"])


@pytest.mark.parametrize("sampler", [3, 2.5, object(), ["llada"]])
def test_sampler_must_be_a_name_a_recipe_or_a_sampler(tiny, sampler):
    with pytest.raises(TypeError, match=r"is not a sampler: pass a registered name .*dllm.get_sampler\(name"):
        generate(tiny, ["hi"], gen_length=4, sampler=sampler)


@pytest.mark.parametrize("policy", ["adablock", 8, object()])
def test_block_policy_must_be_a_policy(tiny, policy):
    """A name or a number is refused with the accepted forms (it failed inside the decoder with an AttributeError)."""
    with pytest.raises(TypeError, match=r"is not a block policy: pass an object from dllm.blocks \(FixedBlocks"):
        generate(tiny, ["hi"], gen_length=4, block_policy=policy)


def test_sampler_forms_that_are_accepted(tiny):
    by_name = generate(tiny, ["hi"], gen_length=4, sampler="threshold").sequences.tolist()
    assert generate(tiny, ["hi"], gen_length=4, sampler=get_sampler("threshold")).sequences.tolist() == by_name


@pytest.mark.parametrize("flag", ["eos_early_stop", "chat_template", "record_confidence"])
@pytest.mark.parametrize("value", ["yes", "no", 1, None])
def test_on_off_options_take_bools_only(tiny, flag, value):
    with pytest.raises(ValueError, match=rf"{flag} must be True or False, got {value!r}"):
        generate(tiny, ["hi"], gen_length=4, **{flag: value})
    with pytest.raises(ValueError, match=rf"{flag} must be True or False"):
        generate(tiny, ["hi"], GenerateConfig(gen_length=4, **{flag: value}))
    generate(tiny, ["hi"], gen_length=4, **{flag: True})


def test_block_cache_on_a_model_without_blocks_is_refused_before_decoding(tiny):
    with pytest.raises(ValueError, match="cache 'block' is the exact cache of block-diffusion checkpoints .* "
                                         "this model is not one"):
        generate(tiny, ["hi"], gen_length=4, cache="block")


def test_save_pretrained_onto_a_file_is_refused(tiny, tmp_path):
    from dllm import save_pretrained

    f = tmp_path / "afile"
    f.write_text("x")
    for target in (f, f / "sub"):
        with pytest.raises(ValueError, match=rf"save_pretrained: {f} is a file, not a directory; give a directory"):
            save_pretrained(tiny, target)
    assert f.read_text() == "x"


def test_answer_lengths_imports_as_docs_architecture_writes_it():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "`from dllm.generate import answer_lengths`" in doc and "| `dllm.generate.answer_lengths` |" not in doc
    from dllm.generate import answer_lengths

    assert callable(answer_lengths)
