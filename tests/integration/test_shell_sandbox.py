"""The shell environment's sandbox against hostile commands (real processes).
Each case is bounded by the command time limit and leaves nothing running."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
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


#: The seed of the count-lines task (seeds pick tasks in name order).
COUNT_LINES = sorted(p.name for p in BUILTIN_TASKS.iterdir()).index("count-lines")


@pytest.fixture
def shell(runner: asyncio.Runner):
    env = Shell(command_timeout_s=TIMEOUT_S, output_limit_bytes=4096, memory_limit_mb=256,
                max_processes=32, work_root=WORK_ROOT)
    runner.run(env.reset(COUNT_LINES))
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


def test_a_task_is_solved_and_tested_and_its_work_folder_removed(shell: Shell) -> None:
    workdir = shell._workdir
    assert "exit code 0" in run(shell, "wc -l < data.txt > count.txt")
    result = shell.runner.run(shell.call_tool(ToolCall("submit", {})))
    assert result.done and result.success and result.reward == 1.0
    assert not Path(workdir).exists()


def test_a_wrong_solution_scores_zero(shell: Shell) -> None:
    run(shell, "echo 12 > count.txt")
    result = shell.runner.run(shell.call_tool(ToolCall("submit", {})))
    assert result.done and not result.success and result.reward == 0.0


def test_a_turn_without_a_tool_call_explains_how_to_act(shell: Shell) -> None:
    result = shell.runner.run(shell.step("I think I should list files"))
    assert not result.done and "call bash" in result.observation


def test_every_builtin_task_fails_its_test_as_set_up_and_passes_with_its_solution(
        runner: asyncio.Runner) -> None:
    """Each task, in the sandbox: the test fails on the set-up folder and
    passes once the reference solution ran; the long ones take ten or more
    steps (more than one window of the local default holds)."""
    shell = Shell(work_root=WORK_ROOT)
    long_tasks = 0
    for task in shell.tasks:
        workdir = runner.run(_set_up(shell, task))
        try:
            test = (task / "test.sh").read_text()
            assert runner.run(shell.sandbox.run(test, workdir)).exit_code != 0, task.name
            solution = (task / "solution.sh").read_text()
            runner.run(shell.sandbox.run(solution, workdir, timeout_s=60))
            passed = runner.run(shell.sandbox.run(test, workdir))
            assert passed.exit_code == 0, f"{task.name}: {passed.describe()}"
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        long_tasks += len(solution.splitlines()) >= 10
    assert len(shell.tasks) >= 14 and long_tasks >= 10


async def _set_up(shell: Shell, task: Path) -> str:
    workdir = tempfile.mkdtemp(dir=WORK_ROOT)
    shell.sandbox.prepare(workdir)
    setup = task / "setup.sh"
    if setup.is_file():
        assert (await shell.sandbox.run(setup.read_text(), workdir)).exit_code == 0
    return workdir


#: The checkout this test file belongs to.
CHECKOUT = Path(__file__).parents[2]


@contextlib.contextmanager
def _world_readable_copy(checkout: Path) -> Iterator[Path]:
    """A copy of ``checkout``'s ``actors`` package that ``nobody`` can import.

    A checkout may sit under a folder only its owner can enter (a clone in
    root's home or in ``mktemp -d``), and then ``nobody`` cannot import from
    it. The user's folders must keep their modes, so the package is copied
    into a fresh folder of this test's own, which it makes world-readable. The
    folder is made under /var/tmp because pytest's own temporary folders (and
    a private ``TMPDIR``) sit under a folder that only their owner can enter.
    The copies get explicit modes because a user with umask 077 checks out
    files that only the owner can read."""
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="crl-nobody-") as shared:
        root = Path(shared)
        shutil.copytree(checkout / "actors", root / "actors",
                        ignore=shutil.ignore_patterns("__pycache__"))
        os.chmod(root, 0o755)
        for folder, _dirs, files in os.walk(root / "actors"):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        yield root


def _run_as_nobody(code: str, importable: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run Python ``code`` as ``nobody``, importing only the standard library
    and the packages in ``importable``.

    ``-I -S`` keep the checkout out of the child's import path (no current
    folder, no PYTHONPATH, no site-packages with the editable install), so
    the child imports exactly what ``importable`` holds. setpriv executes the
    interpreter while it still holds root's capabilities (they go at the
    exec), so an interpreter in the checkout's .venv starts even under a
    private folder; everything the interpreter reads afterwards, it reads as
    ``nobody``."""
    prelude = f"import sys\nsys.path.insert(0, {str(importable)!r})\n"
    argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            sys.executable, "-I", "-S", "-c", prelude + code, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/")


def _skip_unless_nobody_can_run_python() -> None:
    """Skip, saying exactly what is missing, where ``nobody`` cannot read
    this interpreter's standard library (an interpreter installed under a
    private home folder): then no unprivileged Python can start here."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as empty:
        done = _run_as_nobody("import encodings, tomllib", Path(empty))
    if done.returncode != 0:
        pytest.skip(f"user nobody cannot run {sys.executable}: it cannot read the standard "
                    f"library under {sys.base_prefix} ({done.stderr.strip()[-300:]})")


UNISOLATED = """
from actors.envs.shell import Shell, Unisolated
import actors.envs.shell
print("imported from:", actors.envs.shell.__file__)
try:
    Shell(work_root=sys.argv[1])
except Unisolated as exc:
    print("refused:", exc)
print("accepted:", Shell(work_root=sys.argv[1], allow_unisolated=True).sandbox.isolation)
"""


def _refuses_unisolated_as_nobody(checkout: Path) -> None:
    """As ``nobody``, with the ``actors`` of ``checkout``: the environment
    refuses, and runs under resource limits only when told to."""
    _skip_unless_nobody_can_run_python()
    with _world_readable_copy(checkout) as shared:
        root = shared / "work"
        root.mkdir()
        os.chmod(root, 0o777)
        done = _run_as_nobody(UNISOLATED, shared, str(root))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"imported from: {shared}/actors/envs/shell.py" in done.stdout
    assert "refused: the shell sandbox cannot isolate commands" in done.stdout
    assert "accepted: rlimits" in done.stdout


def test_without_isolation_the_environment_refuses_unless_told_to_run_unisolated() -> None:
    """As an unprivileged user the namespaces cannot be made: refused, and
    run under resource limits only when the config says so."""
    _refuses_unisolated_as_nobody(CHECKOUT)


def test_the_unprivileged_child_imports_from_a_checkout_under_a_0700_folder(
        tmp_path: Path) -> None:
    """A checkout under a folder only its owner can enter (a clone in root's
    home or in ``mktemp -d``): ``nobody`` cannot import from it directly, yet
    the refusal test runs, and the private folder keeps its mode."""
    _skip_unless_nobody_can_run_python()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)  # mkdir's mode is reduced by the umask, never raised
    checkout = private / "checkout"
    shutil.copytree(CHECKOUT / "actors", checkout / "actors",
                    ignore=shutil.ignore_patterns("__pycache__"))
    direct = _run_as_nobody("import actors.envs.shell", checkout)
    assert "ModuleNotFoundError" in direct.stderr, (direct.returncode, direct.stderr[-2000:])
    _refuses_unisolated_as_nobody(checkout)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
