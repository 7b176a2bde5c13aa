"""Running one shell command under limits, for the ``shell`` environment.

Layers, each used where the platform allows (``Sandbox.isolation`` says which):

- resource limits on every process: address space (memory), file size,
  process count, no core dumps;
- as root, with ``unshare`` and ``setpriv`` (util-linux): a private network
  namespace (no network), a PID namespace (killing the command kills every
  process it started, fork bombs included), a mount namespace in which ``/``
  is read-only except the work folder and ``/tmp`` and ``/dev/shm`` are small
  private tmpfs, and the command itself runs as ``nobody`` with no
  capabilities, so the process limit counts only sandboxed processes;
- otherwise (not root, or no ``unshare``): limits only, the command in its
  own process group, which is killed on timeout. Network and writes outside
  the work folder are then not prevented; the docs say so.

Every command has a wall-clock limit and an output cap; exceeding either
kills it and says so in the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import subprocess
from dataclasses import dataclass

NOBODY = 65534
#: Read output in chunks of this size; small enough to stop soon after the cap.
READ_CHUNK = 64 * 1024

_INSIDE = (
    'mount --bind "$0" "$0" && mount -o remount,bind,ro / '
    '&& mount -t tmpfs -o size=64m,mode=1777 none /tmp '
    '&& mount -t tmpfs -o size=16m,mode=1777 none /dev/shm '
    '&& cd "$0" && exec setpriv --reuid={uid} --regid={uid} --clear-groups --inh-caps=-all '
    '--bounding-set=-all -- bash -c "$1"'
)


@dataclass
class Limits:
    """Per-command limits."""

    timeout_s: float = 10.0
    output_bytes: int = 64 * 1024
    memory_bytes: int = 1024 * 1024 * 1024
    file_bytes: int = 64 * 1024 * 1024
    processes: int = 64


@dataclass
class CommandResult:
    exit_code: int | None
    """None when the command was killed."""
    output: str
    timed_out: bool = False
    output_capped: bool = False

    def describe(self) -> str:
        """The observation the agent sees."""
        notes = []
        if self.timed_out:
            notes.append("command killed: time limit reached")
        if self.output_capped:
            notes.append("command killed: output limit reached")
        status = f"exit code {self.exit_code}" if self.exit_code is not None else "killed"
        return "\n".join([status, *notes, self.output]).rstrip()


def _namespace_argv(workdir: str, command: str) -> list[str]:
    return ["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc",
            "sh", "-c", _INSIDE.replace("{uid}", str(NOBODY)), workdir, command]


def _namespaces_usable(work_root: str) -> bool:
    """Whether the whole namespace path works here: tried once, for real."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        return False
    os.makedirs(work_root, exist_ok=True)
    probe = subprocess.run(_namespace_argv(work_root, "true"), capture_output=True, timeout=30)
    return probe.returncode == 0


def _only_child(pid: int) -> int | None:
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return None
    return int(children[0]) if len(children) == 1 else None


class Sandbox:
    """Runs commands in a work folder under :class:`Limits`."""

    def __init__(self, limits: Limits, work_root: str) -> None:
        self.limits = limits
        self.isolation = "namespaces" if _namespaces_usable(work_root) else "rlimits"

    def _set_limits(self) -> None:  # runs in the child before exec
        limits = self.limits
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.isolation == "namespaces":  # counts processes of `nobody` only
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))

    def prepare(self, workdir: str) -> None:
        """Make ``workdir`` usable by the sandboxed user."""
        if self.isolation == "namespaces":
            for root, dirs, files in os.walk(workdir):
                for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                    os.chown(name, NOBODY, NOBODY)

    def _kill(self, pid: int) -> None:
        """Kill a running command and everything it started. With namespaces
        the PID namespace's init is killed: the kernel then kills and reaps
        every process inside before ``unshare`` exits, so nothing is left
        behind, not even zombies (killing ``unshare`` first would orphan them)."""
        init = _only_child(pid) if self.isolation == "namespaces" else None
        with contextlib.suppress(ProcessLookupError):
            if init is not None:
                os.kill(init, signal.SIGKILL)
            else:
                os.killpg(pid, signal.SIGKILL)

    async def run(self, command: str, workdir: str, timeout_s: float | None = None
                  ) -> CommandResult:
        """Run ``command`` in ``workdir``; ``timeout_s`` overrides the
        limits' wall-clock limit (a task's test script has its own)."""
        if self.isolation == "namespaces":
            argv = _namespace_argv(workdir, command)
        else:
            argv = ["bash", "-c", command]
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=workdir, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True, preexec_fn=self._set_limits,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"})
        output = bytearray()
        capped = timed_out = False

        async def read() -> None:
            nonlocal capped
            while chunk := await process.stdout.read(READ_CHUNK):
                output.extend(chunk)
                if len(output) > self.limits.output_bytes:
                    capped = True
                    return

        try:
            await asyncio.wait_for(read(), timeout_s or self.limits.timeout_s)
        except TimeoutError:
            timed_out = True
        if timed_out or capped:
            self._kill(process.pid)
        try:
            # drain what is left: the pipe reaches EOF and the process is reaped
            await asyncio.wait_for(process.communicate(), 5)
            exit_code = process.returncode
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            exit_code = None
        await asyncio.sleep(0)  # let the transport's close callbacks run
        text = output[: self.limits.output_bytes].decode("utf-8", errors="replace")
        return CommandResult(None if (timed_out or capped) else exit_code, text, timed_out,
                             capped)
