"""Which attention implementation runs on the Triton backend: SDPA, the flash kernel or the split-K kernel.

:func:`dllm.kernels.attention` on the ``triton`` backend asks :func:`choose` for one of

* ``"sdpa"``: ``F.scaled_dot_product_attention`` through :func:`dllm.kernels.reference.attention` (no mask: the
  flash / cuDNN backends are eligible; a key padding mask goes in as a ``[B, 1, 1, Lk]`` bool mask and fully
  masked rows are zeroed). It has no LSE, so ``return_lse=True`` never goes to it;
* ``"triton"``: :func:`dllm.kernels.triton_kernels.attention` (FlashAttention-2 forward, one program per query tile
  and head);
* ``"splitk"``: :func:`dllm.kernels.triton_kernels.attention_splitk` (flash-decoding: key splits plus a combine),
  with the split count whose programs fill the GPU's SMs in the fewest, fullest waves; ``"splitk-2x"`` and
  ``"splitk-wide"``: the same kernel with about twice that count and with the most splits that fit in four waves
  (:func:`~dllm.kernels.triton_kernels.splitk_candidates`; each a candidate only where it is another split count):
  few heads over long keys may read K/V faster with more programs in flight.

The rule (``"auto"``, the default):

* tensors that are not on a GPU (the Triton interpreter): ``"triton"``;
* float32: ``"splitk"`` always, with a split count that does not depend on the batch size, so a row's fp32 output
  does not depend on the batch it is computed in;
* float16 / bfloat16: measured once per shape bucket ``(B, Hq, Hkv, Lq and Lk rounded up to powers of two, D, dtype,
  has mask, return_lse, device)``: the first call of a bucket runs every candidate once (compilation, autotuning),
  then times three rounds of ten replays of each, captured in a CUDA graph (the way the cached decode steps run it:
  device time, no host launch cost; eager calls where the capture fails), each replay between two CUDA events after
  the L2 cache was overwritten (a decode step's K/V come from memory: the layer's weights read in between evict
  them; ``triton.testing.do_bench``, which the benchmarks use, times the same way), and keeps the fastest (median
  round); later calls reuse the cached choice.
  Nothing is timed while a CUDA graph is being captured or ``torch.compile`` traces: the cached choice is used,
  else SDPA (the flash kernel when the LSE is asked for).

``DLLM_ATTENTION=sdpa|triton|splitk|splitk-2x|splitk-wide|auto`` overrides the rule, :func:`set_attention_backend` overrides both; a
forced ``"sdpa"`` with ``return_lse=True`` runs the flash kernel. :func:`attention_choices` reports the decisions and
their timings (benchmarks and logs).
"""

from __future__ import annotations

import logging
import os
import statistics

import torch

from dllm.kernels import reference

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "sdpa", "triton", "splitk", "splitk-2x", "splitk-wide")
TIMED_CALLS = 10
TIMED_ROUNDS = 3

_forced: str | None = None
_choices: dict[tuple, str] = {}
_timings: dict[tuple, dict[str, float]] = {}


def set_attention_backend(name: str | None) -> None:
    """Force the attention implementation on the Triton backend: ``"auto"`` (the measured rule), ``"sdpa"``,
    ``"triton"`` or ``"splitk"``; None returns to ``DLLM_ATTENTION`` / ``"auto"``."""
    global _forced
    if name is not None and name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}")
    _forced = name


