"""An actor started by hand and SIGKILLed takes its vLLM engine with it:
the engine core, its worker and multiprocessing's resource tracker, which in a
chaos run outlived the actor for minutes (on a GPU they hold the memory the
restarted actor's engine needs). The engine's ipc socket files, left in the
actor's socket folder, go when the next engine on the machine starts.
``up``'s case is in tests/integration/test_up.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from actors.engine import SOCKET_FOLDER_PREFIX
from tests.ports import loopback_addresses
from tests.processes import Background, process_tree, run_command, running

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_sigkilled_actor_leaves_no_engine_process_and_its_sockets_go_at_the_next_start(
        tiny_model_dir: Path, tmp_path: Path, short_tmp: Path) -> None:
    # nothing listens there: the actor starts its engine, then waits for a replay
    [replay] = loopback_addresses(1)
    tmp = short_tmp
    actor = Background(["actor", "--run.model", str(tiny_model_dir), "--no-learner",
                        "--replay", replay, "--actors.engine.cpu_threads_bind", "nobind"],
                       tmp_path / "actor.log", env={"TMPDIR": str(tmp)})
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not any("Worker" in _command_line(p) for p in process_tree(actor.process.pid)):
            assert actor.process.poll() is None, actor.log()[-4000:]
            assert time.monotonic() < deadline, f"no engine worker:\n{actor.log()[-4000:]}"
            time.sleep(0.5)
        tree = process_tree(actor.process.pid)
        engine = [p for p in tree if "EngineCore" in _command_line(p)]
        assert engine, [_command_line(p) for p in tree]
        os.kill(actor.process.pid, signal.SIGKILL)  # the actor alone, not its group
        actor.process.wait()
        deadline = time.monotonic() + 30
        while (left := [p for p in tree if running(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], {p: _command_line(p) for p in left}
        [folder] = tmp.glob(f"{SOCKET_FOLDER_PREFIX}*")
        assert any(p.is_socket() for p in folder.iterdir())  # vLLM's, left by the kill
    finally:
        actor.stop()
        for pid in tree:  # the group's kill misses nothing that escaped it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # the next process to make a socket folder (before its engine starts)
    # removes the dead actor's, and its own at exit
    sweep = run_command([sys.executable, "-c",
                         "from actors.engine import vllm_socket_folder; vllm_socket_folder()"],
                        timeout=60, env={"TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)})
    assert sweep.returncode == 0, sweep.stderr[-4000:]
    assert list(tmp.glob(f"{SOCKET_FOLDER_PREFIX}*")) == []
    assert [p for p in tmp.rglob("*") if p.is_socket()] == []
