"""Plain, slow restatements of the two reference decode loops, used as parity oracles.

These are written independently of ``dllm.generate`` and ``dllm.samplers`` (nothing is imported from
them): one full-canvas forward per step, per-row Python loops, the reference's tensor shapes and the
reference's order of random draws. They restate

* LLaDA ``generate.py`` (ML-GSAI/LLaDA): semi-autoregressive blocks, even per-block quota, float64
  Gumbel-max (nothing drawn at temperature 0), low-confidence or random remasking, unsupervised CFG,
  ``logits_eos_inf`` and ``confidence_eos_eot_inf`` (with the reference's aliasing quirk as an option);
* Dream ``diffusion_generate`` / ``_sample`` (HKUNLP Dream ``generation_utils.py``): ``timesteps =
  linspace(1, eps, steps + 1)``, the ``origin`` / ``maskgit_plus`` / ``topk_margin`` / ``entropy`` rules,
  temperature / top-p / top-k sampling, ``alg_temp`` position sampling and the batch-average mask count.

Differences from the references that are deliberate and do not change the arithmetic:

* the model is a :class:`dllm.models.Transformer` called as ``model(x, positions=..., attn_mask=...)``;
  for Dream-format models its full-canvas logits are already shifted the reference's way
  (``cat([l[:, :1], l[:, :-1]])``), so no second shift is applied here;
* every random draw comes from one explicit ``torch.Generator`` seeded with ``seed`` instead of the global
  RNG; ``torch.distributions.Categorical(probs).sample()`` is written as its underlying call
  ``torch.multinomial(probs, 1, replacement=True)``;
* ragged prompts are left-padded (``pad_id``) to the longest one, the attention mask is False at pads and
  RoPE positions are ``cumsum(mask) - 1`` clipped at 0 (the layout ``dllm.generate`` builds).

One choice where the reference itself is not determined:

* top-k selection breaks exact confidence ties by the lower column. The reference calls ``torch.topk``,
  whose order among equal values is unspecified (on CPU it is lower-index-first for short rows and not for
  longer ones; CUDA differs again), so at a tie the reference has no single answer. Ties are not
  hypothetical: with ``confidence_eos_eot_inf`` every position proposing EOS/EOT gets confidence exactly
  0. Each oracle records the ties that straddle a selection boundary in ``OracleOutput.ties``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


@dataclass
class OracleOutput:
    sequences: torch.Tensor  # [B, gen_length]
    nfe: int  # model forward calls (a CFG pair counts once)
    ties: list = field(default_factory=list)  # (step, row, k, value) for boundary ties


def build_canvas(model, prompts: list[list[int]], gen_length: int):
    """Left-padded canvas ``[B, P + G]``, key mask (``None`` when nothing is padded) and positions."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    T = P + gen_length
    pad = model.pad_id if model.pad_id is not None else model.eos_id
    x = torch.full((B, T), model.mask_id, dtype=torch.long)
    real = torch.zeros((B, T), dtype=torch.bool)
    for b, p in enumerate(prompts):
        n_pad = P - len(p)
        for c in range(n_pad):
            x[b, c] = pad
        for j, tok in enumerate(p):
            x[b, n_pad + j] = tok
        real[b, n_pad:] = True
    if bool(real.all()):
        return x, None, torch.arange(T).unsqueeze(0).repeat(B, 1), P
    positions = (real.long().cumsum(-1) - 1).clamp_min(0)
    return x, real, positions, P


def topk_columns(conf_row: torch.Tensor, k: int, ties: list, step: int, row: int) -> torch.Tensor:
    """Columns of the ``k`` largest values of a 1-D row (``torch.topk``), equal values by lower column.
    Records ``(step, row, k, value)`` when the k-th and (k+1)-th largest are an exact finite tie."""
    vals, cols = torch.sort(conf_row, descending=True, stable=True)
    if 0 < k < conf_row.numel() and torch.isfinite(vals[k - 1]) and vals[k - 1] == vals[k]:
        ties.append((step, row, k, float(vals[k - 1])))
    return cols[:k]


