"""vLLM's ipc socket files go to a folder that is removed once no process
uses it (``actors.engine.vllm_socket_folder``): at its last user's exit, or,
when its users were SIGKILLed, by the next process that makes one. Real
processes; each test has a ``TMPDIR`` of its own. The engine's own sockets
in such a folder: tests/faults/test_killed_actor_leaves_no_engine.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.config import EngineConfig
from actors.engine import SOCKET_FOLDER_PREFIX, engine_environment, engine_process_started

ROOT = Path(__file__).parents[2]

#: Makes (or joins) its socket folder and prints it, leaves a file there as
#: vLLM does, then does what its argument says.
USER = """
import os, signal, subprocess, sys
from actors.engine import vllm_socket_folder
folder = vllm_socket_folder()
print(folder, flush=True)
if folder is None:
    sys.exit()
os.environ["VLLM_RPC_BASE_PATH"] = str(folder)
(folder / f"socket-{os.getpid()}").touch()
then = sys.argv[1]
if then == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
if then == "child waits":  # a child that inherits the folder, and waits for stdin to close
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "wait"],
                             stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().strip(), child.pid, flush=True)
if then == "wait":
    sys.stdin.read()
"""


def _user(tmp: Path, then: str, stdin: int | None = subprocess.DEVNULL
          ) -> subprocess.Popen[str]:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_RPC_BASE_PATH", None)
    return subprocess.Popen([sys.executable, "-c", USER, then, USER], env=env, text=True,
                            stdin=stdin, stdout=subprocess.PIPE)


def _folders(tmp: Path) -> list[Path]:
    return sorted(tmp.glob(f"{SOCKET_FOLDER_PREFIX}*"))


def test_a_process_s_socket_folder_is_removed_when_it_exits(short_tmp: Path) -> None:
    user = _user(short_tmp, "exit")
    folder = Path(user.communicate(timeout=60)[0].strip())
    assert user.returncode == 0
    assert folder.parent == short_tmp and folder.name.startswith(SOCKET_FOLDER_PREFIX)
    assert _folders(short_tmp) == []


def test_a_folder_whose_user_was_killed_is_removed_by_the_next_that_makes_one(
        short_tmp: Path) -> None:
    killed = _user(short_tmp, "killed")
    left = Path(killed.communicate(timeout=60)[0].strip())
    assert killed.returncode == -9
    assert _folders(short_tmp) == [left] and any(left.glob("socket-*"))  # no exit handler ran

    waiting = _user(short_tmp, "wait", stdin=subprocess.PIPE)
    try:
        assert waiting.stdout is not None
        own = Path(waiting.stdout.readline().strip())
        assert _folders(short_tmp) == [own] and own != left
    finally:
        waiting.communicate(timeout=60)
    assert _folders(short_tmp) == []


def test_a_child_shares_its_parent_s_folder_which_lasts_until_its_last_user_exits(
        short_tmp: Path) -> None:
    # the child inherits the parent's stdin, so it waits until the test closes it
    parent = _user(short_tmp, "child waits", stdin=subprocess.PIPE)
    assert parent.stdout is not None and parent.stdin is not None
    folder = Path(parent.stdout.readline().strip())
    child_folder, child_pid = parent.stdout.readline().split()
    assert parent.wait(timeout=60) == 0
    assert Path(child_folder) == folder
    # the parent has exited; its child still uses the folder
    assert _folders(short_tmp) == [folder]
    assert {p.name for p in folder.glob("socket-*")} == {f"socket-{parent.pid}",
                                                         f"socket-{child_pid}"}
    parent.stdin.close()
    deadline = time.monotonic() + 60
    while _folders(short_tmp) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _folders(short_tmp) == []  # removed by the child's exit


def test_a_tmpdir_too_deep_for_socket_paths_leaves_vllm_s_default(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60)  # + "/crl-vllm-xxxxxxxx/<uuid4>": over 107
    deep.mkdir()
    user = _user(deep, "exit")
    assert user.communicate(timeout=60)[0].strip() == "None"
    assert _folders(deep) == []


def test_engine_arguments_keep_an_explicit_socket_path(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    assert "VLLM_RPC_BASE_PATH" not in engine_environment(EngineConfig(), on_cpu=True)
    with engine_process_started(EngineConfig()):
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(tmp_path)
