"""Command-line options checked against config.json before the model loads: each test runs on a copy of a bundled
checkpoint whose weights file is corrupt, so an option checked only after loading shows up as the weights error
instead of the option's own (and ``--out`` is never made)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import refused as main_refused

from dllm.assets import model_path
from dllm.cli import main
from dllm.cli.common import CACHE_HELP
from dllm.samplers import SAMPLERS, get_sampler
from dllm.samplers.recipe import as_recipe

WEIGHTS_ERROR = "not a readable safetensors file"


def _corrupt(tmp_path: Path, name: str) -> str:
    """A copy of the bundled ``name`` with garbage for weights (config.json and tokenizer intact)."""
    d = tmp_path / f"corrupt-{name}"
    shutil.copytree(model_path(name), d)
    (d / "model.safetensors").write_bytes(b"garbage, not safetensors")
    return str(d)


@pytest.fixture
def llada(tmp_path):
    return _corrupt(tmp_path, "llada-tiny")


@pytest.fixture
def sdar(tmp_path):
    return _corrupt(tmp_path, "sdar-tiny")


def refused(capsys, argv: list[str], *needles: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and WEIGHTS_ERROR not in line, line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def test_the_corrupt_copy_is_refused_when_it_loads(capsys, llada):
    """The fixture works: options that are fine get as far as loading, which fails on the weights."""
    assert main(["generate", "hi", "--model", llada, "--gen-length", "8"]) == 2
    assert WEIGHTS_ERROR in capsys.readouterr().err


def test_block_cache_needs_a_block_diffusion_checkpoint(capsys, llada, sdar):
    refused(capsys, ["generate", "hi", "--model", llada, "--cache", "block"],
            "cache 'block' is the exact cache of block-diffusion checkpoints", "use 'prefix', 'dual'")
    assert main(["generate", "hi", "--model", sdar, "--cache", "block", "--gen-length", "8"]) == 2
    assert WEIGHTS_ERROR in capsys.readouterr().err  # a block model takes it: on to loading


def test_gen_length_beyond_the_context_of_config_json(capsys, llada, tmp_path):
    """Text prompts are measured with the checkpoint's tokenizer (chat template applied, as generate does) before
    any weight is read; token-id prompts as they are."""
    from dllm.generate import encode_prompt
    from dllm.models.loading import load_tokenizer

    context = json.loads((Path(llada) / "config.json").read_text())["max_sequence_length"]
    hi = len(encode_prompt(load_tokenizer(Path(llada)), "hi"))
    assert hi > 1
    refused(capsys, ["generate", "hi", "--model", llada, "--gen-length", str(context)],
            f"--gen-length {context} does not fit the model's context of {context} tokens",
            f"the longest prompt has {hi} tokens", f"use --gen-length {context - hi} or less")
    refused(capsys, ["generate", "hi", "--model", llada, "--gen-length", str(context - hi + 1)],
            f"use --gen-length {context - hi} or less")
    assert main(["generate", "hi", "--model", llada, "--gen-length", str(context - hi)]) == 2
    assert WEIGHTS_ERROR in capsys.readouterr().err  # it fits exactly: on to loading
    long = " ".join(["Alice Adams"] * 40)
    batch = tmp_path / "ids.txt"
    batch.write_text(json.dumps(list(range(10, 30))) + "\nhello\n" + json.dumps({"prompt": long}) + "\n")
    n = len(encode_prompt(load_tokenizer(Path(llada)), long))
    assert n > 20
    refused(capsys, ["generate", "--batch-file", str(batch), "--model", llada, "--gen-length", str(context - 5)],
            f"the longest prompt has {n} tokens", f"use --gen-length {context - n} or less")
    batch.write_text(json.dumps(list(range(10, 30))) + "\nhello\n")
    refused(capsys, ["generate", "--batch-file", str(batch), "--model", llada, "--gen-length", str(context - 5)],
            "the longest prompt has 20 tokens", f"use --gen-length {context - 20} or less")


def test_guide_must_be_a_causal_lm(capsys, llada, sdar, tmp_path):
    refused(capsys, ["generate", "hi", "--model", llada, "--guide", sdar],
            f"--guide {sdar}: its config.json has model_type 'sdar', a diffusion checkpoint", "'ar-tiny'")
    refused(capsys, ["generate", "hi", "--model", llada, "--sampler", "guided", "--param", f"guide={llada}"],
            f"--param guide={llada}: its config.json has model_type 'llada'")
    other = tmp_path / "vit"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "vit"}))
    refused(capsys, ["generate", "hi", "--model", llada, "--guide", str(other)],
            "model_type 'vit', not a causal LM transformers knows")
    assert main(["generate", "hi", "--model", llada, "--guide", "ar-tiny", "--gen-length", "8"]) == 2
    assert WEIGHTS_ERROR in capsys.readouterr().err  # the bundled guide is a causal LM


def test_batch_file_token_ids_are_checked_against_config_json(capsys, llada, tmp_path):
    cfg = json.loads((Path(llada) / "config.json").read_text())
    batch = tmp_path / "batch.txt"
    batch.write_text(f'hello\n[1, 2, {cfg["vocab_size"]}]\n')
    refused(capsys, ["generate", "--batch-file", str(batch), "--model", llada],
            f"prompt 1 contains token id {cfg['vocab_size']}, outside the vocabulary (0..{cfg['vocab_size'] - 1})")
    batch.write_text(f'[1, {cfg["mask_token_id"]}]\n')
    refused(capsys, ["generate", "--batch-file", str(batch), "--model", llada],
            f"prompt 0 contains the mask token (id {cfg['mask_token_id']})")
    batch.write_text('[{"role": "user", "content": "hi"}, {"role": "assistant"}]\n')
    refused(capsys, ["generate", "--batch-file", str(batch), "--model", llada],
            f"{batch}:1: message 1", 'a string "role" and a string "content"')


def test_ar_guide_as_model_points_to_guide(capsys):
    refused(capsys, ["generate", "hi", "--model", "ar-tiny"], "ar-tiny is the bundled AR guide",
            "pass it as --guide ar-tiny")


@pytest.mark.parametrize("method,needles", [
    ("threshold:tau=2", ["threshold:tau=2: tau=2 is out of range"]),
    ("topk:k=3", ["topk:k=3: gen_length 32 is not a multiple of k=3"]),
    ("threshold:tau=0.5,2", ["threshold:tau=2"]),
])
def test_parallelbench_settings_are_built_before_the_model_loads(capsys, llada, tmp_path, method, needles):
    out = tmp_path / "pb"
    refused(capsys, ["parallelbench", "run", "--model", llada, "--method", method, "--out", str(out), "--n", "1",
                     "--tasks", "waiting_line/copy"], *needles)
    assert not out.exists()


def test_parallelbench_block_cache_and_budget(capsys, llada, tmp_path):
    out = tmp_path / "pb"
    base = ["parallelbench", "run", "--model", llada, "--out", str(out), "--n", "1", "--tasks", "waiting_line/copy"]
    refused(capsys, [*base, "--method", "threshold", "--cache", "block"], "cache 'block'")
    refused(capsys, [*base, "--method", "topk:k=4", "--gen-length", "30"], "gen_length 30 is not a multiple of k=4")
    assert not out.exists()


def test_cache_help_names_what_resolve_does():
    """--cache's default: the block cache on block-diffusion checkpoints, else every preset's own cache."""
    assert "default: block on block-diffusion checkpoints" in CACHE_HELP
    own = {name: as_recipe(get_sampler(name)).cache for name in SAMPLERS}
    own = {name: c if isinstance(c, str) else c[0] for name, c in own.items() if c is not None}
    assert own  # fast-dllm, elastic, dkv
    for name, cache in own.items():
        assert f"{cache} for {name}" in CACHE_HELP, (name, cache)


def test_train_tiny_names_every_family(tmp_path, capsys):
    from dllm.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    helps = {c.dest: c.help for c in sub._choices_actions}
    assert "SDAR-, LLaDA2-, Fast-dLLM v2- or AR-format" in helps["train-tiny"]
    assert "show" in helps["parallelbench"]
    line = main_refused(capsys, ["train-tiny", "--family", "ar", "--loss", "mean", "--out", str(tmp_path / "ar"),
                                 "--steps", "1"])
    assert "--loss" in line and "llada, dream, sdar, llada2, fastdllm2" in line


def test_sudoku_givens_in_the_wrong_order(capsys, tmp_path):
    refused(capsys, ["parallelbench", "generate", "--out", str(tmp_path / "d"), "--sudoku-givens", "12,4"],
            "LO (12) > HI (4)")


def test_serve_checks_its_model_dtype_and_guides_before_loading(capsys, llada, sdar, tmp_path):
    """`dllm serve` refuses what `dllm generate` refuses before reading a weight: an unknown dtype, the AR guide as
    the model, and an allowed --guide that is not a causal LM checkpoint (a request naming it would fail later)."""
    refused(capsys, ["serve", "--model", llada, "--dtype", "float99"], "--dtype: unknown dtype 'float99'")
    refused(capsys, ["serve", "--model", "ar-tiny"], "ar-tiny is the bundled AR guide")
    refused(capsys, ["serve", "--model", llada, "--guide", sdar],
            f"--guide {sdar}: its config.json has model_type 'sdar', a diffusion checkpoint")
    refused(capsys, ["serve", "--model", llada, "--guide", str(tmp_path / "none")],
            f"--guide {tmp_path / 'none'}: guide", "is neither a bundled guide")
    assert main(["serve", "--model", llada, "--guide", "ar-tiny", "--port", "8123"]) == 2
    assert WEIGHTS_ERROR in capsys.readouterr().err  # all fine: on to loading, which fails on the weights


def test_a_prompt_filling_the_context_is_refused_without_a_negative_suggestion(capsys, llada):
    context = json.loads((Path(llada) / "config.json").read_text())["max_sequence_length"]
    line = refused(capsys, ["generate", "word " * context, "--model", llada, "--gen-length", "8"],
                   f"the model's whole context (config.json: {context} tokens) or more", "shorten it")
    assert "--gen-length -" not in line


def test_the_compared_samplers_block_layout_is_checked_before_loading(capsys, tmp_path):
    sdar = _corrupt(tmp_path, "sdar-tiny")
    refused(capsys, ["generate", "What is 12 + 30?", "--model", sdar, "--gen-length", "420", "--cache", "none",
                     "--trace-out", str(tmp_path / "t.html"), "--compare", "multiblock"],
            "gen_length (420) must be a multiple of the multi-block block_length (32)")


def test_generate_reads_the_tokenizer_once(capsys, monkeypatch, tmp_path):
    """The tokenizer that measured the text prompts before the model loads is the model's: read once, not twice."""
    import dllm.models.loading as loading

    calls = []
    real = loading.load_tokenizer

    def counted(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(loading, "load_tokenizer", counted)
    assert main(["generate", "What is 2 + 2?", "--model", "llada-tiny", "--gen-length", "8", "--steps", "8"]) == 0
    assert capsys.readouterr().out.strip()
    assert len(calls) == 1, calls
    calls.clear()
    ids = tmp_path / "ids.txt"
    ids.write_text(json.dumps(list(range(10, 20))) + "\n")
    assert main(["generate", "--batch-file", str(ids), "--model", "llada-tiny", "--gen-length", "8"]) == 0
    assert len(calls) == 1  # token ids: no prompt check needs it, the model still loads its tokenizer


def test_load_model_takes_a_loaded_tokenizer():
    from dllm.models import load_model
    from dllm.models.loading import load_tokenizer

    tok = load_tokenizer(Path(model_path("llada-tiny")))
    assert load_model("llada-tiny", tokenizer=tok).tokenizer is tok
    assert load_model("llada-tiny", tokenizer=False).tokenizer is None
    with pytest.raises(ValueError, match="tokenizer must be True, False or a tokenizer"):
        load_model("/nonexistent/checkpoint", tokenizer="yes")
