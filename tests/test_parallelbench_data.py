"""Data the ParallelBench suite reads - a ``--data-dir`` (task files and ``task_config.yaml``), ``--samsum`` files,
``score``'s predictions, a sweep's stored samples - is checked when it is read: bad input is one ``error:`` line
naming the file, the line and the field, raised before the model loads. The commands run on a copy of the bundled
model whose weights are corrupt, so a check that ran only after loading would show the weights error instead."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import refused

from dllm.assets import model_path
from dllm.cli import main
from dllm.evals import parallelbench as PB

WEIGHTS_ERROR = "not a readable safetensors file"
TASK = "waiting_line/copy"


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("model") / "corrupt-llada"
    shutil.copytree(model_path("llada-tiny"), d)
    (d / "model.safetensors").write_bytes(b"garbage, not safetensors")
    return str(d)


@pytest.fixture
def data(tmp_path) -> Path:
    """A data directory of four waiting_line/copy records in the short style (and its task_config.yaml)."""
    d = tmp_path / "data"
    PB.write_suite(d, TASK, n=4, style="short")
    return d


def _run(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    return ["parallelbench", "run", "--model", model, "--no-report", "--method", "topk:k=4", "--style", "short",
            "--tasks", TASK, "--data-dir", str(data), "--out", str(out), *extra]


def _append(path: Path, *lines: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def test_the_data_dir_is_fine_until_the_model_loads(capsys, corrupt, data, tmp_path):
    """The fixture's data passes every check: the run gets as far as loading, which fails on the weights."""
    assert main(_run(corrupt, data, tmp_path / "out")) == 2
    assert WEIGHTS_ERROR in capsys.readouterr().err


@pytest.mark.parametrize("budget", [[], ["--gen-length", "32"]])  # the records are read whatever the budget
@pytest.mark.parametrize("line,needles", [
    ('{"answer": "x"}', ["no 'input' field", "each record needs 'input'"]),
    ('{"input": {"context": "[\\"A B\\"]"}}', ["no 'answer' field"]),
    ('{"input": {"foo": 1}, "answer": "[]"}', ["input has no field 'context'", "which the prompt of waiting_line/copy",
                                               "task_config.yaml", "add it to the record (its fields: foo)"]),
    ('{"input": {"context": "[\\"A B\\"]"}, "answer": 5}', ["'answer' must be the reference string", "got int 5"]),
    ('{"input": {"context": "[]", "icl_examples": [{"input": {"context": "[]"}, "answer": 7}]}, "answer": "[]"}',
     ["input.icl_examples[0]: 'answer' must be the reference string"]),
    ('{"input": {"context": "[]", "icl_examples": [{"input": {}, "answer": "[]"}]}, "answer": "[]"}',
     ["input.icl_examples[0].input has no field 'context'"]),
    ('{"input": {"context": "[]"}, "answer": "[]", "metadata": [3]}', ["'metadata' must be an object"]),
])
def test_a_bad_record_is_named_by_file_line_and_field(capsys, corrupt, data, tmp_path, line, needles, budget):
    path = data / f"{TASK}.jsonl"
    _append(path, "", line)  # after a blank line: the record is on line 6
    out = tmp_path / "out"
    refused(capsys, _run(corrupt, data, out, *budget), f"{path}:6: ", *needles)
    assert not out.exists()


def test_an_invalid_task_config_names_the_file(capsys, corrupt, data, tmp_path):
    conf = data / "waiting_line" / "task_config.yaml"
    conf.write_text(": : bad [\n", encoding="utf-8")
    refused(capsys, _run(corrupt, data, tmp_path / "out"), f"{conf}: not valid YAML", "at line 1, column 1",
            "fix it, or remove it to use the built-in prompts")
    conf.write_text(json.dumps({TASK: "a string"}), encoding="utf-8")
    refused(capsys, _run(corrupt, data, tmp_path / "out"), f"{conf}: the entry of {TASK} must be a mapping")


