"""The server's contract as a hostile client sees it: bad input is a 4xx in OpenAI's error shape before anything
runs, never a 500; nothing a client does blocks the event loop or keeps a row decoding after it left; seeds
reproduce; stop strings never leak text past the cut; the OpenAI fields either work or are refused by name."""

from __future__ import annotations

import json
import threading
import time

import pytest
from cli_helpers import refused

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_helpers import served_llada_tiny  # noqa: E402

import dllm  # noqa: E402

PROMPT = 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]'
CHAT = [{"role": "user", "content": PROMPT}]
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    with served_llada_tiny(32, max_body_bytes=BODY_LIMIT) as served:
        yield served


def _post(url, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=data, headers={"Content-Type": "application/json"}, timeout=60, **kw)


def _shaped(r, status: int, param=None, words=()):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


BAD = [  # (path, body, param, words in the message)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages", ["content"]),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages", ["role is required"]),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "hi"}]}, "messages", ["'tool'"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     ["image_url"]),
    ("/v1/chat/completions", {"messages": []}, "messages", ["non-empty"]),
    ("/v1/completions", {"prompt": PROMPT, "stop": 5}, "stop", ["string"]),
    ("/v1/completions", {"prompt": PROMPT, "stop": [1, 2]}, "stop", ["string"]),
    ("/v1/completions", {"prompt": PROMPT, "stop": 5, "stream": True}, "stop", ["string"]),
    ("/v1/completions", {"prompt": PROMPT, "seed": 2**70}, "seed", ["out of range"]),
    ("/v1/completions", {"prompt": PROMPT, "seed": -1}, "seed", ["out of range"]),
    ("/v1/completions", {"prompt": PROMPT, "stream": "no"}, "stream", ["true or false"]),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens", [">= 1"]),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**6}, "prompt", ["context"]),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 500}, "messages", ["context"]),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 32, "block_length": 5}, "max_tokens", ["block_length"]),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature", ["number"]),
    ("/v1/completions", {"prompt": [PROMPT, PROMPT]}, "prompt", ["one prompt per request"]),
    ("/v1/completions", {"prompt": PROMPT, "sampler": "nope"}, "sampler", ["unknown sampler"]),
    ("/v1/completions", {"prompt": PROMPT, "sampler": "klass", "params": {"kl_threshold": "x"}}, "params", []),
    ("/v1/completions", {"prompt": PROMPT, "params": {"tau": "x"}, "sampler": "threshold"}, "params", []),
    ("/v1/completions", {"prompt": PROMPT, "params": {"nope": 1}, "sampler": "threshold"}, "params", ["nope"]),
    ("/v1/completions", {"prompt": PROMPT, "sampler": "ascending", "params": {"per_region": 3}}, "params",
     ["per_region=3", "true or false"]),
    ("/v1/completions", {"prompt": PROMPT, "sampler": "llada", "params": {"logits_eos_inf": "yes"}}, "params",
     ["logits_eos_inf", "true or false"]),
    ("/v1/completions", {"prompt": PROMPT, "cache": "nope"}, "cache", ["not served"]),
    ("/v1/completions", {"prompt": [10**9]}, "prompt", []),
    ("/v1/completions", {"prompt": PROMPT, "frobnicate": 1}, "frobnicate", ["unknown field"]),
    ("/v1/completions", {"prompt": PROMPT, "echo": "yes"}, "echo", []),
    ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, "suffix", ["not supported"]),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 3}, "best_of", ["not supported"]),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs", ["out of range", "0 to 20"]),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs", ["out of range"]),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": True}, "logprobs", ["integer"]),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, "echo": True}, "echo", ["prompt's tokens"]),
    ("/v1/completions", {"prompt": PROMPT, "top_p": -0.5, "sampler": "threshold"}, "top_p", []),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0, "sampler": "dream"}, "top_p", ["out of range"]),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5, "sampler": "dream"}, "top_p", ["out of range"]),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 0.5}, "presence_penalty", ["not supported"]),
    ("/v1/completions", {"prompt": PROMPT, "frequency_penalty": 0.5}, "frequency_penalty", ["not supported"]),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 1}}, "logit_bias", ["not supported"]),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs", ["true or false"]),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", ["needs logprobs"]),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     ["out of range", "0 to 20"]),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2.5}, "top_logprobs",
     ["integer"]),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools", ["not supported"]),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions", ["not supported"]),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, "response_format",
     ["not supported"]),
    ("/v1/chat/completions", {"messages": CHAT, "n": 99}, "n", ["from 1 to 16"]),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "max_completion_tokens": 9}, "max_tokens",
     ["differ"]),
    ("/v1/chat/completions", {"messages": CHAT, "dllm_canvas": True}, "dllm_canvas", ["stream"]),
]


