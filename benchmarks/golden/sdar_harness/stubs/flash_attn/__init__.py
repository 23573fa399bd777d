"""CPU stand-in for the parts of flash-attn that SDAR's modeling_sdar.py imports.

NOT flash-attn. Pure PyTorch, for running SDAR's model file on CPU:
  flash_attn_func        -> F.scaled_dot_product_attention, flash-attn layout [B, L, H, D]
  flash_attn_varlen_func -> imported by modeling_sdar.py but never called at inference; raises.
"""
import math

import torch
import torch.nn.functional as F

__version__ = "0.0.0+sdarref-cpu-stub"


def _repeat_kv_bshd(x, n_rep):
    # x: [B, S, Hkv, D] -> [B, S, Hkv*n_rep, D]; query head h uses kv head h // n_rep (flash-attn GQA rule)
    if n_rep == 1:
        return x
    b, s, hkv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, hkv, n_rep, d).reshape(b, s, hkv * n_rep, d)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False):
    """q: [B, Lq, H, D]; k, v: [B, Lk, Hkv, D] (H % Hkv == 0). Returns [B, Lq, H, D] in q.dtype.

    causal=True follows flash-attn >= 2.1: the causal diagonal is aligned to the bottom-right
    (query i may attend key j iff j <= i + Lk - Lq). SDAR calls this only with causal=False.
    """
    if dropout_p != 0.0 or tuple(window_size) != (-1, -1) or softcap != 0.0 \
            or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("flash_attn stub: only dropout_p=0, no window/softcap/alibi/probs")
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    assert H % Hkv == 0, (H, Hkv)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    kk = _repeat_kv_bshd(k, H // Hkv)
    vv = _repeat_kv_bshd(v, H // Hkv)
    mask = None
    if causal:
        i = torch.arange(Lq, device=q.device)[:, None]
        j = torch.arange(Lk, device=q.device)[None, :]
        mask = j <= i + (Lk - Lq)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
        attn_mask=mask, dropout_p=0.0, is_causal=False, scale=softmax_scale)
    return out.transpose(1, 2).to(q.dtype)


def flash_attn_varlen_func(*args, **kwargs):
    raise NotImplementedError("flash_attn stub: flash_attn_varlen_func is not used by SDAR inference")
