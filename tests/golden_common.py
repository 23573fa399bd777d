"""Golden trajectories recorded from the public reference implementations, and how we compare against them.

A fixture file (``tests/fixtures/golden/<name>.json``) is data written by a recording script under
``benchmarks/golden/`` that ran the reference code locally (the reference code never enters this repository).
Schema::

    {"reference": {"repo": "owner/name", "commit": "<sha>", "file": "path/in/repo.py", "function": "name"},
     "model": "llada-tiny" | "dream-tiny" | {"shaped": "llada" | "dream", "seed": int},
     "weights_sha256": "<sha256 of the model's state dict, see state_sha256>",
     "cases": [{"id": str,
                "prompt_ids": [[int, ...], ...],          # one list per row (usually one row)
                "params": {...},                           # the reference call's arguments, verbatim (plus the
                                                           # recording script's own keys, e.g. "seed" of the
                                                           # global RNG or which function ran; see the script)
                "output": [[int, ...], ...],               # generated ids per row (gen_length each)
                "nfe": int,                                # model forward calls the reference made
                "steps": [[[int, ...], ...], ...]}]}        # per forward, per row: generated positions (0-based
                                                           # offsets into the generation) committed after it

``steps`` has one entry per reference forward (an entry may be empty, e.g. the extra forward that the June
2025 Fast-dLLM cached generators run after a block their first forward decoded entirely); positions are
sorted ascending.

Optional case fields:

* ``"ties": [int, ...]`` -- forwards whose selection the reference decided among exactly equal scores (the
  lowest committed score of a row equals the highest score of a candidate it left masked; e.g. several EOS
  positions at probability 1.0 in float32). ``torch.topk`` orders equal values its own way, so a comparison
  is exact only up to the first such forward (then the per-row commit counts must still agree).
* ``"computed": [[[int, ...], ...], ...]`` -- per forward, per row: the sorted generated-position offsets whose
  hidden states the reference recomputed in that forward (query rows of a partial forward; every position
  for a full forward), for caches that recompute a subset of the canvas.
* ``"blocks": [int, ...]`` -- AdaBlock: the block lengths the reference chose, in order.
* ``"early_exit": bool`` -- Prophet: whether the reference's early exit fired.

``"model"`` may also be ``{"shaped": family, "seed": int, "active": [int, ...]}``: the shaped model with those
ids among its proposals (:func:`golden_models.shaped_model`).

On our side :func:`record_steps` runs ``dllm.generate`` with a forward pre-hook that snapshots the canvas
before each forward; the difference between consecutive snapshots (and the final output) gives the positions
committed after each forward, in the same layout as the fixture.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "golden"


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def save_fixture(name: str, data: dict) -> Path:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / f"{name}.json"
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return path


def decode_logits(rec: dict) -> torch.Tensor:
    """The float32 logits a block-diffusion fixture stores base64-encoded (``logits_f32_b64``, ``shape``)."""
    import base64

    import numpy as np

    flat = np.frombuffer(base64.b64decode(rec["logits_f32_b64"]), dtype="<f4").copy()
    return torch.from_numpy(flat).view(*rec["shape"])


# Block-diffusion logits are compared relative to the largest |logit| at the same position: float32 sums taken in
# another order (the reference's code against ours, one CPU's SIMD kernels against another's: ATEN_CPU_CAPABILITY
# default / avx2 / avx512) differ by a few units in the last place of the values summed, so the error grows with the
# logits' size, and an absolute limit fails on large logits. Measured on the LLaDA2.0, LLaDA2.1 and Fast-dLLM v2
# fixtures (logits up to 26 in magnitude): at most 1.3e-6 of the position's largest |logit| (1.9e-5 absolute) under
# default and avx2 kernels, 0 under the AVX-512 kernels they were recorded with. The limit leaves a margin of ~8;
# a misplaced norm, bias or mask moves logits by far more.
LOGITS_RTOL = 1e-5


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, rtol: float = LOGITS_RTOL) -> None:
    """Each position's logits (last dimension) within ``rtol`` times that position's largest |logit| in ``want``
    (see :data:`LOGITS_RTOL` for why relative)."""
    assert got.shape == want.shape, f"logits of shape {tuple(got.shape)}, the reference's {tuple(want.shape)}"
    err = (got - want).abs().amax(-1)
    limit = rtol * want.abs().amax(-1)
    assert bool((err <= limit).all()), (f"logits differ by up to {(err / limit).max().item():.2f} times the limit "
                                        f"(rtol {rtol} of each position's largest |logit|; max abs {err.max():.3g})")


def state_sha256(module: torch.nn.Module) -> str:
    """A digest of a model's weights (names, shapes, fp32 bytes), to check both sides used the same ones."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def steps_from_canvases(canvases: list[torch.Tensor], final: torch.Tensor, prompt_len: int, mask_id: int):
    """Per forward, per row: generated positions that went from mask to a token between the canvas seen by
    this forward and the next one (the last forward is compared with ``final``). Canvases are ``[B, T]``
    with the generation at columns ``prompt_len:``."""
    out = []
    seq = [c[:, prompt_len:] for c in canvases] + [final]
    for before, after in zip(seq[:-1], seq[1:]):
        newly = (before == mask_id) & (after != mask_id)
        out.append([row.nonzero().flatten().tolist() for row in newly])
    return out