# ------------------------------------------------------------------------------------------------- LLaDA
def llada_quota(n_masked: int, steps: int) -> list[int]:
    """``get_num_transfer_tokens``: ``n // steps`` each step, the first ``n % steps`` steps one more."""
    base, rem = n_masked // steps, n_masked % steps
    return [base + (1 if i < rem else 0) for i in range(steps)]


@torch.no_grad()
def llada_oracle(
    model,
    prompts: list[list[int]],
    *,
    gen_length: int,
    block_length: int,
    steps: int,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    eos_eot_quirk: bool = True,
    softmax_dtype: str = "model",
    seed: int = 0,
) -> OracleOutput:
    """LLaDA ``generate``.

    ``softmax_dtype``: ``"model"`` (current LLaDA: the logits' dtype), ``"float64"`` (Fast-dLLM / older
    LLaDA) or ``"float32"``. ``eos_eot_quirk=True`` restates the reference line
    ``logits_with_noise[:, :, eos] = logits[:, :, eot] = -inf`` literally (at temperature 0 the two names
    are one tensor, so both ids leave the confidence softmax; at temperature > 0 only EOT does);
    ``False`` removes both ids from the confidence softmax at every temperature.
    """
    mask_id, eos, eot = model.mask_id, model.eos_id, model.eot_id
    x, attn, positions, P = build_canvas(model, prompts, gen_length)
    B, T = x.shape
    g = torch.Generator().manual_seed(seed)
    prompt_index = x != mask_id  # prompt tokens and left pads

    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps_per_block = steps // num_blocks
    ties: list = []
    nfe = 0

    for nb in range(num_blocks):
        blk_lo = P + nb * block_length
        blk_hi = P + (nb + 1) * block_length
        quotas = [llada_quota(int((x[b, blk_lo:blk_hi] == mask_id).sum()), steps_per_block) for b in range(B)]
        for i in range(steps_per_block):
            mask_index = x == mask_id
            if cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                both = torch.cat([x, un_x], dim=0)
                both_attn = None if attn is None else torch.cat([attn, attn], dim=0)
                out = model(both, positions=torch.cat([positions, positions], dim=0), attn_mask=both_attn)
                cond, un = torch.chunk(out, 2, dim=0)
                logits = un + (cfg_scale + 1) * (cond - un)
            else:
                logits = model(x, positions=positions, attn_mask=attn).clone()
            nfe += 1

            if logits_eos_inf:
                logits[:, :, eos] = NEG_INF

            # add_gumbel_noise: returns the logits themselves at temperature 0 (no draw)
            if temperature == 0:
                logits_with_noise = logits
            else:
                l64 = logits.to(torch.float64)
                noise = torch.rand(l64.shape, dtype=torch.float64, generator=g)
                logits_with_noise = l64.exp() / (-torch.log(noise)) ** temperature
            x0 = torch.argmax(logits_with_noise, dim=-1)

            if confidence_eos_eot_inf:
                if eos_eot_quirk:
                    logits_with_noise[:, :, eos] = NEG_INF  # aliases `logits` only at temperature 0
                    logits[:, :, eot] = NEG_INF
                else:
                    logits[:, :, eos] = NEG_INF
                    logits[:, :, eot] = NEG_INF

            if remasking == "low_confidence":
                sm_dtype = {"model": logits.dtype, "float64": torch.float64, "float32": torch.float32}[softmax_dtype]
                p = F.softmax(logits.to(sm_dtype), dim=-1)
                x0_p = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
            elif remasking == "random":
                x0_p = torch.rand((B, T), generator=g)
            else:
                raise ValueError(remasking)

            x0_p[:, blk_hi:] = NEG_INF
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.full_like(x0_p, NEG_INF))

            transfer = torch.zeros_like(x, dtype=torch.bool)
            for j in range(B):
                sel = topk_columns(confidence[j], quotas[j][i], ties, nfe - 1, j)
                transfer[j, sel] = True
            x[transfer] = x0[transfer]

    return OracleOutput(x[:, P:].clone(), nfe, ties)


