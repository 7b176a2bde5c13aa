"""Running project commands from tests so that nothing outlives the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


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
