"""The rollout viewer's page (deploy/viewer.py) from a run folder's samples:
what it holds, and that it needs nothing from outside the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.viewer import comparison_pair, viewer_data, write_viewer
from ops.report import write_report
from tests.viewer_runs import SUMMARY, WINDOW, kept_run


def test_the_page_holds_each_kept_rollout_with_its_segments_facts_and_lags(
        tmp_path: Path, tokenizer) -> None:
    data = viewer_data(kept_run(tmp_path, tokenizer), tokenizer)
    assert [(r["step"], r["task_id"]) for r in data["rollouts"]] == [
        (1, "keyvault-1"), (2, "keyvault-2"), (2, "keyvault-1")]
    (sequence,) = data["rollouts"][0]["sequences"]
    assert "".join(sequence["texts"]) == WINDOW + SUMMARY
    execution, summary = sequence["segments"]
    assert (execution["type"], execution["factor"], summary["type"]) == ("execution", 0.5,
                                                                         "summary")
    assert "".join(sequence["texts"][summary["start"]:]) == SUMMARY
    # the window held alpha 7 and alpha 2; the summary wrote alpha 7
    assert summary["facts"] == {"kept": ["alpha 7"], "dropped": ["alpha 2"]}
    assert sequence["values"]["lag"][:2] == [2, 1]  # version 5 less 3 and 4
    assert data["pair"] == ["1-0", "2-1"]  # the same task, early and late


def test_the_pair_falls_back_to_alike_tasks_then_to_the_first_and_last() -> None:
    def rollout(id_: str, step: int, task: str, compactions: int) -> dict:
        return {"id": id_, "step": step, "task_id": task, "tags": {}, "compactions": compactions}

    alike = [rollout("a", 1, "t1", 2), rollout("b", 5, "t2", 3), rollout("c", 9, "t3", 2)]
    assert comparison_pair(alike) == ["a", "c"]
    unlike = [rollout("a", 1, "t1", 1), rollout("b", 5, "t2", 2), rollout("c", 9, "t3", 3)]
    assert comparison_pair(unlike) == ["a", "c"]
    assert comparison_pair(unlike[:1]) == ["a"]


def test_the_page_opens_offline_with_its_data_inside(tmp_path: Path, tokenizer) -> None:
    run_dir = kept_run(tmp_path, tokenizer)
    page = write_viewer(run_dir, tokenizer).read_text()
    # nothing fetched: no script, style or image from elsewhere, no request
    assert not re.search(r"\b(src|href)\s*=|@import|url\(|fetch\(|XMLHttpRequest|import\(",
                         page)
    embedded = re.search(r'<script id="data" type="application/json">(.*?)</script>', page,
                         re.S).group(1)
    assert json.loads(embedded)["run"] == "my-run"
    assert page.count("</script>") == 2  # the data cannot close its element early


def test_view_writes_the_page_of_a_run_and_refuses_a_folder_without_samples(
        tmp_path: Path, tokenizer, tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = kept_run(tmp_path, tokenizer)
    tokenizer.save_pretrained(run_dir / "export")
    assert main(["view", "--run", str(run_dir)]) == 0
    assert (run_dir / "viewer.html").is_file()
    assert main(["view", "--run", str(tmp_path)]) == 2
    assert "holds no samples/" in capsys.readouterr().err
    assert "<a href='viewer.html'>Rollout viewer</a>" in write_report(run_dir, "x").read_text()
    assert "Rollout viewer" not in write_report(tmp_path, "y").read_text()