@pytest.mark.parametrize("path,body,param,words", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_are_400_naming_the_field_before_decoding(server, path, body, param, words):
    model, engine, url = server
    forwards = engine.stats()["forwards"]
    _shaped(_post(url, path, body), 400, param, words)
    assert engine.stats()["forwards"] == forwards  # refused before any decoding
    assert engine.stats()["waiting"] == 0 and engine.stats()["running"] == 0


def test_malformed_bodies_unknown_models_paths_and_methods_are_shaped_errors(server):
    model, engine, url = server
    _shaped(_post(url, "/v1/completions", "{"), 400, None, ["not valid JSON"])
    _shaped(_post(url, "/v1/completions", "[" * 30_000 + "]" * 30_000), 400, None, ["nested too deeply"])
    _shaped(_post(url, "/v1/completions", "[1, 2]"), 400, None, ["JSON object"])
    _shaped(_post(url, "/v1/completions", b"\xff\xfe"), 400, None, ["not valid JSON"])
    err = _shaped(_post(url, "/v1/completions", {"model": "gpt-4", "prompt": PROMPT}), 404, "model", ["'gpt-4'"])
    assert err["code"] == "model_not_found"
    _shaped(httpx.get(f"{url}/v1/nope"), 404, None, ["no such endpoint"])
    _shaped(httpx.get(f"{url}/v1/completions"), 405, None, ["not allowed"])
    err = _shaped(_post(url, "/v1/completions", {"prompt": "x" * (BODY_LIMIT + 1)}), 413)
    assert err["code"] == "request_too_large" and str(BODY_LIMIT) in err["message"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenised(server, monkeypatch):
    model, engine, url = server
    import dllm.serve.engine as eng_mod

    def no_tokenising(*a, **k):
        raise AssertionError("tokenised")

    monkeypatch.setattr(eng_mod, "prepare_prompts", no_tokenising)
    t0 = time.perf_counter()
    r = _post(url, "/v1/completions", {"prompt": "word " * 10_000, "max_tokens": 8})
    _shaped(r, 400, "prompt", ["at least", "context"])
    assert time.perf_counter() - t0 < 5


def test_slow_parsing_and_tokenising_never_block_the_event_loop(server, monkeypatch):
    model, engine, url = server
    real = engine.submit
    entered = threading.Event()

    def slow_submit(*a, **k):  # a tokenizer that takes its time
        entered.set()
        time.sleep(1.5)
        return real(*a, **k)

    monkeypatch.setattr(engine, "submit", slow_submit)
    th = threading.Thread(target=_post, args=(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}))
    th.start()
    assert entered.wait(10)
    t0 = time.perf_counter()
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert time.perf_counter() - t0 < 0.5
    th.join(30)


def test_a_non_streaming_client_that_times_out_frees_its_row(server):
    model, engine, url = server
    before = engine.stats()["requests"]["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", timeout=0.5, json={
            "messages": CHAT, "max_tokens": 400, "sampler": "llada", "block_length": 8})
    for _ in range(200):
        if engine.stats()["requests"]["cancelled"] > before and engine.stats()["running"] == 0:
            break
        time.sleep(0.05)
    assert engine.stats()["requests"]["cancelled"] == before + 1
    assert engine.stats()["running"] == 0


def test_seed_reproduces_alone_and_under_load(server):
    model, engine, url = server
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "seed": 1234, "sampler": "llada"}
    alone = [_post(url, "/v1/completions", body).json()["choices"][0]["text"] for _ in range(2)]
    out = dllm.generate(model, [PROMPT], gen_length=16, seed=1234, sampler=dllm.get_sampler("llada", temperature=0.9),
                        chat_template=False)
    assert alone == [out.texts[0]] * 2
    results = {}

    def ask(k, b):
        results[k] = _post(url, "/v1/completions", b).json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(k, {**body, "seed": 1234 + (k % 3 == 0)})) for k in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[k] for k in range(9) if k % 3] == [out.texts[0]] * 6
    other = _post(url, "/v1/completions", {**body, "seed": 1235}).json()["choices"][0]["text"]
    assert [results[k] for k in range(9) if k % 3 == 0] == [other] * 3


