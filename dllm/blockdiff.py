"""Block-diffusion decoding for SDAR, LLaDA2.0 / 2.1 and Fast-dLLM v2 checkpoints, with the exact KV cache of finished
blocks.

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
  per position from the row's generator, as the reference draws from the global one) and writes the sample at the
  positions the ``remasking`` rule selects, with the even quota ``get_num_transfer_tokens(block_length,
  denoising_steps)``: ``low_confidence_static`` (``torch.topk`` of the quota over the probabilities, ``-inf`` at
  unmasked positions), ``low_confidence_dynamic`` (every masked position above ``confidence_threshold`` when they
  are at least the quota, else that top-k), ``sequential`` (the quota's positions from the first masked one on).
  As in the reference, the quota is not capped at the masks left: when a step has fewer masks than its quota
  (earlier steps of the dynamic rule committed more than theirs, the prompt's tail fills part of the first block),
  the selection includes unmasked positions, and the step's sample overwrites those generated (or prompt) tokens,
  in any block. ``out.trace`` lists each forward's ``committed`` (masked before, a token after) and
  ``overwritten`` (a token before, a different one after) positions.
* After each block, a row whose generated tokens hold a stop id (EOS by default) stops; its later blocks stay
  masks.
* A proposal equal to the mask id leaves its position masked (or re-masks the token it overwrites). A block still
  holding masks after its ``denoising_steps`` steps has no quota left: the reference runs one more denoising
  forward and raises ``IndexError``; here :class:`UnfinishedBlockError` is raised instead (before that forward),
  naming the row and block and carrying the forwards so far.

Greedy decoding is the reference's ``top_k=1`` (every sampled probability is then 1.0, so ``dynamic`` commits
the whole block at once and ``static`` takes the quota in the order ``torch.topk`` breaks the ties). The reference's
``entropy_bounded`` branch cannot run (it reads ``transfer_index`` before assigning it and sums the entropy over
the block); it is not offered. The reference decodes one prompt per call; here each row of a batch is decoded
alone (docs/block-diffusion.md lists every difference from each reference).

``style="llada2"`` is LLaDA2's ``generate`` (``modeling_llada2_moe.py``) instead: no prefill or storing forwards (a
block's first forward also computes and stores the finished block before it, where the reference recomputes the
whole window), greedy decoding at ``temperature=0`` (argmax, softmax probability), at most ``denoising_steps``
forwards per block, EOS alone ends a row, the region cut at ``gen_length`` (docs/block-diffusion.md), and its
options ``minimal_topk`` (at most ``gen_length // minimal_topk`` forwards per block; default 1) and
``eos_early_stop`` (a forward that commits a stop token ends the row when no mask is left before the row's first
stop token; the row then ends with it, past ``gen_length`` when the canvas runs past it there).

``style="llada21"`` is LLaDA2.1's ``generate`` (LLaDA2.1-mini's ``modeling_llada2_moe.py``): token editing. Each
forward covers the current block (finished blocks from the cache, as ``llada2``) and, from the same logits, commits
the masked positions whose proposal is above ``confidence_threshold`` (default 0.95; at least ``num_to_transfer``
of them, else the ``num_to_transfer`` most probable) and edits the block's generated tokens (never the prompt or an
earlier block) whose proposal differs and is above ``editing_threshold`` (default 0.9). A block ends after a forward
with no mask left and no edit, or before a forward when ``max_post_steps`` (default 16) mask-free forwards have
run; there is no step budget. ``eos_early_stop`` ends the row after a finished block whose generated tokens hold a
stop token; otherwise every block is decoded. ``sequences`` are the reference's answer: the first ``gen_length``
tokens cut after the first stop token. At ``temperature=0`` (the default) a block state that repeats (the reference
would loop forever: a proposed mask token "commits" the mask again) ends the block with its masks left.

``style="fastdllm2"`` is Fast-dLLM v2's ``batch_sample`` (NVlabs/Fast-dLLM ``v2/generation_functions.py``, the
official evaluation's decoder) and ``"fastdllm2_generate"`` the ``generate`` of its model file: the prompt's whole
blocks prefilled (a prompt ending on a block boundary gets its next token from the prefill's last row, greedily),
then each block decoded sub-block by sub-block (``small_block_length``): a sub-block's forwards repeat until it
holds no mask, each committing the masked positions whose probability (``temperature`` 0: softmax of the
logits, else top-p sampling) is above ``confidence_threshold`` plus the most probable one; the finished block is
stored by one more forward whose last row gives the next block's first token. Logits are shifted (position i from
hidden row i - 1; a forward's first position from its own row, as the reference). ``use_block_cache`` reproduces
the reference's sub-block cache. ``batch_sample`` finishes the block holding a committed stop token and pads what
follows it; ``generate`` stops as soon as a stop token has no mask before it and cuts the row after it
(docs/block-diffusion.md lists the reference quirks reproduced and those that are not).

Rows are decoded one at a time (each with its own generator seeded by ``seed``), so a row's output never depends
on its batch. Recorded reference runs: ``tests/fixtures/golden/sdar_sdar-tiny.json``, ``sdar_sdar-integer.json``,
``llada2_llada2-tiny.json``, ``llada21_llada2-tiny.json`` and ``fastdllm2_fastdllm2-tiny.json``
(``benchmarks/golden/record_sdar.py``, ``record_llada2.py``, ``record_llada21.py``, ``record_fastdllm2.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm.generate import answer_lengths, check_model, prepare_prompts
from dllm.models.transformer import default_positions
from dllm.samplers.base import top_k_logits, top_p_logits

REMASKING = ("low_confidence_dynamic", "low_confidence_static", "sequential")
STYLES = ("sdar", "llada2", "llada21", "fastdllm2", "fastdllm2_generate")


def model_styles(model) -> tuple[str, ...]:
    """The styles that can decode ``model``: the Fast-dLLM v2 ones for a model with shifted logits (each position
    read from the row before it), the others for one without. A style of the other kind reads every logit one
    position off: junk, or an index past the window."""
    shifted = bool(getattr(model, "shift_logits", False))
    return tuple(s for s in STYLES if s.startswith("fastdllm2") == shifted)


def two_copy_inputs(noisy: torch.Tensor, clean: torch.Tensor, valid: torch.Tensor, block_size: int, P: int,
                    shift: bool) -> dict:
    """Model inputs for one forward over ``[noisy; clean]`` (``[B, 2L]``) in which every noisy block sees what
    decoding shows it, and ``logits_idx`` reading the noisy copy's columns ``P:``.

    A noisy token of block ``b`` attends to the noisy tokens of block ``b`` and the clean tokens of the blocks
    before it; a clean token attends to the clean tokens of blocks up to its own (BD3-LM's objective, used by SDAR
    and LLaDA2). With ``shift`` (token ``i`` predicted from hidden row ``i - 1``, Fast-dLLM v2) a block's first
    column is read from the clean copy's last row of the block before. One forward thus gives every block's
    logits given clean earlier blocks: the block-diffusion training loss (:mod:`dllm.tiny.block`) and its
    likelihood bound (the lm-eval adapter). ``noisy``, ``clean``: ``[B, L]``; ``valid``: ``[B, L]`` real tokens
    (left padding); blocks by position (``cumsum(valid) - 1``) of ``block_size``."""
    B, L = clean.shape
    pos = default_positions(valid, B, L, valid.device)
    blk = pos // block_size
    qb, kb = blk[:, :, None], blk[:, None, :]
    noisy_rows = torch.cat([qb == kb, kb < qb], dim=2)  # noisy keys of the same block, clean keys of earlier ones
    clean_rows = torch.cat([torch.zeros_like(noisy_rows[..., :L]), kb <= qb], dim=2)
    cols = torch.arange(P, L, device=clean.device).expand(B, -1)
    if shift:  # column c from row c - 1: the noisy copy's inside a block, the clean copy's across a boundary
        prev = (cols - 1).clamp_min(0)
        same = blk.gather(1, prev) == blk.gather(1, cols)
        rows = torch.where(same, prev, prev + L)
        logits_idx = rows + 1  # the forward reads row ``logits_idx - 1`` for shifted families
    else:
        logits_idx = cols
    return {
        "tokens": torch.cat([noisy, clean], dim=1),
        "positions": torch.cat([pos, pos], dim=1),
        "attn_mask": torch.cat([valid, valid], dim=1),
        "attn_pattern": torch.cat([noisy_rows, clean_rows], dim=1),
        "logits_idx": logits_idx,
    }


@dataclass
class BlockDiffusionOutput:
    sequences: list[list[int]]  # per row: the generated region (prompt end .. last block end), masks left as is
    texts: list[str] | None  # decoded, cut at the first EOS/EOT
    prompt_lengths: list[int]
    nfe: list[int]  # forwards per row (prefill and the storing forward of each block included)
    trace: list[list[dict]] = field(default_factory=list)  # per row, per forward: block, store, committed
    # positions (sdar: and overwritten positions; llada21: and edited positions)


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
    return _by_confidence(rule, masked, p, quota, threshold)


def _by_confidence(rule: str, masked: torch.Tensor, p: torch.Tensor, quota: int, threshold: float) -> torch.Tensor:
    """The confidence rules' selection: every position above ``threshold`` when there are at least ``quota`` of them
    (``low_confidence_dynamic``), else ``torch.topk`` of the confidences with ``-inf`` at unmasked positions (which
    selects unmasked positions when ``quota`` exceeds the masks left)."""
    out = torch.zeros_like(masked)
    conf = torch.where(masked, p, torch.tensor(float("-inf"), dtype=p.dtype))
    if rule == "low_confidence_dynamic":
        high = conf > threshold
        if int(high.sum()) >= quota:
            return high
    out[torch.topk(conf, quota).indices] = True
    return out


def _commit_sdar(rule: str, masked: torch.Tensor, p: torch.Tensor, quota: int, threshold: float) -> torch.Tensor:
    """Positions of the block SDAR's ``block_diffusion_generate`` writes at a step (``[L]`` bool), as its code
    selects them: ``sequential`` the ``quota`` positions from the first masked one on, the other rules
    ``torch.topk`` of the confidences with ``-inf`` at unmasked positions. When fewer masks are left than the
    quota (the dynamic rule committed more than the quota earlier, a prompt's tail in the block, a committed mask
    token), the selection includes unmasked positions, whose tokens the step then overwrites."""
    if rule == "sequential":
        out = torch.zeros_like(masked)
        first = int(masked.nonzero()[0, 0])
        out[first:first + quota] = True
        return out
    return _by_confidence(rule, masked, p, quota, threshold)


class UnfinishedBlockError(RuntimeError):
    """SDAR's decoder (``style="sdar"``): a block still holds masks after its ``denoising_steps`` steps, because a
    step committed the mask token itself (a proposal equal to the mask id leaves its position masked, or re-masks
    a generated token it overwrites). SDAR's ``block_diffusion_generate`` runs one more denoising forward there
    and then fails (``IndexError``: the quota of step ``denoising_steps`` does not exist), so there is no
    reference continuation. Attributes: ``row`` (index in the batch), ``block``, ``masks`` (positions still
    masked, from the first prompt token), ``sequence`` (the row's generated region so far), ``nfe`` and
    ``trace`` (the forwards run so far)."""

    def __init__(self, block: int, masks: list[int], steps: int, sequence: list[int], trace: list[dict]):
        self.row: int | None = None
        self.block, self.masks, self.steps, self.sequence, self.trace = block, masks, steps, sequence, trace
        self.nfe = len(trace)
        super().__init__()

    def __str__(self) -> str:
        row = "" if self.row is None else f"row {self.row}: "
        return (f"{row}block {self.block} still holds {len(self.masks)} mask(s) (positions {self.masks}) after its "
                f"{self.steps} denoising steps: a step committed the mask token itself (the model proposed the mask "
                f"id), which leaves its position masked. SDAR's block_diffusion_generate cannot go on either (it "
                f"runs one more forward, then raises IndexError: there is no quota for step {self.steps}). Decode "
                f"this row with another seed or other sampling settings, or with dllm.generate's samplers")


def _first_stop(row: list[int], stops: set[int]) -> int | None:
    """Index of the first stop token in ``row`` (None: there is none)."""
    return next((i for i, t in enumerate(row) if t in stops), None)


def _whole_blocks(P: int, gen_length: int, B: int) -> str:
    return f"prompt ({P} tokens) + gen_length ({gen_length}), rounded up to whole blocks of {B}"


def _blocks_canvas(P: int, gen_length: int, B: int) -> tuple[int, str]:
    """The canvas length of a row of ``P`` prompt tokens (prompt and generation rounded up to whole blocks) and
    what it holds, for the context error."""
    return -(-(P + gen_length) // B) * B, _whole_blocks(P, gen_length, B)


def _fastdllm2_canvas(P: int, gen_length: int, B: int) -> tuple[int, str]:
    """Fast-dLLM v2's canvas: the prompt's whole blocks, ``gen_length // B`` blocks, and the token the last block's
    storing forward appends."""
    n_blocks = gen_length // B
    return ((P // B + n_blocks) * B + 1, f"prompt ({P} tokens) + {n_blocks} blocks of {B} (gen_length {gen_length}) "
            "+ the token after them")


def _row_canvas(model, prompt: list[int], total: int, seed: int):
    """One row's canvas ``[1, total]`` (the prompt, then masks), its positions and its generator (its length
    checked against the model's context for every row before any is decoded: :func:`_decode_rows`)."""
    dev = model.device
    x = torch.full((1, total), model.mask_id, dtype=torch.long, device=dev)
    x[0, :len(prompt)] = torch.tensor(prompt, device=dev)
    return x, torch.arange(total, device=dev)[None], torch.Generator(device=dev).manual_seed(seed)


def _decode_rows(model, rows: list[list[int]], decode_row, canvas) -> BlockDiffusionOutput:
    """``decode_row(prompt) -> (sequence, forwards, trace)`` for each row, one at a time, with texts. ``canvas(P)``:
    ``(length, what it holds)`` of a row of ``P`` prompt tokens: every row must fit the model's context before
    the first is decoded."""
    for i, prompt in enumerate(rows):
        total, layout = canvas(len(prompt))
        if total > model.max_seq_len:
            raise ValueError(f"prompt {i}: {layout}: {total} positions, more than the model's context of "
                             f"{model.max_seq_len}; shorten the prompt or lower gen_length")
    out = BlockDiffusionOutput([], None, [len(r) for r in rows], [], [])
    for i, prompt in enumerate(rows):
        try:
            seq, nfe, trace = decode_row(prompt)
        except UnfinishedBlockError as e:
            e.row = i
            raise
        out.sequences.append(seq)
        out.nfe.append(nfe)
        out.trace.append(trace)
    return _with_texts(model, out)


def _decode_row(model, prompt: list[int], gen_length: int, B: int, quota: list[int], remasking: str,
                threshold: float, sampling: tuple, seed: int, stops: set[int], style: str,
                eos_early_stop: bool = False):
    """One row: (generated region, forwards, per-forward trace)."""
    P = len(prompt)
    total, _ = _blocks_canvas(P, gen_length, B)
    x, pos, gen = _row_canvas(model, prompt, total, seed)
    mask_id, steps = model.mask_id, len(quota)
    cache = _BlockKV(len(model.layers))
    trace: list[dict] = []

    def forward(lo: int, hi: int, store: bool | int, block: int | None) -> torch.Tensor:
        cache.store = store
        logits = model(x[:, lo:hi], positions=pos[:, lo:hi], cache=cache, key_positions=pos[:, :hi], block_size=B)
        trace.append({"block": block, "store": store is True, "committed": []})
        return logits[0]

    def denoise(logits: torch.Tensor, lo: int, hi: int, step: int) -> list[int]:
        cur = x[0, lo:hi]
        tok, p = _sample(logits, *sampling, gen)
        commit = _commit(remasking, cur == mask_id, p, quota[step] if step < steps else 0, threshold)
        cur[commit] = tok[commit]
        trace[-1]["committed"] = (commit.nonzero()[:, 0] + lo).tolist()
        return tok[commit].tolist()

    first = P // B
    if style == "sdar":
        if first:  # the prompt's whole blocks, stored at once
            forward(0, first * B, True, None)
        for blk in range(first, total // B):
            lo, hi = blk * B, (blk + 1) * B
            cur = x[0, lo:hi]
            for step in range(steps + 1):
                masked = cur == mask_id
                if not bool(masked.any()):
                    forward(lo, hi, True, blk)  # the finished block's keys and values, appended once
                    break
                if step == steps:  # masks left by committed mask tokens: the reference has no quota here
                    raise UnfinishedBlockError(blk, (masked.nonzero()[:, 0] + lo).tolist(), steps,
                                               x[0, P:].tolist(), trace)
                logits = forward(lo, hi, False, blk)
                tok, p = _sample(logits, *sampling, gen)
                write = _commit_sdar(remasking, masked, p, quota[step], threshold)
                old = cur.clone()
                cur[write] = tok[write]  # the selected positions, masked or not, take this step's sample
                trace[-1]["committed"] = (masked & (cur != mask_id)).nonzero()[:, 0].add(lo).tolist()
                trace[-1]["overwritten"] = (~masked & (cur != old)).nonzero()[:, 0].add(lo).tolist()
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
            committed = denoise(logits, lo, hi, step)
            if eos_early_stop and stops & set(committed):
                # a stop token committed: the row ends here, after the first stop token of the generated
                # tokens (the canvas tail past gen_length included) when no mask is left before it
                row = x[0, P:hi].tolist()
                j = _first_stop(row, stops)
                if mask_id not in row[:j]:
                    return row[:j + 1], len(trace), trace
        if stops & set(x[0, P:hi].tolist()):
            break
    return x[0, P:P + gen_length].tolist(), len(trace), trace


def _decode_row_llada21(model, prompt: list[int], gen_length: int, B: int, threshold: float, editing_threshold: float,
                        max_post_steps: int, num_to_transfer: int, sampling: tuple, seed: int, stops: set[int],
                        eos_early_stop: bool):
    """One row of LLaDA2.1's ``generate`` (``style="llada21"``): (the region cut after its first stop token,
    forwards, per-forward trace with the mask-to-token commits and the token-to-token edits)."""
    P = len(prompt)
    total, _ = _blocks_canvas(P, gen_length, B)
    x, pos, gen = _row_canvas(model, prompt, total, seed)
    mask_id = model.mask_id
    cache = _BlockKV(len(model.layers))
    trace: list[dict] = []
    greedy = sampling[0] == 0
    stored = 0  # as the llada2 style: a block's first forward also computes and stores the finished blocks before it
    for blk in range(P // B, total // B):
        lo, hi = blk * B, (blk + 1) * B
        cur = x[0, lo:hi]
        editable_block = pos[0, lo:hi] >= P  # the prompt is never edited (nor the earlier blocks: not in the block)
        post_steps = 0
        seen: set[tuple] = set()
        while True:
            old = cur.clone()
            active = old == mask_id
            n_active = int(active.sum())
            if not n_active:  # a mask-free step: at most max_post_steps of them
                post_steps += 1
                if post_steps > max_post_steps:
                    break
            elif greedy:  # a repeated state repeats forever at temperature 0 (the reference never ends): stop here
                state = (tuple(old.tolist()), post_steps)
                if state in seen:
                    break
                seen.add(state)
            cache.store = lo - stored
            logits = model(x[:, stored:hi], positions=pos[:, stored:hi], cache=cache, key_positions=pos[:, :hi],
                           block_size=B)[0, lo - stored:]
            stored = lo
            tok, p = _sample(logits, *sampling, gen)
            # mask to token: every masked position above threshold, at least num_to_transfer of them (none left:
            # nothing), the dynamic rule with the quota num_to_transfer
            commit = _commit("low_confidence_dynamic", active, p, num_to_transfer, threshold)
            # token to token: the block's generated tokens whose proposal differs, above editing_threshold
            edit = (p > editing_threshold) & ~active & editable_block & (tok != old)
            cur[commit | edit] = tok[commit | edit]  # a proposed mask token masks (or leaves masked) its position
            trace.append({"block": blk, "store": False, "committed": (commit.nonzero()[:, 0] + lo).tolist(),
                          "edited": (edit.nonzero()[:, 0] + lo).tolist()})
            if not n_active and not bool(edit.any()):
                break
        if eos_early_stop:
            row = x[0, P:hi].tolist()
            if mask_id not in row and stops & set(row):
                break
    row = x[0, P:P + gen_length].tolist()
    j = _first_stop(row, stops)
    return (row if j is None else row[:j + 1]), len(trace), trace


class _SubBlockKV(_BlockKV):
    """:class:`_BlockKV` plus Fast-dLLM v2's block cache (``use_block_cache``): a block-wide forward (``mode
    "block"``) keeps the current block's keys and values; a sub-block forward (``mode "sub"``, ``at``: the
    sub-block's offset in the block) writes its own into them in place and attends to the whole block, the other
    sub-blocks as of the last block-wide forward (the reference's ``replace_position`` update)."""

    def __init__(self, n_layers: int):
        super().__init__(n_layers)
        self.bk: list[torch.Tensor | None] = [None] * n_layers
        self.bv: list[torch.Tensor | None] = [None] * n_layers
        self.mode: str | None = None
        self.at = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.mode == "block":
            self.bk[layer], self.bv[layer] = k, v
        elif self.mode == "sub":
            self.bk[layer][:, :, self.at:self.at + k.shape[2]] = k
            self.bv[layer][:, :, self.at:self.at + v.shape[2]] = v
            k, v = self.bk[layer], self.bv[layer]
        return super().update(layer, k, v)


# Fast-dLLM v2's denoising forwards do not pass a block size, so its model file builds their attention mask on its
# default grid of 32 positions (the published bd_size); for decoding blocks that divide 32 that is the block's own.
_FASTDLLM2_DENOISE_GRID = 32


def _sample_top_p(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator):
    """Fast-dLLM v2's ``sample_with_top_p`` on ``[L, V]`` logits: temperature 0 gives the argmax of the softmax
    and its probability; otherwise the softmax of ``logits / temperature``, the tail beyond ``top_p`` zeroed
    (the first token always kept) and renormalised, one multinomial draw per position. Returns tokens and
    their probabilities."""
    if temperature == 0:
        probs = torch.softmax(logits, -1)
        token = probs.argmax(-1, keepdim=True)
        return token[:, 0], probs.gather(-1, token)[:, 0]
    probs = torch.softmax(logits / temperature, -1)
    sorted_probs, sorted_idx = torch.sort(probs, descending=True)
    remove = torch.cumsum(sorted_probs, -1) > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    probs[torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, sorted_idx, remove)] = 0
    probs = probs / probs.sum(-1, keepdim=True)
    token = torch.multinomial(probs, 1, generator=gen)
    return token[:, 0], probs.gather(-1, token)[:, 0]


def _decode_row_fastdllm2(model, prompt: list[int], gen_length: int, B: int, S: int, threshold: float,
                          temperature: float, top_p: float, use_block_cache: bool, seed: int, stops: set[int],
                          pad_id: int, style: str):
    """One row of Fast-dLLM v2's ``batch_sample`` (``style="fastdllm2"``) or its model file's ``generate``
    (``"fastdllm2_generate"``): (generated region, forwards, per-forward trace)."""
    P = len(prompt)
    n_blocks = gen_length // B
    first = P // B
    total, _ = _fastdllm2_canvas(P, gen_length, B)  # the last block's storing forward appends one token
    x, pos, gen = _row_canvas(model, prompt, total, seed)
    dev, mask_id = model.device, model.mask_id
    cache = _SubBlockKV(len(model.layers))
    trace: list[dict] = []

    def forward(lo: int, hi: int, kind: str, block: int | None, key_hi: int, grid: int, logits_idx=None):
        cache.store = kind in ("prefill", "store")
        cache.mode = {"denoise": "block" if use_block_cache else None, "subblock": "sub"}.get(kind)
        logits = model(x[:, lo:hi], positions=pos[:, lo:hi], cache=cache, key_positions=pos[:, :key_hi],
                       block_size=grid, logits_idx=logits_idx)
        trace.append({"block": block, "kind": kind, "store": cache.store, "committed": []})
        return logits[0]

    def argmax_after(hi: int, kind: str, block: int | None) -> int:  # the token after a stored prefix: AR
        lo = 0 if kind == "prefill" else hi - B
        logits = forward(lo, hi, kind, block, hi, B, logits_idx=torch.tensor([[hi - lo]], device=dev))
        return int(logits[0].argmax())

    length = P  # the reference's current sequence length (x[length:] are not there yet)
    if P >= B:  # the prompt's whole blocks, stored; a prompt that ends on a block boundary gets its next token
        nxt = argmax_after(first * B, "prefill", None)
        if P % B == 0:
            x[0, P] = nxt
            length = P + 1
    finished = False
    for blk in range(first, first + n_blocks):
        if style == "fastdllm2_generate" and stops & set(x[0, P:length].tolist()):
            break
        lo, hi = blk * B, (blk + 1) * B
        region = length  # generate's stop test looks at the tokens after the block's given ones
        cache.bk = [None] * len(model.layers)  # the sub-block cache lives for one block
        have_block_cache = False

        def stopped_before_masks(region: int = region, hi: int = hi) -> bool:  # generate: a stop token, no
            row = x[0, region:hi].tolist()  # mask before it, among the block's tokens after its given ones
            j = _first_stop(row, stops)
            return j is not None and mask_id not in row[:j]

        while True:
            if style == "fastdllm2_generate" and stopped_before_masks():  # the block ends here, not stored
                length = hi
                break
            if not bool((x[0, lo:hi] == mask_id).any()):
                if finished:  # batch_sample: the tokens after the first stop token become padding; no store
                    row = x[0, P:hi].tolist()
                    j = _first_stop(row, stops)
                    x[0, P + j + 1:hi] = pad_id
                    length = hi
                    break
                x[0, hi] = argmax_after(hi, "store", blk)
                length = hi + 1
                break
            for s0 in range(lo, hi, S):
                s1 = s0 + S
                while bool((x[0, s0:s1] == mask_id).any()):
                    if style == "fastdllm2_generate" and stopped_before_masks():
                        break
                    if use_block_cache and have_block_cache and int(x[0, s0]) != mask_id:
                        cache.at = s0 - lo
                        logits = forward(s0, s1, "subblock", blk, hi, B)
                    else:
                        logits = forward(lo, hi, "denoise", blk, hi, _FASTDLLM2_DENOISE_GRID)[s0 - lo:s1 - lo]
                        have_block_cache = use_block_cache
                    cur = x[0, s0:s1]
                    masked = cur == mask_id
                    tok, p = _sample_top_p(logits, temperature, top_p, gen)
                    conf = torch.where(masked, p, torch.tensor(float("-inf"), dtype=p.dtype, device=dev))
                    commit = conf > threshold
                    commit[conf.argmax()] = True
                    commit &= masked
                    cur[commit] = tok[commit]  # a proposed mask token leaves its position masked
                    trace[-1]["committed"] = ((commit & (cur != mask_id)).nonzero()[:, 0] + s0).tolist()
                    if stops & set(tok[commit].tolist()):
                        finished = True
        if style == "fastdllm2" and finished:
            break
    out = x[0, P:length].tolist()
    if style == "fastdllm2_generate":
        j = _first_stop(out, stops)
        out = out if j is None else out[:j + 1]
    return out, len(trace), trace


@torch.no_grad()
def block_diffusion_generate(model, prompts, *, gen_length: int = 128, block_length: int | None = None,
                             denoising_steps: int | None = None, remasking: str = "low_confidence_dynamic",
                             confidence_threshold: float | None = None, temperature: float | None = None,
                             top_k: int | None = 0, top_p: float | None = None, seed: int = 0,
                             stop_ids: list[int] | None = None, chat_template: bool = True, style: str = "sdar",
                             small_block_length: int | None = None, use_block_cache: bool = False,
                             eos_early_stop: bool = False, minimal_topk: int | None = None,
                             editing_threshold: float | None = None, max_post_steps: int | None = None,
                             num_to_transfer: int | None = None) -> BlockDiffusionOutput:
    """Decode ``prompts`` block by block with the exact cache of finished blocks (see the module docstring).

    Args:
        model: a block-diffusion checkpoint (``model.config.block_size`` set, e.g. SDAR); other dLLM
            checkpoints are refused.
        prompts: as :func:`dllm.generate` (strings, conversations, token-id lists); each row is decoded alone (the
            references decode one prompt per call).
        gen_length: tokens to generate at least (the canvas ends at the next block boundary; ``fastdllm2``: the
            reference's ``max_new_tokens``, ``gen_length // block_length`` blocks are decoded).
        block_length: the decoding block (default: the checkpoint's ``block_size``).
        denoising_steps: forwards per block at most (default: ``block_length``; not for ``fastdllm2``).
        remasking: ``low_confidence_dynamic`` (default), ``low_confidence_static`` or ``sequential`` (not for
            ``fastdllm2``, whose rule is its own). ``sdar``: selected as SDAR's code selects, the quota not capped
            at the masks left, so a step with fewer masks than its quota overwrites generated (or prompt) tokens;
            a block still masked after its last step (a committed mask token) raises
            :class:`UnfinishedBlockError`, where the reference raises ``IndexError``.
        confidence_threshold: the dynamic rule's threshold (default 0.85; ``fastdllm2``: 0.9, the official
            evaluation's).
        temperature, top_k, top_p: the reference's sampling (default 1.0, 0, 1.0; ``top_k=1``: SDAR's greedy
            decoding, ``temperature`` must be > 0 for SDAR). ``fastdllm2``: ``temperature`` (default 0: greedy)
            and ``top_p`` (default 0.95) of its ``sample_with_top_p``; no top-k.
        seed: each row's generator seed (the reference's ``torch.manual_seed``).
        stop_ids: token ids that end a row after the block holding one (default: EOS and EOT; ``llada2``: EOS;
            ``llada21``: EOS, which ends a row only with ``eos_early_stop`` and cuts the answer after it;
            ``fastdllm2``: EOT, <|im_end|> as the reference's ``stop_token``, else EOS).
        style: ``"sdar"`` (SDAR's ``block_diffusion_generate``), ``"llada2"`` (LLaDA2's ``generate``: no prefill
            or storing forwards, greedy at ``temperature=0``, ``denoising_steps`` forwards per block at most, the
            region cut at ``gen_length``; use ``remasking="low_confidence_dynamic"`` and its ``threshold``),
            ``"llada21"`` (LLaDA2.1's ``generate`` with token editing: no ``denoising_steps`` or ``remasking``;
            ``confidence_threshold`` default 0.95, ``temperature`` default 0, greedy whatever ``top_k`` / ``top_p``),
            ``"fastdllm2"`` (Fast-dLLM v2's ``batch_sample``, its official evaluation's decoder) or
            ``"fastdllm2_generate"`` (the ``generate`` of its model file); see docs/block-diffusion.md.
        small_block_length: ``fastdllm2``: the sub-block (the reference's ``small_block_size``, default 8 or
            the block when smaller); it must divide ``block_length``.
        use_block_cache: ``fastdllm2``: the reference's sub-block cache (approximate: a sub-block's forward sees
            the other sub-blocks' keys and values as of the block's last block-wide forward).
        eos_early_stop: ``llada2``: LLaDA2's ``eos_early_stop``: a forward that commits a stop token ends the row
            at once when no mask is left before the row's first stop token; ``sequences`` then end with that
            token (default ``False``: the row ends after the block holding a stop token). ``llada21``: the row
            ends after a block whose generated tokens (all unmasked) hold a stop token (default ``False``: every
            block is decoded).
        minimal_topk: ``llada2``: LLaDA2's ``minimal_topk`` (default 1): the forwards per block are at most
            ``gen_length // minimal_topk`` (``denoising_steps`` capped, the quota spread over fewer steps).
        editing_threshold: ``llada21``: a generated token of the current block is replaced by a different proposal
            whose probability is above it (default 0.9; the model card's modes: Q 0.5 with threshold 0.7, S 0.0
            with threshold 0.5).
        max_post_steps: ``llada21``: mask-free forwards per block at most (default 16; 0: none, edits then only
            happen alongside mask commits).
        num_to_transfer: ``llada21``: masks committed per forward at least (default 1).
    """
    check_model(model)
    bs_model = getattr(getattr(model, "config", None), "block_size", None)
    if not bs_model:
        raise ValueError("block_diffusion_generate needs a block-diffusion checkpoint (config block_size, e.g. "
                         "SDAR); decode LLaDA / Dream checkpoints with dllm.generate")
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known: {', '.join(STYLES)}")
    # the options of another style first (they do not depend on the model), then whether the style fits the model
    edit_options = (editing_threshold, max_post_steps, num_to_transfer)
    if style != "llada21" and any(v is not None for v in edit_options):
        raise ValueError(f"editing_threshold, max_post_steps and num_to_transfer are LLaDA2.1's generate options "
                         f"(style='llada21'), not style {style!r}'s: drop them, or use style='llada21'")
    if style not in ("llada2", "llada21") and eos_early_stop is not False:
        raise ValueError(f"eos_early_stop is one of LLaDA2's generate options (style='llada2' or 'llada21'), not "
                         f"style {style!r}'s: drop it, or use style='llada2'")
    if style != "llada2" and minimal_topk is not None:
        raise ValueError(f"minimal_topk is one of LLaDA2's generate options (style='llada2'), not style {style!r}'s: "
                         "drop it" + (" (LLaDA2.1's generate takes it but never uses it)" if style == "llada21" else
                            ", or use style='llada2'"))
    fd2 = style.startswith("fastdllm2")
    if not fd2 and (small_block_length is not None or use_block_cache):
        raise ValueError(f"small_block_length and use_block_cache are Fast-dLLM v2's (style='fastdllm2'), not "
                         f"style {style!r}'s")
    fitting = model_styles(model)
    if style not in fitting:
        family = getattr(getattr(model, "spec", None), "family", "this")
        raise ValueError(f"style {style!r} does not fit a {family} checkpoint: the Fast-dLLM v2 styles decode a model "
                         "with shifted logits (token i predicted from row i - 1), the others one without; this one's "
                         f"logits are {'' if getattr(model, 'shift_logits', False) else 'not '}shifted: use "
                         f"style={' or '.join(repr(s) for s in fitting)}")
    for name, v in (("block_length", block_length), ("denoising_steps", denoising_steps)):
        if v is not None and (type(v) is not int or v < 1):
            raise ValueError(f"{name} must be a positive integer or None (the default), got {v!r}")
    if type(seed) is not int or not -2 ** 63 <= seed < 2 ** 64:
        raise ValueError(f"seed must be an integer torch.manual_seed takes (-2**63 to 2**64 - 1; each row's generator "
                         f"seed), got {seed!r}")
    if stop_ids is not None:
        if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
            raise ValueError(f"stop_ids must be a list of token ids (ints), e.g. [model.eos_id], got {stop_ids!r}")
        stop_ids = list(stop_ids)
        if not all(type(t) is int for t in stop_ids):
            raise ValueError(f"stop_ids must be a list of token ids (ints), e.g. [model.eos_id], got {stop_ids!r}")
    B = block_length or bs_model
    if style == "llada21":
        return _llada21_generate(model, prompts, gen_length, B, denoising_steps, remasking, confidence_threshold,
                                 temperature, top_k, top_p, seed, stop_ids, chat_template, eos_early_stop,
                                 editing_threshold, max_post_steps, num_to_transfer)
    if fd2:
        return _fastdllm2_generate(model, prompts, gen_length, B, small_block_length, use_block_cache,
                                   confidence_threshold, temperature, top_k, top_p, seed, stop_ids, chat_template,
                                   style, denoising_steps, remasking)
    confidence_threshold = 0.85 if confidence_threshold is None else confidence_threshold
    temperature = 1.0 if temperature is None else temperature
    steps = denoising_steps or B
    if remasking not in REMASKING:
        raise ValueError(f"unknown remasking {remasking!r}; known: {', '.join(REMASKING)}")
    for name, v in (("gen_length", gen_length), ("block_length", B), ("denoising_steps", steps)):
        if type(v) is not int or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if style == "llada2":
        steps = min(steps, gen_length // _check_llada2_options(eos_early_stop, minimal_topk, gen_length))
    if steps > B:
        raise ValueError(f"denoising_steps ({steps}) exceeds block_length ({B}): some steps would commit nothing")
    if not (temperature > 0 or (style == "llada2" and temperature == 0)) or temperature == float("inf"):
        raise ValueError(f"temperature={temperature!r} must be a positive number; SDAR's greedy decoding is top_k=1 "
                         "(style='llada2' takes temperature=0)")
    top_k = 0 if top_k is None else top_k
    top_p = 1.0 if top_p is None else top_p
    _check_sampling(top_p, {"confidence_threshold": confidence_threshold}, top_k)
    rows = prepare_prompts(model, prompts, None, chat_template)
    default_stops = (model.eos_id,) if style == "llada2" else (model.eos_id, model.eot_id)
    stops = set(stop_ids if stop_ids is not None else [t for t in default_stops if t is not None])
    if eos_early_stop and not stops:
        raise ValueError("eos_early_stop needs a stop token: pass stop_ids (the checkpoint has no EOS id)")
    quota = num_transfer_tokens(B, steps)
    return _decode_rows(model, rows, lambda prompt: _decode_row(
        model, prompt, gen_length, B, quota, remasking, confidence_threshold, (temperature, top_k, top_p), int(seed),
        stops, style, eos_early_stop), lambda P: _blocks_canvas(P, gen_length, B))


def _check_llada2_options(eos_early_stop, minimal_topk, gen_length: int) -> int:
    """Checks LLaDA2's ``eos_early_stop`` and ``minimal_topk``; returns ``minimal_topk`` (default 1)."""
    if not isinstance(eos_early_stop, bool):
        raise ValueError(f"eos_early_stop must be True or False, got {eos_early_stop!r}")
    minimal_topk = 1 if minimal_topk is None else minimal_topk
    if type(minimal_topk) is not int or minimal_topk < 1:
        raise ValueError(f"minimal_topk must be a positive integer (LLaDA2 divides gen_length by it), got "
                         f"{minimal_topk!r}")
    if minimal_topk > gen_length:
        raise ValueError(f"minimal_topk ({minimal_topk}) exceeds gen_length ({gen_length}): the forwards per block "
                         f"would be capped at gen_length // minimal_topk = 0 and nothing decoded; use minimal_topk "
                         f"<= gen_length")
    return minimal_topk


def _llada21_generate(model, prompts, gen_length, B, denoising_steps, remasking, threshold, temperature, top_k, top_p,
                      seed, stop_ids, chat_template, eos_early_stop, editing_threshold, max_post_steps,
                      num_to_transfer) -> BlockDiffusionOutput:
    """Checks and per-row decoding of LLaDA2.1's ``generate`` (:func:`block_diffusion_generate`, ``llada21``)."""
    if denoising_steps is not None or remasking != "low_confidence_dynamic":
        raise ValueError("LLaDA2.1's decoder has no step budget or remasking rule (its generate's steps is never "
                         "used): each block runs until it holds no mask and a forward edits nothing (at most "
                         "max_post_steps mask-free forwards); drop denoising_steps / remasking")
    threshold = 0.95 if threshold is None else threshold
    editing_threshold = 0.9 if editing_threshold is None else editing_threshold
    max_post_steps = 16 if max_post_steps is None else max_post_steps
    num_to_transfer = 1 if num_to_transfer is None else num_to_transfer
    temperature = 0.0 if temperature is None else temperature
    top_k = 0 if top_k is None else top_k
    top_p = 1.0 if top_p is None else top_p
    for name, v in (("gen_length", gen_length), ("block_length", B), ("num_to_transfer", num_to_transfer)):
        if type(v) is not int or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if type(max_post_steps) is not int or max_post_steps < 0:
        raise ValueError(f"max_post_steps must be an integer >= 0 (0: no mask-free forward), got {max_post_steps!r}")
    _check_sampling(top_p, {"confidence_threshold": threshold, "editing_threshold": editing_threshold}, top_k)
    if not isinstance(eos_early_stop, bool):
        raise ValueError(f"eos_early_stop must be True or False, got {eos_early_stop!r}")
    if isinstance(temperature, bool) or not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0: greedy)")
    # temperature 0 is greedy whatever top_k / top_p say, as LLaDA2.1's sampler
    sampling = (0.0, 0, 1.0) if temperature == 0 else (float(temperature), top_k, float(top_p))
    rows = prepare_prompts(model, prompts, None, chat_template)
    stops = set(stop_ids if stop_ids is not None else [t for t in (model.eos_id,) if t is not None])
    if eos_early_stop and not stops:
        raise ValueError("eos_early_stop needs a stop token: pass stop_ids (the checkpoint has no EOS id)")
    return _decode_rows(model, rows, lambda prompt: _decode_row_llada21(
        model, prompt, gen_length, B, float(threshold), float(editing_threshold), max_post_steps, num_to_transfer,
        sampling, int(seed), stops, eos_early_stop), lambda P: _blocks_canvas(P, gen_length, B))


def _check_sampling(top_p, thresholds: dict, top_k=None) -> None:
    """The checks every style shares: ``top_k`` an integer >= 0 (0: off; None: the style has none), ``top_p`` in
    (0, 1], each of ``thresholds`` (name -> value) a number in [0, 1]."""
    if top_k is not None and (type(top_k) is not int or top_k < 0):
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0: off)")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be a number in (0, 1]")
    for name, v in thresholds.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"{name}={v!r} must be a number in [0, 1]")


