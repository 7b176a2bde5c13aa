"""The processes ``compactionrl up`` supervises: each child's start, stop and
restart back-off (:class:`Child`), the clean-up of what a dead child leaves
behind (:func:`stop_leftovers`), and the Prometheus server that watches the
run (:func:`start_prometheus`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy.config import ConfigError, JobConfig
from ops.metrics import port_in_use
from ops.observability import write_actor_targets, write_prometheus_files

#: Seconds before restarting a process after its n-th consecutive crash.
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
#: A process that ran this long before exiting starts its backoff afresh.
BACKOFF_RESET_S = 60.0
#: The replay or the learner exiting this many times in a row, each within
#: ``BACKOFF_RESET_S`` of its start, is a crash loop (a bad configuration, a
#: bug): the run stops instead of restarting it forever. Actors have no such
#: limit: the run goes on without them, and an operator sees them down.
SERVICE_MAX_CRASHES = 5
#: How long to wait for the killed leftovers of a dead child to be reaped.
ORPHAN_REAP_S = 10.0


@dataclass
class Child:
    name: str
    args: list[str]
    log: Path
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    crashes: int = 0
    restarts: int = 0
    restart_at: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    cores: frozenset[int] = frozenset()
    """CPU cores it (and every process it starts) may run on; empty: any."""
    restart_args: list[str] | None = None
    """Arguments of a restart (the learner resumes); None: the same as the first start."""
    leader_follows: bool = False
    """Stopping signals only its direct children; it exits when they have
    (torchrun: signalled itself, it logs a ``SignalException`` traceback even
    when its ranks stop cleanly)."""
    program: list[str] = field(default_factory=lambda: [sys.executable, "-m", "deploy.cli"])
    """What ``args`` are given to: the ``compactionrl`` command line, or another program."""

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:
            # own process group: stopping it stops the engine's and torchrun's children
            self.process = subprocess.Popen(
                [*self.program, *self.args], stdout=log, stderr=log,
                stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, **self.env})
        if self.cores:  # set before it starts its own children, which inherit it
            os.sched_setaffinity(self.process.pid, self.cores)
        self.started_at = time.monotonic()
        self.restart_at = None

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def schedule_restart(self, now: float) -> float:
        """After an exit at ``now``: count the crash (the count starts afresh
        if it had run longer than ``BACKOFF_RESET_S``), set when it restarts,
        and return the delay, which doubles with each crash in a row up to
        the last of ``RESTART_BACKOFF_S``."""
        if now - self.started_at > BACKOFF_RESET_S:
            self.crashes = 0
        delay = RESTART_BACKOFF_S[min(self.crashes, len(RESTART_BACKOFF_S) - 1)]
        self.crashes += 1
        self.restart_at = now + delay
        return delay

    def crash_looping(self) -> bool:
        """Exited, after ``SERVICE_MAX_CRASHES`` exits in a row each soon
        after its start: for the replay or the learner, the run stops."""
        return self.crashes >= SERVICE_MAX_CRASHES and self.exit_code() is not None

    def stop(self, grace_s: float, sig: int = signal.SIGTERM) -> int | None:
        """Signal the group, wait up to ``grace_s``, then kill what is left.

        The direct children are signalled first: torchrun's ranks run in
        sessions of their own and torchrun gives them only a few seconds
        after forwarding a signal, too little for the final checkpoint and
        export; signalled directly, they finish and torchrun exits with them
        (``leader_follows``)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            children = child_pids(self.process.pid)
            for child in children:
                _signal(child, sig)
            if not (self.leader_follows and children):
                signal_group(self.process.pid, sig)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        signal_group(self.process.pid, signal.SIGKILL)  # stragglers of the group
        return self.process.wait()


def start_prometheus(config: JobConfig, run_dir: Path) -> Child | None:
    """Write the run's Prometheus configuration in ``RUN/prometheus`` and,
    where ``observability.prometheus`` asks for it, start a server with it
    (data in ``RUN/prometheus/data``) and say where it listens. The actor
    list starts empty: the replay lists each actor as it registers, and an
    earlier invocation's list would have Prometheus judge actors that are
    gone. With ``"on"``, raises :class:`ConfigError` where none can start."""
    folder = run_dir / "prometheus"
    write_prometheus_files(folder, **config.observability_files(folder))
    write_actor_targets(Path(config.replay.actor_targets_path), {}, config.run.name)
    wanted, address = config.observability.prometheus, config.observability.prometheus_address
    program = None if wanted == "off" else shutil.which("prometheus")
    if program is None or _in_use(address):
        why_not = ('observability.prometheus = "off"' if wanted == "off"
                   else "no prometheus program is on PATH; as root, `sh deploy/"
                        "observability/install-prometheus.sh` installs Debian's" if program is None
                   else f"observability.prometheus_address {address} is in use")
        if wanted == "on":
            raise ConfigError([f'observability.prometheus = "on", but {why_not}: fix that, or '
                               'set it to "auto" or "off"'])
        print(f"prometheus: not started ({why_not}); this run's configuration for one: "
              f"{folder / 'prometheus.yml'}", flush=True)
        return None
    child = Child("prometheus", [f"--config.file={folder / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={folder / 'data'}",
                                 f"--web.listen-address={address}"],
                  run_dir / "logs" / "prometheus.log", program=[program])
    child.start()
    print(f"prometheus: http://{address} (configuration {folder / 'prometheus.yml'}, log "
          f"{child.log})", flush=True)
    return child


def _in_use(address: str) -> bool:
    """Something listens on ``HOST:PORT``."""
    host, _, port = address.rpartition(":")
    return port_in_use(host.strip("[]"), int(port))


def stop_leftovers(dead: int | None, keep: set[int]) -> list[int]:
    """Kill and reap what dead children left behind: the process group of
    ``dead`` (a child's pid: a vLLM engine's core, workers and resource
    tracker stay in it), and every orphan reparented to this process (``up``
    is a subreaper), such as torchrun's ranks, which run in sessions of their
    own. ``keep``: the pids of the children in service (never touched).
    Returns the orphans' pids."""
    if dead is not None:
        signal_group(dead, signal.SIGKILL)
    orphans = [pid for pid in child_pids(os.getpid()) if pid not in keep]
    for pid in orphans:
        signal_group(pid, signal.SIGKILL)
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + ORPHAN_REAP_S
    waiting = set(orphans)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not ours (any more): gone
                done = pid
            if done:
                waiting.discard(pid)
        time.sleep(0.05)
    return orphans


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
