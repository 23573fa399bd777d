"""Wrap any ``transformers`` model that maps ``(input_ids, attention_mask)`` to logits.

Every sampler works on the wrapped model; caches do not (they need :class:`dllm.models.Transformer`'s
partial forward). Example: a randomly initialised ``BertForMaskedLM`` or ``ModernBertForMaskedLM``, or a
checkpoint loaded with ``AutoModelForMaskedLM``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import numbers

import torch
from torch import nn


@contextlib.contextmanager
def quiet_loading():
    """``transformers``' weight-loading progress bar off while a library call loads a checkpoint (library code
    prints nothing); the caller's setting is restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _first(*ids):
    """The first id that is not None (0 is an id)."""
    return next((i for i in ids if i is not None), None)


def cache_argument(model) -> str:
    """The name under which ``model``'s forward takes its KV cache: ``cache`` (recent transformers, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (earlier versions); a forward that names neither
    (a wrapper taking ``**kwargs``) gets the installed transformers' name."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return _installed_cache_argument()


@functools.cache
def _installed_cache_argument() -> str:
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class HFModel(nn.Module):
    """Adapter exposing the decode loop's model interface over a Hugging Face model.

    Args:
        hf_model: a module whose forward accepts ``input_ids`` and ``attention_mask`` and returns an object
            with ``.logits`` (or a tensor) of shape ``[B, T, V]``.
        tokenizer: optional tokenizer (string prompts, decoded texts).
        mask_id / eos_id / eot_id / pad_id: special ids; default from the tokenizer
            (``mask_token_id``; ``eos_token_id`` or ``sep_token_id``; ``pad_token_id``).
        shift_logits: the logit at ``i`` predicts token ``i + 1`` (AR-initialised models such as Dream).
        max_seq_len: context limit; default ``config.max_position_embeddings``.
    """

    supports_cache = False

    def __init__(self, hf_model, tokenizer=None, *, mask_id=None, eos_id=None, eot_id=None, pad_id=None,
                 shift_logits: bool = False, max_seq_len: int | None = None):
        super().__init__()
        if not callable(getattr(hf_model, "forward", None)):
            raise TypeError(f"hf_model is a {type(hf_model).__name__}, not a model: pass a transformers model whose "
                            "forward returns logits, e.g. AutoModelForMaskedLM.from_pretrained(path)")
        self.hf = hf_model
        self.tokenizer = tokenizer
        self.spec = None
        tok = tokenizer

        def from_tok(attr):
            return getattr(tok, attr, None) if tok is not None else None

        self.mask_id = mask_id if mask_id is not None else from_tok("mask_token_id")
        if self.mask_id is None:
            raise ValueError("HFModel needs a mask token id: pass mask_id= or a tokenizer with a mask token")
        self.eos_id = eos_id if eos_id is not None else _first(from_tok("eos_token_id"), from_tok("sep_token_id"))
        self.eot_id = eot_id
        self.pad_id = pad_id if pad_id is not None else _first(from_tok("pad_token_id"), self.eos_id, 0)
        self._shift = shift_logits
        cfg = getattr(hf_model, "config", None)
        V = getattr(cfg, "vocab_size", None)
        V = V if isinstance(V, int) and not isinstance(V, bool) else None
        for name in ("mask_id", "eos_id", "eot_id", "pad_id"):  # checked here, not as an IndexError in the forward
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0 or (V and value >= V):
                span = f"0..{V - 1}" if V else ">= 0"
                raise ValueError(f"HFModel: {name}={value!r} is not a token id of this model (an integer in {span}); "
                                 "pass the tokenizer's id")
            setattr(self, name, int(value))
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, numbers.Integral)
                                        or max_seq_len < 1):
            raise ValueError(f"HFModel: max_seq_len={max_seq_len!r} must be a positive integer or None (None: "
                             "config.max_position_embeddings)")
        self._max_len = max_seq_len or getattr(cfg, "max_position_embeddings", None) or 4096
        params = inspect.signature(hf_model.forward).parameters
        self._takes_positions = "position_ids" in params

    @classmethod
    def from_pretrained(cls, path, *, auto_class=None, dtype=None, **kwargs) -> HFModel:
        """Load a local checkpoint with ``auto_class`` (default ``AutoModelForMaskedLM``) and its tokenizer."""
        from transformers import AutoModelForMaskedLM, AutoTokenizer

        auto_class = auto_class or AutoModelForMaskedLM
        with quiet_loading():
            model = auto_class.from_pretrained(str(path), dtype=dtype).eval()
        return cls(model, AutoTokenizer.from_pretrained(str(path)), **kwargs)

    @property
    def shift_logits(self) -> bool:
        return self._shift

    @property
    def max_seq_len(self) -> int:
        return self._max_len

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    def forward(self, tokens, *, positions=None, attn_mask=None, query_idx=None, cache=None, logits_idx=None):
        """Same contract as :meth:`dllm.models.Transformer.forward`, without partial forwards or caches."""
        if query_idx is not None or (cache is not None and getattr(cache, "name", "none") != "none"):
            raise ValueError("caches need a dllm Transformer; wrapped Hugging Face models run without a cache")
        B, T = tokens.shape
        mask = torch.ones_like(tokens) if attn_mask is None else attn_mask.long()
        kwargs = {"input_ids": tokens, "attention_mask": mask}
        if self._takes_positions and positions is not None:
            kwargs["position_ids"] = positions
        out = self.hf(**kwargs)
        logits = out.logits if hasattr(out, "logits") else out
        shift = 1 if self._shift else 0
        if logits_idx is None:
            if not shift:
                return logits
            logits_idx = torch.arange(T, device=tokens.device).expand(B, T)
        rows = (logits_idx - shift).clamp_min(0)
        return logits.gather(1, rows[..., None].expand(-1, -1, logits.shape[-1]))
