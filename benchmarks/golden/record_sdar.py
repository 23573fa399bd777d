"""Record SDAR fixtures from SDAR's own code (JetAstra/SDAR @ c2041a83; run locally, the code stays outside).

Two phases, two environments, once per model (``--model tiny``: ``golden_models.sdar_tiny``, fixture
``sdar_sdar-tiny.json``; ``--model integer``: ``test_golden_sdar.sdar_integer``, fixture ``sdar_sdar-integer.json``;
both built without a float-dependent step so that their fixtures hold on every CPU):

1. ``checkpoint`` (this project's environment): write the random-weight SDAR-format checkpoint in SDAR's
   published layout, and the prompts (chat-templated token ids of the bundled tokenizer)::

       PYTHONPATH=tests python benchmarks/golden/record_sdar.py checkpoint --model integer --out /tmp/sdar-int

2. ``record`` (the reference's environment: torch 2.13.0 CPU, transformers 4.52.4, einops, safetensors; the
   reference files copied to ``$SDAR_REF_DIR/sdar_ref/`` as ``sdar_harness/run_ref.py`` says)::

       SDAR_REF_DIR=/path/to/ref /path/to/refenv/bin/python benchmarks/golden/record_sdar.py record \\
           --ckpt /tmp/sdar-int          # -> tests/fixtures/golden/sdar_sdar-integer.json

The reference model class (``SDARForCausalLM`` of ``modeling_sdar.py``) loads the checkpoint; the fixture holds
its full-canvas logits under the block-causal mask (float32, base64) for a few inputs, and for each decoding
case the reference ``block_diffusion_generate``'s output, its forwards (kind: prefill / denoise / store), the
positions each denoising forward committed (masked before, a token after) and overwrote (a token before, a
different one after: the reference's top-k picks unmasked positions when fewer masks than the step's quota are
left). A run in which a block still holds masks after its last step (a committed mask token) makes the
reference raise ``IndexError``: the case keeps the error and the forwards up to it. Checked while recording: the
reference loads every tensor (none missing or unexpected).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _block_recorder as br  # noqa: E402

ROOT = br.ROOT
PROMPTS = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]',
           'Please reverse the order of the list: ["Carol Carter", "David Dixon", "Emma Ellis"]']
# (id, gen_length, block_length, denoising_steps, remasking, temperature, top_k, top_p, threshold, seed)
TINY_CASES = [
    ("greedy_dynamic", 12, 4, 4, "low_confidence_dynamic", 1.0, 1, 1.0, 0.85, 0),
    ("greedy_static", 12, 4, 4, "low_confidence_static", 1.0, 1, 1.0, 0.85, 0),
    ("greedy_sequential", 12, 4, 4, "sequential", 1.0, 1, 1.0, 0.85, 0),
    ("sample_dynamic", 12, 4, 4, "low_confidence_dynamic", 1.0, 0, 1.0, 0.85, 1),
    ("sample_dynamic_t07", 12, 4, 4, "low_confidence_dynamic", 0.7, 0, 1.0, 0.3, 2),
    ("sample_static_topp", 12, 4, 4, "low_confidence_static", 1.0, 0, 0.9, 0.85, 3),
    ("sample_static_b8_s4", 16, 8, 4, "low_confidence_static", 1.0, 0, 1.0, 0.85, 4),
    ("sample_dynamic_b8_s8_topk", 16, 8, 8, "low_confidence_dynamic", 0.8, 20, 1.0, 0.5, 5),
    ("sample_sequential_b8_s8", 16, 8, 8, "sequential", 1.0, 0, 1.0, 0.85, 6),
]
CASES = {
    "tiny": TINY_CASES,
    "integer": TINY_CASES + [
        # the dynamic rule with fewer steps than the block: early steps commit more than their quota, later
        # steps select (and overwrite) decoded positions, in any block
        ("dynamic_b8_s4_topk3", 32, 8, 4, "low_confidence_dynamic", 1.0, 3, 1.0, 0.5, 10),
        ("dynamic_b8_s4_t06", 32, 8, 4, "low_confidence_dynamic", 0.6, 0, 1.0, 0.6, 11),
        ("dynamic_b8_s4_topp", 32, 8, 4, "low_confidence_dynamic", 0.8, 0, 0.8, 0.5, 12),
        ("dynamic_b16_s4_topk2", 48, 16, 4, "low_confidence_dynamic", 1.0, 2, 1.0, 0.6, 13),
        ("dynamic_b16_s4_t06", 48, 16, 4, "low_confidence_dynamic", 0.6, 0, 1.0, 0.6, 14),
        ("dynamic_b16_s4_topk5", 48, 16, 4, "low_confidence_dynamic", 0.8, 5, 1.0, 0.7, 15),
        ("dynamic_b8_s4_topk3_thr03", 40, 8, 4, "low_confidence_dynamic", 1.0, 3, 1.0, 0.3, 20),
        ("dynamic_b16_s4_topk4_thr03", 64, 16, 4, "low_confidence_dynamic", 1.2, 4, 1.0, 0.3, 21),
        ("dynamic_b16_s4_topp_thr04", 64, 16, 4, "low_confidence_dynamic", 0.8, 0, 0.95, 0.4, 22),
        ("greedy_dynamic_b8_s4", 32, 8, 4, "low_confidence_dynamic", 1.0, 1, 1.0, 0.85, 0),
        # a quota above the masks of the prompt's last block: prompt positions overwritten
        ("static_b8_s2", 24, 8, 2, "low_confidence_static", 1.0, 0, 1.0, 0.85, 16),
        ("sequential_b8_s2", 24, 8, 2, "sequential", 1.0, 0, 1.0, 0.85, 17),
        # one step per block: every sampled mask token stays, the block is still masked after its last step
        ("static_b4_s1", 24, 4, 1, "low_confidence_static", 1.0, 0, 1.0, 0.85, 18),
        ("dynamic_b8_s2", 24, 8, 2, "low_confidence_dynamic", 1.0, 0, 1.0, 0.85, 19),
    ],
}


def _fixture(model: str) -> Path:
    return ROOT / "tests" / "fixtures" / "golden" / f"sdar_sdar-{model}.json"


def _builder(model: str):
    sys.path.insert(0, str(ROOT / "tests"))
    if model == "tiny":
        import golden_models as gm

        return lambda: gm.sdar_tiny(0)
    import test_golden_sdar as tg

    return lambda: tg.sdar_integer(0)


def _record(ckpt: Path) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent / "sdar_harness"))
    import run_ref

    meta = br.read_meta(ckpt)
    name = (ckpt / "dllm_model.txt").read_text().strip()
    model = run_ref.load_ref(str(ckpt), torch.float32)
    mask_id, eos = meta["mask_id"], model.config.eos_token_id
    builder = {"tiny": "golden_models.sdar_tiny", "integer": "test_golden_sdar.sdar_integer"}[name]
    fx = {"reference": {"repo": "JetAstra/SDAR", "commit": "c2041a83",
                        "file": "training/model/SDAR-4B-Chat/modeling_sdar.py; generate.py",
                        "function": "SDARForCausalLM.forward; block_diffusion_generate"},
          "model": {"sdar": builder, "seed": 0}, "weights_sha256": meta["weights_sha256"],
          "logits": [], "cases": []}
    g = torch.Generator().manual_seed(0)
    for L, bl in ((12, 4), (19, 4), (16, 8)):
        ids = torch.randint(0, model.config.vocab_size, (1, L), generator=g)
        ids[0, L // 2:] = mask_id
        lg = run_ref.ref_logits(model, ids, bl)[0]
        fx["logits"].append({"input_ids": ids[0].tolist(), "block_length": bl, "shape": list(lg.shape),
                             "logits_f32_b64": br.b64(lg)})
    for p_i, prompt in enumerate(meta["prompt_ids"]):
        for cid, G, bl, steps, rm, temp, top_k, top_p, thr, seed in CASES[name]:
            res = run_ref.ref_generate(model, prompt, mask_id, seed=seed, gen_length=G, block_length=bl,
                                       denoising_steps=steps, temperature=temp, top_k=top_k, top_p=top_p,
                                       remasking_strategy=rm, confidence_threshold=thr,
                                       stopping_criteria_idx=[eos])
            P = len(prompt)
            case = {"id": f"p{p_i}_{cid}", "prompt_ids": [prompt],
                    "params": {"gen_length": G, "block_length": bl, "denoising_steps": steps, "remasking": rm,
                               "temperature": temp, "top_k": top_k, "top_p": top_p, "confidence_threshold": thr,
                               "seed": seed, "stop_ids": [eos]},
                    "nfe": len(res["forwards"]),
                    "forwards": [{"kind": f["kind"], "block": f["block"],
                                  "committed": [c - P for c in f.get("committed", [])],
                                  "overwritten": [c - P for c in f.get("overwritten", [])]}
                                 for f in res["forwards"]]}
            if res["error"] is None:
                case["output"] = [res["output"][0, P:].tolist()]
            else:  # the reference raised: the canvas of the block it stopped in, as its last forward saw it
                last = res["forwards"][-1]
                case["error"] = res["error"]
                case["last_block"] = {"start": last["positions"][0] - P, "tokens": last["input_ids"][0].tolist()}
            fx["cases"].append(case)
    out = _fixture(name)
    out.write_text(json.dumps(fx) + "\n")
    digest = hashlib.sha256(out.read_bytes()).hexdigest()[:12]
    n_err = sum("error" in c for c in fx["cases"])
    n_over = sum(bool(f["overwritten"]) for c in fx["cases"] for f in c["forwards"])
    print(f"wrote {out} ({len(fx['cases'])} cases, {n_err} ending in the reference's IndexError, {n_over} forwards "
          f"overwriting, {len(fx['logits'])} logits inputs, sha256 {digest})")


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["checkpoint", "record"])
    ap.add_argument("--model", choices=sorted(CASES), default="integer", help="checkpoint: which model")
    ap.add_argument("--out", type=Path, help="checkpoint: the directory to write")
    ap.add_argument("--ckpt", type=Path, help="record: the directory the checkpoint phase wrote")
    a = ap.parse_args()
    if a.phase == "checkpoint":
        br.write_checkpoint(_builder(a.model), a.out, PROMPTS)
        (a.out / "dllm_model.txt").write_text(a.model + "\n")
    elif "SDAR_REF_DIR" not in os.environ:
        raise SystemExit("set SDAR_REF_DIR to the directory holding the reference files (see the harness)")
    else:
        _record(a.ckpt)


if __name__ == "__main__":
    _main()
