"""Running project commands from tests so that nothing outlives the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

VENV_BIN = Path(sys.executable).parent

#: Overrides for test-sized episodes: a 512-token window the untrained tiny
#: model fills in a few turns (so it compacts), short turns, few steps.
SMALL_EPISODES = ["--actors.compaction.context_tokens", "512",
                  "--actors.compaction.reserve_tokens", "200",
                  "--actors.compaction.max_summary_tokens", "64",
                  "--actors.sampling.max_turn_tokens", "32",
                  "--actors.environment.max_steps", "12",
                  "--actors.concurrent_episodes", "2"]


def run_command(args: list[str], timeout: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in its own process group and kill the whole group when it
    ends or times out, so engine subprocesses never leak into later tests."""
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env={**os.environ, **(env or {})})
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{args} timed out after {timeout} s:\n{stderr[-4000:]}") from None
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def compactionrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_command([str(VENV_BIN / "compactionrl"), *args], timeout)


class Background:
    """A project command running in its own process group, its stderr in a
    file that tests can wait on; the whole group is killed on ``stop()``.

    Usage::

        with Background([...compactionrl args...], log_path) as learner:
            learner.wait_for("published version 1", timeout=120)
    """

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen([str(VENV_BIN / "compactionrl"), *args],
                                        stdout=subprocess.DEVNULL, stderr=self._log,
                                        start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float, count: int = 1) -> None:
        """Until ``text`` appears ``count`` times in the log (fails if the process exits)."""
        end = time.monotonic() + timeout
        while self.log().count(text) < count:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.args[0]} exited with {self.process.returncode} "
                                     f"before logging {text!r}:\n{self.log()[-4000:]}")
            if time.monotonic() > end:
                raise AssertionError(f"no {text!r} within {timeout} s:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def send(self, sig: int) -> None:
        os.killpg(self.process.pid, sig)

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 60) -> int | None:
        """Signal the group, wait for the process, then kill whatever is left."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            code: int | None = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._log.close()
        return code

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (Linux), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")
