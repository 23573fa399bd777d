"""Record LLaDA2.x fixtures from LLaDA2's own code (LLaDA2MoeModelLM; run locally, the code stays outside).

Two phases, two environments, as ``record_sdar.py``:

1. ``checkpoint`` (this project's environment): write the random-weight LLaDA2-format checkpoint of
   ``tests/golden_models.py`` (``llada2_tiny``: fused QKV, QK norms, partial rotary, a dense layer then 8 routed
   experts with an expert bias and a shared expert) and the prompts::

       PYTHONPATH=tests python benchmarks/golden/record_llada2.py checkpoint --out /tmp/llada2-ckpt

2. ``record`` (the reference's environment: torch 2.13.0 CPU, transformers 4.52.4, safetensors; the reference
   files in ``$LLADA2_REF_DIR/llada2_ref/`` as ``llada2_harness/run_ref.py`` says)::

       LLADA2_REF_DIR=/path/to/ref /path/to/refenv/bin/python benchmarks/golden/record_llada2.py record \\
           --ckpt /tmp/llada2-ckpt          # -> tests/fixtures/golden/llada2_llada2-tiny.json

The fixture holds the reference model's full-canvas logits under the block-causal mask (float32, base64) for a
few inputs, and for each decoding case the output of the model's own ``generate`` (prompt removed), its forward
count and the positions committed at every forward (``transfer_index``, commits of the mask token itself
included). Cases with options also run ``generate``'s ``eos_early_stop`` and ``minimal_topk``, some with another
``eos_id`` (recorded in their ``params``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _block_recorder as br  # noqa: E402

ROOT = br.ROOT
FIXTURE = ROOT / "tests" / "fixtures" / "golden" / "llada2_llada2-tiny.json"
PROMPTS = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]',
           'Please reverse the order of the list: ["Carol Carter", "David Dixon", "Emma Ellis"]']
# (id, gen_length, block_length, steps, threshold, temperature, top_k, top_p, seed[, options]); options: generate's
# eos_early_stop and minimal_topk, and an eos_id other than the checkpoint's EOS (a token the random-weight model
# proposes often, so that it ends rows early; none of the prompts holds it)
CASES = [
    ("greedy_t0.5", 12, 4, 4, 0.5, 0.0, None, None, 0),
    ("greedy_t0.95", 12, 4, 4, 0.95, 0.0, None, None, 0),
    ("greedy_t0.1", 12, 4, 4, 0.1, 0.0, None, None, 0),
    ("greedy_b8_s4", 16, 8, 4, 0.5, 0.0, None, None, 0),
    ("greedy_b8_s8_t0.3", 16, 8, 8, 0.3, 0.0, None, None, 0),
    ("sample_t0.7", 12, 4, 4, 0.5, 0.7, None, None, 1),
    ("sample_topk_topp", 12, 4, 4, 0.5, 1.0, 20, 0.9, 2),
    ("eos80_keep_t0.5", 12, 4, 4, 0.5, 0.0, None, None, 0, {"eos_id": 80, "eos_early_stop": False}),
    ("eos80_stop_t0.5", 12, 4, 4, 0.5, 0.0, None, None, 0, {"eos_id": 80, "eos_early_stop": True}),
    ("eos80_keep_b8_s4", 16, 8, 4, 0.5, 0.0, None, None, 0, {"eos_id": 80, "eos_early_stop": False}),
    ("eos80_stop_b8_s4", 16, 8, 4, 0.5, 0.0, None, None, 0, {"eos_id": 80, "eos_early_stop": True}),
    ("eos80_stop_b8_s8_t0.3", 16, 8, 8, 0.3, 0.0, None, None, 0, {"eos_id": 80, "eos_early_stop": True}),
    ("eos1131_stop_sample_t0.7", 12, 4, 4, 0.5, 0.7, None, None, 1, {"eos_id": 1131, "eos_early_stop": True}),
    # G=10: the canvas runs past gen_length; an EOS there ends the row with more than gen_length tokens
    ("eos1034_stop_tail_b8_s4", 10, 8, 4, 0.95, 0.0, None, None, 0, {"eos_id": 1034, "eos_early_stop": True}),
    ("minimal_topk4_t0.06", 12, 4, 4, 0.06, 0.0, None, None, 0, {"minimal_topk": 4}),  # 3 steps per block
    ("minimal_topk2_b8_s8_t0.06", 12, 8, 8, 0.06, 0.0, None, None, 0, {"minimal_topk": 2}),  # 6 steps
    ("minimal_topk4_b8_s8_t0.95", 16, 8, 8, 0.95, 0.0, None, None, 0, {"minimal_topk": 4}),  # 4 steps
    ("minimal_topk1_g6_b8_s8", 6, 8, 8, 0.95, 0.0, None, None, 0, {"minimal_topk": 1}),  # the default: 6 steps
    ("minimal_topk2_eos80_stop_b8_s8_t0.06", 12, 8, 8, 0.06, 0.0, None, None, 0,
     {"eos_id": 80, "eos_early_stop": True, "minimal_topk": 2}),
]


def _checkpoint(out: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import golden_models as gm

    br.write_checkpoint(lambda: gm.llada2_tiny(0), out, PROMPTS)


def _record(ckpt: Path) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent / "llada2_harness"))
    import run_ref

    meta = br.read_meta(ckpt)
    model = run_ref.load_ref(str(ckpt), torch.float32)
    mask_id, eos = meta["mask_id"], meta["eos_id"]
    fx = {"reference": {"repo": "inclusionAI LLaDA2.0 (Hugging Face modeling file, as copied in "
                                "sajadn/Megatron-Bridge @ 4fde5488)", "commit": "4fde5488",
                        "file": "modeling_llada2_moe.py", "function": "LLaDA2MoeModelLM.forward; generate"},
          "model": {"llada2": "llada2_tiny", "seed": 0}, "weights_sha256": meta["weights_sha256"],
          "logits": [], "cases": []}
    g = torch.Generator().manual_seed(0)
    for L, bl in ((12, 4), (19, 4), (16, 8)):
        ids = torch.randint(9, model.config.vocab_size, (1, L), generator=g)
        ids[0, L // 2:] = mask_id
        lg = run_ref.ref_logits(model, ids, bl)[0]
        fx["logits"].append({"input_ids": ids[0].tolist(), "block_length": bl, "shape": list(lg.shape),
                             "logits_f32_b64": br.b64(lg)})
    for p_i, prompt in enumerate(meta["prompt_ids"]):
        for cid, G, bl, steps, thr, temp, top_k, top_p, seed, *opts in CASES:
            params = {"gen_length": G, "block_length": bl, "steps": steps, "threshold": thr, "temperature": temp,
                      "top_k": top_k, "top_p": top_p, "seed": seed, "eos_id": eos}
            if opts:  # only the cases with options record them (the others' records stay as they were)
                params.update({"eos_early_stop": False, "minimal_topk": 1, **opts[0]})
                if params["eos_id"] in prompt:
                    raise SystemExit(f"{cid}: the prompt holds eos_id {params['eos_id']}")
            extra = {k: params[k] for k in ("eos_early_stop", "minimal_topk") if k in params}
            torch.manual_seed(seed)
            res = run_ref.ref_generate(model, torch.tensor([prompt]), temperature=temp, block_length=bl, steps=steps,
                                       gen_length=G, top_p=top_p, top_k=top_k, threshold=thr,
                                       eos_id=params["eos_id"], mask_id=mask_id, **extra)
            P = len(prompt)
            fx["cases"].append({
                "id": f"p{p_i}_{cid}", "prompt_ids": [prompt], "params": params,
                "output": [res["output"][0, P:].tolist()], "nfe": res["n_forwards"],
                "forwards": [sorted(c - P for c in f.get("committed_positions", [])) for f in res["forwards"]]})
    FIXTURE.write_text(json.dumps(fx) + "\n")
    digest = hashlib.sha256(FIXTURE.read_bytes()).hexdigest()[:12]
    print(f"wrote {FIXTURE} ({len(fx['cases'])} cases, {len(fx['logits'])} logits inputs, sha256 {digest})")


if __name__ == "__main__":
    br.main(__doc__, _checkpoint, _record, "LLADA2_REF_DIR")
