"""``shell``: terminal tasks in the style of terminal benchmarks.

A task is a folder holding ``task.toml`` (``instruction = "..."``), and
optionally ``setup.sh`` (prepares the work folder) and ``check.sh`` (exit 0 =
solved). Each episode copies nothing from the host: it gets a fresh work
folder, runs ``setup.sh`` there, and then runs the agent's commands there,
each in the sandbox of :mod:`actors.envs.sandbox`.

Action format (what the system prompt tells the model):

- a fenced code block runs as one bash command::

      ```bash
      ls -la
      ```

- or the Qwen tool-call format:
  ``<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>``;
- ``submit`` (outside any code block) ends the episode; ``check.sh`` decides
  the reward (1 if it exits 0, else 0).

Anything else is answered with an observation explaining the format.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import tomllib
from pathlib import Path

from actors.envs.base import StepResult, Task
from actors.envs.sandbox import Limits, Sandbox

BUILTIN_TASKS = Path(__file__).parent / "shell_tasks"
#: Work folders live outside /tmp: the sandbox mounts a private /tmp.
DEFAULT_WORK_ROOT = "/var/tmp/compactionrl-shell"

SYSTEM = (
    "You operate a Linux shell to solve a task. Reply with exactly one bash command in a "
    "fenced code block, like:\n```bash\nls\n```\nYou will see its exit code and output. "
    "When the task is done, reply with the single word submit.")

_FENCE = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)```", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_action(text: str) -> tuple[str, str]:
    """``("run", command)``, ``("submit", "")`` or ``("invalid", reason)``."""
    if fence := _FENCE.search(text):
        command = fence.group(1).strip()
        return ("run", command) if command else ("invalid", "the code block is empty")
    if call := _TOOL_CALL.search(text):
        try:
            payload = json.loads(call.group(1))
            command = payload["arguments"]["command"]
        except (ValueError, KeyError, TypeError):
            return "invalid", "the tool call is not {\"name\": \"bash\", \"arguments\": " \
                              "{\"command\": \"...\"}}"
        if isinstance(command, str) and command.strip():
            return "run", command
        return "invalid", "the tool call has no command"
    if re.search(r"\bsubmit\b", text.lower()):
        return "submit", ""
    return "invalid", "no command found"


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
                    instruction=spec["instruction"])

    async def step(self, action: str) -> StepResult:
        assert self._workdir is not None, "reset() first"
        kind, payload = parse_action(action)
        if kind == "invalid":
            return StepResult(f"invalid action: {payload}. Reply with one bash command in a "
                              "```bash fenced block, or submit.")
        if kind == "submit":
            check = self._task_dir / "check.sh"
            result = await self.sandbox.run(check.read_text(), self._workdir)
            solved = result.exit_code == 0
            return StepResult("task solved" if solved else "task not solved", done=True,
                              reward=float(solved), success=solved)
        return StepResult((await self.sandbox.run(payload, self._workdir)).describe())

    async def close(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
