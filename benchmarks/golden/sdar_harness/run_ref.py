"""CPU harness around the *unmodified* public SDAR reference code (JetAstra/SDAR), for recording fixtures.

The reference code stays outside this repository: copy ``training/model/SDAR-4B-Chat/*.py`` and ``generate.py``
of JetAstra/SDAR @ c2041a83 into ``$SDAR_REF_DIR/sdar_ref/`` (with an empty ``__init__.py``) and set
``SDAR_REF_DIR``. ``stubs/flash_attn`` (ours) stands in for the flash-attn functions the model file imports
(flash-attn does not run on CPU); see ``benchmarks/golden/record_sdar.py``.

Functions
    load_ref(ckpt_dir, dtype=torch.float32)          -> SDARForCausalLM (eval, CPU)
    ref_logits(model, input_ids, block_length)        -> float32 logits [B, L, V] under the block-causal mask
    block_causal_mask(L, block_length)                -> the [1, L, L] mask exactly as generate.py builds it
    ref_generate(model, input_ids, mask_id, seed=None, **kw) -> dict(output=..., forwards=[...])

CLI
    python run_ref.py logits   --ckpt DIR --ids 1,2,3,... --block-length 4 [--dtype float32] [--out f.pt]
    python run_ref.py generate --ckpt DIR --ids 1,2,3,... --mask-id 511 --gen-length 8 --block-length 4
                               --steps 4 --remasking low_confidence_static [--top-k 1] [--temperature 1.0]
                               [--top-p 1.0] [--threshold 0.85] [--seed 0] [--out f.pt]
"""
import argparse
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
REF_DIR = os.environ.get("SDAR_REF_DIR", HERE)
for _p in (os.path.join(HERE, "stubs"), REF_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from torch import nn  # noqa: E402


def _install_loss_stub():
    """modeling_sdar.py does `from .fused_linear_diffusion_cross_entropy import FusedLinearDiffusionCrossEntropyLoss`.
    That module needs triton (GPU kernels) at import time and is used only when model.training is True.
    If triton is missing we register a placeholder module under the same name; the real file stays untouched."""
    name = "sdar_ref.fused_linear_diffusion_cross_entropy"
    if name in sys.modules:
        return
    try:
        import triton  # noqa: F401
        return  # real module importable
    except ImportError:
        pass
    mod = types.ModuleType(name)
    mod.__doc__ = "run_ref.py placeholder: the training loss needs triton; inference never calls it."

    class FusedLinearDiffusionCrossEntropyLoss(nn.Module):
        def __init__(self, *a, **k):
            super().__init__()

        def forward(self, *a, **k):
            raise NotImplementedError("training loss not available on CPU (needs triton)")

    mod.FusedLinearDiffusionCrossEntropyLoss = FusedLinearDiffusionCrossEntropyLoss
    sys.modules[name] = mod


_install_loss_stub()

from sdar_ref import generate as sdar_generate  # noqa: E402
from sdar_ref.modeling_sdar import SDARForCausalLM  # noqa: E402


# --------------------------------------------------------------------------------------------- load
def load_ref(ckpt_dir, dtype=torch.float32, attn_implementation="sdpa"):
    """Load the reference SDARForCausalLM from a HF-layout dir (config.json + model.safetensors[.index.json]).
    attn_implementation is only recorded in the config: SDARAttention.forward ignores it at inference and
    always uses flash_attn_func (mask all-True) or F.scaled_dot_product_attention (otherwise)."""
    model, info = SDARForCausalLM.from_pretrained(
        ckpt_dir, torch_dtype=dtype, attn_implementation=attn_implementation,
        output_loading_info=True, device_map=None)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"checkpoint does not match SDARForCausalLM: {bad}")
    model.to("cpu").eval()
    return model


# ------------------------------------------------------------------------------------------- logits
def block_causal_mask(L, block_length, device="cpu"):
    """Same construction as generate.py: tril over blocks, expanded to tokens, float ones/zeros, [1, L, L].
    mask[0, q, k] = 1  iff  k // block_length <= q // block_length."""
    nb = (L + block_length - 1) // block_length
    bm = torch.tril(torch.ones(nb, nb, device=device))
    m = bm.repeat_interleave(block_length, dim=0).repeat_interleave(block_length, dim=1).unsqueeze(0)
    return m[:, :L, :L]


