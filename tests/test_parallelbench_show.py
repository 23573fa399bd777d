"""``dllm parallelbench show`` on a sweep whose method swept a parameter (``threshold:tau=0.5,0.7``): the stored
line's setting is rebuilt from its own fields (its method is the curve, ``threshold``, which has no such
setting), and a setting or task the sweep lacks is refused, listing those it has, before the model loads."""

from __future__ import annotations

import json
import shutil

import pytest

from dllm import load_model
from dllm.assets import model_path
from dllm.cli import main
from dllm.evals.parallelbench import sweep as S


@pytest.mark.parametrize("spec", ["threshold:tau=0.5,0.7,0.9", "topk:k=1,2,4", "topk:k=2,4:sampler=llada-random",
                                  "llada:remasking=low_confidence,random:temperature=0,0.5",
                                  "threshold:tau=0.5,0.9:block_length=8", "llada:steps=4,8", "localleap"])
def test_a_setting_is_rebuilt_from_its_result_line(spec):
    for s in S.parse_method(spec):
        line = {"task": "t", "index": 0, **s.describe()}
        assert S.Setting.from_line(line) == s


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("pb") / "runs"
    assert main(["parallelbench", "run", "--method", "threshold:tau=0.5,0.7", "--method", "localleap", "--out",
                 str(out), "--n", "2", "--tasks", "waiting_line/copy", "--no-report"]) == 0
    return out


def test_show_a_swept_setting(sweep, tmp_path, capsys):
    capsys.readouterr()
    pic = tmp_path / "s.html"
    assert main(["parallelbench", "show", str(sweep), "--id", "0", "--task", "waiting_line/copy", "--setting",
                 "threshold:tau=0.5", "--out", str(pic)]) == 0
    err = capsys.readouterr().err
    assert "threshold:tau=0.5: regenerated the stored output" in err and pic.is_file()
    res, line = S.replay_sample(load_model("llada-tiny"), sweep, 0, setting="threshold:tau=0.7")
    assert line["setting"] == "threshold:tau=0.7" and res.texts[0] == line["prediction"]


def test_unknown_setting_or_task_lists_what_the_sweep_has(sweep, tmp_path, capsys):
    # a model whose weights are corrupt: the error must be the argument's, raised before loading
    bad = tmp_path / "corrupt"
    shutil.copytree(model_path("llada-tiny"), bad)
    (bad / "model.safetensors").write_bytes(b"garbage")
    capsys.readouterr()
    base = ["parallelbench", "show", str(sweep), "--id", "0", "--out", str(tmp_path / "s.html"), "--model", str(bad)]
    assert main([*base, "--setting", "threshold:tau=0.6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no decoded sample of setting 'threshold:tau=0.6'") and err.endswith(
        "its settings: localleap, threshold:tau=0.5, threshold:tau=0.7"), err
    assert main([*base, "--task", "waiting_line/reverse", "--setting", "localleap"]) == 2
    assert "its tasks: waiting_line/copy" in capsys.readouterr().err
    with pytest.raises(ValueError, match="its settings: localleap, threshold:tau=0.5, threshold:tau=0.7"):
        S.stored_sample(sweep, 0, setting="threshold")


def test_a_data_dir_sweep_replays_with_its_own_prompt_style(tmp_path):
    """A data directory's records hold no prompt: without a task_config.yaml prompt the sweep's --style picks the
    built-in one, so run.json pins it and show rebuilds the sample's chat with it (it took the full prompts
    whatever the sweep ran)."""
    from dllm.evals import parallelbench as PB

    data, out = tmp_path / "data", tmp_path / "runs"
    assert main(["parallelbench", "generate", "--out", str(data), "--tasks", "waiting_line/copy", "--n", "2"]) == 0
    (data / "waiting_line" / "task_config.yaml").unlink()  # records alone: the prompt is the style's built-in one
    assert main(["parallelbench", "run", "--method", "topk:k=4", "--out", str(out), "--data-dir", str(data),
                 "--style", "short", "--tasks", "waiting_line/copy", "--no-report"]) == 0
    plan = S.replay_plan(out, 0, "waiting_line/copy", "topk:k=4")
    assert plan.pinned["data"]["style"] == "short"
    record = PB.load_records(data, "waiting_line/copy", "short")[0]
    assert plan.messages == PB.messages_for(record, PB.prompt_for("waiting_line/copy", "short"))
    assert plan.messages != PB.messages_for(record, PB.prompt_for("waiting_line/copy", "full"))
    res, line = S.replay_sample(load_model("llada-tiny"), out, 0, task="waiting_line/copy", setting="topk:k=4")
    assert res.texts[0] == line["prediction"]
    # a run.json from before the style was pinned resumes under the style given (and pins it from then on)
    run = json.loads((out / "run.json").read_text())
    del run["pinned"]["data"]["style"]
    (out / "run.json").write_text(json.dumps(run))
    lines = (out / "samples.jsonl").read_text()
    assert main(["parallelbench", "run", "--method", "topk:k=4", "--out", str(out), "--data-dir", str(data),
                 "--style", "short", "--tasks", "waiting_line/copy", "--no-report"]) == 0
    assert (out / "samples.jsonl").read_text() == lines  # nothing decoded again
    assert json.loads((out / "run.json").read_text())["pinned"]["data"]["style"] == "short"
