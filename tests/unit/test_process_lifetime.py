"""Processes die with what started them, and ``up`` stops what a dead child
left behind: a vLLM engine outliving its SIGKILLed actor held the memory and
cores its restarted actor needed (found in a chaos run)."""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deploy.cli import stop_hint
from ops.lifetime import die_with_multiprocessing_parent
from tests.processes import run_command, running, running_after

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="parent-death signals and subreapers are Linux's")


def _run_parent(tmp_path: Path, script: str, expected: int) -> tuple[subprocess.Popen, list[int]]:
    """Start ``script`` (it prints the pids of the processes it started, one
    per line) and return it with those pids once all are printed."""
    path = tmp_path / "parent.py"
    path.write_text(textwrap.dedent(script))
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              start_new_session=True)
    assert parent.stdout is not None
    pids = [int(parent.stdout.readline()) for _ in range(expected)]
    return parent, pids


def _kill_all(parent: subprocess.Popen, pids: list[int]) -> None:
    for pid in [parent.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    parent.wait()


def _assert_dies_with(parent: subprocess.Popen, child: int) -> None:
    """SIGKILL ``parent``: ``child`` is gone within seconds."""
    try:
        assert running(child)
        parent.kill()
        assert running_after([child], 10) == []
    finally:
        _kill_all(parent, [child])


def test_a_process_that_asked_dies_when_its_parent_is_sigkilled(tmp_path: Path) -> None:
    parent, [child] = _run_parent(tmp_path, """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import sys, time; from ops.lifetime import die_with_parent; die_with_parent(); "
            "print('armed', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
        print(child.pid, flush=True)
        time.sleep(120)
    """, expected=1)
    _assert_dies_with(parent, child)


def test_an_engine_like_multiprocessing_child_dies_with_its_parent(tmp_path: Path) -> None:
    """The vLLM plugin's case: the engine core and its workers are spawned
    ``multiprocessing`` children of the actor."""
    parent, [child] = _run_parent(tmp_path, """
        import multiprocessing, time
        from ops.lifetime import die_with_multiprocessing_parent

        def engine(ready):
            die_with_multiprocessing_parent()
            ready.set()
            time.sleep(120)

        if __name__ == "__main__":
            context = multiprocessing.get_context("spawn")
            ready = context.Event()
            process = context.Process(target=engine, args=(ready,))
            process.start()
            ready.wait(60)
            print(process.pid, flush=True)
            time.sleep(120)
    """, expected=1)
    _assert_dies_with(parent, child)


def test_a_process_that_no_multiprocessing_parent_started_is_left_alone() -> None:
    """The plugin also runs in the actor itself: that one must not die with
    the shell or launcher that started it."""
    die_with_multiprocessing_parent()
    armed = ctypes.c_int(-1)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(armed), 0, 0, 0)  # PR_GET_PDEATHSIG
    assert armed.value == 0


def test_stop_leftovers_kills_a_dead_childs_group_and_its_orphans(tmp_path: Path) -> None:
    """A supervisor (subreaper) whose child died outright: the child's process
    group (an engine) and a grandchild in a session of its own (a torchrun
    rank) are killed and reaped; the live child is untouched."""
    parent, pids = _run_parent(tmp_path, """
        import os, subprocess, sys, time
        from deploy.children import stop_leftovers
        from ops.lifetime import become_subreaper

        assert become_subreaper()
        sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
        live = subprocess.Popen(sleeper, start_new_session=True)
        dead = subprocess.Popen([sys.executable, "-c", (
            "import subprocess, sys, time\\n"
            f"cmd = {sleeper!r}\\n"
            "group = subprocess.Popen(cmd)\\n"
            "session = subprocess.Popen(cmd, start_new_session=True)\\n"
            "print(group.pid, session.pid, flush=True)\\n"
            "time.sleep(120)")], stdout=subprocess.PIPE, text=True, start_new_session=True)
        group, session = map(int, dead.stdout.readline().split())
        print(live.pid, flush=True)
        print(group, flush=True)
        print(session, flush=True)
        dead.kill()
        dead.wait()
        time.sleep(0.5)  # the orphans are reparented to this process
        orphans = stop_leftovers(dead.pid, {live.pid})
        print(int(session in orphans), flush=True)
        time.sleep(120)
    """, expected=4)
    live, group, session, session_was_an_orphan = pids
    try:
        assert running_after([group, session], 15) == []
        assert session_was_an_orphan == 1
        assert running(live)
    finally:
        _kill_all(parent, [live, group, session])


def test_a_hung_command_is_killed_at_its_timeout_with_the_stacks_of_its_whole_tree() -> None:
    """The failure says where each process of a hung command was: its child
    in a session of its own (as torchrun starts its ranks) included."""
    hang = textwrap.dedent("""
        import subprocess, sys, time
        def parent_waits(): time.sleep(60)
        subprocess.Popen([sys.executable, "-c", "import time\\ndef child_waits(): "
                          "time.sleep(60)\\nchild_waits()"], start_new_session=True)
        parent_waits()
    """)
    with pytest.raises(AssertionError, match="timed out after 4 s") as failure:
        run_command([sys.executable, "-c", hang], timeout=4)
    assert "in parent_waits" in str(failure.value) and "in child_waits" in str(failure.value)


def test_the_stop_command_an_actor_prints_stops_it_and_no_twin() -> None:
    """Two processes of one command line (a pattern over command lines, as
    ``pkill -f`` takes, matches both): the command the first's hint names
    stops it alone."""
    twins = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        hint = stop_hint("box-0", twins[0].pid)
        assert hint.startswith(f"actor box-0: pid {twins[0].pid}; ")
        command = hint.split("to stop this actor alone: ", 1)[1].split(" (", 1)[0]
        subprocess.run(shlex.split(command), check=True, timeout=30)
        assert twins[0].wait(timeout=30) == -signal.SIGTERM
        assert running(twins[1].pid)
    finally:
        for twin in twins:
            twin.kill()
            twin.wait()