def record_steps(model, prompts, **generate_kwargs):
    """``dllm.generate`` with the canvas recorded before every forward: ``(output, steps)`` where ``steps``
    follows the fixture layout. A CFG forward (two stacked batches) is recorded once (its first half)."""
    import dllm

    canvases: list[torch.Tensor] = []

    def hook(_module, args, kwargs):
        x = args[0] if args else kwargs["tokens"]
        canvases.append(x.detach().clone())

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = dllm.generate(model, prompts, **generate_kwargs)
    finally:
        handle.remove()
    B = out.sequences.shape[0]
    canvases = [c[:B] for c in canvases]
    P = canvases[0].shape[1] - out.sequences.shape[1]
    return out, steps_from_canvases(canvases, out.sequences, P, model.mask_id)


def first_divergence(ours: list, ref: list) -> str | None:
    """``None`` when the two step lists are equal, else a message naming the first differing forward."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return f"forward {i}: ours committed {a}, the reference {b}"
    if len(ours) != len(ref):
        return f"ours made {len(ours)} forwards, the reference {len(ref)}"
    return None


# ------------------------------------------------------------------------------------- replaying fixtures
def fixture_names() -> list[str]:
    return sorted(p.stem for p in FIXTURES.glob("*.json")) if FIXTURES.exists() else []


@functools.cache
def load_fixture_cached(name: str) -> dict:
    return load_fixture(name)


def fixture_cases(references) -> list:
    """``pytest.param(name, case_id)`` for every case of the fixtures of ``references`` (fixture names are
    ``<reference>_<model>``)."""
    import pytest

    return [pytest.param(name, case["id"], id=f"{name}-{case['id']}")
            for name in fixture_names() if name.split("_")[0] in references
            for case in load_fixture_cached(name)["cases"]]


@functools.cache
def _model(key):
    if isinstance(key, str):
        import dllm
        import dllm.assets

        return dllm.load_model(str(dllm.assets.model_path(key)), dtype="float32")
    import golden_models as gm

    family, seed, active = key
    return gm.shaped_model(family, seed, active=active)


def fixture_model(fx: dict):
    """The model a fixture was recorded with: a bundled checkpoint by name, or a shaped random model
    (``{"shaped": family, "seed": int[, "active": [ids]]}``)."""
    m = fx["model"]
    return _model(m if isinstance(m, str) else (m["shaped"], m["seed"], tuple(m.get("active", ()))))


def adaptive_blocks(out) -> list[int]:
    """Row 0's block lengths in order, from the trace of a run with an adaptive block policy (AdaBlock)."""
    return [rec["hi"][0] - rec["lo"][0] for rec in out.stats.trace if rec.get("block_start", [False])[0]]


def trim_idle_tail(steps: list) -> list:
    """The reference's forwards up to the one that completed its output: forwards after it commit nothing for
    any row (Dream's ``diffusion_generate`` always runs ``steps`` forwards; dllm stops when nothing is left)."""
    n = len(steps)
    while n > 0 and not any(steps[n - 1]):
        n -= 1
    return steps[:n]


def compare_case(case: dict, out, steps: list) -> int | None:
    """Assert that a dllm run (``out``, ``steps`` from :func:`record_steps`) reproduces a fixture case: the same
    positions committed after every forward, the same generated ids, and as many forwards as the reference
    made up to the one that completed its output.

    At a forward the reference decided among exactly equal scores (``case["ties"]``) the two may order the
    tied positions differently (``torch.topk``'s order among equal values is unspecified): if that is the first
    forward where they differ, each row must still commit as many positions there, and the comparison stops
    (what follows may differ): the index of that forward is returned, ``None`` when everything was compared."""
    assert len(case["steps"]) == case["nfe"], "fixture: one steps entry per reference forward"
    ref = trim_idle_tail(case["steps"])
    ties = set(case.get("ties", []))
    for i, (a, b) in enumerate(zip(steps, ref)):
        if a == b:
            continue
        assert i in ties, f"forward {i}: ours committed {a}, the reference {b}"
        assert [len(r) for r in a] == [len(r) for r in b], f"forward {i} (a tie): ours committed {a}, the reference {b}"
        return i  # the tied positions were ordered differently: the later forwards may differ
    assert len(steps) == len(ref), f"ours made {len(steps)} forwards, the reference {len(ref)}"
    assert out.sequences.tolist() == case["output"]
    assert out.stats.nfe == len(ref)
    return None
