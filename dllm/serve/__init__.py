"""Serving: :class:`Engine` (continuous batching at step boundaries, exact per request) and an
OpenAI-compatible HTTP server (:mod:`dllm.serve.server`, ``dllm serve``)."""

from dllm.serve.engine import Engine, QueueFull, RequestError, RequestHandle, Result

__all__ = ["Engine", "QueueFull", "RequestError", "RequestHandle", "Result"]
