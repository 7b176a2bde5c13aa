"""The shell environment's sandbox against hostile commands (real processes).
Each case is bounded by the command time limit and leaves nothing running."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from actors.envs.base import ToolCall
from actors.envs.sandbox import NOBODY
from actors.envs.shell import BUILTIN_TASKS, Shell

TIMEOUT_S = 2.0


def _processes_of(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                pass
    return pids


WORK_ROOT = str(Path("/var/tmp") / f"crl-test-{os.getpid()}")


@pytest.fixture
def runner():
    """One event loop per test: subprocess transports belong to their loop."""
    with asyncio.Runner() as runner:
        yield runner


@pytest.fixture
def shell(runner: asyncio.Runner):
    env = Shell(command_timeout_s=TIMEOUT_S, output_limit_bytes=4096, memory_limit_mb=256,
                max_processes=32, work_root=WORK_ROOT)
    runner.run(env.reset(0))
    env.runner = runner
    yield env
    runner.run(env.close())
    if env.sandbox.isolation == "namespaces":
        assert _processes_of(NOBODY) == [], "sandboxed processes outlived their command"


def run(env: Shell, command: str) -> str:
    return env.runner.run(env.call_tool(ToolCall("bash", {"command": command}))).observation


def test_this_machine_gets_full_isolation(shell: Shell) -> None:
    # CI runs as root with util-linux: the namespace path must be the one tested
    assert shell.sandbox.isolation == "namespaces"


@pytest.mark.parametrize("bomb", [
    ":(){ :|:& };:",                        # the shell exits at once, the bomb runs on
    "bomb() { bomb | bomb & }; bomb; sleep 60",  # the shell stays until the time limit
])
def test_fork_bomb_is_contained(shell: Shell, bomb: str) -> None:
    observation = run(shell, bomb)
    # the step ends; the fixture then checks that no sandboxed process is left
    assert observation.startswith(("killed", "exit code"))
    assert "time limit" in observation or "exit code" in observation


def test_infinite_loop_is_killed_at_the_time_limit(shell: Shell) -> None:
    observation = run(shell, "while true; do :; done")
    assert observation.startswith("killed") and "time limit" in observation


def test_huge_output_is_capped(shell: Shell) -> None:
    observation = run(shell, "yes")
    assert "output limit" in observation
    assert len(observation) < 4096 + 200


def test_no_network(shell: Shell) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        observation = run(shell, f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected")
        assert "connected" not in observation.splitlines()[1:]
        with pytest.raises(TimeoutError):
            listener.accept()


def test_writes_outside_the_work_folder_fail(shell: Shell) -> None:
    target = Path("/var/tmp") / f"crl-escape-{os.getpid()}"
    observation = run(shell, f"echo x > {target}; echo y > /etc/crl-escape; touch ok")
    assert not target.exists() and not Path("/etc/crl-escape").exists()
    assert "exit code 0" in observation  # the last command, inside the work folder, worked


def test_memory_limit_stops_a_hog(shell: Shell) -> None:
    observation = run(shell, "python3 -c 'x = bytearray(2 * 1024**3)'; echo status $?")
    assert "status 0" not in observation


def test_a_task_is_solved_and_checked(shell: Shell) -> None:
    # seed 0 is the first task in name order: count-lines
    assert "exit code 0" in run(shell, "wc -l < data.txt > count.txt")
    result = shell.runner.run(shell.call_tool(ToolCall("submit", {})))
    assert result.done and result.success and result.reward == 1.0


def test_a_wrong_solution_scores_zero(shell: Shell) -> None:
    run(shell, "echo 12 > count.txt")
    result = shell.runner.run(shell.call_tool(ToolCall("submit", {})))
    assert result.done and not result.success and result.reward == 0.0


def test_a_turn_without_a_tool_call_explains_how_to_act(shell: Shell) -> None:
    result = shell.runner.run(shell.step("I think I should list files"))
    assert not result.done and "call bash" in result.observation


def test_every_builtin_task_has_instruction_and_check() -> None:
    tasks = sorted(p for p in BUILTIN_TASKS.iterdir() if p.is_dir())
    assert len(tasks) >= 4
    for task in tasks:
        assert (task / "task.toml").is_file() and (task / "check.sh").is_file(), task
