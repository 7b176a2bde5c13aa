"""``shell``: terminal tasks in the style of terminal benchmarks.

A task is a folder holding ``task.toml`` (``instruction = "..."``), and
optionally ``setup.sh`` (prepares the work folder) and ``check.sh`` (exit 0 =
solved). Each episode copies nothing from the host: it gets a fresh work
folder, runs ``setup.sh`` there, and then runs the agent's commands there,
each in the sandbox of :mod:`actors.envs.sandbox`.

The agent acts through two tools (``Task.tools``, parsed by the configured
vLLM tool parser, actors/tools.py): ``bash`` runs one command and answers
with its exit code and output; ``submit`` ends the episode, and ``check.sh``
decides the reward (1 if it exits 0, else 0). A turn without a tool call is
answered with an observation saying how to act.
"""

from __future__ import annotations

import shutil
import tempfile
import tomllib
from pathlib import Path

from actors.envs.base import StepResult, Task, ToolCall
from actors.envs.sandbox import Limits, Sandbox

BUILTIN_TASKS = Path(__file__).parent / "shell_tasks"
#: Work folders live outside /tmp: the sandbox mounts a private /tmp.
DEFAULT_WORK_ROOT = "/var/tmp/compactionrl-shell"

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
        "name": "submit", "description": "End the task: its check decides the reward.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]


class Shell:
    """One shell episode at a time (see the module docstring)."""

    def __init__(self, tasks_dir: str = str(BUILTIN_TASKS), command_timeout_s: float = 10.0,
                 output_limit_bytes: int = 16 * 1024, memory_limit_mb: int = 1024,
                 max_processes: int = 64, work_root: str = DEFAULT_WORK_ROOT) -> None:
        self.tasks = sorted(p for p in Path(tasks_dir).iterdir() if (p / "task.toml").is_file())
        if not self.tasks:
            raise ValueError(f"no task folders (with task.toml) in {tasks_dir}")
        self.work_root = work_root
        self.sandbox = Sandbox(Limits(timeout_s=command_timeout_s,
                                      output_bytes=output_limit_bytes,
                                      memory_bytes=memory_limit_mb * 1024 * 1024,
                                      processes=max_processes), work_root)
        self._task_dir: Path | None = None
        self._workdir: str | None = None

    async def reset(self, seed: int) -> Task:
        await self.close()
        self._task_dir = self.tasks[seed % len(self.tasks)]
        spec = tomllib.loads((self._task_dir / "task.toml").read_text())
        self._workdir = tempfile.mkdtemp(prefix="episode-", dir=self.work_root)
        self.sandbox.prepare(self._workdir)
        setup = self._task_dir / "setup.sh"
        if setup.is_file():
            result = await self.sandbox.run(setup.read_text(), self._workdir)
            if result.exit_code != 0:
                raise RuntimeError(f"setup of {self._task_dir.name} failed: {result.describe()}")
        return Task(task_id=f"shell-{self._task_dir.name}", system=SYSTEM,
                    instruction=spec["instruction"], tools=TOOLS)

    async def step(self, action: str) -> StepResult:
        return StepResult("no tool call: call bash with one command, or submit when the task "
                          "is done.")

    async def call_tool(self, call: ToolCall) -> StepResult:
        assert self._workdir is not None and self._task_dir is not None, "reset() first"
        if call.name == "submit":
            check = self._task_dir / "check.sh"
            result = await self.sandbox.run(check.read_text(), self._workdir)
            solved = result.exit_code == 0
            return StepResult("task solved" if solved else "task not solved", done=True,
                              reward=float(solved), success=solved)
        command = call.arguments["command"]
        return StepResult((await self.sandbox.run(command, self._workdir)).describe())

    async def close(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
