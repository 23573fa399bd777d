"""The OpenAI-compatible server on a loopback port, driven by the official ``openai`` client: completions and
chat, streaming and not, concurrent requests, outputs identical to ``dllm.generate`` alone, errors."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from cli_helpers import refused

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_helpers import serve_process, served_llada_tiny  # noqa: E402

import dllm  # noqa: E402
from dllm.generate import prepare_prompts  # noqa: E402

KEY = "test-key"
PROMPT = 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]'


@pytest.fixture(scope="module")
def server():
    with served_llada_tiny(6, api_key=KEY) as served:
        yield served


def _solo(model, prompt, rid, chat=True, cache="none", **kw):
    sampler = kw.pop("sampler", None)
    params = kw.pop("params", {})
    out = dllm.generate(model, [prompt], sampler=dllm.get_sampler(sampler, **params) if sampler else None,
                        cache=cache, chat_template=chat, **kw)
    return out.texts[0], out.stats.row_nfe[0]


def test_completion_chat_and_models_match_solo_generate(server):
    model, engine, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["llada-tiny"]
    ids = prepare_prompts(model, [PROMPT], None, True)[0]  # token ids: the chat-templated prompt
    r = client.completions.create(model="llada-tiny", prompt=ids, max_tokens=32, temperature=0,
                                  extra_body={"sampler": "threshold", "block_length": 8})
    text, nfe = _solo(model, ids, r.id, chat=False, sampler="threshold", gen_length=32, block_length=8)
    assert r.choices[0].text == text
    assert r.usage.completion_tokens > 0 and r.usage.model_extra["nfe"] == nfe
    c = client.chat.completions.create(model="llada-tiny", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=16, temperature=0.8, seed=7)
    text, _ = _solo(model, [{"role": "user", "content": PROMPT}], c.id, gen_length=16, seed=7,
                    sampler="llada", params={"temperature": 0.8})
    assert c.choices[0].message.content == text and c.choices[0].message.role == "assistant"


def test_streaming_gives_the_same_text_in_pieces_then_usage(server):
    model, engine, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    pieces, reasons, usage, rid = [], [], None, None
    for ch in client.chat.completions.create(model="llada-tiny", messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=32, stream=True, extra_body={"block_length": 8}):
        rid = ch.id
        if ch.choices and ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
        if ch.choices and ch.choices[0].finish_reason:
            reasons.append(ch.choices[0].finish_reason)
        usage = getattr(ch, "usage", None) or usage
    text, _ = _solo(model, [{"role": "user", "content": PROMPT}], rid, gen_length=32, block_length=8)
    assert "".join(pieces) == text and len(pieces) >= 2
    assert reasons == ["stop"] or reasons == ["length"]
    assert usage is not None and usage.completion_tokens > 0


def test_concurrent_async_requests_are_each_exact(server):
    model, engine, url = server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
    prompts = [PROMPT, "What is 12 + 30?", 'Reverse the list: ["Kevin Irving", "Ann Lee"]', "What is 407 + 2185?"]

    async def one(p, sampler):
        return await client.completions.create(model="llada-tiny", prompt=p, max_tokens=16,
                                               extra_body={"sampler": sampler})

    async def run():
        return await asyncio.gather(*[one(p, s) for p in prompts for s in ("llada", "threshold", "fast-dllm")])

    results = asyncio.run(run())
    for (p, s), r in zip([(p, s) for p in prompts for s in ("llada", "threshold", "fast-dllm")], results):
        text, _ = _solo(model, p, r.id, chat=False, sampler=s, gen_length=16, cache=None)  # fast-dllm: dual
        assert r.choices[0].text == text, (p, s)


def test_errors_are_openai_shaped(server):
    model, engine, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=16, n=17)
    assert e.value.body["param"] == "n" and "from 1 to 16" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=16, extra_body={"sampler": "nope"})
    assert "unknown sampler" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    m = httpx.get(f"{url}/metrics").text
    assert "dllm_requests_total{outcome=\"stop\"}" in m and "dllm_request_nfe_total" in m and "dllm_queue_waiting" in m
    assert "# TYPE dllm_forward_paths_total counter" in m


def test_metrics_count_how_the_forwards_ran():
    """/metrics' ``dllm_forward_paths{how=...}`` and ``dllm_step_paths{how=...}``: the engine's graph-runner counts
    of its forwards and of its steps' work after them (replays, captures, eager and why), here the CPU's
    static-buffer graph path."""
    from dllm.serve import Engine
    from dllm.serve.server import _EngineCollector

    engine = Engine(dllm.load_model("llada-tiny", dtype="float32"), max_rows=2, graphs="on")
    for _ in range(2):
        engine.submit(PROMPT, gen_length=16, block_length=8, sampler="fast-dllm")
    engine.run_until_idle()
    fam = {f.name: f for f in _EngineCollector(engine).collect()}["dllm_forward_paths"]
    got = {s.labels["how"]: s.value for s in fam.samples if s.name == "dllm_forward_paths_total"}
    counts = engine.stats()["graphs"]
    assert got == {k: v for k, v in counts.items() if k != "evicted"} and got["replays"] >= 1
    assert len(got) >= 2
    # dllm_step_paths: how the steps' work after their forwards ran (fast-dllm's step is graph-safe: replayed)
    fam = {f.name: f for f in _EngineCollector(engine).collect()}["dllm_step_paths"]
    got = {s.labels["how"]: s.value for s in fam.samples if s.name == "dllm_step_paths_total"}
    counts = engine.stats()["step_graphs"]
    assert got == {k: v for k, v in counts.items() if k != "evicted"} and got["replays"] >= 1
    assert sum(got.values()) == engine.stats()["steps"]  # every step counted once
    # the logits columns the steps computed, and those in the rows' own windows
    fams = {f.name: f for f in _EngineCollector(engine).collect()}
    for name, key in (("dllm_logits_columns", "logits_columns"), ("dllm_own_logits_columns", "own_logits_columns")):
        assert fams[name].samples[0].value == engine.stats()[key] > 0
    # the batch's K/V buffers went back to the graph path's pool when it ended
    pool = {f.name: f for f in _EngineCollector(engine).collect()}["dllm_graph_pool_bytes"]
    assert pool.samples[0].value == engine.stats()["graph_pool_bytes"] > 0


def test_a_full_queue_answers_429(server):
    model, engine, url = server
    engine.step = lambda: time.sleep(0.01) or False  # the loop runs but decodes nothing: the queue holds
    try:
        handles = [engine.submit(PROMPT, gen_length=8) for _ in range(engine.max_queue)]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        del engine.step
    for h in handles:
        assert h.result(timeout=60).finish_reason in ("stop", "length")


def test_a_disconnected_streaming_client_frees_its_row(server):
    model, engine, url = server
    before = engine.stats()["requests"]["cancelled"]
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 400, "stream": True,
            "sampler": "llada", "block_length": 8}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk has arrived: the request is running
    for _ in range(200):  # the row is freed at a following step, long before its 400 forwards are done
        if engine.stats()["requests"]["cancelled"] > before:
            break
        time.sleep(0.05)
    assert engine.stats()["requests"]["cancelled"] == before + 1
    assert engine.stats()["running"] == 0


def test_the_per_step_canvas_is_streamed_on_request(server):
    """``dllm_canvas``: a chunk per step with the positions it committed; together they are every generated
    position once, with the final tokens, and the steps count up to the request's NFE."""
    model, engine, url = server
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "stream": True,
            "block_length": 8, "sampler": "threshold", "dllm_canvas": True}
    events, usage = [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if "dllm" in ev:
                events.append(ev["dllm"])
            usage = ev.get("usage") or usage
    committed = {}
    for ev in events:
        for pos, tok in ev["committed"].items():
            assert pos not in committed  # each position committed once
            committed[pos] = tok
    out = dllm.generate(model, [[{"role": "user", "content": PROMPT}]], gen_length=16, block_length=8,
                        sampler="threshold")
    assert [committed[str(j)] for j in range(16)] == out.sequences[0].tolist()
    assert [ev["step"] for ev in events] == list(range(1, usage["nfe"] + 1))


def test_sigterm_stops_accepting_and_finishes_the_request_in_flight(tmp_path):
    """``dllm serve`` in its own process: SIGTERM during a request lets it finish, then the process ends."""
    import signal

    with serve_process() as (proc, url):
        result = {}

        def request():
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 400, "sampler": "llada",
                "block_length": 8})
            result["status"], result["body"] = r.status_code, r.json()

        th = threading.Thread(target=request)
        th.start()
        for _ in range(100):  # the request is running
            if "dllm_rows_running 1.0" in httpx.get(f"{url}/metrics").text:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        th.join(60)
        assert result["status"] == 200 and result["body"]["choices"][0]["finish_reason"] in ("stop", "length")
        assert result["body"]["usage"]["nfe"] > 0
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down


def test_serve_command_checks_its_default_sampler_before_listening(capsys):
    refused(capsys, ["serve", "--param", "tau=0.3"], "--param needs --sampler")
    refused(capsys, ["serve", "--sampler", "nope"], "unknown sampler 'nope'")
    refused(capsys, ["serve", "--sampler", "threshold", "--param", "threshold=0.3"], "no parameter")


def test_serve_command_passes_its_graph_mode_to_the_engine(monkeypatch):
    """``dllm serve --graphs off|on|auto`` reaches the engine (default auto); other values are refused."""
    from dllm.cli import main
    from dllm.serve import server

    seen = []
    monkeypatch.setattr(server, "serve", lambda model, **kw: seen.append(kw["graphs"]))
    for argv, want in (([], "auto"), (["--graphs", "off"], "off"), (["--graphs", "on"], "on")):
        assert main(["serve", "--port", "8123", *argv]) == 0
        assert seen[-1] == want
    with pytest.raises(SystemExit):
        main(["serve", "--graphs", "sometimes"])