# ------------------------------------------------------------------------------------------------- Dream
def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    drop_sorted = cum > top_p
    drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()  # keep the token that crosses top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, sorted_idx, drop_sorted)
    return logits.masked_fill(drop, torch.finfo(logits.dtype).min)


def _top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    top_k = min(top_k, logits.size(-1))
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def dream_sample_tokens(logits, g, temperature=0.0, top_p=None, top_k=None, margin=False, neg_entropy=False):
    """Dream ``sample_tokens`` on ``[N, V]`` logits -> ``(confidence, x0)``."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = _top_p(logits, top_p)
    if top_k is not None:
        logits = _top_k(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = torch.multinomial(probs, 1, replacement=True, generator=g).squeeze(-1)  # Categorical(probs).sample()
        confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


@torch.no_grad()
def dream_oracle(
    model,
    prompts: list[list[int]],
    *,
    gen_length: int,
    steps: int,
    alg: str = "entropy",
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    alg_temp: float | None = None,
    eps: float = 1e-3,
    seed: int = 0,
) -> OracleOutput:
    """Dream ``diffusion_generate`` (``_sample``) over the whole canvas."""
    mask_id = model.mask_id
    x, attn, positions, P = build_canvas(model, prompts, gen_length)
    B = x.shape[0]
    g = torch.Generator().manual_seed(seed)
    timesteps = torch.linspace(1, eps, steps + 1)
    ties: list = []

    for i in range(steps):
        mask_index = x == mask_id
        logits = model(x, positions=positions, attn_mask=attn)  # already shifted for Dream-format models
        mask_logits = logits[mask_index]  # [N, V], row-major
        t, s = timesteps[i], timesteps[i + 1]

        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.full((mask_logits.shape[0],), mask_id, dtype=torch.long)
            transfer_ts = torch.rand(x0.shape[0], generator=g) < p_transfer
            _, x0[transfer_ts] = dream_sample_tokens(mask_logits[transfer_ts], g, temperature, top_p, top_k)
            x[mask_index] = x0.clone()
            continue

        if alg == "maskgit_plus":
            confidence, x0 = dream_sample_tokens(mask_logits, g, temperature, top_p, top_k)
        elif alg == "topk_margin":
            confidence, x0 = dream_sample_tokens(mask_logits, g, temperature, top_p, top_k, margin=True)
        elif alg == "entropy":
            confidence, x0 = dream_sample_tokens(mask_logits, g, temperature, top_p, top_k, neg_entropy=True)
        else:
            raise ValueError(alg)
        num_mask = mask_index.sum() / mask_index.shape[0]  # batch average (reference quirk)
        n = int(num_mask * (1 - s / t)) if i < steps - 1 else int(num_mask)
        full_conf = torch.full_like(x, NEG_INF, dtype=logits.dtype)
        full_conf[mask_index] = confidence
        if n > 0:
            if alg_temp is None or alg_temp == 0:
                transfer_index = torch.stack([topk_columns(full_conf[j], n, ties, i, j) for j in range(B)])
            else:
                transfer_index = torch.multinomial(F.softmax(full_conf / alg_temp, dim=-1), n, generator=g)
            x_ = torch.full_like(x, mask_id)
            x_[mask_index] = x0.clone()
            rows = torch.arange(B).unsqueeze(1).expand_as(transfer_index)
            transfer = torch.zeros_like(x, dtype=torch.bool)
            transfer[rows, transfer_index] = True
            x[transfer] = x_[transfer]

    return OracleOutput(x[:, P:].clone(), steps, ties)
