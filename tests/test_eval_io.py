"""The content-keyed JSONL result store (dllm/evals/io.py) on its own: torn lines, stale keys, pinned settings."""

import gzip

import pytest

from dllm.evals.io import (
    ConfigChanged,
    JsonlStore,
    check_pinned,
    content_key,
    pinned_state,
    read_jsonl,
    read_lines,
    read_run_file,
)


def test_content_key_is_stable_and_order_free():
    assert content_key({"a": 1, "b": [1, 2]}, "x") == content_key({"b": [1, 2], "a": 1}, "x")
    assert content_key({"a": 1}) != content_key({"a": 2})
    assert content_key((1, 2)) == content_key([1, 2])


def test_store_appends_flushed_lines_and_splits_current_from_stale(tmp_path):
    store = JsonlStore(tmp_path, ident=lambda r: r["id"])
    with store.append(store.shard(0)) as f:
        f.write({"id": "a", "key": "k1"})
        f.write({"id": "b", "key": "old"})
        assert len(read_lines(store.shard(0))) == 2  # on disk before the writer closes
    with store.append(store.shard(1)) as f:
        f.write({"id": "b", "key": "k2"})
        f.write({"id": "z", "key": "kz"})  # a result this run does not ask about
    store.shard(1).write_text(store.shard(1).read_text() + '{"id": "c", "ke')  # a kill mid-write
    done, others, stale = store.current({"a": "k1", "b": "k2", "c": "k3"})
    assert set(done) == {"a", "b"} and done["b"]["key"] == "k2" and others == [{"id": "z", "key": "kz"}]
    assert stale == 1  # b's old line
    with store.append(store.shard(1)) as f:  # the torn line is cut before appending
        f.write({"id": "c", "key": "k3"})
    assert [r["id"] for r in read_lines(store.shard(1))] == ["b", "z", "c"]
    store.rewrite([*done.values(), *others])
    assert [r["id"] for r in read_lines(store.path)] == ["a", "b", "z"]
    store.clear()
    assert not store.path.exists() and not store.shards()


def test_read_lines_strict_names_the_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: not valid JSON"):
        read_lines(p, strict=True)
    assert read_lines(p) == [{"a": 1}]


def test_check_pinned_names_each_changed_value_and_the_fix():
    check_pinned({"a": 1, "d": {"x": 1}}, {"a": 1, "d": {"x": 1}}, "out")
    with pytest.raises(ConfigChanged) as e:
        check_pinned({"a": 1, "d": {"x": 1, "y": 2}}, {"a": 1, "d": {"x": 3, "y": 2}, "n": None}, "runs/x")
    msg = str(e.value)
    assert "d.x: 1 there, 3 now" in msg and "--overwrite" in msg and "another --out" in msg
    assert msg.count(" there, ") == 1  # d.y is unchanged; a new key that is None equals a missing one


def test_run_file_read_and_pinned_state(tmp_path):
    run = tmp_path / "run.json"
    assert read_run_file(run) is None and pinned_state(None, {"a": 1}, tmp_path, overwrite=False) is None
    run.write_text('{"a": 1}')
    old = read_run_file(run)
    assert pinned_state(old, {"a": 1}, tmp_path, overwrite=False) == "resume"
    assert pinned_state(old, {"a": 2}, tmp_path, overwrite=True) == "discard"
    with pytest.raises(ConfigChanged, match="a: 1 there, 2 now"):
        pinned_state(old, {"a": 2}, tmp_path, overwrite=False)
    run.write_text("{not json")
    with pytest.raises(ValueError, match=r"run.json is not valid JSON"):
        read_run_file(run)
    run.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"run.json holds no settings object"):
        read_run_file(run)


def test_store_skips_lines_that_are_not_results(tmp_path, caplog):
    # JSON, but not an object with an id: skipped with a warning naming the file and line, like a malformed line
    store = JsonlStore(tmp_path, ident=lambda r: str(r["id"]))
    store.path.write_bytes(b'[1, 2]\n"hello"\n{"foo": 1}\n{"id": "a", "key": "k"}\nnot json\n\xff\n')
    with caplog.at_level("WARNING", logger="dllm.evals.io"):
        assert store.read() == [{"id": "a", "key": "k"}]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 5 and all("samples.jsonl:" in w and "skipping" in w for w in warned)
    assert any(":3: skipping a line that is not a result" in w for w in warned)
    with pytest.raises(ValueError, match=r"samples.jsonl:1: a JSON list, not an object"):
        read_lines(store.path, strict=True)


def test_read_jsonl_names_the_file_when_it_is_not_utf8_or_not_gzip(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"q": "a"}\n{"q": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl:2: not UTF-8 text .*must be UTF-8 JSONL.*convert it"):
        read_jsonl(latin)
    fake = tmp_path / "plain.jsonl.gz"
    fake.write_text('{"q": "a"}\n')
    with pytest.raises(ValueError, match=r"plain.jsonl.gz: a name ending in .gz must be a gzip-compressed .*rename it"):
        read_jsonl(fake)
    torn = tmp_path / "torn.jsonl.gz"
    torn.write_bytes(gzip.compress(b'{"q": "a"}\n' * 100)[:40])
    with pytest.raises(ValueError, match=r"torn.jsonl.gz: .*could not be decompressed"):
        read_jsonl(torn)
    good = tmp_path / "good.jsonl.gz"
    good.write_bytes(gzip.compress('\ufeff{"q": "é"}\n\n{"q": "b"}\n'.encode()))
    assert read_jsonl(good) == [{"q": "é"}, {"q": "b"}]
