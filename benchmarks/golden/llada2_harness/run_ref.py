"""CPU harness around the public LLaDA2.0-MoE reference code (LLaDA2MoeModelLM, model_type "llada2_moe"), for
recording fixtures (benchmarks/golden/record_llada2.py).

The reference code stays outside this repository: put the Hugging Face ``modeling_llada2_moe.py`` (a copy is in
sajadn/Megatron-Bridge @ 4fde5488, ``modeling_llada2_moe.py``) and ``configuration_llada2_moe.py`` (e.g.
inclusionAI/dInfer @ fce4e32, ``python/dinfer/model/configuration_llada2_moe.py``) into
``$LLADA2_REF_DIR/llada2_ref/`` with an empty ``__init__.py``. Everything here wraps them from the outside.

Python: torch 2.13.0 CPU, transformers 4.52.4.

  load_ref(ckpt_dir, dtype=torch.float32, attn_implementation="sdpa")
  block_diffusion_mask(L, block_length, dtype)       -> [1,1,L,L] additive 0/-inf mask, as generate() builds it
  ref_logits(model, input_ids, block_length)         -> float32 logits [1, L, V]
  ref_generate(model, input_ids, **generate_kwargs)  -> dict(output=..., n_forwards=..., forwards=[...])

What works on CPU: SDPA attention with a float32 additive block mask. The model's generate() builds its mask in
bfloat16, which SDPA refuses with float32 queries: ref_generate casts the mask to the model's dtype (0 and -inf
are exact in both), its only intervention. Eager attention turns a 4-D additive mask into an all-minimum mask in
transformers 4.52.4 (wrong logits), so it is refused.
"""
import os
import sys

REF_DIR = os.environ.get("LLADA2_REF_DIR", os.path.dirname(os.path.abspath(__file__)))
if REF_DIR not in sys.path:
    sys.path.insert(0, REF_DIR)

import torch  # noqa: E402
from llada2_ref.modeling_llada2_moe import LLaDA2MoeModelLM  # noqa: E402


# ----------------------------------------------------------------------------- loading
def load_ref(ckpt_dir, dtype=torch.float32, attn_implementation="sdpa"):
    """from_pretrained with output_loading_info; asserts that no key is missing / unexpected / mismatched.

    attn_implementation: "sdpa" (default; the only one that gives correct block-diffusion logits with a
    4-D additive mask in transformers 4.52.4) or "eager" (loads and runs, but the model's
    forward turns any 4-D additive mask into an all-`finfo.min` mask, i.e. the logits are wrong).
    """
    model, info = LLaDA2MoeModelLM.from_pretrained(
        ckpt_dir,
        torch_dtype=dtype,
        attn_implementation=attn_implementation,
        output_loading_info=True,
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"loading info not clean: {bad}")
    # expert_bias is a persistent buffer: check it really came from the checkpoint (not the zeros init)
    import glob

    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(ckpt_dir, "*.safetensors")))
    sd = model.state_dict()
    ckpt_keys = set()
    for fn in files:
        with safe_open(fn, "pt") as f:
            for k in f.keys():
                ckpt_keys.add(k)
                if k.endswith("expert_bias"):
                    if not torch.equal(f.get_tensor(k).to(sd[k].dtype), sd[k]):
                        raise RuntimeError(f"{k} was not loaded from the checkpoint")
    if ckpt_keys != set(sd.keys()):
        raise RuntimeError(f"state_dict/ckpt key mismatch: {sorted(set(sd) ^ ckpt_keys)}")
    model.eval()
    return model


# ----------------------------------------------------------------------------- mask
def block_diffusion_mask(L, block_length, dtype=torch.float32, device="cpu"):
    """Exactly the construction in LLaDA2MoeModelLM.generate() (tril over blocks, repeat_interleave to tokens,
    0 where allowed / -inf where not, shape [1,1,T,T]), sliced to the first L tokens, but kept in `dtype`
    instead of generate()'s bfloat16."""
    num_blocks = (L + block_length - 1) // block_length
    block_mask = torch.tril(torch.ones(num_blocks, num_blocks, device=device))
    m = (
        block_mask.repeat_interleave(block_length, dim=0)
        .repeat_interleave(block_length, dim=1)
        .unsqueeze(0)
        .unsqueeze(0)
    ).bool()
    m = torch.where(m, 0.0, float("-inf")).to(dtype)
    return m[:, :, :L, :L]


# ----------------------------------------------------------------------------- logits
@torch.no_grad()
def ref_logits(model, input_ids, block_length, mask_dtype=None):
    """One forward of the reference model with generate()'s block-diffusion mask and position_ids 0..L-1.

    mask_dtype defaults to the model dtype (float32 for a float32 model). generate() itself uses a bfloat16
    mask; values are only 0 / -inf, so bf16 -> fp32 is exact, but SDPA on CPU rejects a bf16 mask for fp32
    queries (RuntimeError), hence the model-dtype mask here.
    """
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(
            "ref_logits needs attn_implementation='sdpa': with 'eager' the reference forward passes a 4-D mask "
            "through transformers' _prepare_4d_causal_attention_mask, which inverts it as if it were a 0/1 "
            "mask and fills every entry with finfo.min (attention becomes uniform)."
        )
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    L = input_ids.shape[1]
    mask = block_diffusion_mask(L, block_length, dtype=mask_dtype or model.dtype, device=input_ids.device)
    pos = torch.arange(L, device=input_ids.device).unsqueeze(0)
    out = model(input_ids, attention_mask=mask, position_ids=pos)
    return out.logits.float()


