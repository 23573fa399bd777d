"""Ray Serve deployment of the OpenAI-compatible server: one :class:`~dllm.serve.Engine` per replica.

One engine serves one model replica in one process on one device. For more replicas, on one machine or a
cluster, Ray Serve runs the same FastAPI app (:func:`dllm.serve.server.create_app`) in each replica and
routes the HTTP requests between them; nothing here schedules across replicas. Every response is still
token-identical to ``dllm.generate`` of the request alone (float32), whichever replica answers it.

From the command line (Ray's own ``serve run``; ``key=value`` arguments go to :func:`app_builder`)::

    serve run dllm.serve.ray_serve:app_builder model=llada-tiny num_replicas=2 num_cpus=1

From Python::

    from ray import serve
    from dllm.serve.ray_serve import deployment

    serve.run(deployment("llada-tiny", num_replicas=2), route_prefix="/")   # http://127.0.0.1:8000/v1/...

Needs the ``ray`` extra (``pip install 'dllm[ray]'``). On GPUs, give each replica a device with
``num_gpus=1`` (Ray sets ``CUDA_VISIBLE_DEVICES`` per replica) and ``device="cuda"``.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from ray import serve
except ImportError as exc:  # pragma: no cover - exercised only without the ray extra
    raise ImportError("the Ray Serve deployment needs Ray Serve: pip install 'dllm[ray]'") from exc

from dllm.serve.engine import Engine, check_positive
from dllm.serve.server import create_app


@serve.ingress()
class DllmServer:
    """A replica: loads the model, starts an :class:`Engine` and serves :func:`create_app`'s endpoints
    (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``: this replica's
    counters)."""

    def __init__(self, model: str = "llada-tiny", *, dtype: str | None = None, device: str | None = None,
                 model_name: str | None = None, api_key: str | None = None, max_rows: int = 8,
                 max_queue: int = 256, sampler: str | None = None, params: dict | None = None):
        from dllm.models import load_model

        self.engine = Engine(load_model(model, dtype=dtype, device=device), max_rows=max_rows,
                             max_queue=max_queue, sampler=sampler, params=params)
        self.engine.start()
        self._app = create_app(self.engine, model_name or os.path.basename(str(model).rstrip("/")), api_key)

        @self._app.get("/replica")
        async def replica():  # which process answered (for checking that requests spread over replicas)
            return {"pid": os.getpid(), **{k: v for k, v in self.engine.stats().items() if k in ("waiting", "running")}}

    def __serve_build_asgi_app__(self):
        return self._app

    def __del__(self):
        # Ray Serve stops routing to a replica and waits for its requests in flight before it goes away; the
        # engine has nothing left to drain by then.
        self.engine.stop(drain=False)


def deployment(model: str = "llada-tiny", *, num_replicas: int = 1, num_cpus: float = 1, num_gpus: float = 0,
               max_ongoing_requests: int | None = None, **server: Any):
    """The application to pass to ``serve.run``: ``num_replicas`` replicas of :class:`DllmServer` for
    ``model`` (a checkpoint directory or a bundled name), each with ``num_cpus`` / ``num_gpus``. ``server``
    goes to :class:`DllmServer` (``dtype``, ``device``, ``model_name``, ``api_key``, ``max_rows``,
    ``max_queue``, ``sampler``, ``params``). ``max_ongoing_requests`` (default: ``max_queue``) bounds what Ray
    routes to one replica; beyond ``max_queue`` a replica answers 429."""
    check_positive("num_replicas", num_replicas)
    ongoing = max_ongoing_requests or int(server.get("max_queue", 256))
    dep = serve.deployment(DllmServer, name="dllm", num_replicas=num_replicas, max_ongoing_requests=ongoing,
                           ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})
    return dep.bind(model, **server)


_INT_ARGS = ("num_replicas", "max_rows", "max_queue", "max_ongoing_requests")
_FLOAT_ARGS = ("num_cpus", "num_gpus")


def app_builder(args: dict[str, str]):
    """``serve run dllm.serve.ray_serve:app_builder key=value ...``: Ray's application-builder entry point
    (the values arrive as strings; ``param.K=V`` sets a sampler parameter)."""
    from dllm.evals.parallelbench.sweep import parse_scalar

    kw: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for key, value in args.items():
        if key.startswith("param."):
            params[key[len("param."):]] = parse_scalar(str(value))
        elif key in _INT_ARGS:
            kw[key] = int(value)
        elif key in _FLOAT_ARGS:
            kw[key] = float(value)
        else:
            kw[key] = value
    if params:
        kw["params"] = params
    return deployment(**kw)
