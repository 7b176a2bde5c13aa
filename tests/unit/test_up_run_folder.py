"""``compactionrl up`` without ``--resume`` refuses a run folder that holds an
earlier run: a fresh learner at version 0 beside that run's checkpoints and
replay log would train on both runs' rollouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.config import load_config
from deploy.up import EXIT_FAILED, EXIT_FINISHED, EXIT_INTERRUPTED, Up, status_code


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


@pytest.mark.parametrize(("running", "ended", "code"), [
    (True, None, 0),
    (False, {"exit_code": EXIT_FINISHED}, 0),
    (False, {"exit_code": EXIT_INTERRUPTED}, 0),
    (False, {"exit_code": EXIT_FAILED}, 1),
    (False, None, 1),
])
def test_status_fails_only_for_a_run_that_failed_or_was_killed(
        running: bool, ended: dict | None, code: int) -> None:
    """A finished run, or one stopped cleanly by Ctrl-C, is no failure for a
    script that checks ``compactionrl status``; a killed ``up`` wrote no end."""
    assert status_code(running, ended) == code
