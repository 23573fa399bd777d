"""Shared by the HTTP serving tests: a free loopback port, a uvicorn server run in a thread, and the bundled
``llada-tiny`` served behind it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app, port: int | None = None):
    """Serve ``app`` on 127.0.0.1 in a daemon thread; yields the base URL, stops the server on exit."""
    import uvicorn

    port = port or free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(10)


@contextlib.contextmanager
def served_llada_tiny(max_queue: int, **app_kw):
    """The bundled ``llada-tiny`` (float32) in a started engine (4 rows) behind the app on a loopback port; yields
    ``(model, engine, url)`` and stops both on exit. ``app_kw``: :func:`dllm.serve.server.create_app` options."""
    import dllm
    from dllm.serve import Engine
    from dllm.serve.server import create_app

    model = dllm.load_model("llada-tiny", dtype="float32")
    engine = Engine(model, max_rows=4, max_queue=max_queue)
    engine.start()
    try:
        with running_server(create_app(engine, "llada-tiny", **app_kw)) as url:
            yield model, engine, url
    finally:
        engine.stop(drain=False)


@contextlib.contextmanager
def serve_process(*options: str):
    """``dllm serve --model llada-tiny OPTIONS`` in its own process on a free loopback port, waited for until
    ``/health`` answers 200; yields ``(process, base URL)`` and kills the process on exit."""
    import os
    import subprocess
    import sys

    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", "--model", "llada-tiny", "--port", str(port),
                             *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
