"""Block-diffusion decoding for SDAR and LLaDA2.x checkpoints, with the exact KV cache of finished blocks.

A block-diffusion model attends bidirectionally inside a block and causally across blocks, so the keys and
values of a finished block never change: they are computed once, when the block is complete, and appended to
the cache (never refreshed). :func:`block_diffusion_generate` reproduces SDAR's ``block_diffusion_generate``
(``JetAstra/SDAR``, ``generate.py``) step for step:

* The canvas is the prompt followed by masks up to the next multiple of ``block_length`` at or after
  ``prompt + gen_length`` tokens; blocks are aligned to multiples of ``block_length`` from the first prompt
  token. The prompt's whole blocks are prefilled in one forward (stored); the first decoded block holds the
  prompt's tail.
* Each block takes up to ``denoising_steps`` forwards over the block alone (the stored blocks as keys), then
  one more forward over the finished block that stores its keys and values: ``NFE = (prefill) + per block
  (steps used + 1)``, as the reference counts.
* A step samples every position of the block (``temperature``, ``top_k``, ``top_p``, then one multinomial draw
  per position from the row's generator, as the reference draws from the global one) and commits by the
  ``remasking`` rule, with the even quota ``get_num_transfer_tokens(block_length, denoising_steps)``:
  ``low_confidence_static`` (the quota's most probable masked positions), ``low_confidence_dynamic`` (every
  masked position above ``confidence_threshold`` when they are at least the quota, else the quota's most
  probable), ``sequential`` (the quota's leftmost masked positions).
* After each block, a row whose generated tokens hold a stop id (EOS by default) stops; its later blocks stay
  masks.

Greedy decoding is the reference's ``top_k=1`` (every sampled probability is then 1.0, so ``dynamic`` commits
the whole block at once and ``static`` commits the quota's leftmost masked positions). The reference's
``entropy_bounded`` branch cannot run (it reads ``transfer_index`` before assigning it and sums the entropy over
the block); it is not offered. Where the first block holds fewer masks than a step's quota, the reference's
top-k also picks prompt positions of that block and overwrites them with predictions; here only masked positions
are committed (the only difference; it needs ``block_length / denoising_steps`` larger than the masks left in
the prompt's last block).

``style="llada2"`` is LLaDA2's ``generate`` (``modeling_llada2_moe.py``) instead: no prefill or storing forwards (a
block's first forward also computes and stores the finished block before it, where the reference recomputes the
whole window), greedy decoding at ``temperature=0`` (argmax, softmax probability), at most ``denoising_steps``
forwards per block, EOS alone ends a row, the region cut at ``gen_length`` (docs/block-diffusion.md).

Rows are decoded one at a time (each with its own generator seeded by ``seed``), so a row's output never depends
on its batch. Recorded reference runs: ``tests/fixtures/golden/sdar_sdar-tiny.json`` and
``llada2_llada2-tiny.json`` (``benchmarks/golden/record_sdar.py``, ``record_llada2.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm.generate import answer_lengths, prepare_prompts
from dllm.samplers.dream import top_k_logits, top_p_logits

REMASKING = ("low_confidence_dynamic", "low_confidence_static", "sequential")
STYLES = ("sdar", "llada2")


@dataclass
class BlockDiffusionOutput:
    sequences: list[list[int]]  # per row: the generated region (prompt end .. last block end), masks left as is
    texts: list[str] | None  # decoded, cut at the first EOS/EOT
    prompt_lengths: list[int]
    nfe: list[int]  # forwards per row (prefill and the storing forward of each block included)
    trace: list[list[dict]] = field(default_factory=list)  # per row, per forward: block, store, committed


class _BlockKV:
    """Keys and values of the finished blocks, per layer; ``store`` appends that many of this forward's leading
    rows (``True``: all of them)."""

    def __init__(self, n_layers: int):
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.store: bool | int = False

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        past = 0 if self.k[layer] is None else self.k[layer].shape[2]
        if self.k[layer] is not None:
            full_k, full_v = torch.cat([self.k[layer], k], 2), torch.cat([self.v[layer], v], 2)
        else:
            full_k, full_v = k, v
        if self.store:
            keep = full_k.shape[2] if self.store is True else past + self.store
            self.k[layer], self.v[layer] = full_k[:, :, :keep], full_v[:, :, :keep]
        return full_k, full_v

    # the decode loop's optional cache hooks, unused here
    layer_input = None
    observe = None


def num_transfer_tokens(block_length: int, steps: int) -> list[int]:
    """The even quota of a block: ``block_length // steps`` per step, the remainder one each to the first steps."""
    base, rem = divmod(block_length, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator):
    """One draw per position (``[L, V]`` logits) and its probability, as the references'
    ``sample_with_temperature_topk_topp``; temperature 0 without top-k / top-p: the argmax and its softmax
    probability (LLaDA2's greedy mode; SDAR has none)."""
    if temperature == 0 and not top_k and top_p >= 1.0:
        probs = torch.softmax(logits, -1)
        token = logits.argmax(-1, keepdim=True)
        return token[:, 0], probs.gather(-1, token)[:, 0]
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    if top_k > 0:
        logits = top_k_logits(logits, top_k, fill=float("-inf"))
    if top_p < 1.0:
        logits = top_p_logits(logits, top_p, fill=float("-inf"))
    probs = torch.softmax(logits, -1)
    token = torch.multinomial(probs, 1, generator=gen)
    return token[:, 0], probs.gather(-1, token)[:, 0]


