"""Ray Serve: two CPU replicas of the OpenAI-compatible server on a local Ray instance (loopback only),
driven by the official ``openai`` client: requests spread over both replicas and every answer equals
``dllm.generate`` of the request alone."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from serve_helpers import free_port  # noqa: E402

import dllm  # noqa: E402

PROMPTS = ['Please copy the list exactly: ["Ann Lee", "Bob Stone"]',
           'Please reverse the order of the list: ["Carol Carter", "David Dixon", "Emma Ellis"]',
           "What is 12 + 30?", 'Remove a random person: ["Ann Lee", "Bob Stone", "Frank Fisher"]']


@pytest.fixture(scope="module")
def ray_server():
    from ray import serve

    from dllm.serve.ray_serve import app_builder

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = app_builder({"model": "llada-tiny", "dtype": "float32", "num_replicas": "2", "num_cpus": "1",
                           "max_rows": "4", "sampler": "threshold", "param.tau": "0.5"})
        serve.run(app, name="dllm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow  # a Ray cluster and two replicas take about 40 s to start
def test_two_replicas_answer_exactly_and_both_serve(ray_server):
    status = __import__("ray").serve.status().applications["dllm"].deployments["dllm"]
    assert status.replica_states.get("RUNNING") == 2
    pids = {json.load(urllib.request.urlopen(f"{ray_server}/replica"))["pid"] for _ in range(24)}
    assert len(pids) == 2  # the proxy routes to both replicas

    client = openai.OpenAI(base_url=f"{ray_server}/v1", api_key="unused", max_retries=0)
    settings = [(p, None, {}) for p in PROMPTS] + [(p, "llada", {}) for p in PROMPTS[:2]] + \
               [(PROMPTS[2], "threshold", {"tau": 0.9}), (PROMPTS[3], "llada", {"temperature": 0.8})]

    def ask(item):
        prompt, sampler, params = item
        extra = {"block_length": 8, **({"sampler": sampler, "params": params} if sampler else {})}
        return client.chat.completions.create(model="llada-tiny", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=16, extra_body=extra)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, settings))
    assert len({a.id for a in answers}) == len(settings)  # nothing duplicated or crossed

    model = dllm.load_model("llada-tiny", dtype="float32")
    for (prompt, sampler, params), r in zip(settings, answers):
        # a request naming no sampler runs the deployment's default: threshold with tau=0.5
        s = dllm.get_sampler(sampler or "threshold", **(params if sampler else {"tau": 0.5}))
        out = dllm.generate(model, [[{"role": "user", "content": prompt}]], sampler=s, gen_length=16,
                            block_length=8, cache="none")
        assert r.choices[0].message.content == out.texts[0]
        assert r.usage.nfe == out.stats.row_nfe[0]
    assert len({a.choices[0].message.content for a in answers}) > 3


def test_app_builder_reads_ray_cli_arguments():
    from dllm.serve.ray_serve import app_builder

    with pytest.raises(ValueError, match="num_replicas=0"):
        app_builder({"num_replicas": "0"})
