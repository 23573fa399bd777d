"""Record SDAR fixtures from SDAR's own code (JetAstra/SDAR @ c2041a83; run locally, the code stays outside).

Two phases, two environments:

1. ``checkpoint`` (this project's environment): write the random-weight SDAR-format checkpoint of
   ``tests/golden_models.py`` (``sdar_tiny``) in SDAR's published layout, and the prompts (chat-templated token
   ids of the bundled tokenizer)::

       PYTHONPATH=tests python benchmarks/golden/record_sdar.py checkpoint --out /tmp/sdar-ckpt

2. ``record`` (the reference's environment: torch 2.13.0 CPU, transformers 4.52.4, einops, safetensors; the
   reference files copied to ``$SDAR_REF_DIR/sdar_ref/`` as ``sdar_harness/run_ref.py`` says)::

       SDAR_REF_DIR=/path/to/ref /path/to/refenv/bin/python benchmarks/golden/record_sdar.py record \\
           --ckpt /tmp/sdar-ckpt          # -> tests/fixtures/golden/sdar_sdar-tiny.json

The reference model class (``SDARForCausalLM`` of ``modeling_sdar.py``) loads the checkpoint; the fixture holds
its full-canvas logits under the block-causal mask (float32, base64) for a few inputs, and for each decoding
case the reference ``block_diffusion_generate``'s output, its forwards (kind: prefill / denoise / store) and the
positions committed at each denoising forward. Checks while recording: the reference loads every tensor (none
missing or unexpected), and no forward overwrites a prompt token (the reference's first-block quirk; such
settings are not recorded).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _block_recorder as br  # noqa: E402

ROOT = br.ROOT
FIXTURE = ROOT / "tests" / "fixtures" / "golden" / "sdar_sdar-tiny.json"
PROMPTS = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]',
           'Please reverse the order of the list: ["Carol Carter", "David Dixon", "Emma Ellis"]']
# (id, gen_length, block_length, denoising_steps, remasking, temperature, top_k, top_p, threshold, seed)
CASES = [
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


def _checkpoint(out: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import golden_models as gm

    br.write_checkpoint(lambda: gm.sdar_tiny(0), out, PROMPTS)


def _record(ckpt: Path) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent / "sdar_harness"))
    import run_ref

    meta = br.read_meta(ckpt)
    model = run_ref.load_ref(str(ckpt), torch.float32)
    mask_id, eos = meta["mask_id"], model.config.eos_token_id
    fx = {"reference": {"repo": "JetAstra/SDAR", "commit": "c2041a83",
                        "file": "training/model/SDAR-4B-Chat/modeling_sdar.py; generate.py",
                        "function": "SDARForCausalLM.forward; block_diffusion_generate"},
          "model": {"sdar": "sdar_tiny", "seed": 0}, "weights_sha256": meta["weights_sha256"],
          "logits": [], "cases": []}
    g = torch.Generator().manual_seed(0)
    for L, bl in ((12, 4), (19, 4), (16, 8)):
        ids = torch.randint(0, model.config.vocab_size, (1, L), generator=g)
        ids[0, L // 2:] = mask_id
        lg = run_ref.ref_logits(model, ids, bl)[0]
        fx["logits"].append({"input_ids": ids[0].tolist(), "block_length": bl, "shape": list(lg.shape),
                             "logits_f32_b64": br.b64(lg)})
    for p_i, prompt in enumerate(meta["prompt_ids"]):
        for cid, G, bl, steps, rm, temp, top_k, top_p, thr, seed in CASES:
            res = run_ref.ref_generate(model, prompt, mask_id, seed=seed, gen_length=G, block_length=bl,
                                       denoising_steps=steps, temperature=temp, top_k=top_k, top_p=top_p,
                                       remasking_strategy=rm, confidence_threshold=thr,
                                       stopping_criteria_idx=[eos])
            if any(f.get("overwritten") for f in res["forwards"]):
                print(f"skip {cid} on prompt {p_i}: the reference overwrote prompt tokens")
                continue
            P = len(prompt)
            fx["cases"].append({
                "id": f"p{p_i}_{cid}", "prompt_ids": [prompt],
                "params": {"gen_length": G, "block_length": bl, "denoising_steps": steps, "remasking": rm,
                           "temperature": temp, "top_k": top_k, "top_p": top_p, "confidence_threshold": thr,
                           "seed": seed, "stop_ids": [eos]},
                "output": [res["output"][0, P:].tolist()], "nfe": len(res["forwards"]),
                "forwards": [{"kind": f["kind"], "block": f["block"],
                              "committed": [c - P for c in f.get("committed", [])]} for f in res["forwards"]]})
    FIXTURE.write_text(json.dumps(fx) + "\n")
    digest = hashlib.sha256(FIXTURE.read_bytes()).hexdigest()[:12]
    print(f"wrote {FIXTURE} ({len(fx['cases'])} cases, {len(fx['logits'])} logits inputs, sha256 {digest})")


if __name__ == "__main__":
    br.main(__doc__, _checkpoint, _record, "SDAR_REF_DIR")