def _commit(rule: str, masked: torch.Tensor, p: torch.Tensor, quota: int, threshold: float) -> torch.Tensor:
    """Positions of the block to commit (``[L]`` bool), masked positions only."""
    out = torch.zeros_like(masked)
    quota = min(quota, int(masked.sum()))
    if rule == "sequential":
        out[masked.nonzero()[:quota, 0]] = True
        return out
    conf = torch.where(masked, p, torch.tensor(float("-inf"), dtype=p.dtype))
    if rule == "low_confidence_dynamic":
        high = conf > threshold
        if int(high.sum()) >= quota:
            return high
    out[torch.topk(conf, quota).indices] = True
    return out


def _decode_row(model, prompt: list[int], gen_length: int, B: int, quota: list[int], remasking: str,
                threshold: float, sampling: tuple, seed: int, stops: set[int], style: str):
    """One row: (generated region, forwards, per-forward trace)."""
    P = len(prompt)
    total = -(-(P + gen_length) // B) * B
    if total > model.max_seq_len:
        raise ValueError(f"prompt ({P} tokens) + gen_length ({gen_length}), rounded up to whole blocks of {B}, is "
                         f"{total} tokens: more than the model's context of {model.max_seq_len}")
    dev, mask_id, steps = model.device, model.mask_id, len(quota)
    x = torch.full((1, total), mask_id, dtype=torch.long, device=dev)
    x[0, :P] = torch.tensor(prompt, device=dev)
    pos = torch.arange(total, device=dev)[None]
    gen = torch.Generator(device=dev).manual_seed(seed)
    cache = _BlockKV(len(model.layers))
    trace: list[dict] = []

    def forward(lo: int, hi: int, store: bool | int, block: int | None) -> torch.Tensor:
        cache.store = store
        logits = model(x[:, lo:hi], positions=pos[:, lo:hi], cache=cache, key_positions=pos[:, :hi], block_size=B)
        trace.append({"block": block, "store": store is True, "committed": []})
        return logits[0]

    def denoise(logits: torch.Tensor, lo: int, hi: int, step: int) -> None:
        cur = x[0, lo:hi]
        tok, p = _sample(logits, *sampling, gen)
        commit = _commit(remasking, cur == mask_id, p, quota[step] if step < steps else 0, threshold)
        cur[commit] = tok[commit]
        trace[-1]["committed"] = (commit.nonzero()[:, 0] + lo).tolist()

    first = P // B
    if style == "sdar":
        if first:  # the prompt's whole blocks, stored at once
            forward(0, first * B, True, None)
        for blk in range(first, total // B):
            lo, hi = blk * B, (blk + 1) * B
            for step in range(steps + 1):
                if not bool((x[0, lo:hi] == mask_id).any()):
                    forward(lo, hi, True, blk)  # the finished block's keys and values, appended once
                    break
                denoise(forward(lo, hi, False, blk), lo, hi, step)
            if stops & set(x[0, P:hi].tolist()):
                break
        return x[0, P:].tolist(), len(trace), trace
    stored = 0  # llada2: no prefill or storing forwards; a block's first forward also computes (and stores)
    for blk in range(first, total // B):  # the finished blocks not stored yet: the logits the reference's
        lo, hi = blk * B, (blk + 1) * B  # full recomputation of the window gives
        for step in range(steps):
            if not bool((x[0, lo:hi] == mask_id).any()):
                break
            logits = forward(stored, hi, lo - stored, blk)[lo - stored:]
            stored = lo
            denoise(logits, lo, hi, step)
        if stops & set(x[0, P:hi].tolist()):
            break
    return x[0, P:P + gen_length].tolist(), len(trace), trace


@torch.no_grad()
def block_diffusion_generate(model, prompts, *, gen_length: int = 128, block_length: int | None = None,
                             denoising_steps: int | None = None, remasking: str = "low_confidence_dynamic",
                             confidence_threshold: float = 0.85, temperature: float = 1.0, top_k: int | None = 0,
                             top_p: float | None = 1.0, seed: int = 0, stop_ids: list[int] | None = None,
                             chat_template: bool = True, style: str = "sdar") -> BlockDiffusionOutput:
    """Decode ``prompts`` block by block with the exact cache of finished blocks (see the module docstring).

    Args:
        model: a block-diffusion checkpoint (``model.config.block_size`` set, e.g. SDAR); other dLLM
            checkpoints are refused.
        prompts: as :func:`dllm.generate` (strings, conversations, token-id lists).
        gen_length: tokens to generate at least (the canvas ends at the next block boundary).
        block_length: the decoding block (default: the checkpoint's ``block_size``).
        denoising_steps: forwards per block at most (default: ``block_length``).
        remasking: ``low_confidence_dynamic`` (default), ``low_confidence_static`` or ``sequential``.
        temperature, top_k, top_p: the reference's sampling (``top_k=1``: greedy). ``temperature`` must be > 0.
        seed: each row's generator seed (the reference's ``torch.manual_seed``).
        stop_ids: token ids that end a row after the block holding one (default: EOS and EOT; ``llada2``: EOS).
        style: ``"sdar"`` (SDAR's ``block_diffusion_generate``) or ``"llada2"`` (LLaDA2's ``generate``: no prefill
            or storing forwards, greedy at ``temperature=0``, ``denoising_steps`` forwards per block at most, the
            region cut at ``gen_length``; use ``remasking="low_confidence_dynamic"`` and its ``threshold``).
    """
    bs_model = getattr(getattr(model, "config", None), "block_size", None)
    if not bs_model:
        raise ValueError("block_diffusion_generate needs a block-diffusion checkpoint (config block_size, e.g. "
                         "SDAR); decode LLaDA / Dream checkpoints with dllm.generate")
    B = block_length or bs_model
    steps = denoising_steps or B
    if remasking not in REMASKING:
        raise ValueError(f"unknown remasking {remasking!r}; known: {', '.join(REMASKING)}")
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known: {', '.join(STYLES)}")
    for name, v in (("gen_length", gen_length), ("block_length", B), ("denoising_steps", steps)):
        if type(v) is not int or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if steps > B:
        raise ValueError(f"denoising_steps ({steps}) exceeds block_length ({B}): some steps would commit nothing")
    if not (temperature > 0 or (style == "llada2" and temperature == 0)) or temperature == float("inf"):
        raise ValueError(f"temperature={temperature!r} must be a positive number; SDAR's greedy decoding is top_k=1 "
                         "(style='llada2' takes temperature=0)")
    top_k = 0 if top_k is None else top_k
    top_p = 1.0 if top_p is None else top_p
    if type(top_k) is not int or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0: off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
    if not 0 <= confidence_threshold <= 1:
        raise ValueError(f"confidence_threshold={confidence_threshold!r} must be in [0, 1]")
    rows = prepare_prompts(model, prompts, None, chat_template)
    default_stops = (model.eos_id,) if style == "llada2" else (model.eos_id, model.eot_id)
    stops = set(stop_ids if stop_ids is not None else [t for t in default_stops if t is not None])
    quota = num_transfer_tokens(B, steps)
    out = BlockDiffusionOutput([], None, [len(r) for r in rows], [], [])
    for prompt in rows:
        seq, nfe, trace = _decode_row(model, prompt, gen_length, B, quota, remasking, confidence_threshold,
                                      (temperature, top_k, top_p), int(seed), stops, style)
        out.sequences.append(seq)
        out.nfe.append(nfe)
        out.trace.append(trace)
    tok = getattr(model, "tokenizer", None)
    if tok is not None:
        lens = answer_lengths(model, out.sequences)
        out.texts = [tok.decode([t for t in s[:n] if t != model.mask_id], skip_special_tokens=True)
                     for s, n in zip(out.sequences, lens)]
    return out
