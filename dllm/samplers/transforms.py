"""Stages around the commit rule: a logits transform (CreditDecoding's trace credits) and a confidence
modifier (EOS early rejection). Both are small frozen dataclasses used by
:class:`~dllm.samplers.composed.ComposedSampler`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from dllm.ops import cached_arange, moved_rows
from dllm.samplers.base import (
    SOFTMAX_DTYPES,
    SamplerBase,
    StepContext,
    argmax_unmasked,
    check_int,
    check_range,
    row_forwards,
    token_prob,
    top_p_logits,
)

EOS_PROGRESS = ("step", "step-total", "decoded", "ass")
#: Most credited tokens kept per position: the table is ``[batch, canvas, slots]`` (12 bytes a slot), and a position
#: gains at most one credited token per step, so more slots than a block's steps are never used
MAX_CREDIT_SLOTS = 256


@dataclass(frozen=True)
class CreditFusion:
    """CreditDecoding's trace credits (dInfer ``CreditThresholdParallelDecoder``).

    Per position a credit ``C[v]`` per token: every step ``C *= beta``, then each still-masked candidate adds
    ``p_top1 ** gamma`` to the credit of its current (raw) top-1 token; the fused logits
    ``logits + alpha * log(1 + C)`` give the proposal and the confidence. Credits start at zero when a row's
    region changes.

    Storage is a **sparse top-``slots`` table** per canvas position (token ids and credits, ``[B, T, slots]``),
    not dInfer's dense ``B x L x V`` tensor: a position gains one credited token per step at most, so the
    table is exact while a position has seen at most ``slots`` distinct top-1 tokens in its region; beyond
    that the smallest credit is evicted (it has decayed by ``beta`` per step since it was last refreshed).
    """

    alpha: float = 0.7
    beta: float = 0.8
    gamma: float = 0.2
    slots: int = 8

    def __post_init__(self):
        check_range("alpha", self.alpha, 0, math.inf, hi_open=True, fix="; dInfer uses credit alpha 0.7 (0 disables)")
        check_range("beta", self.beta, 0, 1, fix="; beta is the per-step credit decay (dInfer uses 0.8)")
        check_range("gamma", self.gamma, 0, math.inf, hi_open=True, fix="; dInfer boosts with p_top1 ** 0.2")
        check_int("slots", self.slots, 1, MAX_CREDIT_SLOTS,
                  fix=" (credited tokens kept per position, e.g. 8; a position gains at most one per step)")

    def update(self, top: torch.Tensor, p_top: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Decay the window's credits and add ``p_top ** gamma`` to each candidate's top-1 token ``top``
        (``[B, W]``). Returns the window's ``(tokens, credits)`` table, ``[B, W, slots]`` views."""
        B, W = top.shape
        st = ctx.state.setdefault("credit", {})
        if "tok" not in st:
            st["tok"] = torch.zeros((B, ctx.canvas_len, self.slots), dtype=torch.long, device=top.device)
            st["val"] = torch.zeros((B, ctx.canvas_len, self.slots), dtype=torch.float32, device=top.device)
            st["region"] = ctx.region_lo.clone()
        st["val"].masked_fill_((st["region"] != ctx.region_lo)[:, None, None], 0.0)
        st["region"] = ctx.region_lo.clone()
        if torch.is_tensor(ctx.win_lo):  # each row's own window ([B, 1] starts): copies, written back below
            idx = (ctx.win_lo + cached_arange(W, top.device))[..., None].expand(-1, -1, self.slots)
            tok, val = st["tok"].gather(1, idx), st["val"].gather(1, idx)
        else:  # views into the canvas-indexed table
            idx = None
            tok = st["tok"][:, ctx.win_lo : ctx.win_lo + W]
            val = st["val"][:, ctx.win_lo : ctx.win_lo + W]
        val.mul_(self.beta)
        add = p_top.float().pow(self.gamma)
        match = (tok == top[..., None]) & (val > 0)
        hit = match.any(-1)
        slot = torch.where(hit, match.int().argmax(-1), val.argmin(-1))[..., None]  # else evict the smallest
        old_v = val.gather(-1, slot).squeeze(-1)
        new_v = torch.where(hit, old_v, torch.zeros_like(old_v)) + add
        upd = ctx.cand
        tok.scatter_(-1, slot, torch.where(upd, top, tok.gather(-1, slot).squeeze(-1))[..., None])
        val.scatter_(-1, slot, torch.where(upd, new_v, old_v)[..., None])
        if idx is not None:  # a row's columns are distinct
            st["tok"].scatter_(1, idx, tok)
            st["val"].scatter_(1, idx, val)
        return tok, val

    def move_rows(self, state: dict, d: int, keep: torch.Tensor | None, n_new: int) -> None:
        """Move the credit tables (``state["credit"]``: canvas-indexed ``[B, T, slots]`` tokens and credits, and
        the rows' region starts, canvas columns) with the rows of its batch (the serving engine,
        :meth:`~dllm.samplers.base.SamplerBase.move_rows` of the sampler holding this stage): ``keep`` rows
        selected, canvas columns shifted by ``d`` (left padding added, or cropped when ``d < 0``), ``n_new`` rows
        appended with empty tables."""
        st = state.get("credit")
        if not st or "tok" not in st:
            return
        st["tok"] = moved_rows(st["tok"], keep, n_new, d=d, dim=1)
        st["val"] = moved_rows(st["val"], keep, n_new, d=d, dim=1)
        st["region"] = moved_rows(st["region"], keep, n_new, d=d, shift=True)

    def apply(self, logits: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense path: ``(fused logits [B, W, V] float32, raw top-1 token [B, W])``; updates the credits."""
        lf = logits.float()
        top = argmax_unmasked(lf, ctx.mask_id)
        p_top = token_prob(lf, top)
        tok, val = self.update(top, p_top, ctx)
        fused = lf.clone() if lf is logits else lf
        fused.scatter_add_(-1, tok, self.alpha * torch.log1p(val))
        return fused, top

    def propose(self, logits: torch.Tensor, ctx: StepContext, softmax_dtype: str = "float32"):
        """Sparse path, exact for greedy proposals: ``(x0, conf, raw top-1)`` with ``x0`` the argmax of the
        fused logits and ``conf`` its fused softmax probability, from one softmax of the raw logits and the
        ``slots`` credited entries (the fused logits differ from the raw ones only there):
        ``softmax(fused)[v] = p[v] (1 + C[v]) ** alpha / (1 + sum_k p[k] ((1 + C[k]) ** alpha - 1))``."""
        dt = SOFTMAX_DTYPES[softmax_dtype] or logits.dtype
        p = torch.softmax(logits.to(dt), dim=-1)
        top = argmax_unmasked(logits, ctx.mask_id)
        p_top = p.gather(-1, top[..., None]).squeeze(-1)
        tok, val = self.update(top, p_top, ctx)
        boost = (self.alpha * torch.log1p(val)).to(dt)  # fused - raw logit at the credited tokens
        z = logits.gather(-1, tok).to(dt) + boost
        z = z.masked_fill(val <= 0, float("-inf"))  # empty slots (their token id is a placeholder)
        z_top = logits.gather(-1, top[..., None]).to(dt)
        vals = torch.cat([z, z_top], -1)
        ids = torch.cat([tok, top[..., None]], -1)
        best = vals.amax(-1, keepdim=True)
        x0 = torch.where(vals == best, ids, logits.shape[-1]).amin(-1)  # first maximal token id, as argmax
        p_tok = p.gather(-1, tok)
        norm = 1 + (p_tok * torch.expm1(boost)).sum(-1)
        b_x0 = (boost * (tok == x0[..., None])).amax(-1)  # the credited tokens are distinct; 0 if none
        conf = p.gather(-1, x0[..., None]).squeeze(-1) * torch.exp(b_x0) / norm
        return x0, conf, top


@dataclass(frozen=True)
class EOSRejection:
    """EOS early rejection (EOSER): ``conf[x0 == eos] *= g``, ``g`` rising linearly from ``gamma_min`` to 1
    with the decoding progress ``t``:

    * ``"step"`` (default): ``t = min(step, S - 1) / (S - 1)``, ``step`` and ``S`` the region's step index
      and schedule length (the reference with one block; ``g = 1`` when ``S = 1``);
    * ``"step-total"``: the reference's multi-block quirk, the region's step index over the *total* steps;
    * ``"decoded"``: the fraction of the region already decoded (for threshold rules, which end a region
      long before its nominal ``S`` steps);
    * ``"ass"``: ``t = (2**(i + 1) - 1) / 2**S`` with ``i`` the global step and ``S = floor(log2(gen_length))``,
      the fraction decoded after step ``i`` of the ascending schedule (EOSER under ASS, reference
      ``ass_sampling``), capped at 1.

    Only EOS is attenuated (the reference's ``tokenizer.eos_token_id``); ``include_eot`` adds EOT.
    """

    gamma_min: float = 0.4
    progress: str = "step"
    include_eot: bool = False

    def __post_init__(self):
        check_range("gamma_min", self.gamma_min, 0, 1,
                    fix="; EOSER uses 0.4 alone and 0.01 with the ascending schedule")
        if self.progress not in EOS_PROGRESS:
            raise ValueError(f"unknown EOS rejection progress {self.progress!r}; known: {', '.join(EOS_PROGRESS)}")

    def factor(self, ctx: StepContext) -> torch.Tensor:
        """``[B]`` attenuation factor ``g`` for this step."""
        if self.progress in ("step", "step-total"):
            S = ctx.steps if self.progress == "step" else torch.full_like(ctx.steps, ctx.total_steps)
            t = ctx.step.minimum(S - 1).clamp_min(0).float() / (S - 1).clamp_min(1).float()
            t = torch.where(S > 1, t, torch.ones_like(t))
        elif self.progress == "decoded":
            left = ctx.cand.sum(-1).float()
            t = 1 - left / ctx.n_region_start.clamp_min(1).float()
        else:
            G = max(ctx.canvas_len - ctx.gen_lo, 1)
            S = max(int(math.floor(math.log2(G))), 0)
            i = row_forwards(ctx).clamp_max(60)  # the row's own forwards (exact under serving)
            t = ((torch.pow(2, i + 1) - 1).to(torch.float64) / 2**S).clamp_max(1.0).to(torch.get_default_dtype())
        return self.gamma_min + (1 - self.gamma_min) * t.clamp(0, 1)

    def apply(self, conf: torch.Tensor, x0: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attenuated conf, g [B])``."""
        g = self.factor(ctx)
        ids = [ctx.eos_id] + ([ctx.eot_id] if self.include_eot else [])
        ids = [i for i in ids if i is not None]
        if not ids:
            return conf, g
        hit = x0 == ids[0]
        for i in ids[1:]:
            hit = hit | (x0 == i)
        return torch.where(hit, conf * g[:, None].to(conf.dtype), conf), g


@dataclass(frozen=True)
class TopP(SamplerBase):
    """A nucleus cut in front of any sampler: before ``inner`` sees a step's logits, every token outside the
    smallest set of most probable tokens whose probability exceeds ``top_p`` gets ``-inf`` (the most probable
    token always stays). The set is taken from the softmax over the proposable tokens (the mask token never
    counts: no sampler proposes it), so the inner sampler's proposals and confidences come from the renormalised
    nucleus, as with Dream's own ``top_p``. ``top_p = 1`` changes nothing (the logits pass through untouched).

    Everything else is the inner sampler's: its name, window, parameters and per-row state; ``bind_model``
    binds the inner sampler."""

    inner: Any
    top_p: float = 1.0

    def __post_init__(self):
        if not hasattr(self.inner, "step"):
            raise TypeError(f"inner must be a sampler with step(logits, ctx), got {self.inner!r}")
        check_range("top_p", self.top_p, 0, 1, lo_open=True, fix="; the nucleus mass, 0 < top_p <= 1 (1: no cut)")

    @property
    def window_columns(self):
        return getattr(self.inner, "window_columns", None)

    def __getattr__(self, attr):  # the inner sampler's attributes (temperature, rule, ...)
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def bind_model(self, model) -> TopP:
        inner = self.inner.bind_model(model) if hasattr(self.inner, "bind_model") else self.inner
        return self if inner is self.inner else replace(self, inner=inner)

    def move_rows(self, state: dict, d: int, keep: torch.Tensor | None, n_new: int, **joining) -> None:
        """The inner sampler's :meth:`~dllm.samplers.base.SamplerBase.move_rows` (its per-row state)."""
        move = getattr(self.inner, "move_rows", None)
        if move is not None:
            move(state, d, keep, n_new, **joining)

    def step(self, logits: torch.Tensor, ctx: StepContext):
        if self.top_p >= 1:
            return self.inner.step(logits, ctx)
        return self.inner.step(nucleus(logits, self.top_p, ctx.mask_id), ctx)


def nucleus(logits: torch.Tensor, top_p: float, mask_id: int | None = None) -> torch.Tensor:
    """``logits`` with ``-inf`` outside the nucleus of mass ``top_p`` (see :class:`TopP`): Dream's cut
    (:func:`dllm.samplers.base.top_p_logits`) over the distribution without the mask token, which gets ``-inf``."""
    lf = logits.float()
    if mask_id is not None and 0 <= mask_id < lf.shape[-1]:
        lf = lf.clone()
        lf[..., mask_id] = float("-inf")
    return logits.masked_fill(top_p_logits(lf, top_p, fill=float("-inf")) == float("-inf"), float("-inf"))


def with_top_p(sampler, top_p: float):
    """``sampler`` (a sampler or a :class:`~dllm.samplers.recipe.Recipe`) behind a :class:`TopP` nucleus cut; a
    recipe keeps its block layout and cache."""
    from dllm.samplers.recipe import Recipe

    if isinstance(sampler, Recipe):
        return replace(sampler, sampler=TopP(sampler.sampler, top_p))
    return TopP(sampler, top_p)
