"""Shared by the HTTP serving tests: a free loopback port and a uvicorn server run in a thread."""

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
