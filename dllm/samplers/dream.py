"""Dream's ``diffusion_generate`` algorithms as a sampler.

``timesteps = linspace(1, eps, S + 1)``; at region step ``i`` with ``t, s = ts[i], ts[i + 1]``:

* ``origin``: each masked position is revealed with probability ``1 - s/t`` (all at the last step);
* ``maskgit_plus`` / ``topk_margin`` / ``entropy``: ``n = int(m * (1 - s/t))`` (all at the last step)
  positions with the highest confidence (top-1 probability, top-1 minus top-2, or ``sum p log p``), or
  ``n`` sampled from ``softmax(conf / alg_temp)`` when ``alg_temp > 0``.

Proposals: ``logits / T``, top-p, top-k, then a categorical draw (``T > 0``) or the argmax. Dream's
reference uses the batch-average mask count ``m``; here ``m`` is the row's own count, which is identical
whenever all rows have the same number of masks (always, without early stop) and correct otherwise.

Greedy confidence algorithms (``temperature = 0``, any ``alg`` but ``origin``) can take the proposal and its
score from :func:`dllm.kernels.confidence_stats` (one pass over the vocabulary, no softmax tensor; see
``fused``): ``maskgit_plus`` = ``p_max``, ``topk_margin`` = ``p_max - p_second``, ``entropy`` = ``-H`` (the
negative entropy in nats). Dream's reference scores entropy as ``sum p log(p + 1e-10)``; ``-H = sum p log p``
is lower by ``sum p log(1 + 1e-10 / p)``, between 0 and ``V * 1e-10`` (1.3e-5 at V = 126,464) and nearly the
same for every position, so only near-ties can rank differently. By default the fused path runs only where the
dispatcher runs the Triton kernel (CUDA) on float32 logits; the CPU / reference backend keeps the bit-exact path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dllm import ops
from dllm.samplers.base import (
    NOISE_SCOPES,
    SamplerBase,
    StepContext,
    StepResult,
    argmax_unmasked,
    canvas_rand,
    check_choice,
    check_int,
    check_range,
    check_temperature,
    fused_enabled,
    select_topk,
    top2_values,
    top_k_logits,
    top_p_logits,
)
from dllm.samplers.composed import FUSED_CHOICES
from dllm.samplers.scores import unmasked_confidence_stats

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def dream_proposal(logits, temperature, top_p, top_k, alg, generator, fused: bool = False, mask_id: int | None = None,
                   u: torch.Tensor | None = None):
    """``(confidence, x0)`` for ``[N, V]`` float logits, Dream's ``sample_tokens`` rule: ``[N]`` scores (the
    softmax dtype: the logits' own, float32 when ``fused``) and ``[N]`` int64 proposals.

    Scores come from the softmax over the whole vocabulary (the reference's); ``mask_id`` is never proposed:
    the greedy proposal is the best other token, and a categorical draw that lands on it (it has the
    probability the model gives it) is replaced by the best other token, keeping the random stream.

    ``fused`` (greedy only, ``alg`` not ``origin``): proposal and score from :func:`fused_scores` after the
    top-p / top-k filters (the full-vocabulary scores, the mask never proposed).

    ``u`` (``[N]`` uniforms in (0, 1)): at ``temperature > 0`` draw each categorical by inversion of its
    cumulative probabilities instead of ``torch.multinomial`` with ``generator`` (per-row noise)."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    if fused:
        if temperature > 0 or alg == "origin":
            raise ValueError(f"the fused confidence path needs temperature 0 and a confidence alg, got "
                             f"temperature={temperature}, alg={alg!r}; pass fused=False")
        return fused_scores(logits, alg, mask_id)
    if temperature > 0:
        probs = torch.softmax(logits, dim=-1)
        if u is None:
            x0 = torch.multinomial(probs, 1, replacement=True, generator=generator).squeeze(-1)
        else:
            cdf = probs.to(torch.float64).cumsum(-1)
            x0 = torch.searchsorted(cdf, (u.to(torch.float64) * cdf[:, -1])[:, None]).squeeze(-1)
            x0 = x0.clamp_max(probs.shape[-1] - 1)
        if mask_id is not None:
            x0 = torch.where(x0 == mask_id, argmax_unmasked(probs, mask_id), x0)
        conf = probs.gather(-1, x0[:, None]).squeeze(-1)
        return _alg_confidence(probs, conf, alg), x0
    # Greedy: the same row-wise operations, a few rows at a time so that each row's probabilities stay in
    # cache between the softmax and the confidence passes (every value is bit-identical to the one-shot
    # computation: all operations are independent per row).
    confs, x0s = [], []
    for chunk in logits.split(_CHUNK_ROWS):
        probs = torch.softmax(chunk, dim=-1)
        x0 = argmax_unmasked(probs, mask_id)  # == probs.max(-1).indices (first maximal index), mask excluded
        conf = probs.gather(-1, x0[:, None]).squeeze(-1)
        confs.append(_alg_confidence(probs, conf, alg))
        x0s.append(x0)
    if not confs:
        return logits.new_empty((0,)), torch.empty((0,), dtype=torch.long, device=logits.device)
    return torch.cat(confs), torch.cat(x0s)


_CHUNK_ROWS = 4  # 4 rows x 126,464 fp32 probabilities = 2 MB


def fused_scores(logits: torch.Tensor, alg: str, mask_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``(confidence [N] float32, x0 [N] int64)`` for ``[N, V]`` float logits from one
    :func:`dllm.kernels.confidence_stats` call (float32 softmax): ``maskgit_plus`` -> ``p_max``,
    ``topk_margin`` -> ``p_max - p_second``, ``entropy`` -> ``-H`` (see the module docstring for how it differs
    from Dream's ``sum p log(p + 1e-10)``)."""
    stats = unmasked_confidence_stats(logits, mask_id)
    if alg == "maskgit_plus":
        conf = stats.p_token  # == p_max at temperature 0
    elif alg == "topk_margin":
        conf = stats.p_max - stats.p_second
    elif alg == "entropy":
        conf = -stats.entropy
    else:
        raise ValueError(f"Dream alg {alg!r} has no fused score; fused algs: maskgit_plus, topk_margin, entropy")
    return conf, stats.token


def _alg_confidence(probs: torch.Tensor, conf: torch.Tensor, alg: str) -> torch.Tensor:
    if alg == "topk_margin":
        top2 = top2_values(probs)
        return top2[:, 0] - top2[:, 1]
    if alg == "entropy":
        plogp = probs + 1e-10
        plogp.log_()
        plogp.mul_(probs)  # probs * log(probs + 1e-10), in place: the same values, no further allocation
        return plogp.sum(dim=-1)
    return conf


def dream_ratio(ctx: StepContext, eps: float) -> torch.Tensor:
    """``1 - s/t`` per row for the row's current step (float32, exactly as the reference computes it from
    ``torch.linspace(1, eps, S + 1)``); 1 at the region's last step. The values for every schedule length
    ``S`` up to the run's longest (``max(total_steps, gen_length)``, rounded up to a
    :func:`~dllm.ops.shape_bucket` size) are tabulated once per (``eps``, size, device) and shared
    (:func:`dllm.ops.kept`), so the lookup needs no host synchronisation and a captured step graph reads a table
    that outlives its generation."""
    smax = max(ctx.total_steps, ctx.canvas_len - ctx.gen_lo, 1)
    size, device = ops.shape_bucket(smax), ctx.steps.device

    def make():
        table = torch.ones((size + 1, size + 1), dtype=torch.float32, device=device)
        for S in range(1, size + 1):
            ts = torch.linspace(1, eps, S + 1, device=device)
            table[S, :S] = 1 - ts[1:] / ts[:-1]
        return table

    table = ops.kept(("dream_ratio", float(eps), size, device), make)
    steps = ctx.steps.clamp(1, smax)
    i = ctx.step.clamp_max(steps - 1)
    ratio = table[steps, i]
    return torch.where(ctx.step >= steps - 1, torch.ones_like(ratio), ratio)


@dataclass(frozen=True)
class DreamSampler(SamplerBase):
    """Dream ``diffusion_generate`` as a sampler (see module docstring).

    ``noise_scope``: ``"row"`` (default) takes every random number from per-row counter-based noise
    (:func:`dllm.samplers.base.canvas_rand`), so a row's output does not depend on its batch: categorical
    proposals by inversion of the cumulative probabilities, ``origin``'s reveal test from a uniform per
    position, the ``alg_temp`` draw of positions as Gumbel-top-k (the same distribution as sampling without
    replacement). ``"region"`` draws from the run's generator as the reference does when the window is its
    whole canvas (``torch.rand`` / ``torch.multinomial`` over the masked positions); ``"canvas"`` also draws
    the ``alg_temp`` multinomial over the whole canvas row, as the reference does. Both depend on the batch.

    ``fused``: ``"auto"`` (default), ``"on"`` or ``"off"``: at ``temperature = 0`` with ``maskgit_plus``,
    ``topk_margin`` or ``entropy``, take the proposal and its score from :func:`dllm.kernels.confidence_stats`
    through the kernel dispatcher (scores in float32; see the module docstring for the entropy offset).
    ``"auto"`` does so where :func:`dllm.kernels.uses_triton` is true and the logits are float32 (Dream's
    softmax runs in the logits' dtype, so only then are the semantics those of a float32 softmax); elsewhere
    the bit-exact PyTorch path runs. ``"on"`` forces the dispatcher for any logits dtype (the kernel reads
    them in float32; on CPU it runs the kernel's PyTorch twin). ``origin`` and ``temperature > 0`` always take
    the plain path.
    """

    alg: str = "entropy"
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    alg_temp: float | None = None
    eps: float = 1e-3
    noise_scope: str = "row"
    fused: str = "auto"
    name: str = "dream"

    def __post_init__(self):
        if self.alg not in ALGS:
            raise ValueError(f"unknown Dream alg {self.alg!r}; known: {', '.join(ALGS)}")
        check_temperature("temperature", self.temperature)
        if self.top_p is not None:
            check_range("top_p", self.top_p, 0, 1, lo_open=True)
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1, what="a positive integer", fix=" (or None: no top-k cut)")
        if self.alg_temp is not None:
            check_temperature("alg_temp", self.alg_temp, " (the temperature of Dream's position draw; None: off)")
        check_range("eps", self.eps, 0, 1, lo_open=True, hi_open=True)
        check_choice("noise_scope", self.noise_scope, NOISE_SCOPES)
        check_choice("fused", self.fused, FUSED_CHOICES)

    def graph_safe(self) -> bool:
        """Its schedule is a shared table (:func:`dream_ratio`), read on the device; its noise is each row's
        counter-based stream (``noise_scope="row"``) or none (a greedy confidence ``alg`` without ``alg_temp``). On a
        GPU it scores every window position (:func:`dllm.ops.dense_window`): no data-dependent shape."""
        return self.noise_scope == "row" or (self.temperature == 0 and self.alg != "origin" and not self.alg_temp)

    def row_windows(self) -> bool:
        """Its quotas and selections are per row; its noise each row's counter-based stream of generation columns or
        none (:meth:`graph_safe`'s condition)."""
        return self.graph_safe()

    def _fused(self, logits: torch.Tensor) -> bool:
        """Whether this step's proposal and score come from :func:`dllm.kernels.confidence_stats`."""
        eligible = self.temperature == 0 and self.alg != "origin" and (self.fused == "on" or logits.dtype == torch.float32)
        return fused_enabled(self.fused, logits, eligible)

    def step(self, logits: torch.Tensor, ctx: StepContext) -> StepResult:
        """``logits``: ``[B, W, V]`` float (the whole vocabulary); returns ``[B, W]`` int64 proposals and a
        ``[B, W]`` bool commit mask."""
        B, W, V = logits.shape
        cand = ctx.cand
        ratio = dream_ratio(ctx, self.eps)  # [B]
        per_row = self.noise_scope == "row" and ctx.row_key is not None
        if self.alg == "origin":
            return self._origin(logits, ctx, ratio, per_row)
        u_tok = canvas_rand((), ctx, W, B, torch.float64, logits.device, "row") if per_row and \
            self.temperature > 0 else None
        if ops.dense_window(logits) and (per_row or self.temperature == 0):  # every position: no data-dependent shape
            c, x0 = dream_proposal(logits.reshape(B * W, V), self.temperature, self.top_p, self.top_k, self.alg,
                                   ctx.generator, fused=self._fused(logits), mask_id=ctx.mask_id,
                                   u=None if u_tok is None else u_tok.reshape(-1))
            proposal = torch.where(cand, x0.view(B, W), ctx.x)
            conf = c.view(B, W).masked_fill(~cand, float("-inf"))
        else:  # the masked positions only, row-major like the reference's logits[mask_index]
            conf_flat, x0 = dream_proposal(logits[cand], self.temperature, self.top_p, self.top_k, self.alg,
                                           ctx.generator, fused=self._fused(logits), mask_id=ctx.mask_id,
                                           u=None if u_tok is None else u_tok[cand])
            proposal = ctx.x.clone()
            proposal[cand] = x0
            conf = torch.full((B, W), float("-inf"), dtype=conf_flat.dtype, device=logits.device)
            conf[cand] = conf_flat
        m = cand.sum(-1)
        n = (m.float() * ratio).long()
        n = torch.where(ctx.step >= ctx.steps - 1, m, n)
        if self.alg_temp:
            commit = self._sample_positions(conf, n, ctx)
        else:
            commit = select_topk(conf, cand, n)
        return StepResult(proposal, commit & cand)

    def _origin(self, logits, ctx: StepContext, ratio, per_row: bool) -> StepResult:
        """Dream's ``origin``: each masked position is revealed with probability ``1 - s/t``, with a token drawn
        from its distribution."""
        B, W, V = logits.shape
        cand = ctx.cand
        if per_row:
            u_tok = canvas_rand((), ctx, W, B, torch.float64, logits.device, "row") if self.temperature > 0 else None
            u = canvas_rand((), ctx, W, B, torch.float32, logits.device, "row")
            reveal = (u < ratio[:, None]) & cand
            if ops.dense_window(logits):
                _, x0 = dream_proposal(logits.reshape(B * W, V), self.temperature, self.top_p, self.top_k, self.alg,
                                       ctx.generator, mask_id=ctx.mask_id,
                                       u=None if u_tok is None else u_tok.reshape(-1))
                return StepResult(torch.where(reveal, x0.view(B, W), ctx.x), reveal)
            _, x0 = dream_proposal(logits[reveal], self.temperature, self.top_p, self.top_k, self.alg,
                                   ctx.generator, mask_id=ctx.mask_id, u=None if u_tok is None else u_tok[reveal])
            proposal = ctx.x.clone()
            proposal[reveal] = x0
            return StepResult(proposal, reveal)
        # the reference's stream: one uniform per masked position (row-major), then the revealed ones' draws
        flat_logits = logits[cand]
        u = torch.rand(flat_logits.shape[0], generator=ctx.generator, device=logits.device)
        reveal = u < ratio[:, None].expand(B, W)[cand]
        _, x0 = dream_proposal(flat_logits[reveal], self.temperature, self.top_p, self.top_k, self.alg,
                               ctx.generator, mask_id=ctx.mask_id)
        flat = torch.full((flat_logits.shape[0],), ctx.mask_id, dtype=torch.long, device=logits.device)
        flat[reveal] = x0
        proposal = ctx.x.clone()
        proposal[cand] = flat
        commit = torch.zeros_like(cand)
        commit[cand] = reveal
        return StepResult(proposal, commit)

    def _sample_positions(self, conf, n, ctx: StepContext) -> torch.Tensor:
        B, W = conf.shape
        if self.noise_scope == "row" and ctx.row_key is not None:
            # Gumbel-top-k: the k largest of log p + Gumbel noise are a draw of k positions without replacement
            # with probabilities proportional to p = softmax(conf / alg_temp), Dream's multinomial.
            u = canvas_rand((), ctx, W, B, torch.float64, conf.device, "row")
            keys = (conf.to(torch.float64) / self.alg_temp) - torch.log(-torch.log(u))
            keys = keys.masked_fill(~ctx.cand, float("-inf"))
            return select_topk(keys, ctx.cand, n)
        commit = torch.zeros((B, W), dtype=torch.bool, device=conf.device)
        k = int(n.max())
        if k == 0:
            return commit
        if self.noise_scope == "canvas":
            full = torch.full((B, ctx.canvas_len), float("-inf"), dtype=conf.dtype, device=conf.device)
            full[:, ctx.win_lo : ctx.win_lo + W] = conf
            probs, shift = F.softmax(full / self.alg_temp, dim=-1), ctx.win_lo
        else:
            probs, shift = F.softmax(conf / self.alg_temp, dim=-1), 0
        # Rows with fewer than k drawable positions (finished rows, rows with fewer masks left than another
        # row's quota, underflowed probabilities) would make the batched draw fail; they draw from a
        # placeholder and take their n most confident candidates instead. Other rows are unaffected.
        ok = (probs > 0).sum(-1) >= k
        probs = torch.where(ok[:, None], probs, torch.ones_like(probs))
        idx = torch.multinomial(probs, k, generator=ctx.generator) - shift
        keep = (torch.arange(k, device=conf.device)[None] < n[:, None]) & ok[:, None]
        commit.scatter_(-1, idx.clamp(0, W - 1), keep)
        return torch.where(ok[:, None], commit, select_topk(conf, ctx.cand, n))
