"""CPU harness around the *unmodified* public Fast-dLLM v2 reference code, for recording fixtures.

The reference code stays outside this repository. Copy into ``$FASTDLLM2_REF_DIR/``:

* ``modeling.py`` and ``configuration.py``: the Hugging Face hub files of Efficient-Large-Model/Fast_dLLM_v2_7B
  (``Fast_dLLM_QwenForCausalLM``; public copies: ``v2/modeling_ori.py`` and ``v2/configuration.py`` of
  wangziyannb/Fast-dLLM @ fd27cb3);
* ``generation_functions.py``: NVlabs/Fast-dLLM ``v2/generation_functions.py`` @ d259b48 (``batch_sample``, the
  decoder of the official evaluation ``v2/eval.py``).

The model file imports ``configuration`` as a top-level module, so the directory itself goes on ``sys.path``.
No stand-ins are needed on CPU with torch 2.13 and transformers 4.53.1 (the version the reference pins): the
flex-attention import exists on CPU and is used only in training, the ``torch.compile`` decorator compiles
lazily (never, at inference), and ``use_kernel_forward_from_hub`` is a no-op without the ``kernels`` package.

Functions
    load_ref(ckpt_dir, dtype=torch.float32)            -> Fast_dLLM_QwenForCausalLM (eval, CPU)
    ref_logits(model, input_ids, block_size)            -> raw float32 logits [B, L, V] (row i: hidden row i; the
                                                           decoders shift them: position i from row i - 1)
    ref_decode(model, prompt_ids, fn, seed=None, **kw)  -> dict(output=..., forwards=[...]); fn: "batch_sample"
                                                           or "generate"
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

REF_DIR = os.environ.get("FASTDLLM2_REF_DIR")
if not REF_DIR or not os.path.isfile(os.path.join(REF_DIR, "modeling.py")):
    raise SystemExit("set FASTDLLM2_REF_DIR to the directory holding the reference modeling.py, configuration.py "
                     "and generation_functions.py (see this file's docstring)")
if REF_DIR not in sys.path:
    sys.path.insert(0, REF_DIR)

import generation_functions  # noqa: E402
import torch  # noqa: E402
from modeling import Fast_dLLM_QwenForCausalLM  # noqa: E402


def load_ref(ckpt_dir, dtype=torch.float32):
    """The reference model class on a checkpoint directory; every tensor must be used, none missing."""
    model, info = Fast_dLLM_QwenForCausalLM.from_pretrained(ckpt_dir, torch_dtype=dtype, output_loading_info=True,
                                                            attn_implementation="sdpa")
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"checkpoint does not match Fast_dLLM_QwenForCausalLM: {bad}")
    return model.to("cpu").eval()


@torch.no_grad()
def ref_logits(model, input_ids, block_size):
    """One forward over the whole canvas, no cache: the block-causal mask of ``block_size``, positions 0..L-1."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    return model(input_ids=ids, use_cache=False, block_size=block_size).logits.float()


def _kind(kw) -> str:
    if kw.get("update_past_key_values"):  # the prefill passes no cache; a block's store passes its own (maybe None)
        return "store" if "past_key_values" in kw else "prefill"
    if kw.get("replace_position") is not None and kw.get("block_past_key_values") is not None:
        return "subblock"
    return "denoise"


@torch.no_grad()
def ref_decode(model, prompt_ids, fn: str, seed=None, pad_id=0, **kw):
    """Run the reference decoder ``fn`` unchanged on one prompt, recording every forward.

    ``batch_sample`` takes ``block_size``, ``max_new_tokens``, ``small_block_size``, ``mask_id``, ``threshold``,
    ``stop_token``, ``use_block_cache``, ``top_p``, ``temperature`` (``min_len`` and ``seq_len`` are the prompt's
    length, as the official evaluation passes them); ``generate`` the same names (``max_new_tokens``...). The
    tokenizer argument is a stand-in holding ``pad_token_id``. ``seed``: ``torch.manual_seed(seed)`` just before.

    Returns ``output`` (the row after the prompt, as returned) and ``forwards``: per forward ``kind`` (prefill /
    denoise / subblock / store), ``block`` (None for the prefill), ``positions`` and ``committed`` (absolute
    positions that were masked at the forward and hold a token at the next forward or the end: the decoders
    write into the tensor the forward was given a view of, so the view is read again then).
    """
    mask_id = kw["mask_id"]
    B = kw["block_size"]
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    P = ids.shape[1]
    log = []
    orig = model.forward

    def recording_forward(*a, **k):
        x = k["input_ids"]
        past = k.get("past_key_values")
        start = (past.get_seq_length() if past is not None else 0) + (k.get("replace_position") or 0)
        log.append({"kind": _kind(k), "view": x, "before": x.detach().clone(), "start": start, "n": x.shape[1]})
        if len(log) > 1:
            _settle(log[-2], mask_id)
        return orig(*a, **k)

    tok = SimpleNamespace(pad_token_id=pad_id)
    model.forward = recording_forward
    try:
        if seed is not None:
            torch.manual_seed(seed)
        if fn == "batch_sample":
            res = generation_functions.Fast_dLLM_QwenForCausalLM.batch_sample(
                model, ids.clone(), tok, min_len=P, seq_len=torch.tensor([P]), **kw)
            out = res[0]
        elif fn == "generate":
            out = model.generate(ids.clone(), tokenizer=tok, **kw)[0]
        else:
            raise ValueError(f"unknown reference decoder {fn!r}")
    finally:
        del model.forward
    if log:
        _settle(log[-1], mask_id)
    forwards = []
    for f in log:
        forwards.append({"kind": f["kind"], "block": None if f["kind"] == "prefill" else f["start"] // B,
                         "positions": list(range(f["start"], f["start"] + f["n"])),
                         "committed": f.get("committed", [])})
    return {"output": out[P:].tolist(), "forwards": forwards}


def _settle(f, mask_id):
    """The positions of forward ``f`` that were masked then and are not now (its step's commits)."""
    if f["kind"] in ("prefill", "store"):
        return
    now = f["view"][0]
    newly = (f["before"][0] == mask_id) & (now != mask_id)
    f["committed"] = [f["start"] + j for j in newly.nonzero().flatten().tolist()]
