"""Shared fixtures: tiny random-weight LLaDA- and Dream-format models (fp32, CPU)."""

from __future__ import annotations

import os

import pytest
import torch

# On CPU-only machines the Triton kernels are tested under the interpreter (tests/test_kernels.py). Triton's @jit
# picks the interpreter when it decorates, at import, so the variable must be set before anything in the session
# (transformers' modeling files, for one) imports triton.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Inductor's on-disk cache does not key its compiled CPU code by ATEN_CPU_CAPABILITY: a run with the portable kernels
# (ATEN_CPU_CAPABILITY=default, as CI runs the golden tests) after a native run would load vectorised code that the
# portable build's headers cannot compile. One cache per capability (unless the caller chose a cache).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile

    _capability = os.environ.get("ATEN_CPU_CAPABILITY", "native").replace(os.sep, "_") or "native"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_uid{os.getuid()}_{_capability}")

from dllm.models import DREAM, LLADA, Transformer, TransformerConfig
from dllm.models.weights import init_weights


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The test models are tiny: intra-op threads only add synchronisation (up to 30x slower on a busy
    2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


VOCAB = 96
MASK, EOS, EOT, PAD = 95, 1, 2, 1


def random_model(family: str = "llada", seed: int = 0, vocab: int = VOCAB, std: float = 0.5) -> Transformer:
    """A random-weight model with well-spread logits (std 0.5 keeps confidences away from ties)."""
    spec = LLADA if family == "llada" else DREAM
    cfg = TransformerConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4,
                            n_kv_heads=4 if family == "llada" else 2, mlp_hidden=64,
                            qkv_bias=family == "dream", max_seq_len=256)
    torch.manual_seed(seed)
    model = Transformer(cfg, spec)
    init_weights(model, std=std)
    model.eval().requires_grad_(False)
    model.mask_id, model.eos_id, model.eot_id, model.pad_id = vocab - 1, EOS, EOT, PAD
    return model


@pytest.fixture(params=["llada", "dream"])
def family(request) -> str:
    return request.param


@pytest.fixture
def model(family) -> Transformer:
    return random_model(family)


def ragged_prompts(n: int = 3, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 9, 3, 7, 4][:n]
    return [torch.randint(3, vocab - 1, (L,), generator=g).tolist() for L in lengths]


@pytest.fixture
def triton_backend():
    """The Triton kernel backend for the test (its kernels run under the interpreter on CPU), then the previous one."""
    from dllm import kernels

    old = kernels.get_backend()
    kernels.set_backend("triton")
    yield
    kernels.set_backend(old)