def _stream(url, body):
    pieces, reasons, usage = [], [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            for c in ev.get("choices", []):
                if c["delta"].get("content"):
                    pieces.append(c["delta"]["content"])
                if c["finish_reason"]:
                    reasons.append(c["finish_reason"])
            usage = ev.get("usage") or usage
    return pieces, reasons, usage


@pytest.mark.parametrize("inline", [True, False], ids=["decoded-on-the-loop", "decoded-in-a-thread"])
def test_a_stop_string_straddling_two_chunks_is_never_sent_and_ends_the_decoding(server, inline, monkeypatch):
    import dllm.serve.server as srv

    monkeypatch.setattr(srv, "INLINE_DECODE", 10**6 if inline else 0)
    model, engine, url = server
    body = {"messages": CHAT, "max_tokens": 48, "block_length": 8, "sampler": "llada"}
    pieces, _, usage = _stream(url, body)
    assert len(pieces) >= 3
    j = next(j for j in range(1, len(pieces) - 1) if len(pieces[j - 1]) >= 2 and len(pieces[j]) >= 2)
    stop = pieces[j - 1][-2:] + pieces[j][:2]  # across the boundary of two chunks
    full = "".join(pieces)
    want = full[: full.find(stop)]
    cancelled = engine.stats()["requests"]["cancelled"]
    got, reasons, usage_stop = _stream(url, {**body, "stop": [stop, "zzzz"]})
    assert "".join(got) == want and reasons == ["stop"]
    assert stop not in "".join(got)
    assert engine.stats()["requests"]["cancelled"] == cancelled + 1  # the row was freed at the match
    assert usage_stop["nfe"] < usage["nfe"] and usage_stop["completion_tokens"] <= usage["completion_tokens"]
    r = _post(url, "/v1/chat/completions", {**body, "stop": stop}).json()  # not streaming: the same cut
    assert r["choices"][0]["message"]["content"] == want and r["choices"][0]["finish_reason"] == "stop"


def test_n_text_parts_max_completion_tokens_and_echo_work(server):
    model, engine, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="llada-tiny", messages=CHAT, max_tokens=16, temperature=0.9, seed=5, n=3)
    out = dllm.generate(model, [CHAT] * 3, gen_length=16, seed=5, sampler=dllm.get_sampler("llada", temperature=0.9))
    assert [c.message.content for c in r.choices] == out.texts and [c.index for c in r.choices] == [0, 1, 2]
    assert len(set(out.texts)) > 1  # three different answers
    parts = [{"role": "user", "content": [{"type": "text", "text": PROMPT[:10]}, {"type": "text", "text": PROMPT[10:]}]}]
    a = client.chat.completions.create(model="llada-tiny", messages=parts, max_completion_tokens=16)
    b = client.chat.completions.create(model="llada-tiny", messages=CHAT, max_tokens=16)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content == dllm.generate(model, [CHAT], gen_length=16).texts[0]
    e = client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=8, echo=True)
    plain = client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=8)
    assert e.choices[0].text == PROMPT + plain.choices[0].text
    pieces = {0: "", 1: ""}
    for ch in client.chat.completions.create(model="llada-tiny", messages=CHAT, max_tokens=16, temperature=0.9,
                                             seed=5, n=2, stream=True):
        for c in ch.choices:
            pieces[c.index] += c.delta.content or ""
    assert [pieces[0], pieces[1]] == out.texts[:2]


def test_health_is_503_and_requests_are_refused_when_the_engine_is_not_running(server):
    model, engine, url = server
    engine.stop(drain=True)
    try:
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        _shaped(_post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}), 503)
    finally:
        engine.start()
    assert httpx.get(f"{url}/health").status_code == 200
    assert _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}).status_code == 200


def test_the_readme_serving_example_answers_correctly(server):
    """The README's curl body, sent as is: the bundled model reverses the list."""
    import pathlib
    import re

    model, engine, url = server
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Serving"):]
    body = json.loads(re.search(r"-d '(\{.*?\})'", section, re.S).group(1))
    r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 200
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == ["Carol Carter", "Brian Baker", "Alice Adams"]


def test_serve_checks_its_port_before_loading_the_model(monkeypatch, capsys):
    import dllm.cli.serve as cli_serve

    def no_loading(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_serve, "load_model_arg", no_loading)
    for port in ("99999", "0", "-1", "65536"):
        refused(capsys, ["serve", "--port", port], pattern="--port.*from 1 to 65535")
    refused(capsys, ["serve", "--max-body-bytes", "0"], "--max-body-bytes must be >= 1")


def test_top_p_is_the_samplers_own_nucleus_cut(server):
    model, engine, url = server
    body = {"messages": CHAT, "max_tokens": 16, "temperature": 0.9, "seed": 3, "sampler": "dream"}
    for top_p in (0.3, 1):
        r = _post(url, "/v1/chat/completions", {**body, "top_p": top_p}).json()
        params = {"temperature": 0.9, **({"top_p": top_p} if top_p < 1 else {})}
        out = dllm.generate(model, [CHAT], gen_length=16, seed=3, sampler=dllm.get_sampler("dream", **params))
        assert r["choices"][0]["message"]["content"] == out.texts[0], top_p


def test_top_p_is_a_logits_transform_for_every_other_sampler(server):
    """A sampler without a nucleus cut of its own gets one in front (``TopP``): the served answer is generate's with
    ``with_top_p(sampler, top_p)``."""
    from dllm.samplers.transforms import with_top_p

    model, engine, url = server
    for name, params in (("llada", {"temperature": 0.9}), ("threshold", {"temperature": 0.9})):
        body = {"messages": CHAT, "max_tokens": 16, "block_length": 8, "seed": 5, "sampler": name, "top_p": 0.4,
                **({"temperature": 0.9} if params else {})}
        r = _post(url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        out = dllm.generate(model, [CHAT], gen_length=16, block_length=8, seed=5,
                            sampler=with_top_p(dllm.get_sampler(name, **params), 0.4))
        assert r.json()["choices"][0]["message"]["content"] == out.texts[0], name
