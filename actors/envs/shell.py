"""``shell``: terminal tasks in the style of Terminal-Bench and Harbor.

A task is a folder (``actors/envs/shell_tasks/`` ships fourteen):

- ``task.toml``: ``instruction`` (required); ``time_limit_s``, the agent's
  wall time for the episode; ``test_timeout_s``, the test script's; and
  ``family`` and ``difficulty``, which become the task's tags;
- ``setup.sh`` (optional): prepares the work folder;
- ``test.sh``: decides the reward, 1 if it exits 0, else 0;
- ``solution.sh`` (optional): a reference solution, one natural step per
  line; never shown to the agent (the tests run it to prove each task
  solvable).

Each episode gets a fresh work folder under ``work_root`` (nothing is copied
from the host), runs ``setup.sh`` there, and then the agent's commands,
each in the sandbox of :mod:`actors.envs.sandbox`. The agent acts through
two tools (``Task.tools``, parsed by the configured vLLM tool parser,
actors/tools.py): ``bash`` runs one command and answers with its exit code
and output; ``submit`` ends the episode and ``test.sh`` decides the reward.
Past ``time_limit_s`` the next call ends the episode the same way. A turn
without a tool call is answered with an observation saying how to act. When
the episode ends, its work folder is removed.

Isolation: the agent's commands are arbitrary code. Where the sandbox cannot
isolate them (not root, or no ``unshare``/``setpriv``: a pod without
``CAP_SYS_ADMIN``), the environment refuses to start unless
``allow_unisolated = true`` says to run them under resource limits only,
which stop neither network access nor writes outside the work folder.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import tomllib
from pathlib import Path

from actors.envs.base import StepResult, Task, ToolCall
from actors.envs.sandbox import Limits, Sandbox

BUILTIN_TASKS = Path(__file__).parent / "shell_tasks"
#: Work folders live outside /tmp: the sandbox mounts a private /tmp.
DEFAULT_WORK_ROOT = "/var/tmp/compactionrl-shell"
#: A test script's wall-clock limit where its task.toml sets none.
DEFAULT_TEST_TIMEOUT_S = 60.0

SYSTEM = ("You operate a Linux shell to solve a task. Call the bash tool with one command at "
          "a time; you will see its exit code and output. When the task is done, call submit.")

TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run one bash command in the task's work folder.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "minLength": 1,
                        "description": "The command line to run."}},
            "required": ["command"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "submit", "description": "End the task: its test decides the reward.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]


class Unisolated(RuntimeError):
    """The sandbox cannot isolate commands here and the config did not accept that."""


class Shell:
    """One shell episode at a time (see the module docstring)."""

    def __init__(self, tasks_dir: str = str(BUILTIN_TASKS), command_timeout_s: float = 10.0,
                 output_limit_bytes: int = 16 * 1024, memory_limit_mb: int = 1024,
                 max_processes: int = 64, work_root: str = DEFAULT_WORK_ROOT,
                 allow_unisolated: bool = False) -> None:
        self.tasks = sorted(p for p in Path(tasks_dir).iterdir() if (p / "task.toml").is_file())
        if not self.tasks:
            raise ValueError(f"no task folders (with task.toml) in {tasks_dir}")
        missing = [task.name for task in self.tasks if not (task / "test.sh").is_file()]
        if missing:
            raise ValueError(f"task folders without test.sh in {tasks_dir}: {missing}")
        self.work_root = work_root
        self.sandbox = Sandbox(Limits(timeout_s=command_timeout_s,
                                      output_bytes=output_limit_bytes,
                                      memory_bytes=memory_limit_mb * 1024 * 1024,
                                      processes=max_processes), work_root)
        if self.sandbox.isolation != "namespaces" and not allow_unisolated:
            raise Unisolated(
                "the shell sandbox cannot isolate commands on this machine (it needs root and "
                "util-linux's unshare and setpriv; a container needs CAP_SYS_ADMIN): the agent's "
                "commands would reach the network and write wherever this user can. Refusing; "
                "set allow_unisolated = true in the environment's options to run them under "
                "resource limits only")
        self._task_dir: Path | None = None
        self._spec: dict = {}
        self._workdir: str | None = None
        self._deadline = float("inf")

    async def reset(self, seed: int) -> Task:
        await self.close()
        self._task_dir = self.tasks[seed % len(self.tasks)]
        self._spec = tomllib.loads((self._task_dir / "task.toml").read_text())
        self._workdir = tempfile.mkdtemp(prefix="episode-", dir=self.work_root)
        self.sandbox.prepare(self._workdir)
        setup = self._task_dir / "setup.sh"
        if setup.is_file():
            result = await self.sandbox.run(setup.read_text(), self._workdir)
            if result.exit_code != 0:
                raise RuntimeError(f"setup of {self._task_dir.name} failed: {result.describe()}")
        self._deadline = time.monotonic() + float(self._spec.get("time_limit_s", float("inf")))
        tags = {key: str(self._spec[key]) for key in ("family", "difficulty") if key in self._spec}
        return Task(task_id=f"shell-{self._task_dir.name}", system=SYSTEM,
                    instruction=self._spec["instruction"], tools=TOOLS, tags=tags)

    async def step(self, action: str) -> StepResult:
        return StepResult("no tool call: call bash with one command, or submit when the task "
                          "is done.")

    async def call_tool(self, call: ToolCall) -> StepResult:
        assert self._workdir is not None, "reset() first"
        if call.name == "submit":
            return await self._test("submitted")
        if time.monotonic() > self._deadline:
            return await self._test("time limit reached")
        command = call.arguments["command"]
        return StepResult((await self.sandbox.run(command, self._workdir)).describe())

    async def _test(self, why: str) -> StepResult:
        """End the episode: the task's test decides, then the work folder goes."""
        assert self._task_dir is not None and self._workdir is not None
        result = await self.sandbox.run(
            (self._task_dir / "test.sh").read_text(), self._workdir,
            float(self._spec.get("test_timeout_s", DEFAULT_TEST_TIMEOUT_S)))
        solved = result.exit_code == 0
        await self.close()
        return StepResult(f"{why}: task {'solved' if solved else 'not solved'}", done=True,
                          reward=float(solved), success=solved)

    async def close(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
