"""Block policies: which region of the canvas each row decodes (one axis of a decoding recipe, beside the
sampler and the cache). Regions are contiguous and advance left to right per row: when a row's region has no
masks left, the policy is asked for the next one, starting where the last ended. Rows advance independently.

* :class:`FixedBlocks` / :func:`WholeCanvas`: semi-autoregressive blocks (LLaDA) or one region (Dream);
* :class:`SlidingWindow`: Elastic-Cache's window over the first remaining masks;
* :class:`AdaBlock`: delimiter-aligned adaptive blocks (AdaBlock-dLLM);
* :class:`AlignedBlocks`: blocks on a block-diffusion model's block grid (SDAR);
* :class:`MultiBlock`: d3LLM's multi-block decoding (the next block starts before the current one is done).
"""

from dllm.blocks.adablock import FAMILY_THRESHOLDS, AdaBlock, tokenizer_delimiters
from dllm.blocks.aligned import AlignedBlocks
from dllm.blocks.fixed import BlockPolicy, BlockPolicyBase, FixedBlocks, WholeCanvas
from dllm.blocks.multiblock import MultiBlock
from dllm.blocks.sliding import SlidingWindow

__all__ = ["FAMILY_THRESHOLDS", "AdaBlock", "AlignedBlocks", "BlockPolicy", "BlockPolicyBase", "FixedBlocks", "MultiBlock", "SlidingWindow",
           "WholeCanvas", "tokenizer_delimiters"]
