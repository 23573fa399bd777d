"""Log-probabilities of diffusion-decoded tokens: each token's log-probability under the distribution (full-vocabulary
softmax) of the step that committed it, and that step's top k there. Recorded by the decode loop
(``record_confidence``, ``record_top_logprobs``), served by the engine and the OpenAI endpoints with the same
values as ``dllm.generate`` of the request alone, whatever else runs (float32, bundled tiny models)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import dllm
from dllm.serve import Engine, RequestError

PROMPTS = [
    'Please copy the list exactly: ["Ann Lee", "Bob Stone"]',
    'Reverse the list: ["Kevin Irving", "Ann Lee", "Paula Parker", "Julia Graham"]',
    "What is 12 + 30?",
    'Sort the list by last name: ["Wendy Harper", "Frank Dawson", "Martin Gordon"]',
]
CHAT = [{"role": "user", "content": PROMPTS[0]}]


@pytest.fixture(scope="module")
def llada():
    return dllm.load_model("llada-tiny", dtype="float32")


def offline(model, prompt, k, sampler=None, params=None, cache="none", **kw):
    """``dllm.generate`` of the request alone with the record on: (tokens, commit_logprob, top-k pairs)."""
    s = dllm.get_sampler(sampler, **(params or {})) if sampler else None
    out = dllm.generate(model, [prompt], sampler=s, cache=cache, record_confidence=True, record_top_logprobs=k,
                        **kw)
    st = out.stats
    lps = st.commit_logprob[0]
    tops = [list(zip(i, v)) for i, v in zip(st.commit_top_ids[0], st.commit_top_logprobs[0])] if k else \
        [[] for _ in lps]
    return out.sequences[0].tolist(), lps, tops


# ------------------------------------------------------------------------------------------ the record
@pytest.mark.parametrize("sampler,cache", [("llada", "none"), ("fast-dllm", "dual")])
def test_the_record_is_the_committing_steps_distribution_and_changes_nothing_else(llada, sampler, cache):
    kw = dict(gen_length=32, block_length=8, steps=32, cache=cache, seed=3, chat_template=False,
              sampler=dllm.get_sampler(sampler, temperature=1.0))
    plain = dllm.generate(llada, PROMPTS, **kw)
    conf = dllm.generate(llada, PROMPTS, record_confidence=True, **kw)
    both = dllm.generate(llada, PROMPTS, record_confidence=True, record_top_logprobs=5, **kw)
    assert torch.equal(plain.sequences, both.sequences) and torch.equal(plain.sequences, conf.sequences)
    assert plain.stats.commit_step == both.stats.commit_step
    assert conf.stats.commit_conf == both.stats.commit_conf  # the top-k record leaves the confidence bit-identical
    assert plain.stats.commit_top_ids == [] and conf.stats.commit_top_ids == []
    not_argmax = 0
    for b in range(len(PROMPTS)):
        for j, tok in enumerate(both.sequences[b].tolist()):
            ids, tops = both.stats.commit_top_ids[b][j], both.stats.commit_top_logprobs[b][j]
            if both.stats.commit_step[b][j] < 0 or math.isnan(both.stats.commit_conf[b][j]):
                continue
            lp = math.log(both.stats.commit_conf[b][j])
            assert lp <= 0 and all(t <= 0 for t in tops)
            assert tops == sorted(tops, reverse=True) and len(set(ids)) == 5
            assert sum(math.exp(t) for t in tops) <= 1 + 1e-5
            assert tops[0] >= lp - 1e-5  # the step's most probable token is at least as probable as the one taken
            if tok in ids:  # the same number, recorded twice
                assert tops[ids.index(tok)] == pytest.approx(lp, abs=1e-5)
            else:
                assert lp <= tops[-1] + 1e-5
            if tok != ids[0]:
                not_argmax += 1
                assert tops[0] >= lp - 1e-6
    assert not_argmax > 0  # sampling at temperature 1 takes tokens that are not the argmax


class _Spread(torch.nn.Module):
    """A model whose distribution puts all but ``e**-200`` of its mass on token 0: every other token's probability
    underflows to 0 in float32 (its log-probability, -200 and a little, does not)."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(()))  # where the adapter reads the device

    def forward(self, input_ids, attention_mask=None):
        logits = torch.full((*input_ids.shape, 16), -200.0)
        logits[..., 0] = 0.0
        return logits


