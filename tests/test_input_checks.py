"""Bad values are refused with a message naming the fix; odd but valid inputs do the right thing."""

import importlib
import json
import math

import numpy as np
import pytest

from dllm.cli import main
from dllm.config import GenerateConfig
from dllm.samplers import get_sampler

G = importlib.import_module("dllm.generate")  # the module (``dllm.generate`` the attribute is the function)


@pytest.fixture(scope="module")
def tiny():
    from dllm.assets import model_path
    from dllm.models import load_model

    return load_model(str(model_path("llada-tiny")))


@pytest.mark.parametrize("kw,match", [
    ({"gen_length": True}, "gen_length must be a positive integer"),
    ({"block_length": True}, "block_length must be a positive integer or None"),
    ({"steps": False}, "steps must be a positive integer or None"),
    ({"gen_length": 8.0}, "gen_length must be a positive integer"),
    ({"cfg_scale": math.inf}, "cfg_scale must be >= 0 and finite"),
    ({"cfg_scale": math.nan}, "cfg_scale must be >= 0 and finite"),
    ({"cfg_scale": -1.0}, "cfg_scale must be >= 0 and finite"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"seed": True}, "seed must be an integer"),
])
def test_config_refuses_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        GenerateConfig(**kw)


def test_numpy_integers_are_accepted_and_stored_as_int(tiny):
    cfg = GenerateConfig(gen_length=np.int64(8), block_length=np.int32(8), steps=np.int64(4), seed=np.int64(3))
    assert (cfg.gen_length, cfg.block_length, cfg.steps, cfg.seed) == (8, 8, 4, 3)
    assert all(type(v) is int for v in (cfg.gen_length, cfg.block_length, cfg.steps, cfg.seed))
    a = G.generate(tiny, ["hello"], cfg, sampler=get_sampler("llada-random"))
    b = G.generate(tiny, ["hello"], GenerateConfig(gen_length=8, block_length=8, steps=4, seed=3),
                   sampler=get_sampler("llada-random"))
    assert a.sequences.tolist() == b.sequences.tolist()  # the same seed, whatever its integer type


def test_sampler_parameters_refuse_nan_and_non_numbers():
    with pytest.raises(ValueError, match=r"tau=nan is out of range; it must lie in \(0, 1\]"):
        get_sampler("threshold", tau=float("nan"))
    with pytest.raises(ValueError, match="tau='abc' is not a number"):
        get_sampler("threshold", tau="abc")
    with pytest.raises(ValueError, match="temperature='hot' is not a number"):
        get_sampler("llada", temperature="hot")
    with pytest.raises(ValueError, match="window='wide' is not a number"):
        get_sampler("elastic", window="wide")
    for name, flag in (("ascending", "per_region"), ("factor", "quirk"), ("llada", "eos_eot_quirk")):
        for bad in (1, 0, "true", None):  # a flag takes True or False, from the API as from the command line
            with pytest.raises(ValueError, match=rf"{name}: {flag}={bad!r} is not true or false; {flag} is a flag"):
                get_sampler(name, **{flag: bad})
        get_sampler(name, **{flag: True})


def test_bytes_prompts_are_refused_with_the_fix(tiny):
    for prompts in (b"hello", [b"hello"], ["ok", bytearray(b"x")]):
        with pytest.raises(ValueError, match=r"decode them to str first"):
            G.prepare_prompts(tiny, prompts)


def test_prophet_span_outside_the_output_is_refused(tiny):
    with pytest.raises(ValueError, match=r"span=204:5 .* beyond the output \(gen_length 16\)"):
        G.generate(tiny, ["hi"], GenerateConfig(gen_length=16), sampler=get_sampler("prophet", span="204:5"))
    G.generate(tiny, ["hi"], GenerateConfig(gen_length=16), sampler=get_sampler("prophet", span="11:5"))  # fits


def test_cli_one_line_errors(capsys):
    assert main(["generate", "hi", "--sampler", "threshold", "--param", "tau=abc", "--gen-length", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: threshold: tau='abc' is not a number") and err.count("\n") == 1 and "Traceback" not in err
    assert main(["eval-tasks", "--n", "0"]) == 2
    assert capsys.readouterr().err == "error: --n must be >= 1 (examples per task), got 0\n"


def _spy(monkeypatch):
    seen = []
    real = G.generate

    def spy(model, prompts, *a, **k):
        seen.append(prompts)
        return real(model, prompts, *a, **k)

    monkeypatch.setattr(G, "generate", spy)
    return seen


def test_batch_file_lines(tmp_path, monkeypatch, capsys, tiny):
    conv = [{"role": "user", "content": "Please copy the list: [\"Ann Bo\"]"}]
    ids = tiny.tokenizer("hello", add_special_tokens=False)["input_ids"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(["[INST] plain text that starts with a bracket", json.dumps(conv), json.dumps(ids),
                            json.dumps({"prompt": "from an object"}), "[1, 2", ""]) + "\n", encoding="utf-8")
    seen = _spy(monkeypatch)
    assert main(["generate", "--batch-file", str(f), "--gen-length", "8", "--json"]) == 0
    assert seen[-1] == ["[INST] plain text that starts with a bracket", conv, ids, "from an object", "[1, 2"]
    assert len(json.loads(capsys.readouterr().out)["texts"]) == 5
    f.write_text('{"prompt": "x"\n', encoding="utf-8")
    assert main(["generate", "--batch-file", str(f), "--gen-length", "8"]) == 2
    assert f"{f}:1: a line starting with '{{' must be a JSON object" in capsys.readouterr().err


def test_escapes_keep_non_ascii(tmp_path, monkeypatch, capsys):
    seen = _spy(monkeypatch)
    assert main(["generate", "--escapes", r"café\nnaïve 日本 \u00e9\t!", "--gen-length", "8", "--json"]) == 0
    assert seen[-1] == ["café\nnaïve 日本 é\t!"]
    f = tmp_path / "p.txt"
    f.write_text(json.dumps([{"role": "user", "content": "hi"}]) + "\n", encoding="utf-8")
    assert main(["generate", "--escapes", "--batch-file", str(f), "--gen-length", "8", "--json"]) == 0
    assert seen[-1] == [[{"role": "user", "content": "hi"}]]  # conversations pass through unchanged
    capsys.readouterr()