# ----------------------------------------------------------------------------- generate
class _IndexRecorder(torch.Tensor):
    """x0 as returned to generate(): a plain LongTensor whose __getitem__ records the (first) boolean index
    generate() applies to it -- that index is generate()'s own `transfer_index`. No torch-function
    propagation: every op on it returns a plain Tensor, values are untouched."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getitem__(self, idx):
        rec = getattr(self, "_rec", None)
        if rec is not None and torch.is_tensor(idx) and idx.dtype == torch.bool and "_transfer_index" not in rec:
            rec["_transfer_index"] = idx.clone()
        return super().__getitem__(idx)


def ref_generate(model, input_ids, cast_mask_to_model_dtype=None, **gen_kwargs):
    """Calls the model's own generate() unchanged, instrumented from the outside.

    Instrumentation (instance attributes shadowing the bound methods, removed afterwards):
      * model.forward: records every forward's input window (token ids), the window length, the mask dtype;
        optionally casts the [1,1,w,w] additive mask to the model dtype (the *only* intervention; it is
        needed for a float32 model on CPU because SDPA refuses a bf16 mask with fp32 queries; 0/-inf are
        exactly representable so the cast is lossless).
      * model._sample_with_temperature_topk_topp: records x0 (proposed tokens) and x0_p (their probability)
        for the active block.
      * commits: x0 is handed back to generate() as an _IndexRecorder view (same values), which records
        the boolean `transfer_index` generate() indexes it with -> exact committed positions/tokens, including
        commits of mask_id itself (which leave the position masked). Cross-check: the window tensor
        generate() passes to forward is a view of its canvas `x`; at the next forward (or when generate
        returns) it is diffed against the clone taken at forward time ("changed_positions").

    cast_mask_to_model_dtype: None = auto (True iff model dtype != bfloat16).
    Returns dict(output=LongTensor [1, n], n_forwards=int, forwards=[...per forward record...]).
    """
    mask_id = gen_kwargs.get("mask_id", 156895)
    if cast_mask_to_model_dtype is None:
        cast_mask_to_model_dtype = model.dtype != torch.bfloat16

    records = []
    state = {"live": None, "before": None, "rec": None}

    def _close_pending():
        if state["live"] is None:
            return
        live, before, rec = state["live"], state["before"], state["rec"]
        now = live.clone()
        changed = (before != now)[0]
        newly = changed & (before[0] == mask_id)
        if bool((changed & ~newly).any()):
            raise RuntimeError("a non-mask position changed during a step (unexpected)")
        pos = newly.nonzero(as_tuple=True)[0]
        # what actually changed in the canvas (cannot see a commit of mask_id itself: mask -> mask)
        rec["changed_positions"] = [int(p) for p in pos]
        rec["changed_tokens"] = [int(now[0, p]) for p in pos]
        # exact commit set, from the boolean transfer_index that generate() used to index x0
        ti = rec.get("_transfer_index")
        if ti is not None:
            start = rec["active_block_start"]
            idx = ti[0].nonzero(as_tuple=True)[0]
            rec["committed_positions"] = [start + int(i) for i in idx]
            rec["committed_tokens"] = [int(rec["x0"][int(i)]) for i in idx]
            for p, t in zip(rec["committed_positions"], rec["committed_tokens"]):
                if int(now[0, p]) != t:
                    raise RuntimeError("commit record disagrees with the canvas")
            if [p for p, t in zip(rec["committed_positions"], rec["committed_tokens"]) if t != mask_id] != rec[
                "changed_positions"
            ]:
                raise RuntimeError("commit record disagrees with the canvas diff")
            rec["committed_mask_id_itself"] = [
                p for p, t in zip(rec["committed_positions"], rec["committed_tokens"]) if t == mask_id
            ]
            del rec["_transfer_index"]
        else:
            rec["committed_positions"], rec["committed_tokens"] = rec["changed_positions"], rec["changed_tokens"]
        state["live"] = None

    orig_forward = model.forward  # bound method
    orig_sample = model._sample_with_temperature_topk_topp

    def forward_wrapper(input_ids=None, attention_mask=None, position_ids=None, **kw):
        _close_pending()
        rec = {
            "index": len(records),
            "window_len": int(input_ids.shape[1]),
            "window_tokens": input_ids[0].tolist(),
            "position_ids_are_arange": bool(
                torch.equal(position_ids[0], torch.arange(input_ids.shape[1], device=position_ids.device))
            )
            if position_ids is not None
            else None,
            "mask_dtype_from_generate": str(attention_mask.dtype) if attention_mask is not None else None,
            "mask_cast_to": None,
        }
        if attention_mask is not None and cast_mask_to_model_dtype and attention_mask.dtype != model.dtype:
            attention_mask = attention_mask.to(model.dtype)
            rec["mask_cast_to"] = str(model.dtype)
        records.append(rec)
        state["live"] = input_ids  # a view of generate()'s canvas x
        state["before"] = input_ids.clone()
        state["rec"] = rec
        return orig_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw)

    def sample_wrapper(logits, *a, **kw):
        x0, x0_p = orig_sample(logits, *a, **kw)
        if records:
            rec = records[-1]
            rec["x0"] = x0[0].tolist()
            rec["x0_p"] = x0_p[0].tolist()
            rec["active_block_start"] = rec["window_len"] - logits.shape[1]
            x0 = x0.as_subclass(_IndexRecorder)
            x0._rec = rec
        return x0, x0_p

    model.forward = forward_wrapper
    model._sample_with_temperature_topk_topp = sample_wrapper
    try:
        out = model.generate(input_ids, **gen_kwargs)
        _close_pending()
    finally:
        del model.forward
        del model._sample_with_temperature_topk_topp
    return {"output": out, "n_forwards": len(records), "forwards": records}