def test_a_probability_that_underflows_keeps_its_log_probability():
    from dllm.models.hf import HFModel

    model = HFModel(_Spread(), mask_id=15, eos_id=14, pad_id=13)
    kw = dict(gen_length=8, steps=8, seed=1)
    hot = dllm.get_sampler("llada", temperature=100.0)  # Gumbel noise wide enough to take the unlikely tokens
    out = dllm.generate(model, [[1, 2, 4]], sampler=hot, record_confidence=True, **kw)
    tokens, conf, lps = out.sequences[0].tolist(), out.stats.commit_conf[0], out.stats.commit_logprob[0]
    assert any(t != 0 for t in tokens)
    for t, p, lp in zip(tokens, conf, lps):
        assert (p, lp) == ((1.0, 0.0) if t == 0 else (0.0, -200.0))  # the probability underflows, its log does not
    eng = Engine(model, max_rows=2)
    h = eng.submit([1, 2, 4], logprobs=0, sampler="llada", params={"temperature": 100.0}, **kw)
    eng.run_until_idle()
    r = h.result(timeout=0)
    assert r.tokens == tokens and r.logprobs == lps  # served as recorded, not -inf


def test_record_top_logprobs_is_checked():
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ValueError, match="record_top_logprobs"):
            dllm.GenerateConfig(record_top_logprobs=bad)


# ------------------------------------------------------------------------------------------ the engine
def test_served_logprobs_equal_the_offline_record_alone_and_with_requests_joining(llada):
    settings = [  # (prompt, k, sampler, params, gen_length, block_length, seed, cache)
        (PROMPTS[0], 3, "llada", {"temperature": 0.9}, 32, 8, 1, "none"),
        (PROMPTS[1], 0, "llada", {}, 32, 8, 0, "none"),
        (PROMPTS[2], 5, "llada", {"temperature": 0.9}, 32, 8, 1, "none"),
        (PROMPTS[3], 3, "llada", {"temperature": 0.9}, 32, 8, 1, "none"),
        (PROMPTS[1], 2, "fast-dllm", {}, 32, 8, 0, "dual"),
        (PROMPTS[3], 2, "fast-dllm", {}, 32, 8, 0, "dual"),
    ]
    # alone
    eng = Engine(llada, max_rows=4)
    p, k, s, params, G, B, seed, cache = settings[0]
    h = eng.submit(p, gen_length=G, block_length=B, sampler=s, params=params, seed=seed, cache=cache, logprobs=k)
    eng.run_until_idle()
    want = offline(llada, p, k, s, params, cache, gen_length=G, block_length=B, seed=seed)
    r = h.result(timeout=0)
    assert (r.tokens, r.logprobs, r.top_logprobs) == want
    assert all(len(t) == k for t in r.top_logprobs)
    # under load: the same settings as above and requests without logprobs, joining running batches mid-decode
    eng = Engine(llada, max_rows=3)
    reqs = []
    for wave in range(2):
        for n, (p, k, s, params, G, B, seed, cache) in enumerate(settings):
            h = eng.submit(p, gen_length=G, block_length=B, sampler=s, params=params, seed=seed, cache=cache,
                           logprobs=k)
            plain = eng.submit(PROMPTS[(n + wave) % len(PROMPTS)], gen_length=G, block_length=B, sampler=s,
                               params=params, seed=seed, cache=cache)
            reqs.append((h, plain, settings[n], PROMPTS[(n + wave) % len(PROMPTS)]))
            eng.step()
            eng.step()
    assert eng.stats()["joins"] > 0
    eng.run_until_idle()
    for h, plain, (p, k, s, params, G, B, seed, cache), plain_prompt in reqs:
        r = h.result(timeout=0)
        tokens, lps, tops = offline(llada, p, k, s, params, cache, gen_length=G, block_length=B, seed=seed)
        # the tokens are identical; the numbers up to float32 rounding: in a batch the row's forward runs at
        # another (padded) width and batch size, where float32 reductions may round differently
        assert r.tokens == tokens, (p, s, k)
        assert r.logprobs == pytest.approx(lps, abs=2e-5, rel=2e-5), (p, s, k)
        assert [[a for a, _ in t] for t in r.top_logprobs] == [[a for a, _ in t] for t in tops]
        assert [v for t in r.top_logprobs for _, v in t] == pytest.approx([v for t in tops for _, v in t],
                                                                           abs=2e-5, rel=2e-5)
        pr = plain.result(timeout=0)
        assert pr.logprobs is None and pr.top_logprobs is None
        assert pr.tokens == offline(llada, plain_prompt, 0, s, params, cache, gen_length=G, block_length=B,
                                    seed=seed)[0]


