"""Plain, slow restatements of the parallel samplers' reference rules, used as golden-test oracles.

Written from ``../shared/ALGORITHMS.md`` and the reference code's semantics, independently of
``dllm.samplers`` (nothing is imported from it): per-row Python loops over sorted confidences, dense credit
matrices, the references' block loops with one full-canvas forward per step.

* Fast-dLLM ``get_transfer_index`` (threshold) and dInfer ``get_transfer_index_threshold`` (its vectorised
  ``conf >= min(tau, max - 1e-5)`` form); dInfer ``get_transfer_index_dynamic`` (factor, with its
  last-index quirk as an option);
* LocalLeap ``get_transfer_index`` (anchors, relaxed threshold within a radius);
* dInfer ``CreditThresholdParallelDecoder`` (dense ``L x V`` credit matrix per block);
* KLASS ``stable_confident_decode`` (``p_prev`` and the KL history);
* EOSER-ASS-RL ``sampling`` / ``ass_sampling`` factors, ``get_num_transfer_tokens_ass`` and the block layout
  of ``ass_generate``;
* Prophet ``should_early_exit`` and its ``generate`` loop (early exit fills every mask);
* AdaBlock ``compute_block_length`` and its ``generate_adablock`` loop.

Ties in confidence order are broken by the lower column (``torch.topk``'s order is unspecified there).
Deliberate differences that do not change the rule are noted where they occur.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from oracles import build_canvas

NEG_INF = float("-inf")


def order_desc(conf: list[float], cand: list[bool]) -> list[int]:
    """Candidate indices by descending confidence, ties by lower index."""
    idx = [i for i in range(len(conf)) if cand[i]]
    return sorted(idx, key=lambda i: (-conf[i], i))


# --------------------------------------------------------------------------------------- commit rules (one row)
def threshold_select(conf: list[float], cand: list[bool], tau: float) -> set[int]:
    """Fast-dLLM: topk over all candidates; the first always, the k-th (k >= 1) iff conf >= tau."""
    order = order_desc(conf, cand)
    if not order:
        return set()
    sel = {order[0]}
    for k in range(1, len(order)):
        if conf[order[k]] >= tau:
            sel.add(order[k])
    return sel


def dinfer_threshold_select(conf: list[float], cand: list[bool], tau: float) -> set[int]:
    """dInfer: ``conf >= clamp(max_conf - 1e-5, -1000, tau)`` over candidates."""
    vals = [conf[i] for i in range(len(conf)) if cand[i]]
    if not vals:
        return set()
    thr = min(max(max(vals) - 1e-5, -1000.0), tau)
    return {i for i in range(len(conf)) if cand[i] and conf[i] >= thr}


def factor_select(conf: list[float], cand: list[bool], factor: float, quirk: bool) -> set[int]:
    """dInfer ``get_transfer_index_dynamic`` (quirk=True literally; False: the longest passing prefix)."""
    order = order_desc(conf, cand)
    N = len(order)
    if N == 0:
        return set()
    threshs = [1 - factor / (n + 1) for n in range(1, N + 1)]
    threshs[0] = -1
    top_i = N - 1
    broke = False
    for top_i in range(N):
        if conf[order[top_i]] < threshs[top_i]:
            broke = True
            break
    if quirk:
        if top_i == 0 or top_i == N - 1:
            top_i += 1
        k = top_i
    else:
        k = top_i if broke else N
    return set(order[:k])


def localleap_select(conf: list[float], cand: list[bool], kappa: float, tau: float | None, radius: int) -> set[int]:
    """LocalLeap: accept order[0]; anchors = candidates >= kappa; a candidate within ``radius`` of an anchor
    needs tau, any other kappa."""
    order = order_desc(conf, cand)
    if not order:
        return set()
    if tau is None:
        return threshold_select(conf, cand, kappa)
    anchors = [i for i in order if conf[i] >= kappa]
    sel = {order[0]}
    for i in order[1:]:
        near = any(abs(i - a) <= radius for a in anchors)
        thr = tau if (anchors and near) else kappa
        if conf[i] >= thr:
            sel.add(i)
    return sel


def quota_select(conf: list[float], cand: list[bool], k: int) -> set[int]:
    return set(order_desc(conf, cand)[:k])


def llada_quota(n: int, steps: int) -> list[int]:
    return [n // steps + (1 if i < n % steps else 0) for i in range(steps)]


# ------------------------------------------------------------------------------------------- EOSER / ASS
def eoser_factor(step_idx: int, total_steps: int, g_min: float, g_max: float = 1.0) -> float:
    """EOSER-ASS-RL ``sampling``."""
    if total_steps > 1:
        t = min(max(step_idx, 0), total_steps - 1) / (total_steps - 1)
        return g_min + (g_max - g_min) * t
    return g_max


def ass_eoser_factor(step_idx: int, steps: int, g_min: float, g_max: float = 1.0) -> float:
    """EOSER-ASS-RL ``ass_sampling``."""
    if steps > 1:
        t = (2 ** (step_idx + 1) - 1) / 2**steps
        return g_min + (g_max - g_min) * t
    return g_max


def ass_schedule(gen_length: int, steps: int, block_num: int) -> list[list[int]]:
    """Per block, the tokens committed at each of its steps (``ass_generate``'s layout and
    ``get_num_transfer_tokens_ass``)."""
    S = int(math.log2(gen_length))
    sizes, block_steps = [], []
    reminder = gen_length - 2**S
    remaining = gen_length
    if block_num == 1:
        sizes, block_steps = [remaining], [list(range(S))]
    else:
        p = S - 1
        for b in range(block_num - 1, -1, -1):
            if b == block_num - 1:
                size, st = 2**p + 1 + reminder, [p]
                p -= 1
            elif b == 0:
                size, st = remaining, list(range(p + 1))
            else:
                size, st = 2**p, [p]
                p -= 1
            remaining -= size
            sizes.insert(0, size)
            block_steps.insert(0, st)
    quota = []
    for i in range(steps):
        if i == steps - 1:
            if len(sizes) == 1:
                quota.append(sizes[-1] - (2**i - 1))
            elif sizes[-1] > 2**i:
                quota.append(sizes[-1])
            else:
                quota.append(0)
        else:
            quota.append(2**i)
    return [[quota[i] for i in st] for st in block_steps]


# ------------------------------------------------------------------------------------------------ Prophet
def prophet_should_exit(current_step: int, max_steps: int, gap: float, early=7.5, mid=5.0, late=2.5) -> bool:
    progress = current_step / max_steps
    if progress < 0.33:
        return gap >= early
    if progress < 0.67:
        return gap >= mid
    return gap >= late


# ----------------------------------------------------------------------------------------------- AdaBlock
def adablock_length(logits_row: torch.Tensor, pred_row: torch.Tensor, block_start: int, gen_length: int,
                    generated: int, b0: int, ids: list[int], thr: float) -> int:
    """AdaBlock ``compute_block_length`` for one row (``logits_row`` ``[T, V]`` over the canvas)."""
    remaining = gen_length - generated
    window = min(int(0.25 * gen_length), remaining)
    best, best_pos = None, None
    for k in range(window):
        pos = block_start + k
        tok = int(pred_row[pos])
        if tok in ids:
            c = float(torch.exp(logits_row[pos, tok] - torch.logsumexp(logits_row[pos], -1)))
            if best is None or c > best:
                best, best_pos = c, pos
    if best is None:
        return min(b0, remaining)
    return best_pos - block_start + 1 if best >= thr else min(b0, remaining)


# ------------------------------------------------------------------------------------------------ credit
class DenseCredit:
    """dInfer's credit matrices, one dense ``[L, V]`` float32 tensor per block key."""

    def __init__(self, alpha: float, beta: float, gamma: float):
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.mats: dict = {}
        self.iters: dict = {}

    def fuse(self, logits: torch.Tensor, mask: torch.Tensor, key) -> torch.Tensor:
        """``logits`` ``[L, V]`` of the block, ``mask`` ``[L]`` still masked -> fused ``[L, V]``."""
        L, V = logits.shape
        if key not in self.mats:
            self.mats[key] = torch.zeros(L, V)
            self.iters[key] = 0
        mat = self.mats[key]
        if self.iters[key] > 0:
            mat *= self.beta
        probs = F.softmax(logits.float(), dim=-1)
        for i in range(L):
            if mask[i]:
                p1, v1 = probs[i].max(-1)
                mat[i, v1] += p1 ** self.gamma
        self.iters[key] += 1
        return logits + self.alpha * torch.log(mat + 1)


