"""How ``compactionrl up`` restarts what exits (deploy/up.py ``Child``), on
real child processes that exit at once: the delay doubles with each exit in
a row up to its cap, starts afresh after a long run, and the replay or the
learner exiting ``SERVICE_MAX_CRASHES`` times in a row is a crash loop."""

from __future__ import annotations

import time
from pathlib import Path

from deploy.children import BACKOFF_RESET_S, RESTART_BACKOFF_S, SERVICE_MAX_CRASHES, Child


def _exited(child: Child) -> int:
    """Start ``child`` and wait for its exit code."""
    child.start()
    assert child.process is not None
    return child.process.wait(timeout=120)


def _crashing(tmp_path: Path) -> Child:
    # an unknown subcommand: the real entry point exits at once with 2
    return Child("replay", ["no-such-command"], tmp_path / "replay.log")


def test_each_exit_in_a_row_doubles_the_delay_up_to_its_cap(tmp_path: Path) -> None:
    child = _crashing(tmp_path)
    delays = []
    for _ in range(len(RESTART_BACKOFF_S) + 1):
        assert _exited(child) == 2
        now = time.monotonic()
        delays.append(child.schedule_restart(now))
        assert child.restart_at == now + delays[-1]
    assert delays == [*RESTART_BACKOFF_S, RESTART_BACKOFF_S[-1]]
    assert "invalid choice" in (tmp_path / "replay.log").read_text()


def test_a_long_run_before_the_exit_starts_the_count_afresh(tmp_path: Path) -> None:
    child = _crashing(tmp_path)
    for _ in range(2):
        _exited(child)
        child.schedule_restart(time.monotonic())
    _exited(child)
    # as if this incarnation had run past the reset
    assert child.schedule_restart(child.started_at + BACKOFF_RESET_S + 1) == RESTART_BACKOFF_S[0]
    assert child.crashes == 1


def test_a_service_exiting_again_and_again_is_a_crash_loop_only_once_exited(
        tmp_path: Path) -> None:
    child = _crashing(tmp_path)
    for n in range(1, SERVICE_MAX_CRASHES + 1):
        assert not child.crash_looping()  # n - 1 exits counted
        _exited(child)
        child.schedule_restart(time.monotonic())
        assert child.crashes == n
    assert child.crash_looping()
    # restarted and running: not a loop until it exits again
    child.start()
    assert not child.crash_looping()
    child.process.wait(timeout=120)
    assert child.crash_looping()
