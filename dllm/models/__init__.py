"""Models: one bidirectional Transformer, a ModelSpec per family, loading and saving."""

from dllm.models.loading import load_model, save_pretrained
from dllm.models.spec import DREAM, LLADA, SPECS, ModelSpec
from dllm.models.transformer import Transformer, TransformerConfig

__all__ = ["DREAM", "LLADA", "SPECS", "ModelSpec", "Transformer", "TransformerConfig", "load_model",
           "save_pretrained"]