@pytest.mark.parametrize("change,needles", [
    ({"metric": "nosuch_metric"}, ["unknown metric 'nosuch_metric'", "known metrics: list_match_score"]),
    ({"max_tokens": "32"}, ["'max_tokens' must be a positive integer"]),
    ({"prompt": ["a list"]}, ["'prompt' must be a string"]),
])
def test_task_config_settings_of_the_wrong_kind(capsys, corrupt, data, tmp_path, change, needles):
    conf = data / "waiting_line" / "task_config.yaml"
    entries = json.loads(conf.read_text(encoding="utf-8"))
    entries[TASK].update(change)
    conf.write_text(json.dumps(entries), encoding="utf-8")
    refused(capsys, _run(corrupt, data, tmp_path / "out"), f"{conf}: {TASK}: ", *needles)


@pytest.mark.parametrize("prompt,needles", [
    ("Copy {nosuchfield}", ["uses the field(s) 'nosuchfield', which no record", "the records' fields: context"]),
    ("Copy {context} {", ["is not a valid template (Single '{' encountered", "write {{ and }} for literal braces"]),
    ("Copy {}", ["positional field {}"]),
])
def test_a_prompt_naming_an_unknown_field_names_its_file(capsys, corrupt, data, tmp_path, prompt, needles):
    conf = data / "waiting_line" / "task_config.yaml"
    entries = json.loads(conf.read_text(encoding="utf-8"))
    entries[TASK]["prompt"] = prompt
    conf.write_text(json.dumps(entries), encoding="utf-8")
    refused(capsys, _run(corrupt, data, tmp_path / "out"), f"{conf}: the prompt of {TASK}: ", *needles)


def test_an_empty_task_file_is_refused(capsys, corrupt, data, tmp_path):
    path = data / f"{TASK}.jsonl"
    path.write_text("\n", encoding="utf-8")
    refused(capsys, _run(corrupt, data, tmp_path / "out"), f"{path}: task {TASK} has no samples")


def test_a_text_data_file_is_checked_against_its_metric(capsys, corrupt, tmp_path):
    rows = tmp_path / "samsum.jsonl"
    good = {"dialogue": "A: hi\nB: hello", "summary": "They greet."}
    rows.write_text(json.dumps(good) + "\n" + json.dumps({"input": {"text": "x"}, "answer": {"summary": 5}}) + "\n")
    argv = ["parallelbench", "run", "--model", corrupt, "--method", "topk:k=4", "--style", "short", "--tasks",
            "paraphrase_summarize/samsum", "--samsum", str(rows), "--out", str(tmp_path / "out")]
    refused(capsys, argv, f"{rows}:2: 'answer' must be an object with 'summary'", "got an object with keys ['summary']")
    rows.write_text("")
    refused(capsys, argv, f"{rows}: no records for paraphrase_summarize/samsum")
    rows.write_text(json.dumps(good) + "\n")
    assert main(argv) == 2 and WEIGHTS_ERROR in capsys.readouterr().err  # a good file: on to loading


def test_every_generated_record_passes_the_checks():
    """The checks accept what the suite writes: every task, both styles, each with its own prompt and metric."""
    for style in PB.STYLES:
        for name, task in PB.TASKS.items():
            if task.needs_data:
                continue
            records = PB.generate_task(name, 12, style=style)
            PB.check_records(name, records, template=PB.prompt_for(name, style), metric=task.metric)


@pytest.mark.parametrize("metric,answer,needle", [
    ("list_shuffle_score", {"input": "Ann Lee", "example": "[]"}, "'input' (the source list"),
    ("list_random_insert_score", {"input": ["a"], "word": 3}, "'answer.word' must be a string"),
    ("list_random_remove_score", {"input": ["a"], "n_words": "1"}, "'answer.n_words' must be a positive integer"),
    ("latin_square_score", {"symbols": 4}, "'symbols' (the square's symbols"),
    ("latin_square_score", {"symbols": ["A", "B"], "givens": {"9": "A"}}, "cell numbers 0-3"),
    ("sudoku_score", "12\n34", "4 lines of 4 digits"),
    ("sentence_to_words_score", {"words": "cat dog"}, "'words': an array of strings"),
    ("paraphrase_score", {"summary": "x"}, "'text': a string"),
])
def test_answer_types_each_metric_reads(metric, answer, needle):
    assert needle in PB.answer_problem(metric, answer)