# ------------------------------------------------------------------------------------------ decode loops
def _forward(model, x, positions, attn):
    """Full-canvas logits (Dream-format models: already shifted), the whole vocabulary as the references see it."""
    return model(x, positions=positions, attn_mask=attn).clone()


def _proposal(logits: torch.Tensor, temperature: float, g, mask_id: int) -> torch.Tensor:
    """Argmax (Gumbel-max at ``temperature > 0``) over every token but the mask id: the one deliberate
    difference from the references, which would commit a proposed mask id as a no-op. The noise is drawn for
    the whole vocabulary, as the references draw it."""
    if temperature == 0:
        scores = logits.clone()
    else:
        l64 = logits.to(torch.float64)
        noise = torch.rand(l64.shape, dtype=torch.float64, generator=g)
        scores = l64.exp() / (-torch.log(noise)) ** temperature
    scores[..., mask_id] = NEG_INF
    return scores.argmax(-1)


def _prob(logits: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.float(), -1).gather(-1, x0[..., None]).squeeze(-1)


@torch.no_grad()
def block_oracle(model, prompts, *, gen_length: int, block_length: int, rule, temperature: float = 0.0,
                 seed: int = 0, credit: tuple | None = None, steps: int | None = None):
    """Semi-AR blocks, each decoded until it has no masks (Fast-dLLM's loop), rows in lockstep.

    ``rule(j, conf_row, cand_row, step_in_block, n_block_start, x0=, logits=, lo=, hi=) -> set of columns``
    for row ``j`` (lists over canvas columns; ``x0``/``logits`` the row's tensors).
    ``credit=(alpha, beta, gamma)`` fuses dInfer credits before the proposal. Returns ``(sequences, row_nfe)``.
    """
    mask_id = model.mask_id
    x, attn, positions, P = build_canvas(model, prompts, gen_length)
    B, T = x.shape
    g = torch.Generator().manual_seed(seed)
    credits = [DenseCredit(*credit) for _ in range(B)] if credit else None
    row_nfe = [0] * B
    for lo in range(P, T, block_length):
        hi = min(lo + block_length, T)
        n_start = [int((x[j, lo:hi] == mask_id).sum()) for j in range(B)]
        i = 0
        while (x[:, lo:hi] == mask_id).any():
            logits = _forward(model, x, positions, attn)
            if credits:
                fused = logits.clone()
                for j in range(B):
                    fused[j, lo:hi] = credits[j].fuse(logits[j, lo:hi], x[j, lo:hi] == mask_id, (lo, hi))
                logits = fused
            x0 = _proposal(logits, temperature, g, mask_id)
            conf = _prob(logits, x0)
            for j in range(B):
                cand = [(lo <= c < hi) and bool(x[j, c] == mask_id) for c in range(T)]
                if not any(cand):
                    continue
                row_nfe[j] += 1
                for c in rule(j, conf[j].tolist(), cand, i, n_start[j], x0=x0[j], logits=logits[j], lo=lo, hi=hi):
                    x[j, c] = x0[j, c]
            i += 1
    return x[:, P:].clone(), row_nfe