@torch.no_grad()
def ref_logits(model, input_ids, block_length):
    """Full-canvas logits, one forward, no cache, block-causal mask, positions 0..L-1. Returns float32 [B, L, V]."""
    if not torch.is_tensor(input_ids):
        input_ids = torch.tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    B, L = input_ids.shape
    mask = block_causal_mask(L, block_length, input_ids.device)
    pos = torch.arange(L, device=input_ids.device).unsqueeze(0).expand(B, L)
    out = model(input_ids, attention_mask=mask, position_ids=pos, use_cache=False)
    return out.logits.float()


# ----------------------------------------------------------------------------------------- generate
class _RecordingModel:
    """Transparent proxy: block_diffusion_generate calls model.eval(), model.device and model(...)."""

    def __init__(self, model, log):
        self._m = model
        self._log = log

    def __getattr__(self, name):
        return getattr(self._m, name)

    def __call__(self, input_ids, **kw):
        pkv = kw.get("past_key_values")
        rec = dict(
            input_ids=input_ids.detach().clone(),
            position_ids=kw["position_ids"].detach().clone(),
            attention_mask_shape=tuple(kw["attention_mask"].shape),
            attention_mask_all_true=bool(torch.all(kw["attention_mask"].bool())),
            store_kv=bool(kw.get("store_kv", False)),
            cache_len_before=(pkv.get_seq_length() if pkv is not None else 0),
        )
        out = self._m(input_ids, **kw)
        rec["cache_len_after"] = pkv.get_seq_length() if pkv is not None else 0
        rec["logits"] = out.logits.detach().float().clone() if out.logits is not None else None
        self._log.append(rec)
        return out