def test_score_checks_each_line_before_scoring(capsys, tmp_path):
    record = PB.generate_task(TASK, 1)[0]
    good = {**record, "task": TASK, "prediction": record["answer"]}
    preds = tmp_path / "preds.jsonl"
    for bad, needles in [({"answer": 5}, ["'answer' must be the reference string"]),
                         ({"answer": None, "metric": "nosuch"}, ["unknown metric 'nosuch'"]),
                         ({"prediction": 5}, ["'prediction' must be the model's output text"]),
                         ({"task": ["x"]}, ["'task' must be a task name"]),
                         ({"task": "nosuch/task"}, ["no metric known for task 'nosuch/task'"])]:
        preds.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, **bad}) + "\n")
        refused(capsys, ["parallelbench", "score", str(preds)], f"{preds}:3: ", *needles)
        assert "score" not in json.loads(preds.read_text().splitlines()[0])  # nothing written
    line = {k: v for k, v in good.items() if k != "answer"}
    preds.write_text(json.dumps(line) + "\n")
    refused(capsys, ["parallelbench", "score", str(preds)], f"{preds}:1: no 'answer' field")
    preds.write_text(json.dumps(good) + "\n")
    assert main(["parallelbench", "score", str(preds)]) == 0
    assert json.loads(preds.read_text())["score"] == 1.0


def test_report_names_a_stored_line_it_cannot_use(capsys, tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    line = {"task": TASK, "index": 0, "method": "topk", "setting": "topk:k=4", "score": 1.0, "score_strict": 1.0,
            "nfe": 8, "tokens_per_step": 4.0}
    samples = out / "samples.jsonl"
    samples.write_text(json.dumps(line) + "\n")
    assert main(["parallelbench", "report", str(out), "--no-plot"]) == 0
    for bad, needle in [({"setting": None}, "'setting' is not a string"), ({"nfe": "8"}, "'nfe' is not a number"),
                        ({"score": "1"}, "'score' is not a number")]:
        samples.write_text(json.dumps(line) + "\n" + json.dumps({**line, "index": 1, **bad}) + "\n")
        refused(capsys, ["parallelbench", "report", str(out), "--no-plot"], f"{samples}:2: not a result line", needle)
    samples.write_text(json.dumps(line) + "\n" + json.dumps({k: v for k, v in line.items() if k != "task"}) + "\n")
    refused(capsys, ["parallelbench", "report", str(out), "--no-plot"], f"{samples}:2: ", "no 'task' field")
    samples.write_text(json.dumps(line) + "\n")
    (out / "run.json").write_text("{not json")
    refused(capsys, ["parallelbench", "report", str(out), "--no-plot"], f"{out / 'run.json'} is not valid JSON")


def test_show_checks_the_sample_s_record_before_loading(capsys, corrupt, data, tmp_path):
    out = tmp_path / "sweep"
    assert main(_run("llada-tiny", data, out, "--gen-length", "8", "--method", "topk:k=8")) == 0
    path = data / f"{TASK}.jsonl"
    base = ["parallelbench", "show", str(out), "--id", "3", "--task", TASK, "--setting", "topk:k=4", "--out",
            str(tmp_path / "s.html"), "--model", corrupt]
    assert main(base) == 2 and WEIGHTS_ERROR in capsys.readouterr().err  # all there: on to loading
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))
    refused(capsys, base, "sample 3 of waiting_line/copy / topk:k=4", "now has 2 records",
            "its record 3 is gone")
    _append(path, '{"input": {"context": "[]"}, "answer": 5}', "{}")
    refused(capsys, base, f"{path}:3: 'answer' must be the reference string")
