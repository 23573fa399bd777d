"""train-tiny's argument checks and save_pretrained over an earlier checkpoint: refused before anything is
written, and a re-save leaves no earlier tokenizer behind."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from dllm.assets import BUNDLED
from dllm.models.loading import load_model, save_pretrained
from tests.cli_helpers import refused

TINY = ["--steps", "1", "--batch-size", "2", "--layers", "1", "--mlp", "8", "--examples-per-task", "2"]


def _digest(d):
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("family", ["llada", "sdar", "ar"])
def test_odd_head_size_refused(capsys, tmp_path, family):
    out = tmp_path / "o"
    refused(capsys, ["train-tiny", "--family", family, "--out", str(out), "--d-model", "6", "--heads", "2", *TINY],
            "--d-model 6", "--heads 2", "even head size")
    assert not out.exists()


@pytest.mark.parametrize("option", ["--lr", "--time-budget"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_non_finite_float_options_refused(capsys, tmp_path, option, value):
    out = tmp_path / "o"
    refused(capsys, ["train-tiny", "--family", "llada", "--out", str(out), option, value, *TINY],
            option, "finite")
    assert not out.exists()


@pytest.mark.parametrize("argv,needles", [
    (["--family", "llada", "--init-from", "/nonexist/ckpt"], ["--init-from", "no such directory"]),
    (["--family", "llada", "--init-from-ar", "/nonexist/ckpt"], ["--init-from-ar", "no such directory"]),
    (["--family", "ar", "--init-from", "/nonexist/ckpt"], ["--init-from", "no such directory"]),
    (["--family", "sdar", "--init-from", "llada-tiny", "--d-model", "64", "--heads", "4"],
     ["--init-from llada-tiny", "family: checkpoint 'llada', run 'sdar'", "train with the checkpoint's"]),
])
def test_bad_init_from_leaves_existing_out_untouched(capsys, tmp_path, argv, needles):
    out = tmp_path / "ckpt"
    shutil.copytree(BUNDLED["llada-tiny"], out)
    before = _digest(out)
    line = refused(capsys, ["train-tiny", "--out", str(out), *TINY, *argv], *needles)
    assert "TransformerConfig(" not in line
    assert _digest(out) == before


def test_init_from_shape_mismatch_lists_only_differing_fields(capsys, tmp_path):
    line = refused(capsys, ["train-tiny", "--family", "llada", "--out", str(tmp_path / "o"), "--init-from",
                            "llada-tiny", "--d-model", "32", "--heads", "4", *TINY], "d_model: checkpoint 64, run 32")
    assert "TransformerConfig(" not in line and "rope_theta" not in line
    assert not (tmp_path / "o").exists()


def test_save_over_another_checkpoint_replaces_its_tokenizer(tmp_path):
    d = tmp_path / "x"
    shutil.copytree(BUNDLED["llada-tiny"], d)
    (d / "notes.txt").write_text("mine")
    model = load_model(BUNDLED["sdar-tiny"])
    save_pretrained(model, d)
    fresh = tmp_path / "fresh"
    save_pretrained(model, fresh)
    assert sorted(p.name for p in d.iterdir()) == sorted([*(p.name for p in fresh.iterdir()), "notes.txt"])
    assert not (d / "training.json").exists()
    loaded = load_model(d)
    assert (loaded.mask_id, loaded.spec.family) == (model.mask_id, "sdar")


def test_save_without_tokenizer_over_a_tokenizer_refused(tmp_path):
    d = tmp_path / "x"
    shutil.copytree(BUNDLED["llada-tiny"], d)
    before = _digest(d)
    with pytest.raises(ValueError, match="holds another save's tokenizer.*tokenizer=False"):
        save_pretrained(load_model(BUNDLED["sdar-tiny"], tokenizer=False), d)
    assert _digest(d) == before
    save_pretrained(load_model(BUNDLED["sdar-tiny"], tokenizer=False), tmp_path / "new")  # a new directory: fine


@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": "int8"}, "unknown dtype"),
    ({"max_shard_bytes": "lots"}, "max_shard_bytes 'lots' is not a size"),
    ({"max_shard_bytes": "-1GB"}, "max_shard_bytes '-1GB' must be at least one whole byte"),
    ({"max_shard_bytes": "0GB"}, "at least one whole byte"),
    ({"max_shard_bytes": 0.5}, "max_shard_bytes 0.5 must be at least one whole byte"),
    ({"max_shard_bytes": float("inf")}, "at least one whole byte"),
])
def test_save_arguments_checked_before_anything_is_written(tmp_path, kwargs, match):
    model = load_model(BUNDLED["llada-tiny"], tokenizer=False)
    with pytest.raises(ValueError, match=match):
        save_pretrained(model, tmp_path / "s" / "sub", **kwargs)
    assert not (tmp_path / "s").exists()