def _with_texts(model, out: BlockDiffusionOutput) -> BlockDiffusionOutput:
    tok = getattr(model, "tokenizer", None)
    if tok is not None:
        lens = answer_lengths(model, out.sequences)
        out.texts = [tok.decode([t for t in s[:n] if t != model.mask_id], skip_special_tokens=True)
                     for s, n in zip(out.sequences, lens)]
    return out


def _fastdllm2_generate(model, prompts, gen_length, B, S, use_block_cache, threshold, temperature, top_k, top_p,
                        seed, stop_ids, chat_template, style, denoising_steps, remasking) -> BlockDiffusionOutput:
    """Checks and per-row decoding of the two Fast-dLLM v2 styles (:func:`block_diffusion_generate`)."""
    if denoising_steps is not None or remasking != "low_confidence_dynamic" or top_k not in (None, 0):
        raise ValueError("Fast-dLLM v2's decoder has no denoising_steps, remasking rule or top_k: each sub-block is "
                         "denoised until done, committing the positions above confidence_threshold and the most "
                         "confident one; drop those arguments")
    S = S if S is not None else min(8, B)  # the reference's small_block_size default
    threshold = 0.9 if threshold is None else threshold
    temperature = 0.0 if temperature is None else temperature
    top_p = 0.95 if top_p is None else top_p
    for name, v in (("block_length", B), ("small_block_length", S)):
        if type(v) is not int or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if type(gen_length) is not int or gen_length < B:
        raise ValueError(f"gen_length={gen_length!r} must be an integer >= block_length ({B}): Fast-dLLM v2 decodes "
                         f"gen_length // block_length whole blocks")
    if B % S:
        raise ValueError(f"small_block_length ({S}) must divide block_length ({B}); the reference never finishes a "
                         "block otherwise")
    if not isinstance(use_block_cache, bool):
        raise ValueError(f"use_block_cache must be True or False, got {use_block_cache!r}")
    if isinstance(temperature, bool) or not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0: greedy)")
    _check_sampling(top_p, {"confidence_threshold": threshold})
    rows = prepare_prompts(model, prompts, None, chat_template)
    default = model.eot_id if model.eot_id is not None else model.eos_id
    stops = set(stop_ids if stop_ids is not None else ([default] if default is not None else []))
    pad_id = model.pad_id if model.pad_id is not None else model.eos_id
    return _decode_rows(model, rows, lambda prompt: _decode_row_fastdllm2(
        model, prompt, gen_length, B, S, float(threshold), float(temperature), float(top_p), use_block_cache,
        int(seed), stops, pad_id, style), lambda P: _fastdllm2_canvas(P, gen_length, B))
