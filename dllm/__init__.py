"""dllm: fast decoding for masked diffusion language models (LLaDA, Dream and compatible checkpoints)."""

from dllm.caches import CACHES, NoCache, get_cache
from dllm.config import GenerateConfig
from dllm.generate import GenerateOutput, GenerateStats, NonFiniteLogitsError, generate
from dllm.models import load_model, save_pretrained
from dllm.samplers import SAMPLERS, get_sampler, list_samplers

__version__ = "0.1.0"

__all__ = [
           "CACHES",
           "SAMPLERS",
           "GenerateConfig",
           "GenerateOutput",
           "GenerateStats",
           "NoCache",
           "NonFiniteLogitsError",
           "__version__",
           "generate",
           "get_cache",
           "get_sampler",
           "list_samplers",
           "load_model",
           "save_pretrained",
]
