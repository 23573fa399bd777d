"""AdaBlock-dLLM (lgxi24/AdaBlock-dLLM ``compute_block_length``): delimiter-aligned adaptive blocks.

When a row starts a new block at generation offset ``s``, with the forward of that step already computed:
the look-ahead window is the next ``min(int(window * gen_length), remaining)`` positions; among the window
positions whose prediction is a delimiter token, take the most confident one ``d``; if its confidence is
``>= delimiter_threshold`` the block ends right after it (``[s, d + 1)``), otherwise it is
``min(block_length, remaining)`` long. The same forward's logits then drive the block's first commit step.

Delimiters come from the model's tokenizer (``delimiters="newline"``: every token whose text contains a
newline; ``"newline-exact"``: tokens whose text is exactly ``"\\n"``), or are given as token ids. The
reference hard-codes ``[198]`` for LLaDA and 24 newline-bearing Qwen ids for Dream. A model without a
tokenizer (and no ids given) gets a ``UserWarning`` and fixed blocks of ``block_length``.

Differences from the reference: the delimiter prediction and its confidence come from the clean logits'
argmax (the reference uses its Gumbel-noised proposal at temperature > 0); rows choose their blocks
independently (the reference runs batch 1).
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from dllm import ops
from dllm.blocks.fixed import BlockPolicyBase
from dllm.config import GenerateConfig
from dllm.models.spec import vocab_size
from dllm.ops import check_int, check_range, fast_argmax

DELIMITER_MODES = ("newline", "newline-exact")
FAMILY_THRESHOLDS = {"llada": 0.3, "dream": 0.5}
_DELIMS: dict[tuple[int, int, str], tuple[int, ...]] = {}


def tokenizer_delimiters(tokenizer, mode: str = "newline") -> tuple[int, ...]:
    """Token ids whose decoded text contains a newline (``"newline"``) or is exactly one (``"newline-exact"``)."""
    key = (id(tokenizer), len(tokenizer), mode)
    if key not in _DELIMS:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        if mode == "newline":
            ids = tuple(i for i, t in enumerate(texts) if "\n" in t)
        else:
            ids = tuple(i for i, t in enumerate(texts) if t == "\n")
        _DELIMS[key] = ids
    return _DELIMS[key]


def _parse_delimiters(value):
    """``"newline"`` / ``"newline-exact"`` as they are, token ids (a comma-separated text, one integer, a list or
    tuple) as a tuple of ints, each checked to be a token id (``>= 0``; the vocabulary is checked at ``bind``)."""
    fix = " (token ids of the model's tokenizer, e.g. delimiters=(198,); or 'newline', 'newline-exact')"
    if isinstance(value, str):
        if value in DELIMITER_MODES:
            return value
        try:
            ids = [int(v) for v in value.replace(" ", "").split(",") if v]
        except ValueError:
            raise ValueError(f"delimiters={value!r} is not understood; use 'newline', 'newline-exact' or token ids "
                             "('198,271' or a tuple)") from None
    elif isinstance(value, (list, tuple)):
        ids = list(value)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        ids = [value]
    else:
        raise ValueError(f"delimiters={value!r} is not understood; use 'newline', 'newline-exact' or token ids "
                         "('198,271' or a tuple)")
    for i in ids:
        check_int("delimiters", i, 0, what="a token id (an integer >= 0)", fix=fix)
    return tuple(int(i) for i in ids)


@dataclass(frozen=True)
class AdaBlock(BlockPolicyBase):
    """Delimiter-aligned adaptive block policy (see the module docstring).

    Args:
        block_length: fallback block size ``B0`` (``None``: ``GenerateConfig.block_length`` or 32).
        delimiter_threshold: confidence a delimiter needs to end the block (``None``: 0.3 for LLaDA-family
            models, 0.5 for Dream-family ones, the reference's values).
        delimiters: ``"newline"`` (default), ``"newline-exact"`` or token ids.
        window: look-ahead window as a fraction of ``gen_length`` (reference: 0.25).

    ``generate`` calls :meth:`bind` with the model (resolving delimiters and the threshold), then
    :meth:`next_region` (a provisional region that covers the look-ahead window, so the block's first
    forward computes its logits) and, after that forward, :meth:`refine` (the block's real end).
    """

    block_length: int | None = None
    delimiter_threshold: float | None = None
    delimiters: Any = "newline"
    window: float = 0.25
    name: str = "adablock"
    refine_rows = True  # refine reads each row's own window columns (win_lo [B, 1]) where the loop gives them

    def __post_init__(self):
        if self.block_length is not None:
            check_int("block_length", self.block_length, 1, what="a positive integer or None",
                      fix=" (AdaBlock's fallback block size; the paper uses 32)")
        if self.delimiter_threshold is not None:
            check_range("delimiter_threshold", self.delimiter_threshold, 0, 1,
                        fix="; the reference uses 0.3 (LLaDA) and 0.5 (Dream)")
        check_range("window", self.window, 0, 1, lo_open=True, fix="; a fraction of gen_length (reference 0.25)")
        object.__setattr__(self, "delimiters", _parse_delimiters(self.delimiters))

    def bind(self, model) -> AdaBlock:
        """Resolve tokenizer delimiters and the family threshold for ``model``; check ids against its vocabulary."""
        ids = self.delimiters
        tok = getattr(model, "tokenizer", None)
        if isinstance(ids, tuple) and not ids:
            raise ValueError("AdaBlock delimiters is empty; give token ids or 'newline'")
        if isinstance(ids, str):
            if tok is None:
                warnings.warn(f"AdaBlock delimiters={ids!r} needs the model's tokenizer to find the delimiter tokens "
                              "and this model has none: every block falls back to block_length. Load the model "
                              "with its tokenizer or pass delimiters=(id, ...).", UserWarning, stacklevel=3)
                return dataclasses.replace(self, delimiters=(), delimiter_threshold=self._threshold(model))
            ids = tokenizer_delimiters(tok, ids)
            if not ids:
                raise ValueError(f"no token of the tokenizer matches delimiters={self.delimiters!r}; "
                                 "pass delimiters=(id, ...)")
        vocab = vocab_size(model)
        bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
        if bad:
            raise ValueError(f"AdaBlock delimiter id(s) {bad} are not in the vocabulary (0..{vocab - 1 if vocab else '?'}); "
                             "use ids of the model's tokenizer (e.g. delimiters='newline')")
        if getattr(model, "mask_id", None) in ids:
            raise ValueError(f"AdaBlock delimiters contain the mask id {model.mask_id}; remove it")
        return dataclasses.replace(self, delimiters=tuple(ids), delimiter_threshold=self._threshold(model))

    def _threshold(self, model) -> float:
        if self.delimiter_threshold is not None:
            return self.delimiter_threshold
        family = getattr(getattr(model, "spec", None), "family", "llada")
        return FAMILY_THRESHOLDS.get(family, 0.3)

    def b0(self, cfg: GenerateConfig) -> int:
        return self.block_length or cfg.block_length or 32

    def validate(self, cfg: GenerateConfig) -> None:
        if isinstance(self.delimiters, str) or self.delimiter_threshold is None:
            raise ValueError("AdaBlock is not bound to a model; generate() binds it (or call policy.bind(model))")
        if self.block_length is not None and cfg.block_length is not None and cfg.block_length != self.block_length:
            raise ValueError(f"block_length={cfg.block_length} disagrees with AdaBlock's block_length="
                             f"{self.block_length}, which would ignore it; give the fallback block length once: in "
                             "the sampler (--param block_length=...) or as block_length")

    def _steps(self, length: torch.Tensor, cfg: GenerateConfig) -> torch.Tensor:
        """Schedule length for a region (quota samplers): the region's share of ``steps``, at least 1."""
        share = torch.ceil(length.float() * cfg.total_steps / cfg.gen_length).long()
        return share.clamp_min(1).minimum(length.clamp_min(1))

    def next_region(self, lo, gen_hi, cfg):
        """Provisional region: wide enough for the look-ahead window and the fallback block."""
        G = cfg.gen_length
        span = max(int(self.window * G), self.b0(cfg), 1)
        hi = (lo + span).clamp_max(gen_hi)
        return hi, self._steps(hi - lo, cfg)

    def refine(self, logits: torch.Tensor, win_lo: int, lo, hi, steps, fresh, cfg):
        """The real end of each fresh row's block from this forward's ``[B, W, V]`` window logits.

        Returns ``(hi, steps, info)``; rows not in ``fresh`` are unchanged. ``info`` (``[B]`` each, for the
        trace): ``block_start`` (a block started at this step), ``delimiter_conf`` (confidence of the best
        delimiter in the window, NaN if none), ``delimiter_block`` (the block ends at that delimiter)."""
        # on the CPU a step that starts no block skips the pass; on CUDA every step makes it (its outcome is kept only
        # for the rows starting a block: the same values, no host synchronisation)
        if not ops.dense_window(logits) and not bool(fresh.any()):
            nan = torch.full(fresh.shape, torch.nan, device=fresh.device)
            return hi, steps, {"block_start": fresh.clone(), "delimiter_conf": nan, "delimiter_block": fresh.clone()}
        W = logits.shape[1]
        # [1, W] canvas columns of the batch's window, or [B, W] of each row's own (win_lo [B, 1]: refine_rows)
        cols = win_lo + torch.arange(W, device=logits.device)[None]
        x0 = fast_argmax(logits)  # over the whole vocabulary, as the reference (a mask prediction is no delimiter)
        # the reference's exp(l - logsumexp(l)) in the logits' dtype: it saturates to exactly 1.0 for confident
        # delimiters (a softmax may not), and among equal maxima the first delimiter wins
        conf = torch.exp(logits.gather(-1, x0[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1))
        table = ops.id_table(tuple(self.delimiters), logits.shape[-1], logits.device)
        win = int(self.window * cfg.gen_length)
        in_win = (cols >= lo[:, None]) & (cols < (lo + win)[:, None]) & (cols < hi[:, None])
        is_delim = table[x0] & in_win
        c = conf.masked_fill(~is_delim, -1.0)
        best, pos = c.max(-1)
        found = is_delim.any(-1) & (best >= self.delimiter_threshold)
        b0_hi = (lo + self.b0(cfg)).minimum(hi)  # hi: provisional, min(lo + max(window, B0), canvas end)
        new_hi = torch.where(found, cols.expand(lo.shape[0], -1).gather(1, pos[:, None]).squeeze(1) + 1, b0_hi)
        new_hi = torch.where(fresh, new_hi, hi)
        new_steps = torch.where(fresh, self._steps(new_hi - lo, cfg), steps)
        info = {"block_start": fresh.clone(),
                "delimiter_conf": torch.where(fresh & is_delim.any(-1), best, torch.nan),
                "delimiter_block": fresh & found}
        return new_hi, new_steps, info


__all__ = ["FAMILY_THRESHOLDS", "AdaBlock", "tokenizer_delimiters"]
