"""Small frozen configuration records."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

#: ``GenerateConfig.graphs``: CUDA graphs for the forwards of the decode loop (``auto``: on CUDA devices, ``on``:
#: also the static-buffer path without capture off CUDA, ``off``: eager forwards only); see :mod:`dllm.graphs`
GRAPH_MODES = ("auto", "on", "off")


def check_graphs(mode) -> None:
    """Raise a ValueError naming ``mode`` unless it is one of :data:`GRAPH_MODES`."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"graphs must be one of {', '.join(map(repr, GRAPH_MODES))}, got {mode!r}")


@dataclass(frozen=True)
class GenerateConfig:
    """What the decode loop needs beyond the sampler, cache and block policy.

    Attributes:
        gen_length: number of masked positions appended to each prompt.
        block_length: semi-autoregressive block size for the fixed-block policy (``None``: one block, the
            whole canvas). ``gen_length`` must be a multiple of it.
        steps: total decoding steps for schedule-driven samplers (LLaDA's even quota, Dream's ``1 - s/t``),
            split evenly over the blocks (``None``: ``gen_length``, one token per step). Threshold-style
            samplers stop a block as soon as it has no masks and treat ``steps`` only as the schedule.
        cfg_scale: unsupervised classifier-free guidance (LLaDA): ``un + (cfg + 1) * (cond - un)``.
        eos_early_stop: once a completed block of a row contains EOS, fill every position after that block
            with EOS and finish the row (dInfer's and LocalLeap's early stop; the block keeps its tokens; EOT alone
            does not stop, as in those references). With a sliding window: once EOS or EOT has every position
            before it decoded.
        seed: seed of the ``torch.Generator`` every random draw of the run comes from (``None``: unseeded).
        chat_template: apply the tokenizer's chat template to string prompts.
        record_confidence: record in ``stats.commit_conf`` each committed token's probability and in
            ``stats.commit_logprob`` its log-probability (one extra log-sum-exp over the window's logits per step;
            for trajectory pictures and served logprobs).
        record_top_logprobs: ``k > 0`` records, per committed position, the ``k`` most probable tokens of the
            committing step's distribution (full-vocabulary softmax) and their log-probabilities in
            ``stats.commit_top_ids`` / ``stats.commit_top_logprobs`` (one log-sum-exp and one top-k over the
            window's logits per step); 0: not recorded.
        graphs: run the forwards as replayed CUDA graphs (the cached steps' partial forwards, and the full
            forwards: every step without a cache, a cache's refreshes after its first forward): ``"auto"`` (default)
            on CUDA devices, ``"off"`` never, ``"on"`` also off CUDA, where the same static-buffer path runs without
            capture (the CPU twin of the graph path). Elastic-Cache's hooked forwards, classifier-free guidance and
            models other than dllm's Transformer run eagerly (:mod:`dllm.graphs`). With a cache the shapes are
            rounded up to a few sizes (the canvas gets more left padding; the tokens are the same) and the cache's
            K/V buffers are lent by the model's graph runner and given back at the end of the call (a cache passed
            in holds none afterwards; its next call takes them again).
    """

    gen_length: int = 128
    block_length: int | None = None
    steps: int | None = None
    cfg_scale: float = 0.0
    eos_early_stop: bool = False
    seed: int | None = 0
    chat_template: bool = True
    record_confidence: bool = False
    record_top_logprobs: int = 0
    graphs: str = "auto"

    def __post_init__(self):
        # bool is an int subclass but never a length; numpy integers are stored as plain ints
        for name, optional in (("gen_length", False), ("block_length", True), ("steps", True)):
            v = getattr(self, name)
            if optional and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}, got {v!r}")
            object.__setattr__(self, name, int(v))
        k = self.record_top_logprobs
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"record_top_logprobs must be an integer >= 0 (0: not recorded), got {k!r}")
        object.__setattr__(self, "record_top_logprobs", int(k))
        c = self.cfg_scale
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c < 0:
            raise ValueError(f"cfg_scale must be >= 0 and finite (0: no guidance), got {c!r}")
        object.__setattr__(self, "cfg_scale", float(c))
        check_graphs(self.graphs)
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
                raise ValueError(f"seed must be an integer (Python or numpy) or None, got {self.seed!r}")
            if not -(2**63) <= self.seed < 2**64:  # torch.Generator.manual_seed's range
                raise ValueError(f"seed={self.seed} is out of range; it must lie in [-2**63, 2**64 - 1] (the range "
                                 "torch.Generator takes), or be None")
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def block(self) -> int:
        return self.block_length or self.gen_length

    @property
    def total_steps(self) -> int:
        return self.steps or self.gen_length
