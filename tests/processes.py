"""Running project commands from tests so that nothing outlives the test."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from deploy.children import child_pids
from ops.summary import scrape
from tests.ports import free_port_range, free_ports, loopback_addresses

VENV_BIN = Path(sys.executable).parent

#: Overrides for test-sized episodes: the default 270-token window (the
#: untrained tiny model fills it in a few turns, so it compacts), few steps,
#: two at a time.
SMALL_EPISODES = ["--actors.environment.max_steps", "12",
                  "--actors.concurrent_episodes", "2"]


#: Seconds the Python processes of a timed-out command get to write their stacks.
STACK_DUMP_S = 3.0


def run_command(args: list[str], timeout: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in its own process group and kill the whole group when it
    ends or times out, so engine subprocesses never leak into later tests.

    A command that times out is hung somewhere: before it is killed, every
    process of its tree gets SIGABRT, on which Python's fault handler (on in
    each of them through ``PYTHONFAULTHANDLER``) writes every thread's stack
    to stderr, whose tail the failure then shows."""
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True,
                               env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = process_tree(process.pid)
        for pid in reversed(tree):  # the deepest first
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=STACK_DUMP_S)
        except subprocess.TimeoutExpired:  # one that handles SIGABRT, in a session of its own
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        raise AssertionError(f"{args} timed out after {timeout} s (stacks at the end):\n"
                             f"{stderr[-12000:]}") from None
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def wait_until(condition: Callable[[], object], timeout: float, what: str,
               process: subprocess.Popen | None = None, context: Callable[[], str] = str,
               poll_s: float = 0.3, between: Callable[[float], object] = time.sleep) -> float:
    """Seconds until ``condition()`` holds; fails after ``timeout`` s, or as
    soon as ``process`` (the one the condition waits on) exits, with
    ``context()`` (log tails, say) in the message. ``between(poll_s)`` runs
    between two checks: a sleep, or the serving of an in-process peer that
    the condition waits on (``ReplayPeer.pump``)."""
    began = time.monotonic()
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{process.args[0]} exited with {process.returncode} before "
                                 f"{what}\n{context()}")
        if time.monotonic() - began > timeout:
            raise AssertionError(f"no {what} within {timeout} s\n{context()}")
        between(poll_s)
    return time.monotonic() - began


def _labelled_sum(samples: dict, name: str, labels: dict[str, str]) -> float:
    return sum(value for found, value in samples.get(name, [])
               if all(found.get(k) == v for k, v in labels.items()))


