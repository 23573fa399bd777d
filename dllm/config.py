"""Small frozen configuration records."""

from __future__ import annotations

from dataclasses import dataclass


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
        eos_early_stop: once a completed block of a row contains EOS/EOT, fill the rest of that row with
            EOS and finish it.
        seed: seed of the ``torch.Generator`` every random draw of the run comes from (``None``: unseeded).
        chat_template: apply the tokenizer's chat template to string prompts.
    """

    gen_length: int = 128
    block_length: int | None = None
    steps: int | None = None
    cfg_scale: float = 0.0
    eos_early_stop: bool = False
    seed: int | None = 0
    chat_template: bool = True

    def __post_init__(self):
        if not isinstance(self.gen_length, int) or self.gen_length <= 0:
            raise ValueError(f"gen_length must be a positive integer, got {self.gen_length!r}")
        if self.block_length is not None and (not isinstance(self.block_length, int) or self.block_length <= 0):
            raise ValueError(f"block_length must be a positive integer or None, got {self.block_length!r}")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps <= 0):
            raise ValueError(f"steps must be a positive integer or None, got {self.steps!r}")
        if self.cfg_scale < 0:
            raise ValueError(f"cfg_scale must be >= 0, got {self.cfg_scale}")

    @property
    def block(self) -> int:
        return self.block_length or self.gen_length

    @property
    def total_steps(self) -> int:
        return self.steps or self.gen_length