def test_streamed_logprobs_come_with_the_ids_they_describe(llada):
    eng = Engine(llada, max_rows=2)
    h = eng.submit(PROMPTS[0], gen_length=32, block_length=8, logprobs=2, sampler="llada",
                   params={"temperature": 0.9}, seed=4)
    eng.run_until_idle()
    events = list(h.events())
    ids = [v for kind, v in events if kind == "ids"]
    entries = [v for kind, v in events if kind == "logprobs"]
    assert [len(e) for e in entries] == [len(i) for i in ids] and len(ids) > 1
    kinds = [kind for kind, _ in events]
    assert all(kinds[j + 1] == "ids" for j, kind in enumerate(kinds) if kind == "logprobs")  # each right before its ids
    r = h.result(timeout=0)
    assert sum(ids, []) == r.tokens
    assert [lp for e in entries for lp, _ in e] == r.logprobs
    assert [top for e in entries for _, top in e] == r.top_logprobs


def test_engine_refuses_a_bad_logprobs(llada):
    eng = Engine(llada)
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(RequestError, match="logprobs") as exc:
            eng.submit(PROMPTS[0], gen_length=8, logprobs=bad)
        assert exc.value.param == "logprobs"


# ------------------------------------------------------------------------------------------ HTTP
fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def server(llada):
    from serve_helpers import running_server

    from dllm.serve.server import create_app

    engine = Engine(llada, max_rows=4, max_queue=32)
    engine.start()
    with running_server(create_app(engine, "llada-tiny")) as url:
        yield llada, engine, url
    engine.stop(drain=False)


def _post(url, path, body):
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url, path, body):
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return [c for ev in chunks for c in ev["choices"]]


def _answer(model, tokens, lps, tops, n):
    """The first ``n`` (answer) tokens' entries as the server words them."""
    tok = model.tokenizer
    return [(tok.decode([t]), lp, [(tok.decode([a]), alp) for a, alp in top])
            for t, lp, top in zip(tokens[:n], lps[:n], tops[:n])]