def attention_backend() -> str:
    """The requested attention implementation: :func:`set_attention_backend`, else ``DLLM_ATTENTION``, else auto."""
    if _forced is not None:
        return _forced
    env = os.environ.get("DLLM_ATTENTION", "").strip().lower() or "auto"
    if env not in ATTENTION_BACKENDS:
        raise ValueError(f"DLLM_ATTENTION={env!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    return env


def attention_choices() -> dict[tuple, dict]:
    """The measured choices so far: ``{bucket: {"choice": name, "ms": {candidate: median ms}}}``, bucket =
    ``(B, Hq, Hkv, Lq bucket, Lk bucket, D, dtype, has_mask, return_lse, device)``."""
    return {key: {"choice": name, "ms": dict(_timings.get(key, {}))} for key, name in _choices.items()}


def reset_attention_choices() -> None:
    """Forget the measured choices (the next call of each bucket measures again)."""
    _choices.clear()
    _timings.clear()


def bucket(q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None, return_lse: bool) -> tuple:
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    lk = 1 << max(Lk - 1, 0).bit_length()
    lq = 1 << max(Lq - 1, 0).bit_length()  # the prefix cache's active set shrinks block by block: few buckets
    return (B, Hq, Hkv, lq, lk, D, str(q.dtype).removeprefix("torch."), key_padding_mask is not None, bool(return_lse),
            str(q.device))


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _tracing() -> bool:
    return torch.compiler.is_compiling() or _capturing()


def run(name: str, tk, q, k, v, key_padding_mask, return_lse):
    """Run candidate ``name`` (``tk``: the Triton kernel module)."""
    if name == "sdpa" and not return_lse:
        return reference.attention(q, k, v, key_padding_mask=key_padding_mask)
    if name == "splitk":
        return tk.attention_splitk(q, k, v, key_padding_mask=key_padding_mask, return_lse=return_lse)
    if name.startswith("splitk-"):
        return tk.attention_splitk(q, k, v, key_padding_mask=key_padding_mask, return_lse=return_lse,
                                   num_splits=_split_candidates(tk, q, k, distinct=False)[name])
    return tk.attention(q, k, v, key_padding_mask=key_padding_mask, return_lse=return_lse)


def _split_candidates(tk, q, k, distinct: bool = True) -> dict[str, int]:
    return tk.splitk_candidates(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.dtype, distinct)


def reset_rng_capture_state() -> None:
    """After a capture that raised, CUDA's default generator can be left in its capturing state (the capture's
    epilogue never ran), and every later random draw on the device then fails ("Offset increment outside graph
    capture"). Capturing an empty graph runs a prologue and an epilogue again, which clears that state."""
    stream = torch.cuda.current_stream()
    try:
        torch.cuda.synchronize()
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            pass
    except Exception as exc:  # pragma: no cover - depends on the CUDA state
        torch.cuda.set_stream(stream)
        log.warning("could not reset the CUDA generator after a failed capture: %s", exc)


def capture_graph(fn, pool=None):
    """``(graph, fn())``: ``fn``'s kernels captured in a new CUDA graph, in thread-local mode (CUDA calls of other
    threads, a server's, do not invalidate the capture). Where the capture raises, the thread is put back on the
    stream it was on (``torch.cuda.graph`` leaves it on the capture stream when the capture's end fails too) and
    CUDA's generator made usable again (:func:`reset_rng_capture_state`), and the error is raised."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
    except Exception:
        torch.cuda.set_stream(stream)
        reset_rng_capture_state()
        raise
    return graph, out


def _graphed(fn):
    """``fn`` captured in a CUDA graph (its ``replay``), or None where the capture fails: the decode steps that
    matter run as CUDA graph replays (:mod:`dllm.graphs`), where a kernel's time is its device time, without the
    host's launch cost that an eager timing charges (and that favours the one-launch SDPA)."""
    try:
        graph, _ = capture_graph(fn)
        return graph.replay
    except Exception as exc:  # pragma: no cover - depends on the device
        log.info("timing an attention candidate eagerly (its capture failed: %s)", exc)
        return None


def _l2_flush_buffer() -> torch.Tensor:
    """A buffer twice the current device's L2 cache: zeroing it evicts whatever an earlier call left there."""
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or 64 << 20
    return torch.empty(2 * l2 // 4, dtype=torch.int32, device="cuda")


def _measure(fn, flush: torch.Tensor | None = None) -> float:
    """Milliseconds per call of ``fn``: after one untimed call, the median over ``TIMED_ROUNDS`` rounds of the mean
    of ``TIMED_CALLS`` replays of ``fn`` captured in a CUDA graph (eager calls where it cannot be captured), each
    between two CUDA events, after ``flush`` (:func:`_l2_flush_buffer`) was zeroed."""
    fn()
    torch.cuda.synchronize()
    call = _graphed(fn) or fn
    torch.cuda.synchronize()
    times = []
    for _ in range(TIMED_ROUNDS):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(TIMED_CALLS)]
        for start, end in events:
            if flush is not None:
                flush.zero_()
            start.record()
            call()
            end.record()
        events[-1][1].synchronize()
        times.append(sum(start.elapsed_time(end) for start, end in events) / TIMED_CALLS)
    return statistics.median(times)


def choose(tk, q, k, v, key_padding_mask=None, return_lse=False) -> str:
    """The implementation :func:`attention` runs for these inputs (may time the candidates; see the module doc)."""
    name = attention_backend()
    if name != "auto":
        return "triton" if name == "sdpa" and return_lse else name
    if not _on_gpu(q) or q.numel() == 0 or k.shape[2] == 0:
        return "triton"
    if q.dtype == torch.float32:
        return "splitk"
    key = bucket(q, k, key_padding_mask, return_lse)
    cached = _choices.get(key)
    if cached is not None:
        return cached
    fallback = "triton" if return_lse else "sdpa"
    if _tracing():
        return fallback
    candidates = ("triton",) if return_lse else ("sdpa", "triton")
    candidates += tuple(_split_candidates(tk, q, k))
    ms = {}
    flush = _l2_flush_buffer()
    for cand in candidates:
        try:
            ms[cand] = _measure(lambda: run(cand, tk, q, k, v, key_padding_mask, return_lse), flush)  # noqa: B023
        except Exception as exc:  # a candidate that cannot run this shape (e.g. out of resources) is skipped
            log.warning("attention candidate %s failed on %s: %s", cand, key, exc)
    del flush
    best = min(ms, key=ms.get) if ms else fallback
    _choices[key], _timings[key] = best, ms
    log.info("attention bucket %s: %s (%s)", key, best, ", ".join(f"{c} {t:.4f} ms" for c, t in ms.items()))
    return best


def attention(tk, q, k, v, key_padding_mask=None, return_lse=False):
    """Attention on the Triton backend (``tk``: the Triton kernel module): the implementation :func:`choose` picks."""
    if not tk._usable(q):
        return reference.attention(q, k, v, key_padding_mask=key_padding_mask, return_lse=return_lse)
    return run(choose(tk, q, k, v, key_padding_mask, return_lse), tk, q, k, v, key_padding_mask, return_lse)
