"""What the two-phase recorders of block-diffusion references share (``record_sdar.py``, ``record_llada2.py``,
``record_llada21.py``): the checkpoint phase in this project's environment, the record phase in the reference's,
the logits encoding."""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_checkpoint(build, out: Path, prompts: list[str]) -> None:
    """Save ``build()`` (a tests/golden_models.py builder) to ``out`` with ``dllm_prompts.json``: the prompts'
    chat-templated ids, the weights' sha256 and the special ids the record phase needs (mask, EOS, EOT, pad)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import golden_common as gc

    from dllm.generate import prepare_prompts
    from dllm.models.loading import save_pretrained

    m = build()
    save_pretrained(m, out)
    meta = {"prompt_ids": prepare_prompts(m, prompts, None, True), "weights_sha256": gc.state_sha256(m),
            "mask_id": m.mask_id, "eos_id": m.eos_id, "eot_id": m.eot_id, "pad_id": m.pad_id}
    (out / "dllm_prompts.json").write_text(json.dumps(meta))
    print(f"wrote {out}")


def read_meta(ckpt: Path) -> dict:
    return json.loads((ckpt / "dllm_prompts.json").read_text())


def b64(t) -> str:
    """float32 little-endian bytes of ``t``, base64 (``golden_common.decode_logits`` reads them)."""
    return base64.b64encode(t.detach().float().contiguous().numpy().astype("<f4").tobytes()).decode()


def main(doc: str, checkpoint, record, ref_env: str) -> None:
    """``checkpoint --out DIR`` or ``record --ckpt DIR`` (which needs ``$ref_env``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["checkpoint", "record"])
    ap.add_argument("--out", type=Path, help="checkpoint: the directory to write")
    ap.add_argument("--ckpt", type=Path, help="record: the directory the checkpoint phase wrote")
    a = ap.parse_args()
    if a.phase == "checkpoint":
        checkpoint(a.out)
    elif ref_env not in os.environ:
        raise SystemExit(f"set {ref_env} to the directory holding the reference files (see the harness)")
    else:
        record(a.ckpt)
