"""Record Fast-dLLM v2 fixtures from its own code (run locally, the code stays outside).

The reference: the Hugging Face model file of Efficient-Large-Model/Fast_dLLM_v2_7B (``modeling.py`` and
``configuration.py``: ``Fast_dLLM_QwenForCausalLM`` and its ``generate``; public copies ``v2/modeling_ori.py`` and
``v2/configuration.py`` of wangziyannb/Fast-dLLM @ fd27cb3) and ``v2/generation_functions.py`` of NVlabs/Fast-dLLM
@ d259b48 (``batch_sample``, the decoder of the official evaluation ``v2/eval.py``).

Two phases, two environments:

1. ``checkpoint`` (this project's environment): write the random-weight Fast-dLLM v2-format checkpoint of
   ``tests/golden_models.py`` (``fastdllm2_tiny``) in the published layout, and the prompts (chat-templated token
   ids of the bundled tokenizer)::

       PYTHONPATH=tests python benchmarks/golden/record_fastdllm2.py checkpoint --out /tmp/fd2-ckpt

2. ``record`` (the reference's environment: torch 2.13.0 CPU, transformers 4.53.1 (the reference's pin), einops,
   safetensors; the three reference files in ``$FASTDLLM2_REF_DIR`` as ``fastdllm2_harness/run_ref.py`` says)::

       FASTDLLM2_REF_DIR=/path/to/ref /path/to/refenv/bin/python benchmarks/golden/record_fastdllm2.py record \\
           --ckpt /tmp/fd2-ckpt          # -> tests/fixtures/golden/fastdllm2_fastdllm2-tiny.json

The reference model class loads the checkpoint; the fixture holds its raw full-canvas logits under the
block-causal mask (float32, base64; the decoders shift them, position i from hidden row i - 1) for a few inputs,
and for each decoding case the reference decoder's output after the prompt, its forwards (kind: prefill /
denoise / subblock / store, block) and the positions committed at each denoising forward. Each prompt runs alone
(batch size 1: ``min_len`` and ``seq_len`` its length, as the official evaluation passes them for a batch of one).
Prompts of exactly one block are not recorded (the reference then decodes without the prompt; see
docs/block-diffusion.md).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _block_recorder as br  # noqa: E402

ROOT = br.ROOT
FIXTURE = ROOT / "tests" / "fixtures" / "golden" / "fastdllm2_fastdllm2-tiny.json"
PROMPTS = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]',
           'Please reverse the order of the list: ["Carol Carter", "David Dixon", "Emma Ellis"]', "Hi"]
# (id, reference decoder, prompt, gen_length, block, sub-block, threshold, temperature, top_p, block cache, seed)
CASES = [
    ("bs_greedy_b8s4", "batch_sample", 0, 32, 8, 4, 0.9, 0.0, 0.95, False, 0),
    ("bs_greedy_b8s4_cache", "batch_sample", 0, 32, 8, 4, 0.9, 0.0, 0.95, True, 0),
    ("bs_greedy_b8s2_t05", "batch_sample", 1, 32, 8, 2, 0.5, 0.0, 0.95, False, 0),
    ("bs_greedy_b8s2_t05_cache", "batch_sample", 1, 32, 8, 2, 0.5, 0.0, 0.95, True, 0),
    ("bs_greedy_b8s4_t07_cache", "batch_sample", 2, 32, 8, 4, 0.7, 0.0, 0.95, True, 0),
    ("bs_greedy_b16s4_t07", "batch_sample", 2, 32, 16, 4, 0.7, 0.0, 0.95, False, 0),
    ("bs_greedy_b16s4_t095_cache", "batch_sample", 3, 32, 16, 4, 0.95, 0.0, 0.95, True, 0),
    ("bs_greedy_b16s8_t06", "batch_sample", 3, 32, 16, 8, 0.6, 0.0, 0.95, False, 0),
    ("bs_greedy_b16s16_t08_cache", "batch_sample", 0, 32, 16, 16, 0.8, 0.0, 0.95, True, 0),
    ("bs_greedy_b64s16_cache", "batch_sample", 0, 64, 64, 16, 0.9, 0.0, 0.95, True, 0),
    ("bs_greedy_b8s4_t1", "batch_sample", 0, 32, 8, 4, 1.0, 0.0, 0.95, False, 0),
    ("bs_sample_b8s4", "batch_sample", 0, 32, 8, 4, 0.9, 1.0, 0.95, False, 1),
    ("bs_sample_b8s4_cache", "batch_sample", 1, 32, 8, 4, 0.6, 0.7, 0.9, True, 2),
    ("bs_sample_b16s4_topp1_cache", "batch_sample", 2, 32, 16, 4, 0.5, 1.0, 1.0, True, 3),
    ("bs_sample_b8s2_hot", "batch_sample", 3, 32, 8, 2, 0.9, 1.3, 0.8, False, 4),
    ("bs_sample_b16s8", "batch_sample", 2, 32, 16, 8, 0.95, 0.5, 0.95, False, 5),
    ("gen_greedy_b8s4", "generate", 0, 32, 8, 4, 0.9, 0.0, 0.95, False, 0),
    ("gen_greedy_b8s2_t05_cache", "generate", 1, 32, 8, 2, 0.5, 0.0, 0.95, True, 0),
    ("gen_greedy_b16s4_t07_cache", "generate", 2, 32, 16, 4, 0.7, 0.0, 0.95, True, 0),
    ("gen_greedy_b16s8_t1_cache", "generate", 0, 32, 16, 8, 1.0, 0.0, 0.95, True, 0),
    ("gen_greedy_b64s16", "generate", 1, 64, 64, 16, 0.9, 0.0, 0.95, False, 0),
    ("gen_sample_b8s4", "generate", 3, 32, 8, 4, 0.7, 1.0, 0.95, False, 6),
    ("gen_sample_b16s4_cache", "generate", 1, 32, 16, 4, 0.6, 0.8, 0.9, True, 7),
]


def _checkpoint(out: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import golden_models as gm

    br.write_checkpoint(lambda: gm.fastdllm2_tiny(0), out, PROMPTS)


def _record(ckpt: Path) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent / "fastdllm2_harness"))
    import run_ref

    meta = br.read_meta(ckpt)
    model = run_ref.load_ref(str(ckpt), torch.float32)
    mask_id, stop, pad = meta["mask_id"], meta["eot_id"], meta["pad_id"]
    fx = {"reference": {"files": {"modeling.py, configuration.py": "Efficient-Large-Model/Fast_dLLM_v2_7B (hub; "
                                  "copies: wangziyannb/Fast-dLLM @ fd27cb3, v2/modeling_ori.py, v2/configuration.py)",
                                  "generation_functions.py": "NVlabs/Fast-dLLM @ d259b48, v2/generation_functions.py"},
                        "function": "Fast_dLLM_QwenForCausalLM.forward; batch_sample; generate",
                        "environment": "torch 2.13.0 CPU, transformers 4.53.1"},
          "model": {"fastdllm2": "fastdllm2_tiny", "seed": 0}, "weights_sha256": meta["weights_sha256"],
          "logits": [], "cases": []}
    g = torch.Generator().manual_seed(0)
    for L, bl in ((12, 4), (19, 8), (24, 16)):
        ids = torch.randint(0, model.config.vocab_size, (1, L), generator=g)
        ids[0, L // 2:] = mask_id
        lg = run_ref.ref_logits(model, ids, bl)[0]
        fx["logits"].append({"input_ids": ids[0].tolist(), "block_length": bl, "shape": list(lg.shape),
                             "logits_f32_b64": br.b64(lg)})
    for cid, fn, p_i, G, B, S, thr, temp, top_p, cache, seed in CASES:
        prompt = meta["prompt_ids"][p_i]
        if len(prompt) == B:
            raise SystemExit(f"case {cid}: a prompt of exactly one block; the reference ignores it, pick another")
        try:
            res = run_ref.ref_decode(model, prompt, fn, seed=seed, pad_id=pad, block_size=B, max_new_tokens=G,
                                     small_block_size=S, mask_id=mask_id, threshold=thr, stop_token=stop,
                                     use_block_cache=cache, top_p=top_p, temperature=temp)
        except TypeError as e:  # batch_sample: a row that stops in the first block before any cache exists
            print(f"skip {cid}: the reference fails ({e})")
            continue
        fx["cases"].append({
            "id": cid, "reference": fn, "prompt_ids": [prompt],
            "params": {"style": "fastdllm2" if fn == "batch_sample" else "fastdllm2_generate", "gen_length": G,
                       "block_length": B, "small_block_length": S, "confidence_threshold": thr,
                       "temperature": temp, "top_p": top_p, "use_block_cache": cache, "seed": seed,
                       "stop_ids": [stop]},
            "output": [res["output"]], "nfe": len(res["forwards"]),
            "forwards": [{k: f[k] for k in ("kind", "block", "committed")} for f in res["forwards"]]})
    FIXTURE.write_text(json.dumps(fx) + "\n")
    digest = hashlib.sha256(FIXTURE.read_bytes()).hexdigest()[:12]
    print(f"wrote {FIXTURE} ({len(fx['cases'])} cases, {len(fx['logits'])} logits inputs, sha256 {digest})")


if __name__ == "__main__":
    br.main(__doc__, _checkpoint, _record, "FASTDLLM2_REF_DIR")
