"""Record LLaDA2.1 fixtures from LLaDA2.1's own code (LLaDA2MoeModelLM.generate with token editing; run locally, the
code stays outside).

Two phases, two environments, as ``record_llada2.py``:

1. ``checkpoint`` (this project's environment): write the random-weight LLaDA2-format checkpoint of
   ``tests/golden_models.py`` (``llada21_tiny``: ``llada2_tiny`` with the head scaled by 3) and the prompts::

       PYTHONPATH=tests python benchmarks/golden/record_llada21.py checkpoint --out /tmp/llada21-ckpt

2. ``record`` (the reference's environment: torch 2.13.0 CPU, transformers 4.57.x, safetensors; the reference files
   in ``$LLADA21_REF_DIR/llada21_ref/`` as ``llada21_harness/run_ref.py`` says)::

       LLADA21_REF_DIR=/path/to/ref /path/to/refenv/bin/python benchmarks/golden/record_llada21.py record \\
           --ckpt /tmp/llada21-ckpt          # -> tests/fixtures/golden/llada21_llada2-tiny.json

The fixture holds the reference model's full-canvas logits under the strict block-causal mask (float32, base64) for
two inputs, the size of the reference's mask quirk on them (the largest logit difference per block between its
0/1 mask used as an additive bias and the strict mask), and for each decoding case the output of the model's own
``generate`` (the generated answer, cut after its first ``eos_id``), its forward count and, at every forward, the
positions committed from masks (commits of the mask token itself included) and the positions edited. The harness
runs ``generate`` with the strict mask (its one intervention) and stops a run at 400 forwards (the reference has no
step cap); every recorded case terminates on its own.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _block_recorder as br  # noqa: E402

ROOT = br.ROOT
FIXTURE = ROOT / "tests" / "fixtures" / "golden" / "llada21_llada2-tiny.json"
PROMPTS = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]',
           'Please reverse the order of the list: ["Carol Carter", "David Dixon", "Emma Ellis"]']
MAX_FORWARDS = 400
Q, S = {"threshold": 0.7, "editing_threshold": 0.5}, {"threshold": 0.5, "editing_threshold": 0.0}  # the model card's
# (id, gen_length, block_length, options): generate's options other than its defaults (threshold 0.95,
# editing_threshold 0.9, max_post_steps 16, num_to_transfer 1, temperature 0, eos_early_stop False, the checkpoint's
# eos_id); each case runs on every prompt
CASES = [
    ("default_b4", 16, 4, {}),
    ("default_b8", 16, 8, {}),
    ("Q_b4", 16, 4, Q),
    ("Q_b8", 16, 8, Q),
    ("S_b4", 12, 4, S),
    ("S_b8", 16, 8, S),
    ("Q_post0_b4", 16, 4, {**Q, "max_post_steps": 0}),
    ("Q_post2_b4", 16, 4, {**Q, "max_post_steps": 2}),
    ("S_post2_b8", 16, 8, {**S, "max_post_steps": 2}),
    ("default_post0_b8", 16, 8, {"max_post_steps": 0}),
    ("Q_ntt2_b4", 16, 4, {**Q, "num_to_transfer": 2}),
    ("default_ntt2_b8", 16, 8, {"num_to_transfer": 2}),
    ("Q_ntt3_post2_b8", 16, 8, {**Q, "num_to_transfer": 3, "max_post_steps": 2}),
    ("Q_topk5_greedy_b4", 12, 4, {**Q, "top_k": 5, "top_p": 0.5}),  # temperature 0: greedy whatever top_k / top_p
    ("edit1.0_thr1.0_b4", 12, 4, {"threshold": 1.0, "editing_threshold": 1.0}),  # one commit per forward, no edit
    ("Q_sample_t0.7_b4", 12, 4, {**Q, "temperature": 0.7, "seed": 1}),
    ("Q_sample_topk_topp_b8", 16, 8, {**Q, "temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 2}),
    ("S_sample_t0.3_post2_b4", 12, 4, {**S, "temperature": 0.3, "max_post_steps": 2, "seed": 3}),
    ("Q_eos_stop_b4", 16, 4, {**Q, "eos_early_stop": True}),
    ("default_eos_stop_b8", 16, 8, {"eos_early_stop": True}),
    ("Q_eos_stop_sample_t0.7_b4", 16, 4, {**Q, "temperature": 0.7, "seed": 1, "eos_early_stop": True}),
    # G=10: the canvas runs past gen_length (decoded, then dropped from the answer)
    ("Q_eos_stop_tail_b8", 10, 8, {**Q, "eos_early_stop": True}),
]


def _checkpoint(out: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import golden_models as gm

    br.write_checkpoint(lambda: gm.llada21_tiny(0), out, PROMPTS)


def _record(ckpt: Path) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent / "llada21_harness"))
    import run_ref

    meta = br.read_meta(ckpt)
    model = run_ref.load_ref(str(ckpt), torch.float32)
    mask_id, eos = meta["mask_id"], meta["eos_id"]
    fx = {"reference": {"repo": "inclusionAI LLaDA2.1-mini (Hugging Face modeling file, as copied in ZHZisZZ/dllm "
                                "@ 9268328a, dllm/pipelines/llada21/models/)", "commit": "9268328a",
                        "file": "modeling_llada2_moe.py", "function": "LLaDA2MoeModelLM.forward; generate",
                        "intervention": "generate's 0/1 block mask turned into the strict 0/-inf mask"},
          "model": {"llada21": "llada21_tiny", "seed": 0}, "weights_sha256": meta["weights_sha256"],
          "logits": [], "mask_quirk": [], "cases": []}
    g = torch.Generator().manual_seed(0)
    for L, bl in ((12, 4), (16, 8)):
        ids = torch.randint(9, model.config.vocab_size, (1, L), generator=g)
        ids[0, L // 2:] = mask_id
        lg = run_ref.ref_logits(model, ids, bl)[0]
        fx["logits"].append({"input_ids": ids[0].tolist(), "block_length": bl, "shape": list(lg.shape),
                             "logits_f32_b64": br.b64(lg)})
        d = (run_ref.ref_logits(model, ids, bl, mask="as_is")[0] - lg).abs()
        fx["mask_quirk"].append({"input_ids": ids[0].tolist(), "block_length": bl,
                                 "max_abs_diff_per_block": [round(d[i:i + bl].max().item(), 4)
                                                            for i in range(0, L, bl)]})
    for p_i, prompt in enumerate(meta["prompt_ids"]):
        for cid, G, bl, opts in CASES:
            params = {"gen_length": G, "block_length": bl, "threshold": 0.95, "editing_threshold": 0.9,
                      "max_post_steps": 16, "num_to_transfer": 1, "temperature": 0.0, "top_k": None, "top_p": None,
                      "seed": 0, "eos_early_stop": False, "eos_id": eos, **opts}
            if params["eos_id"] in prompt:
                raise SystemExit(f"{cid}: the prompt holds eos_id {params['eos_id']}")
            kw = {k: v for k, v in params.items() if k != "seed"}
            torch.manual_seed(params["seed"])
            res = run_ref.ref_generate(model, torch.tensor([prompt]), max_forwards=MAX_FORWARDS, mask_id=mask_id,
                                       **kw)
            P = len(prompt)
            fx["cases"].append({
                "id": f"p{p_i}_{cid}", "prompt_ids": [prompt], "params": params,
                "output": [res["output"][0].tolist()], "nfe": res["n_forwards"],
                "forwards": [[[c - P for c in f["committed"]], [e - P for e in f["edited"]]]
                             for f in res["forwards"]]})
    edits = sum(len(f[1]) for c in fx["cases"] for f in c["forwards"])
    edited_cases = sum(any(f[1] for f in c["forwards"]) for c in fx["cases"])
    if edited_cases < len(fx["cases"]) // 2:
        raise SystemExit(f"only {edited_cases} of {len(fx['cases'])} cases edit a committed token")
    FIXTURE.write_text(json.dumps(fx) + "\n")
    digest = hashlib.sha256(FIXTURE.read_bytes()).hexdigest()[:12]
    print(f"wrote {FIXTURE} ({len(fx['cases'])} cases, {edited_cases} with edits, {edits} edits in all, "
          f"{len(fx['logits'])} logits inputs, sha256 {digest})")


if __name__ == "__main__":
    br.main(__doc__, _checkpoint, _record, "LLADA21_REF_DIR")
