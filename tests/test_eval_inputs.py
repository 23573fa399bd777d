"""`dllm eval`'s inputs: data records checked field by field, few-shot examples that are never the sample, bad
--timeout values, results files with lines that are not results, and the offline path without --data. Input
errors are refused before the model loads (one `error:` line, exit status 2)."""

import json
import socket
import time
from pathlib import Path

import pytest

from dllm.cli import main as cli_main
from dllm.evals.standard import build_prompts, get_standard_task, load_samples
from tests.cli_helpers import refused

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "tests" / "fixtures" / "eval" / "gsm8k.jsonl"
QUICK = ["--model", "llada-tiny", "--shots", "0", "--gen-length", "8", "--block-length", "8", "--no-progress"]


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model fails the test: what is checked here must be refused before."""
    import dllm.models

    def load_model(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(dllm.models, "load_model", load_model)


def _jsonl(path: Path, *rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {
    "gsm8k": {"question": "q?", "answer": "1 + 1 = 2\n#### 2"},
    "math": {"problem": "p?", "solution": "so $\\boxed{5}$"},
    "mbpp": {"task_id": 11, "text": "Write f.", "code": "def f():\n    return 1", "test_list": ["assert f() == 1"]},
    "humaneval": {"task_id": "H/0", "prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n",
                  "entry_point": "f"},
}


@pytest.mark.parametrize("task,field,value,expected", [
    ("gsm8k", "answer", 5, "must be a string"),
    ("gsm8k", "question", None, "must be a string"),
    ("gsm8k", "id", [1], "must be a string or an integer"),
    ("math", "solution", 5, "must be a string"),
    ("math", "answer", [5], "must be a string or a number"),
    ("mbpp", "test_list", None, "non-empty list of strings"),
    ("mbpp", "test_list", [1, 2], "non-empty list of strings"),
    ("mbpp", "test_list", "assert f() == 1", "non-empty list of strings"),
    ("mbpp", "test_list", [], "non-empty list of strings"),
    ("mbpp", "test_setup_code", 3, "a string of Python code or null"),
    ("humaneval", "prompt", 5, "non-empty string of Python code"),
    ("humaneval", "test", "", "defines check(candidate)"),
    ("humaneval", "entry_point", "f g", "a Python identifier"),
])
def test_field_types_are_checked_before_the_model_loads(task, field, value, expected, tmp_path, capsys, no_model):
    data = _jsonl(tmp_path / "data.jsonl", GOOD[task], {**GOOD[task], "task_id": 12, field: value})
    line = refused(capsys, ["eval", task, "--data", str(data), *QUICK, "--out", str(tmp_path / "out")],
                   f"{data}: record 2 (line 2): field {field!r}", expected, "correct the record")
    assert "Traceback" not in line


def test_well_formed_records_of_every_task_load(tmp_path):
    for name, row in GOOD.items():
        samples, _ = load_samples(get_standard_task(name), str(_jsonl(tmp_path / f"{name}.jsonl", row)))
        assert len(samples) == 1 and samples[0].row == row


def test_a_reference_error_names_the_file_and_record(tmp_path):
    data = _jsonl(tmp_path / "g.jsonl", GOOD["gsm8k"], {"question": "q", "answer": "five"})
    with pytest.raises(ValueError, match=r"g.jsonl: record 2 \(line 2\): GSM8K answer field has no '####'"):
        load_samples(get_standard_task("gsm8k"), str(data))


def _examples(conversation: list[dict]) -> list[str]:
    return [m["content"].split("\n")[0] for m in conversation[:-1] if m["role"] == "user"]


def test_a_sample_is_never_its_own_example_across_files(tmp_path):
    # neither file has ids; the last test question is also the first row of the few-shot file
    test = [{"question": f"test question {i}", "answer": f"#### {i}"} for i in range(4)]
    train = [dict(test[3])] + [{"question": f"train question {i}", "answer": f"#### {100 + i}"} for i in range(1, 5)]
    task = get_standard_task("gsm8k")
    samples, pool = load_samples(task, str(_jsonl(tmp_path / "test.jsonl", *test)),
                                 str(_jsonl(tmp_path / "train.jsonl", *train)), shots=2)
    convs = build_prompts(task, samples, pool, 2)
    # sample 0 keeps the pool's first rows (another line 0 is no reason to skip one)
    assert _examples(convs[0]) == ["Question: test question 3", "Question: train question 1"]
    # sample 3 does not get itself as an example
    assert _examples(convs[3]) == ["Question: train question 1", "Question: train question 2"]


def test_explicit_ids_still_exclude_the_sample(tmp_path):
    task = get_standard_task("gsm8k")
    rows = [{"id": f"r{i}", "question": f"question {i}", "answer": f"#### {i}"} for i in range(3)]
    pool_rows = [{**rows[0], "question": "question 0, worded again"}, rows[1], rows[2]]
    samples, pool = load_samples(task, str(_jsonl(tmp_path / "t.jsonl", *rows)),
                                 str(_jsonl(tmp_path / "p.jsonl", *pool_rows)), shots=1)
    assert _examples(build_prompts(task, samples, pool, 1)[0]) == ["Question: question 1"]  # r0 is r0
    with pytest.raises(ValueError, match="the few-shot pool has 2 besides the sample"):
        build_prompts(task, samples, pool, 3)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0"])
def test_timeout_must_be_finite_and_positive(value, tmp_path, capsys, no_model):
    refused(capsys, ["eval", "mbpp", "--data", str(REPO / "tests" / "fixtures" / "eval" / "mbpp.jsonl"), *QUICK,
                     f"--timeout={value}", "--out", str(tmp_path)], "--timeout must be > 0 and finite")


@pytest.mark.parametrize("case,content", [
    ("not-utf8", b'{"question": "caf\xe9", "answer": "#### 1"}\n'),
    ("not-gzip", b'{"question": "q", "answer": "#### 1"}\n'),
])
def test_undecodable_data_files_are_named(case, content, tmp_path, capsys, no_model):
    data = tmp_path / ("data.jsonl.gz" if case == "not-gzip" else "data.jsonl")
    data.write_bytes(content)
    refused(capsys, ["eval", "gsm8k", "--data", str(data), *QUICK, "--out", str(tmp_path / "out")], str(data),
            "UTF-8" if case == "not-utf8" else "gzip")


def test_results_lines_that_are_not_results_are_skipped_on_resume(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["eval", "gsm8k", "--data", str(GSM8K), "--limit", "1", *QUICK, "--out", str(out)]
    assert cli_main(args) == 0
    good = (out / "samples.jsonl").read_text()
    (out / "samples.jsonl").write_text('[1, 2]\n"hello"\n{"foo": 1}\n' + good)
    capsys.readouterr()
    assert cli_main(args) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "0 samples scored, 1 already in" in err
    assert (out / "samples.jsonl").read_text() == good  # the stray lines are dropped when the file is rewritten


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """A machine where the Hub cannot be reached (a closed local port), offline mode off, an empty cache."""
    datasets = pytest.importorskip("datasets")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    cache = tmp_path / "datasets-cache"
    cache.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return datasets, cache


def test_without_data_offline_fails_fast_naming_the_fixes(no_hub, tmp_path, capsys, monkeypatch, no_model):
    datasets, _ = no_hub
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a) or [])  # not reached
    t0 = time.monotonic()
    refused(capsys, ["eval", "mbpp", *QUICK, "--out", str(tmp_path / "out")], "cannot be reached",
            "pass --data PATH", "HF_HUB_OFFLINE=1", "127.0.0.1")
    assert time.monotonic() - t0 < 10 and calls == []


def test_the_hub_probe_goes_through_the_environments_proxy(no_hub, monkeypatch):
    """Behind a proxy named only by ALL_PROXY (which the Hub client honours), the Hub is reachable: the probe does
    not refuse the run, and `datasets` is asked."""
    import http.server
    import socketserver
    import threading

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    datasets, _ = no_hub
    with socketserver.TCPServer(("127.0.0.1", 0), Proxy) as proxy:
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        monkeypatch.setenv("ALL_PROXY", f"http://127.0.0.1:{proxy.server_address[1]}")
        monkeypatch.setenv("HF_ENDPOINT", "http://hub.internal.invalid")  # resolvable only by the proxy
        rows = [{"question": "q?", "answer": "#### 3"}]
        monkeypatch.setattr(datasets, "load_dataset", lambda path, cfg, split: rows)
        try:
            samples, _ = load_samples(get_standard_task("gsm8k"), None)
        finally:
            proxy.shutdown()
    assert [s.reference for s in samples] == ["3"]


def test_without_data_a_cached_dataset_is_still_loaded(no_hub, monkeypatch):
    # the dataset prepared in the `datasets` cache: no probe stops the run; `datasets` loads it from there
    datasets, cache = no_hub
    (cache / "openai___gsm8k" / "main" / "0.0.0" / "0123abcd").mkdir(parents=True)
    rows = [{"question": "q?", "answer": "#### 3"}]
    monkeypatch.setattr(datasets, "load_dataset", lambda path, cfg, split: rows if path == "openai/gsm8k" else [])
    samples, _ = load_samples(get_standard_task("gsm8k"), None)
    assert [s.reference for s in samples] == ["3"]
    from huggingface_hub import constants

    seen = []
    monkeypatch.setattr(datasets, "load_dataset", lambda path, cfg, split: seen.append(
        (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)) or rows)
    load_samples(get_standard_task("gsm8k"), None)
    assert seen == [(True, True)]  # the Hub is unreachable: `datasets` reads its cache in offline mode
    assert (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == (False, False)  # and only then


def _cache_as_the_hub_would(datasets, cache: Path, tmp_path: Path, rows: list[dict]) -> None:
    """A prepared GSM8K in the `datasets` cache, laid out as loading it from the Hub leaves it (built from a local
    JSONL by `datasets`' own json builder, then moved and named as the Hub's ``openai/gsm8k``, config ``main``)."""
    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build = tmp_path / "build"
    datasets.load_dataset_builder("json", data_files={s: str(src / f"{s}.jsonl") for s in ("train", "test")},
                                  cache_dir=str(build)).download_and_prepare()
    (prepared,) = [p for p in build.glob("json/*/*/*") if p.is_dir()]
    dest = cache / "openai___gsm8k" / "main" / "0.0.0" / prepared.name
    dest.parent.mkdir(parents=True)
    prepared.rename(dest)
    for split in ("train", "test"):
        (dest / f"json-{split}.arrow").rename(dest / f"gsm8k-{split}.arrow")
    info = json.loads((dest / "dataset_info.json").read_text())
    (dest / "dataset_info.json").write_text(json.dumps({**info, "config_name": "main", "dataset_name": "gsm8k",
                                                        "builder_name": "gsm8k"}))


def test_a_cached_dataset_loads_at_once_with_the_hub_unreachable(no_hub, tmp_path):
    """HF_HUB_OFFLINE unset, the Hub unreachable, the dataset in the cache: the real `datasets` reads it without
    spending its retries on the Hub (tens of seconds before, with the Hub's name unresolvable)."""
    datasets, cache = no_hub
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(3)]
    _cache_as_the_hub_would(datasets, cache, tmp_path, rows)
    t0 = time.monotonic()
    samples, _ = load_samples(get_standard_task("gsm8k"), None)
    assert [s.reference for s in samples] == ["1", "2", "3"]
    assert time.monotonic() - t0 < 10


def test_the_hub_is_asked_once_for_the_samples_and_the_few_shot_pool(no_hub, tmp_path, monkeypatch):
    """Test split and few-shot pool from the same cache, the Hub unreachable: one reachability check, not one per
    split (each may take seconds)."""
    import dllm.evals.standard.tasks as tasks_module

    datasets, cache = no_hub
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(3)]
    _cache_as_the_hub_would(datasets, cache, tmp_path, rows)
    probes = []
    real = tasks_module._hub_unreachable
    monkeypatch.setattr(tasks_module, "_hub_unreachable", lambda endpoint: probes.append(endpoint) or real(endpoint))
    samples, pool = load_samples(get_standard_task("gsm8k"), None, shots=2)
    assert [s.reference for s in samples] == [s.reference for s in pool] == ["1", "2", "3"]
    assert len(probes) == 1
