"""``compactionrl up`` without ``--resume`` refuses a run folder that holds an
earlier run: a fresh learner at version 0 beside that run's checkpoints and
replay log would train on both runs' rollouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.config import load_config
from deploy.up import EXIT_FAILED, Up


@pytest.mark.parametrize("earlier", ["checkpoints/step-3", "replay/segments.log"])
def test_an_earlier_run_in_the_folder_is_refused_without_resume(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], earlier: str) -> None:
    config = load_config(None, ["--run.out_dir", str(tmp_path), "--run.name", "r"])
    run_dir = tmp_path / "r"
    (run_dir / earlier).parent.mkdir(parents=True)
    (run_dir / earlier).touch()
    up = Up(config, run_dir, interactive=False)
    started = []
    for child in (up.replay, up.learner, *up.actors):
        child.start = lambda child=child: started.append(child.name)  # type: ignore[method-assign]
    assert up.run() == EXIT_FAILED
    assert started == []
    message = capsys.readouterr().err
    assert "holds an earlier run" in message and "--resume" in message
    assert not (run_dir / "config.toml").exists()  # nothing of the earlier run was touched
