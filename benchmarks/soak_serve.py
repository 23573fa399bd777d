"""Soak test of the OpenAI-compatible server under hostile clients.

Starts the server in-process on a free loopback port and runs client threads for ``--seconds``; each sends a
random mix of valid requests (streaming or not, seeds, stop strings, ``n``), malformed ones (wrong types, unknown
fields, refused OpenAI fields, bad JSON, deep JSON, oversized bodies), streams it hangs up on after the first
chunk and non-streaming requests it stops waiting for. Checks, and exits 1 when one fails:

* no answer is a 5xx, every 4xx has OpenAI's error shape;
* the same seeded request always gets the same answer;
* a deterministic request (greedy, no stop string, one choice) gets exactly the answer ``dllm.generate`` gives it
  alone;
* ``/health`` stays 200 and answers within ``--health-limit`` seconds while the clients run;
* afterwards the engine is alive (never restarted) and no row or queued request is left.

It prints the requests by kind, the exact answers, the problems, and the resident memory at start and end.

    OMP_NUM_THREADS=1 python benchmarks/soak_serve.py --model llada-tiny --clients 8 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import threading
import time
from collections import Counter

import httpx
import uvicorn

import dllm
from dllm.serve import Engine
from dllm.serve.server import create_app

PROMPTS = ["What is 12 + 30?", 'Please copy the list exactly:\n["Ann Lee", "Bob Stone"]',
           'Please reverse the order of the list:\n["Alice Adams", "Brian Baker", "Carol Carter"]']
BAD_BODIES = [
    {"messages": [{"role": "user", "content": None}]}, {"messages": [{"content": "x"}]},
    {"messages": [{"role": "tool", "content": "x"}]}, {"prompt": "x", "stop": 5}, {"prompt": "x", "stop": [1, 2]},
    {"prompt": "x", "seed": 2**70}, {"prompt": "x", "stream": "no"}, {"prompt": "x", "top_p": 1.5},
    {"prompt": "x", "logprobs": 30}, {"prompt": "x", "frobnicate": True}, {"prompt": "x", "max_tokens": 10**7},
    {"prompt": "x", "sampler": "nope"}, {"prompt": "x", "params": {"tau": [1]}, "sampler": "threshold"},
    {"prompt": "x", "model": "gpt-4"}, {"prompt": "x", "stream": True, "stop": 5}, {"prompt": [-5]},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib() -> float:
    """Resident memory of this process (Linux), MiB."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Soak:
    def __init__(self, url: str, max_body: int, model=None):
        self.url, self.max_body, self.model = url, max_body, model
        self.solo: dict[str, str] = {}
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self.answers: dict[str, str] = {}
        self.lock = threading.Lock()

    def problem(self, what: str) -> None:
        with self.lock:
            self.problems.append(what)

    def check_error(self, r: httpx.Response, what: str) -> None:
        if r.status_code >= 500:
            self.problem(f"{what}: {r.status_code} {r.text[:200]}")
            return
        try:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
        except Exception:
            self.problem(f"{what}: {r.status_code} not in OpenAI's error shape: {r.text[:200]}")

    def valid(self, rng: random.Random) -> dict:
        body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": rng.choice([8, 16, 32]),
                "sampler": rng.choice(["llada", "threshold", "fast-dllm"]), "block_length": 8}
        if rng.random() < 0.5:
            body.update(temperature=0.8, seed=rng.randrange(4))
        if rng.random() < 0.3:
            body["stop"] = rng.choice(['", "', "Brian", "\n"])
        if rng.random() < 0.2:
            body["n"] = 2
        return body

    def client(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while time.monotonic() < until:
                kind = rng.choice(["valid", "valid", "stream", "bad", "garbage", "big", "hangup", "timeout"])
                self.counts[kind] += 1
                try:
                    self.one(c, rng, kind)
                except httpx.TransportError as exc:
                    if kind not in ("hangup", "timeout"):
                        self.problem(f"{kind}: transport error {exc!r}")

    def one(self, c: httpx.Client, rng: random.Random, kind: str) -> None:
        path = "/v1/chat/completions"
        if kind == "valid":
            body = self.valid(rng)
            r = c.post(path, json=body)
            if r.status_code != 200:
                self.check_error(r, "valid request")
                if r.status_code != 429:
                    self.problem(f"valid request answered {r.status_code}: {r.text[:200]}")
                return
            texts = [ch["message"]["content"] for ch in r.json()["choices"]]
            if self.model is not None and "temperature" not in body and "stop" not in body and "n" not in body:
                self.against_solo(body, texts[0])
            if "seed" in body or "temperature" not in body:  # deterministic: must reproduce
                key = json.dumps(body, sort_keys=True)
                with self.lock:
                    seen = self.answers.setdefault(key, json.dumps(texts))
                if seen != json.dumps(texts):
                    self.problem(f"same request, different answers: {key}")
        elif kind == "stream":
            body = {**self.valid(rng), "stream": True}
            with c.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    self.check_error(r, "stream")
                    return
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        self.problem(f"stream error event: {line[:200]}")
        elif kind == "bad":
            body = rng.choice(BAD_BODIES)
            r = c.post("/v1/completions" if "prompt" in body else path, json=body)
            if r.status_code < 400:
                self.problem(f"bad body accepted: {body}")
            self.check_error(r, f"bad body {body}")
        elif kind == "garbage":
            raw = rng.choice([b"{", b"\xff\xfe", b"[" * 20000 + b"]" * 20000, b"null", b'{"prompt": "x"' * 3])
            r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
            self.check_error(r, "garbage body")
        elif kind == "big":
            r = c.post(path, json={"messages": [{"role": "user", "content": "x" * (self.max_body + 10)}]})
            if r.status_code != 413:
                self.problem(f"oversized body answered {r.status_code}")
            self.check_error(r, "oversized body")
        elif kind == "hangup":  # the first chunk, then gone
            body = {**self.valid(rng), "stream": True, "max_tokens": 256}
            with c.stream("POST", path, json=body) as r:
                for _ in r.iter_lines():
                    break
        elif kind == "timeout":
            try:
                c.post(path, json={**self.valid(rng), "max_tokens": 256}, timeout=rng.uniform(0.01, 0.3))
            except httpx.TimeoutException:
                pass

    def against_solo(self, body: dict, text: str) -> None:
        """The served answer of a greedy request against ``dllm.generate`` on that request alone."""
        key = json.dumps(body, sort_keys=True)
        with self.lock:
            want = self.solo.get(key)
            if want is None:
                out = dllm.generate(self.model, [body["messages"]], gen_length=body["max_tokens"],
                                    block_length=body["block_length"], sampler=body["sampler"])
                want = self.solo[key] = out.texts[0]
        self.counts["exact_vs_solo"] += text == want
        if text != want:
            self.problem(f"served answer differs from generate alone: {key}: {text!r} vs {want!r}")

    def health(self, until: float, limit: float) -> None:
        worst = 0.0
        while time.monotonic() < until:
            t0 = time.perf_counter()
            try:
                r = httpx.get(f"{self.url}/health", timeout=limit * 4)
                if r.status_code != 200:
                    self.problem(f"/health {r.status_code}: {r.text[:200]}")
            except httpx.TransportError as exc:
                self.problem(f"/health unreachable: {exc!r}")
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.2)
        if worst > limit:
            self.problem(f"/health took {worst:.2f} s (limit {limit} s)")
        self.counts["health_worst_ms"] = round(worst * 1000)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llada-tiny")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-rows", type=int, default=8)
    ap.add_argument("--max-body-bytes", type=int, default=64 * 1024)
    ap.add_argument("--health-limit", type=float, default=1.0, help="slowest acceptable /health answer (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--graphs", default="auto", choices=["auto", "on", "off"],
                    help="the engine's graph path (on: its static buffers on the CPU too: bucketed batches, pooled "
                         "K/V buffers)")
    args = ap.parse_args(argv)

    rss0 = rss_mib()
    model = dllm.load_model(args.model)
    engine = Engine(model, max_rows=args.max_rows, max_queue=64, graphs=args.graphs)
    engine.start()
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine, args.model, max_body_bytes=args.max_body_bytes),
                                        host="127.0.0.1", port=port, log_level="critical"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.05)
    # the solo check decodes on its own copy of the model: the engine's thread uses the served one (and the
    # per-model state kept on it) at the same time; rss_mib_end counts both copies
    soak = Soak(f"http://127.0.0.1:{port}", args.max_body_bytes, dllm.load_model(args.model))
    until = time.monotonic() + args.seconds
    threads = [threading.Thread(target=soak.client, args=(args.seed * 1000 + i, until)) for i in range(args.clients)]
    threads.append(threading.Thread(target=soak.health, args=(until, args.health_limit)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(600):  # the hung-up and timed-out rows are freed within a few steps
        s = engine.stats()
        if s["running"] == 0 and s["waiting"] == 0:
            break
        time.sleep(0.05)
    s = engine.stats()
    if not engine.alive():
        soak.problem("the engine is not alive after the soak")
    if s["running"] or s["waiting"]:
        soak.problem(f"rows left after the soak: running {s['running']}, waiting {s['waiting']}")
    srv.should_exit = True
    th.join(10)
    engine.stop(drain=False, timeout=10)
    report = {"requests": dict(soak.counts), "outcomes": s["requests"], "engine_errors": s["engine_errors"],
              "forwards": s["forwards"], "graphs": s["graphs"], "distinct_deterministic_requests": len(soak.answers),
              "problems": soak.problems[:20], "n_problems": len(soak.problems),
              "rss_mib_start": round(rss0), "rss_mib_end": round(rss_mib())}
    print(json.dumps(report, indent=1))
    return 1 if soak.problems else 0


if __name__ == "__main__":
    sys.exit(main())