@torch.no_grad()
def prophet_oracle(model, prompts, *, gen_length: int, block_length: int, steps: int, early=7.5, mid=5.0,
                   late=2.5, span: tuple[int, int] | None = None, seed: int = 0):
    """Prophet ``generate`` (LLaDA low-confidence, even quota, temperature 0) per row. The span is the
    generation-relative ``(offset, length)`` if given, else the row's still-masked block positions (this
    toolkit's default; the reference monitors a fixed answer span). Returns ``(sequences, row_nfe)``."""
    mask_id = model.mask_id
    x, attn, positions, P = build_canvas(model, prompts, gen_length)
    B, T = x.shape
    n_blocks = gen_length // block_length
    spb = steps // n_blocks
    row_nfe = [0] * B
    done = [False] * B
    global_step = 0
    for nb in range(n_blocks):
        lo, hi = P + nb * block_length, P + (nb + 1) * block_length
        quotas = [llada_quota(int((x[j, lo:hi] == mask_id).sum()), spb) for j in range(B)]
        for i in range(spb):
            global_step += 1
            if all(done):
                break
            logits = _forward(model, x, positions, attn)
            x0 = _proposal(logits, 0.0, None, mask_id)
            conf = _prob(logits, x0)
            top2 = torch.topk(logits, 2, dim=-1).values
            for j in range(B):
                if done[j]:
                    continue
                row_nfe[j] += 1
                if span is None:
                    cols = [c for c in range(lo, hi) if x[j, c] == mask_id]
                else:
                    cols = [c for c in range(P + span[0], min(P + span[0] + span[1], T))]
                if cols:
                    gap = sum(float(top2[j, c, 0] - top2[j, c, 1]) for c in cols) / len(cols)
                    if prophet_should_exit(global_step, steps, gap, early, mid, late):
                        for c in range(P, T):
                            if x[j, c] == mask_id:
                                x[j, c] = x0[j, c]
                        done[j] = True
                        continue
                cand = [(lo <= c < hi) and bool(x[j, c] == mask_id) for c in range(T)]
                for c in quota_select(conf[j].tolist(), cand, quotas[j][i]):
                    x[j, c] = x0[j, c]
                if not (x[j, P:] == mask_id).any():
                    done[j] = True
    return x[:, P:].clone(), row_nfe


