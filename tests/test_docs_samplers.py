"""docs/samplers.md says what the registry and the command line really do: which presets take ``fused``,
``confidence`` and ``softmax_dtype``, and what the guided-decoding example prints on the bundled tiny models."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from dllm.cli import main
from dllm.samplers import SAMPLERS

DOC = (Path(__file__).resolve().parents[1] / "docs" / "samplers.md").read_text(encoding="utf-8")


def _names(text: str) -> set[str]:
    """The preset names in backticks in ``text`` (``dream*``: every ``dream`` preset)."""
    out = set()
    for name in re.findall(r"`([a-z0-9*-]+)`", text):
        out |= {n for n in SAMPLERS if n.startswith("dream")} if name == "dream*" else {name}
    return out & (set(SAMPLERS) | {n for n in SAMPLERS if n.startswith("dream")})


def _without(param: str) -> set[str]:
    return {n for n, e in SAMPLERS.items() if param not in e.params()}


def test_the_presets_that_take_fused():
    said = re.search(r"The presets that take `fused` as a parameter are (.*?)\(`dllm samplers`", DOC, re.S)
    assert said, "docs/samplers.md no longer lists the presets that take fused"
    assert _names(said.group(1)) == set(SAMPLERS) - _without("fused")


def test_the_exceptions_to_confidence_and_softmax_dtype():
    conf = re.search(r"`confidence` \(`prob`, (.*?)\), `softmax_dtype`", DOC, re.S)
    soft = re.search(r"`softmax_dtype` \(`float32`; (.*?)\) and\s+`block_length`", DOC, re.S)
    assert conf and soft, "docs/samplers.md no longer lists the presets without confidence / softmax_dtype"
    assert _names(conf.group(1)) == _without("confidence")
    assert _names(soft.group(1)) == _without("softmax_dtype")


def test_the_guided_example_prints_what_the_doc_shows(capsys):
    m = re.search(r"```bash\n(dllm generate --guide ar-tiny[^\n]*)\n```\n\n[^\n]*\n\n```\n(.*?)\n```", DOC, re.S)
    assert m, "docs/samplers.md no longer shows the guided example with its output"
    command, shown = m.group(1), m.group(2).splitlines()
    capsys.readouterr()
    assert main(shlex.split(command)[1:]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == shown[:1]
    timeless = re.sub(r"\d+\.\d+s", "TIME", err.strip().splitlines()[-1])
    assert timeless == re.sub(r"\d+\.\d+s", "TIME", shown[1])