def metric(port: int, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` with ``labels`` at a process's metrics
    port on loopback (0 if it does not answer)."""
    return _labelled_sum(scrape(f"http://127.0.0.1:{port}/metrics") or {}, name, labels)


def answered_metric(port: int, name: str, timeout: float = 60, **labels: str) -> float:
    """Like :func:`metric`, for a value a test asserts on: a process that
    does not answer (busy past the scrape's timeout) is asked again, never
    read as 0."""
    end = time.monotonic() + timeout
    while (samples := scrape(f"http://127.0.0.1:{port}/metrics")) is None:
        assert time.monotonic() < end, f"no answer from the metrics port {port} in {timeout} s"
        time.sleep(0.5)
    return _labelled_sum(samples, name, labels)


def compactionrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_command([str(VENV_BIN / "compactionrl"), *args], timeout)


class Background:
    """A project command running in its own process group, its stderr in a
    file that tests can wait on; the whole group is killed on ``stop()``.

    Usage::

        with Background([...compactionrl args...], log_path) as learner:
            learner.wait_for("published version 1", timeout=120)
    """

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None) -> None:
        """``launcher``: a command that runs the rest (``ip netns exec NS``)."""
        self.args = args
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen([*(launcher or []), str(VENV_BIN / "compactionrl"),
                                         *args],
                                        stdout=subprocess.DEVNULL, stderr=self._log,
                                        start_new_session=True,
                                        env={**os.environ, **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float, count: int = 1) -> None:
        """Until ``text`` appears ``count`` times in the log (fails if the process exits)."""
        end = time.monotonic() + timeout
        while self.log().count(text) < count:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.args[0]} exited with {self.process.returncode} "
                                     f"before logging {text!r}:\n{self.log()[-4000:]}")
            if time.monotonic() > end:
                raise AssertionError(f"no {text!r} within {timeout} s:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def send(self, sig: int) -> None:
        os.killpg(self.process.pid, sig)

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 60) -> int | None:
        """Signal the group, wait for the process, then kill whatever is left."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            code: int | None = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._log.close()
        return code

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (Linux), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def running(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie (Linux /proc): a zombie has
    exited, and its parent, not the test, reaps it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def running_after(pids: list[int], seconds: float) -> list[int]:
    """Those of ``pids`` still running after ``seconds``, or at once when none
    is: what a test asserts empty once it has stopped or killed them."""
    deadline = time.monotonic() + seconds
    while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (Linux): an actor with its
    engine's processes, torchrun with its ranks (which run in sessions of their
    own, so a process group would miss them)."""
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier += child_pids(pid)
    return tree


def command_line(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ('' once it has gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def engine_core(actor_pid: int) -> int:
    """The pid of the vLLM engine core process under an actor."""
    [pid] = [p for p in process_tree(actor_pid) if "EngineCore" in command_line(p)]
    return pid


def tree_rss_bytes(root: int) -> int:
    """Resident memory of ``process_tree(root)``, in bytes. Shared pages count
    once per process, so this bounds what the tree uses."""
    total = 0
    for pid in process_tree(root):
        try:
            total += rss_bytes(pid)
        except (OSError, AssertionError):  # exited meanwhile
            continue
    return total


class ReplayProcess:
    """`compactionrl replay` on free loopback ports, in its own process group
    (killed by ``stop()``), its metrics read from its own port.

    Usage::

        replay = ReplayProcess(tmp_path, "--replay.vocab_size", "100")
        replay.metric("crl_replay_segments_total", result="accepted")
        replay.stop()
    """

    def __init__(self, folder: Path, *overrides: str) -> None:
        self.actor_address, self.learner_address = loopback_addresses(2)
        [self.metrics_port] = free_ports(1)
        self.background = Background([
            "replay", "--replay.actor_address", self.actor_address,
            "--replay.learner_address", self.learner_address,
            "--replay.metrics_port", str(self.metrics_port),
            "--replay.log_path", str(folder / "replay" / "segments.log"),
            "--run.model", str(folder / "no-model"), *overrides], folder / "replay.log")
        self.pid = self.background.process.pid
        end = time.monotonic() + 60
        while self.samples() is None:  # sockets are bound before metrics are served
            assert self.background.process.poll() is None, self.background.log()[-4000:]
            assert time.monotonic() < end, "the replay did not start within 60 s"
            time.sleep(0.2)

    def samples(self) -> dict | None:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics_port, name, **labels)

    def rejected(self) -> Counter[str]:
        return Counter({found["reason"]: int(value) for found, value in
                        (self.samples() or {}).get("crl_replay_rejected_messages_total", [])})

    def wait_learner_version(self, version: int) -> None:
        """Until the replay knows the learner's version (it bounds the version window)."""
        end = time.monotonic() + 30
        while self.metric("crl_replay_learner_version") != version:
            assert time.monotonic() < end, "the learner's request did not arrive"
            time.sleep(0.1)

    def wait_rejected(self, total: int, timeout_s: float = 30) -> Counter[str]:
        end = time.monotonic() + timeout_s
        while sum((counts := self.rejected()).values()) < total:
            assert time.monotonic() < end, f"only {counts} rejections counted, {total} expected"
            time.sleep(0.2)
        return counts

    def stop(self) -> None:
        self.background.stop()


def leave_process_group() -> NoReturn:
    """End a rank of a test program once every rank is done: a barrier, then
    exit without tearing gloo down, whose teardown races when a peer closes
    first (a rank aborts: "terminate called without an active exception")."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class UpOnLoopback:
    """`compactionrl up` of a test: replay, learner and ``actors`` actors on
    free loopback ports (each process's metrics port in ``ports``), the run
    folder under ``root``; started by :meth:`start` in a session of its own,
    and stopped with its whole process tree by :meth:`stop_tree` (the engines'
    and torchrun's processes run in sessions of their own too).

    Usage::

        up = UpOnLoopback(tmp_path, "my-run", model, actors=1, "--replay.rollouts_per_batch", "4")
        process = up.start()
        try:
            ...
        finally:
            up.stop_tree()
    """

    def __init__(self, root: Path, name: str, model: Path, actors: int, *overrides: str) -> None:
        actor_address, learner_address, control_address = loopback_addresses(3)
        store, replay_port, learner_port = free_ports(3)
        self.actor_ports = free_port_range(actors)  # actor i serves on actors.metrics_port + i
        self.ports = {"replay": replay_port, "learner": learner_port,
                      "actor": self.actor_ports.start}
        self.folder = root / "runs" / name
        self.args = [
            str(VENV_BIN / "compactionrl"), "up", "--run.name", name,
            "--run.out_dir", str(root / "runs"), "--run.model", str(model),
            "--learner.nproc", "1", "--learner.control_address", control_address,
            "--learner.weight_store_address", f"127.0.0.1:{store}",
            "--learner.metrics_port", str(learner_port),
            "--replay.actor_address", actor_address, "--replay.learner_address", learner_address,
            "--replay.metrics_port", str(replay_port),
            "--replay.log_path", str(root / "replay" / "segments.log"),
            "--actors.metrics_port", str(self.actor_ports.start), "--actors.count", str(actors),
            # a test's run starts no Prometheus of its own: two on one port would race
            "--observability.prometheus", "off", *overrides]
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> subprocess.Popen[str]:
        self.process = subprocess.Popen(self.args, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        return self.process

    def stop_tree(self) -> None:
        """If still running (a test failed before its clean stop): SIGINT,
        then SIGKILL to whatever of the tree is left."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        tree = process_tree(process.pid)
        process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=120)
        for pid in [process.pid, *tree]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def scripted_replay(folder: Path, batch: int, *overrides: str) -> Iterator[ReplayProcess]:
    """A replay process for scripted peers: token ids below 100, batches of
    ``batch``, a staleness bound of 4; stopped on the way out."""
    process = ReplayProcess(folder, "--replay.vocab_size", "100", "--replay.rollouts_per_batch",
                            str(batch), "--replay.max_staleness", "4", *overrides)
    try:
        yield process
    finally:
        process.stop()