@torch.no_grad()
def adablock_oracle(model, prompts, *, gen_length: int, b0: int, ids: list[int], delim_thr: float, tau: float):
    """AdaBlock ``generate_adablock`` per row (temperature 0): block length from the block's first forward,
    then Fast-dLLM threshold steps until the block is full. Returns ``(sequences, row_nfe, blocks)``."""
    mask_id = model.mask_id
    x, attn, positions, P = build_canvas(model, prompts, gen_length)
    B, T = x.shape
    generated = [0] * B
    row_nfe = [0] * B
    blocks: list[list[int]] = [[] for _ in range(B)]
    bounds = [None] * B
    while any(generated[j] < gen_length or bounds[j] is not None for j in range(B)):
        logits = _forward(model, x, positions, attn)
        x0 = _proposal(logits, 0.0, None, mask_id)
        conf = _prob(logits, x0)
        for j in range(B):
            if bounds[j] is None:
                if generated[j] >= gen_length:
                    continue
                start = P + generated[j]
                L = adablock_length(logits[j], x0[j], start, gen_length, generated[j], b0, ids, delim_thr)
                bounds[j] = (start, start + L)
                blocks[j].append(L)
                generated[j] += L
            lo, hi = bounds[j]
            row_nfe[j] += 1
            cand = [(lo <= c < hi) and bool(x[j, c] == mask_id) for c in range(T)]
            for c in threshold_select(conf[j].tolist(), cand, tau):
                x[j, c] = x0[j, c]
            if not (x[j, lo:hi] == mask_id).any():
                bounds[j] = None
    return x[:, P:].clone(), row_nfe, blocks


class KLASSRow:
    """KLASS's per-row state: ``p_prev`` over the block's positions and the last ``H`` KL values.

    The history is kept per block (this toolkit's documented simplification: the reference's full-canvas
    history lets a block's positions use distributions computed during the previous block)."""

    def __init__(self, H: int):
        self.H = H
        self.p_prev = None
        self.hist: list[list[float]] = []

    def select(self, probs: torch.Tensor, conf: list[float], cand: list[bool], quota: int, conf_thr: float,
               kl_thr: float) -> set[int]:
        """``probs`` ``[L, V]`` float32 over the block's columns; ``conf``/``cand`` block-relative."""
        L = probs.shape[0]
        if self.p_prev is None:
            kl = [math.inf] * L
            self.hist = [[math.inf] * self.H for _ in range(L)]
        else:
            eps = 1e-12  # the reference's form
            kl = [float((probs[i] * (torch.log(probs[i] + eps) - torch.log(self.p_prev[i] + eps))).sum())
                  for i in range(L)]
        for i in range(L):
            self.hist[i] = self.hist[i][1:] + [kl[i]]
        self.p_prev = probs
        ready = {i for i in range(L) if cand[i] and all(h < kl_thr for h in self.hist[i]) and conf[i] > conf_thr}
        return ready if ready else quota_select(conf, cand, quota)