def ref_generate(model, input_ids, mask_id, seed=None, **kw):
    """Run sdar_ref/generate.py:block_diffusion_generate unchanged, recording every forward.

    kw: gen_length, block_length, denoising_steps, temperature, top_k, top_p, remasking_strategy,
        confidence_threshold, eb_threshold, stopping_criteria_idx  (same names/defaults as generate.py)
    seed: if not None, torch.manual_seed(seed) right before the call (torch.multinomial is always used).

    Returns dict:
      output    LongTensor [1, total_length] (the reference's return value; may still contain mask_id), or None
                when the reference raised IndexError (a block still holding masks after its last step)
      error     None, or the IndexError's "type: message" (the forwards up to it are recorded)
      forwards  list of dicts, in call order, each with
        kind            'prefill' | 'denoise' | 'store'
        block           block index (prefill: None)
        positions       absolute positions of the forward's tokens (list)
        input_ids       tokens fed to that forward
        store_kv, cache_len_before, cache_len_after, attention_mask_shape, attention_mask_all_true
        logits          float32 logits returned by that forward
        x0, x0_p        (denoise only) what sample_with_temperature_topk_topp returned
        committed       (denoise only) absolute positions that were mask before and non-mask after this step
        committed_tokens  tokens written there
        overwritten     (denoise only) positions that were NOT mask but whose token changed in this step
                        (the reference's top-k selects unmasked positions when fewer masks than the step's
                        quota are left; a rewrite with the same token is invisible)
    """
    if not torch.is_tensor(input_ids):
        input_ids = torch.tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    log, samples = [], []
    orig_sample = sdar_generate.sample_with_temperature_topk_topp

    def rec_sample(logits, *a, **k):
        x0, x0_p = orig_sample(logits, *a, **k)
        samples.append((x0.detach().clone(), x0_p.detach().clone()))
        return x0, x0_p

    sdar_generate.sample_with_temperature_topk_topp = rec_sample
    error = None
    try:
        if seed is not None:
            torch.manual_seed(seed)
        out = sdar_generate.block_diffusion_generate(
            _RecordingModel(model, log), prompt={"input_ids": input_ids}, mask_id=mask_id, **kw)
    except IndexError as e:  # a block still masked after its last step: the reference reads a quota past the end
        out, error = None, f"{type(e).__name__}: {e}"
    finally:
        sdar_generate.sample_with_temperature_topk_topp = orig_sample

    bl = kw.get("block_length", 8)
    prompt_len = input_ids.shape[1]
    prefill_len = (prompt_len // bl) * bl
    forwards, si = [], 0
    for i, r in enumerate(log):
        pos = r["position_ids"][0].tolist()
        f = dict(r)
        f["positions"] = pos
        if r["store_kv"] and pos[0] == 0 and len(pos) == prefill_len and i == 0 and prefill_len > 0:
            f["kind"], f["block"] = "prefill", None
        elif r["store_kv"]:
            f["kind"], f["block"] = "store", pos[0] // bl
        else:
            f["kind"], f["block"] = "denoise", pos[0] // bl
            f["x0"], f["x0_p"] = samples[si]
            si += 1
            before = r["input_ids"][0]
            # state after this step = input of the next forward on the same block, else the final canvas
            if i + 1 < len(log) and log[i + 1]["position_ids"][0, 0].item() == pos[0]:
                after = log[i + 1]["input_ids"][0]
            elif out is None:  # the forward after which the reference raised: nothing was written
                after = before
            else:
                after = out[0, pos[0]:pos[0] + len(pos)]
            newly = (before == mask_id) & (after != mask_id)
            changed = (before != mask_id) & (after != before)
            f["committed"] = [pos[j] for j in newly.nonzero().flatten().tolist()]
            f["committed_tokens"] = after[newly].tolist()
            f["overwritten"] = [pos[j] for j in changed.nonzero().flatten().tolist()]
        forwards.append(f)
    assert si == len(samples)
    return dict(output=out, forwards=forwards, error=error)


def summarize(res, mask_id=None):
    lines = []
    for f in res["forwards"]:
        s = (f"{f['kind']:8s} block={f['block']} pos={f['positions'][0]}..{f['positions'][-1]} "
             f"in={f['input_ids'][0].tolist()} cache {f['cache_len_before']}->{f['cache_len_after']} "
             f"maskAllTrue={f['attention_mask_all_true']}")
        if f["kind"] == "denoise":
            s += (f"\n           x0={f['x0'][0].tolist()} x0_p={[round(p, 5) for p in f['x0_p'][0].tolist()]}"
                  f"\n           committed={f['committed']} tokens={f['committed_tokens']}"
                  + (f" OVERWRITTEN={f['overwritten']}" if f["overwritten"] else ""))
        lines.append(s)
    lines.append(f"output={res['output'][0].tolist()}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- cli
def _main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["logits", "generate"])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--ids", required=True, help="comma-separated token ids")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--block-length", type=int, default=4)
    ap.add_argument("--mask-id", type=int, default=None, help="default: config.mask_token_id")
    ap.add_argument("--gen-length", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--remasking", default="low_confidence_dynamic")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--threshold", type=float, default=0.85)
    ap.add_argument("--eb-threshold", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="torch.save the result here")
    a = ap.parse_args()
    torch.set_printoptions(precision=6, linewidth=160)
    model = load_ref(a.ckpt, getattr(torch, a.dtype))
    ids = torch.tensor([[int(t) for t in a.ids.split(",")]], dtype=torch.long)
    if a.cmd == "logits":
        lg = ref_logits(model, ids, a.block_length)
        print("logits", tuple(lg.shape), lg.dtype)
        print("argmax", lg.argmax(-1)[0].tolist())
        print(lg[0, :, :6])
        if a.out:
            torch.save(dict(input_ids=ids, block_length=a.block_length, logits=lg), a.out)
    else:
        mask_id = a.mask_id if a.mask_id is not None else model.config.mask_token_id
        res = ref_generate(model, ids, mask_id, seed=a.seed, gen_length=a.gen_length,
                           block_length=a.block_length, denoising_steps=a.steps,
                           temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                           remasking_strategy=a.remasking, confidence_threshold=a.threshold,
                           eb_threshold=a.eb_threshold)
        print(summarize(res))
        if a.out:
            torch.save(res, a.out)
    if a.out:
        print("saved", a.out)


if __name__ == "__main__":
    _main()