def test_completions_logprobs_shape_and_values(server):
    model, engine, url = server
    body = {"prompt": PROMPTS[0], "max_tokens": 32, "logprobs": 3, "sampler": "llada", "temperature": 0.9,
            "seed": 7, "block_length": 8}
    out = _post(url, "/v1/completions", body)
    c = out["choices"][0]
    lp = c["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n = out["usage"]["completion_tokens"]
    assert n > 0 and len(lp["tokens"]) == n
    tokens, lps, tops = offline(model, PROMPTS[0], 3, "llada", {"temperature": 0.9}, gen_length=32,
                                block_length=8, seed=7, chat_template=False)
    want = _answer(model, tokens, lps, tops, n)
    assert lp["tokens"] == [w[0] for w in want]
    assert lp["token_logprobs"] == [w[1] for w in want]
    assert lp["top_logprobs"] == [dict(w[2]) for w in want]
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert lp["text_offset"][0] == 0
    assert [b - a for a, b in zip(lp["text_offset"], lp["text_offset"][1:])] == [len(t) for t in lp["tokens"][:-1]]
    # streamed: the chunks' entries add up to the same, each chunk carrying those of the text it sends
    streamed = _stream(url, "/v1/completions", body)
    got = [c["logprobs"] for c in streamed if c["logprobs"]]
    assert sum((g["tokens"] for g in got), []) == lp["tokens"]
    assert sum((g["token_logprobs"] for g in got), []) == lp["token_logprobs"]
    assert sum((g["top_logprobs"] for g in got), []) == lp["top_logprobs"]
    assert sum((g["text_offset"] for g in got), []) == lp["text_offset"]
    assert all(c["text"] for c in streamed if c["logprobs"])
    # left out: null, as before
    assert _post(url, "/v1/completions", {**body, "logprobs": None})["choices"][0]["logprobs"] is None


def test_chat_logprobs_shape_values_and_streaming(server):
    model, engine, url = server
    body = {"messages": CHAT, "max_tokens": 32, "logprobs": True, "top_logprobs": 2, "sampler": "llada",
            "temperature": 0.9, "seed": 5, "block_length": 8}
    out = _post(url, "/v1/chat/completions", body)
    content = out["choices"][0]["logprobs"]["content"]
    n = out["usage"]["completion_tokens"]
    assert len(content) == n > 0
    tokens, lps, tops = offline(model, CHAT, 2, "llada", {"temperature": 0.9}, gen_length=32, block_length=8,
                                seed=5)
    want = _answer(model, tokens, lps, tops, n)
    for e, (t, lp, top) in zip(content, want):
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert (e["token"], e["logprob"], e["bytes"]) == (t, lp, list(t.encode("utf-8")))
        assert [(a["token"], a["logprob"]) for a in e["top_logprobs"]] == top
        assert all(a["bytes"] == list(a["token"].encode("utf-8")) for a in e["top_logprobs"])
        assert e["logprob"] <= 0
        if e["token"] != e["top_logprobs"][0]["token"]:
            assert e["top_logprobs"][0]["logprob"] >= e["logprob"]
    streamed = _stream(url, "/v1/chat/completions", body)
    got = sum((c["logprobs"]["content"] for c in streamed if c.get("logprobs")), [])
    assert got == content
    for c in streamed:  # a chunk's entries are those of the text it sends
        if c.get("logprobs"):
            assert c["delta"].get("content")
    # logprobs without top_logprobs: the entries with no alternatives
    plain = _post(url, "/v1/chat/completions", {**body, "top_logprobs": None})["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in plain] == [(e["token"], e["logprob"]) for e in content]
    assert all(e["top_logprobs"] == [] for e in plain)
    assert _post(url, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": 0}
                 )["choices"][0]["logprobs"] is None


def test_a_stop_string_cuts_the_logprobs_with_the_text(server):
    model, engine, url = server
    body = {"messages": CHAT, "max_tokens": 32, "logprobs": True, "block_length": 8}
    full = _post(url, "/v1/chat/completions", body)
    text = full["choices"][0]["message"]["content"]
    assert len(text) > 6
    stop = text[4:7]
    cut = _post(url, "/v1/chat/completions", {**body, "stop": stop})
    content = cut["choices"][0]["logprobs"]["content"]
    assert len(content) == cut["usage"]["completion_tokens"] < len(full["choices"][0]["logprobs"]["content"])
    assert content == full["choices"][0]["logprobs"]["content"][:len(content)]
    streamed = _stream(url, "/v1/chat/completions", {**body, "stop": stop})
    assert sum((c["logprobs"]["content"] for c in streamed if c.get("logprobs")), []) == content


def test_the_openai_client_reads_them(server):
    openai = pytest.importorskip("openai")
    model, engine, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    chat = client.chat.completions.create(model="llada-tiny", messages=CHAT, max_tokens=16, logprobs=True,
                                          top_logprobs=2)
    raw = _post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 16, "logprobs": True, "top_logprobs": 2})
    content = chat.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in content] == [(e["token"], e["logprob"]) for e in
                                                       raw["choices"][0]["logprobs"]["content"]]
    assert all(len(e.top_logprobs) == 2 for e in content)
    comp = client.completions.create(model="llada-tiny", prompt=PROMPTS[0], max_tokens=16, logprobs=2)
    assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens
