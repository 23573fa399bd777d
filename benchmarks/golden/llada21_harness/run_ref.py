"""CPU harness around the public LLaDA2.1 reference code (the Hugging Face ``modeling_llada2_moe.py`` of
LLaDA2.1-mini: LLaDA2MoeModelLM, whose ``generate`` decodes with token editing), for recording fixtures
(benchmarks/golden/record_llada21.py).

The reference code stays outside this repository: put LLaDA2.1's ``modeling_llada2_moe.py`` and
``configuration_llada2_moe.py`` (a copy of the hub files: ZHZisZZ/dllm @ 9268328a,
``dllm/pipelines/llada21/models/``, the commit that added them; later commits of that repository edit the file)
into ``$LLADA21_REF_DIR/llada21_ref/`` with an empty ``__init__.py``. Everything here wraps them from the outside.

Python: torch 2.13.0 CPU, transformers 4.57.x (the file needs ``TransformersKwargs``, absent from 4.52).

  load_ref(ckpt_dir, dtype=torch.float32, attn_implementation="sdpa")
  block_mask(L, block_length, dtype)                  -> [1,1,L,L] strict additive mask (0 allowed / -inf not)
  ref_logits(model, input_ids, block_length, mask=)   -> float32 logits [1, L, V]
  ref_generate(model, input_ids, mask=, max_forwards=, **generate_kwargs)
                                                       -> dict(output=..., n_forwards=..., forwards=[...])

The one intervention: LLaDA2.1's ``generate`` builds its block mask as 1 (allowed) / 0 (not allowed) in bfloat16
and its forward adds any 4-D mask to the attention scores as is, so the 0/1 mask is a +1 / +0 bias that masks
nothing (earlier blocks then attend to the current block's drafts). ``mask="strict"`` (the default, what the
fixtures record) turns generate's mask into the block-causal 0 / -inf mask it stands for, in the model's dtype::

    attention_mask = torch.where(attention_mask > 0, 0.0, float("-inf")).to(model.dtype)

``mask="as_is"`` runs the reference's own 0/1 bias (only cast to the model's dtype: PyTorch's attention refuses a
bfloat16 mask for float32 queries; 0 and 1 are exact in both), to measure the quirk. ``max_forwards``: the
reference has no step cap (a masked position whose greedy proposal is the mask token itself is "committed"
again and again), so a run that reaches that many forwards raises :class:`ForwardCap`.
"""
import glob
import os
import sys

REF_DIR = os.environ.get("LLADA21_REF_DIR", os.path.dirname(os.path.abspath(__file__)))
if REF_DIR not in sys.path:
    sys.path.insert(0, REF_DIR)

import torch  # noqa: E402
from llada21_ref.modeling_llada2_moe import LLaDA2MoeModelLM  # noqa: E402


class ForwardCap(RuntimeError):
    """generate() ran ``max_forwards`` forwards (it does not terminate on this input)."""


def load_ref(ckpt_dir, dtype=torch.float32, attn_implementation="sdpa"):
    """from_pretrained with output_loading_info; asserts that no key is missing / unexpected / mismatched and that
    the expert bias (a buffer) was read from the checkpoint."""
    from safetensors import safe_open

    model, info = LLaDA2MoeModelLM.from_pretrained(ckpt_dir, dtype=dtype, attn_implementation=attn_implementation,
                                                   output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"loading info not clean: {bad}")
    sd, keys = model.state_dict(), set()
    for fn in sorted(glob.glob(os.path.join(ckpt_dir, "*.safetensors"))):
        with safe_open(fn, "pt") as f:
            for k in f.keys():
                keys.add(k)
                if k.endswith("expert_bias") and not torch.equal(f.get_tensor(k).to(sd[k].dtype), sd[k]):
                    raise RuntimeError(f"{k} was not loaded from the checkpoint")
    if keys != set(sd):
        raise RuntimeError(f"state_dict/ckpt key mismatch: {sorted(set(sd) ^ keys)}")
    return model.eval()


def block_mask(L, block_length, dtype=torch.float32, device="cpu", mask="strict"):
    """generate()'s block mask (tril over blocks, repeated to tokens) for the first L tokens: ``strict`` as
    0 / -inf, ``as_is`` as generate's own 1 / 0 values; in ``dtype``."""
    nb = (L + block_length - 1) // block_length
    m = torch.tril(torch.ones(nb, nb, device=device))
    m = m.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)[None, None, :L, :L]
    return _convert(m, dtype, mask)


def _convert(m, dtype, mask):
    if mask == "strict":
        return torch.where(m > 0, 0.0, float("-inf")).to(dtype)
    if mask == "as_is":
        return m.to(dtype)
    raise ValueError(f"mask must be 'strict' or 'as_is', got {mask!r}")


@torch.no_grad()
def ref_logits(model, input_ids, block_length, mask="strict"):
    """One forward of the reference model with the block mask and position_ids 0..L-1 (float32 logits)."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    L = input_ids.shape[1]
    am = block_mask(L, block_length, model.dtype, input_ids.device, mask)
    out = model(input_ids, attention_mask=am, position_ids=torch.arange(L, device=input_ids.device)[None])
    return out.logits.float()


class _IndexRecorder(torch.Tensor):
    """x0 as handed back to generate(): a plain LongTensor whose __getitem__ records the first boolean index applied
    to it -- generate()'s ``final_transfer_index`` (mask-to-token commits | token-to-token edits). No torch-function
    propagation: every op on it returns a plain Tensor, values untouched."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getitem__(self, idx):
        rec = getattr(self, "_rec", None)
        if rec is not None and torch.is_tensor(idx) and idx.dtype == torch.bool and "_final" not in rec:
            rec["_final"] = idx.clone()
        return super().__getitem__(idx)


def ref_generate(model, input_ids, mask="strict", max_forwards=None, **gen_kwargs):
    """Calls the model's own generate() unchanged, instrumented from the outside (instance attributes shadowing the
    bound methods, removed afterwards):

      * model.forward: records each forward's window, converts generate's mask (``mask``, see the module docstring)
        and raises :class:`ForwardCap` past ``max_forwards``;
      * model._sample_with_temperature_topk_topp: records the proposals x0 and their probabilities x0_p of the
        current block and hands x0 back as an :class:`_IndexRecorder`, which records generate's
        ``final_transfer_index``. Positions in it that were masks at the forward are its mask-to-token commits
        (``committed``, commits of the mask token itself included), the others its edits (``edited``): the two
        sets are disjoint by construction. Cross-check: the canvas (generate's window is a view of it) is diffed
        against its state at the forward; every changed position must be in the index, with x0's token.

    Returns dict(output=LongTensor [1, n], n_forwards=int, forwards=[per-forward records]); positions are absolute
    (canvas) positions.
    """
    mask_id = gen_kwargs.get("mask_id", 156895)
    records = []
    state = {"live": None, "before": None, "rec": None}

    def close():
        if state["live"] is None:
            return
        live, before, rec = state["live"], state["before"], state["rec"]
        now = live.clone()[0]
        before = before[0]
        start = rec["block_start"]
        final = rec.pop("_final", None)
        idx = [] if final is None else final[0].nonzero(as_tuple=True)[0].tolist()
        rec["committed"] = [start + i for i in idx if int(before[start + i]) == mask_id]
        rec["edited"] = [start + i for i in idx if int(before[start + i]) != mask_id]
        rec["committed_tokens"] = [int(rec["x0"][p - start]) for p in rec["committed"]]
        rec["edited_tokens"] = [int(rec["x0"][p - start]) for p in rec["edited"]]
        changed = (before != now).nonzero(as_tuple=True)[0].tolist()
        if not set(changed) <= {start + i for i in idx}:
            raise RuntimeError("the canvas changed outside generate's transfer index")
        for i in idx:
            if int(now[start + i]) != int(rec["x0"][i]):
                raise RuntimeError("the transfer record disagrees with the canvas")
        state["live"] = None

    orig_forward = model.forward
    orig_sample = model._sample_with_temperature_topk_topp

    def forward_wrapper(input_ids=None, attention_mask=None, position_ids=None, **kw):
        close()
        if max_forwards is not None and len(records) >= max_forwards:
            raise ForwardCap(f"generate() ran {max_forwards} forwards")
        records.append({"index": len(records), "window_len": int(input_ids.shape[1]),
                        "mask_dtype_from_generate": str(attention_mask.dtype)})
        state.update(live=input_ids, before=input_ids.clone(), rec=records[-1])
        attention_mask = _convert(attention_mask, model.dtype, mask)
        return orig_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw)

    def sample_wrapper(logits, *a, **kw):
        x0, x0_p = orig_sample(logits, *a, **kw)
        rec = records[-1]
        rec["x0"], rec["x0_p"] = x0[0].tolist(), x0_p[0].tolist()
        rec["block_start"] = rec["window_len"] - logits.shape[1]
        x0 = x0.as_subclass(_IndexRecorder)
        x0._rec = rec
        return x0, x0_p

    model.forward = forward_wrapper
    model._sample_with_temperature_topk_topp = sample_wrapper
    try:
        out = model.generate(input_ids, **gen_kwargs)
        close()
    finally:
        del model.forward
        del model._sample_with_temperature_topk_topp
    return {"output": out, "n_forwards": len(records), "forwards": records}
