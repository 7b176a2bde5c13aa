"""``compactionrl up``: the whole run on this machine, supervised.

Starts the replay, the learner (under torchrun) and ``actors.count`` actors
as separate process groups, each logging to ``RUN/logs/NAME.log``, with the
effective configuration written once to ``RUN/config.toml`` and read by all.

Devices come from the plan (:mod:`deploy.device_plan`): each process gets its
GPUs as ``CUDA_VISIBLE_DEVICES`` and the learner and the actors the weight
transport it chose. With co-location (an engine on a learner rank's GPU) that
engine starts first, at the plan's ``gpu_memory_utilization``, and the learner
once the engine answers on its metrics port: vLLM measures free memory while
it starts and fails if another process allocates or frees meanwhile. On a
CPU-only machine the plan sets no devices and local actors get a core each.

Supervision:

- a process that exits is restarted with backoff (``RESTART_BACKOFF_S``;
  reset after it ran ``BACKOFF_RESET_S``):
  - an actor rejoins as a new incarnation (the replay expires its lost
    in-flight rollouts, the learner sends it weights);
  - the replay recovers its durable log (every acknowledged segment) and the
    actors resend what it had not acknowledged;
  - the learner is restarted with ``--resume``: it continues from its newest
    checkpoint at a version above any it announced, and the actors load its
    next publication;
- the learner or the replay failing ``SERVICE_MAX_CRASHES`` times in a row
  (a crash loop, not a fault) stops the run, says which and where its log
  is, and prints the command that resumes it;
- the learner finishing (``learner.max_steps``), ``run.max_minutes``, Ctrl-C
  or SIGTERM shut everything down in order: the learner first (it writes a
  checkpoint and the HF export), then the actors (they flush their
  segments), then the replay. Nothing is left running.

Exit codes: 0 finished (steps or wall time), 1 a component failed,
130 interrupted.

Every ``SCRAPE_INTERVAL_S`` the processes' ``/metrics`` are summarised into
a snapshot (:mod:`ops.summary`), appended to ``RUN/metrics.jsonl`` and shown
(a live table on a terminal, a line every ``PLAIN_EVERY_S`` otherwise). At the
end ``RUN/report.html`` (:mod:`ops.report`) and ``RUN/summary.txt`` are written.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy.config import ConfigError, JobConfig, RunConfig, to_toml
from deploy.device_plan import DevicePlan, plan_devices
from learner.checkpoint import checkpoint_position, latest_checkpoint
from ops.files import atomic_write_text
from ops.lifetime import become_subreaper
from ops.report import read_history, write_report
from ops.summary import RunEnds, RunScraper, pace_start, scrape, summarise

#: Seconds before restarting a process after its n-th consecutive crash.
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
#: A process that ran this long before exiting starts its backoff afresh.
BACKOFF_RESET_S = 60.0
#: The replay or the learner exiting this many times in a row, each within
#: ``BACKOFF_RESET_S`` of its start, is a crash loop (a bad configuration, a
#: bug): the run stops instead of restarting it forever. Actors have no such
#: limit: the run goes on without them, and an operator sees them down.
SERVICE_MAX_CRASHES = 5
SCRAPE_INTERVAL_S = 2.0
#: Without a terminal (CI, pipes), one summary line this often.
PLAIN_EVERY_S = 15.0
#: The learner's checkpoint and export at shutdown can take this long.
LEARNER_STOP_S = 120.0
#: The replay's final log sync.
REPLAY_STOP_S = 20.0
#: How long to wait for the killed leftovers of a dead child to be reaped.
ORPHAN_REAP_S = 10.0
#: How often a learner waiting for a co-located engine asks whether it is up.
READY_POLL_S = 2.0
EXIT_FINISHED, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


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

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:
            # own process group: stopping it stops the engine's and torchrun's children
            self.process = subprocess.Popen(
                [sys.executable, "-m", "deploy.cli", *self.args], stdout=log, stderr=log,
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
                _signal_group(self.process.pid, sig)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process.pid, signal.SIGKILL)  # stragglers of the group
        return self.process.wait()


def stop_leftovers(dead: int | None, keep: set[int]) -> list[int]:
    """Kill and reap what dead children left behind: the process group of
    ``dead`` (a child's pid: a vLLM engine's core, workers and resource
    tracker stay in it), and every orphan reparented to this process (``up``
    is a subreaper), such as torchrun's ranks, which run in sessions of their
    own. ``keep``: the pids of the children in service (never touched).
    Returns the orphans' pids."""
    if dead is not None:
        _signal_group(dead, signal.SIGKILL)
    orphans = [pid for pid in child_pids(os.getpid()) if pid not in keep]
    for pid in orphans:
        _signal_group(pid, signal.SIGKILL)
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


def _signal_group(pid: int, sig: int) -> None:
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


@dataclass
class Up:
    config: JobConfig
    run_dir: Path
    resume: bool = False
    interactive: bool = field(default_factory=lambda: sys.stdout.isatty())
    plan: DevicePlan | None = None
    """Which GPUs each process gets (None: planned for this machine's GPUs)."""
    history: list[dict] = field(default_factory=list)
    _stop_reason: str | None = None

    def __post_init__(self) -> None:
        if self.plan is None:
            self.plan = plan_devices(self.config, self._gpus_present())
        if self.plan.problems:
            raise ConfigError(list(self.plan.problems))
        self.config_path = self.run_dir / "config.toml"
        self.history_path = self.run_dir / "metrics.jsonl"
        logs = self.run_dir / "logs"
        common = ["--config", str(self.config_path)]
        self.replay = Child("replay", ["replay", *common], logs / "replay.log")
        actor_cores, learner_cores = self._cpu_cores()
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
        learner_plan = self.plan.process("learner")
        transport = self._transport_args()
        learner_env = {**self._learner_env(learner_cores), **learner_plan.env(inherited)}
        self.learner = Child("learner", ["learner", *common, *transport,
                                         *(["--resume"] if self.resume else [])],
                             logs / "learner.log", env=learner_env,
                             cores=learner_cores,
                             restart_args=["learner", *common, *transport, "--resume"],
                             leader_follows=True)
        self.actors = [Child(f"actor-{i}", ["actor", *common, "--index", str(i), "--actor-id",
                                            f"{self.config.run.name}-actor-{i}",
                                            *self._bind_engine(actor_cores, i),
                                            *transport, *self._engine_memory(i)],
                             logs / f"actor-{i}.log",
                             env=self.plan.process(f"actor-{i}").env(inherited),
                             cores=frozenset({actor_cores[i]}) if actor_cores else frozenset())
                       for i in range(self.config.actors.count)]
        self._waiting = {self.learner.name: learner_plan.waits_for} if learner_plan.waits_for \
            else {}
        self._last_ready_poll = 0.0

    def _transport_args(self) -> list[str]:
        """The plan's weight transport for learner and actors ("auto" resolved
        here: only the plan knows of co-location). Nothing on the CPU plan."""
        if not self.plan.gpus_present:
            return []
        return ["--learner.weight_transport", self.plan.weight_transport]

    def _engine_memory(self, index: int) -> list[str]:
        """A co-located engine's lowered share of its GPU."""
        memory = self.plan.process(f"actor-{index}").gpu_memory_utilization
        if memory is None or memory == self.config.actors.engine.gpu_memory_utilization:
            return []
        return ["--actors.engine.gpu_memory_utilization", str(memory)]

    def _cpu_cores(self) -> tuple[list[int], frozenset[int]]:
        """On a CPU-only machine (engine binding "auto"): the core of each local
        actor, round robin over all cores but the last ones, and the cores left
        to the learner — as on a cluster, where each has devices of its own.
        Engines that each spin OpenMP threads on every core starve each other
        and the learner, and a learner on an engine's core slows both. Empty
        (no placement) on GPU machines or with an explicit binding."""
        if self.plan.gpus_present or self.config.actors.engine.cpu_threads_bind != "auto":
            return [], frozenset()
        cores = sorted(os.sched_getaffinity(0))
        # at least one core is the learner's whenever there are two
        span = max(1, min(self.config.actors.count, len(cores) - 1))
        actor_cores = [cores[i % span] for i in range(self.config.actors.count)]
        return actor_cores, frozenset(cores[span:] or cores)

    @staticmethod
    def _bind_engine(actor_cores: list[int], index: int) -> list[str]:
        """The engine's OpenMP threads on the actor's core."""
        return ["--actors.engine.cpu_threads_bind", str(actor_cores[index])] if actor_cores else []

    def _learner_env(self, learner_cores: frozenset[int]) -> dict[str, str]:
        """The learner's ranks share its cores: one OpenMP thread each per core."""
        if not learner_cores:
            return {}
        return {"OMP_NUM_THREADS": str(max(1, len(learner_cores) // self.config.learner.nproc))}

    @staticmethod
    def _on_gpu() -> bool:
        import torch

        return torch.cuda.is_available()

    @staticmethod
    def _gpus_present() -> int:
        """GPUs this process sees (within its own CUDA_VISIBLE_DEVICES)."""
        if not Up._on_gpu():
            return 0
        import torch

        return torch.cuda.device_count()

    @staticmethod
    def _gpu_bytes() -> int | None:
        """The smallest GPU's memory in bytes (None without GPUs)."""
        if not Up._gpus_present():
            return None
        import torch

        return min(torch.cuda.get_device_properties(i).total_memory
                   for i in range(torch.cuda.device_count()))

    # ------------------------------------------------------------------ the run

    def run(self) -> int:
        earlier = [path for path in (self.run_dir / "checkpoints",
                                     Path(self.config.replay.log_path))
                   if path.exists()]
        if earlier and not self.resume:
            # a fresh learner at version 0 beside an earlier run's checkpoints
            # and rollouts would mix the two runs
            print(f"the run folder {self.run_dir} holds an earlier run "
                  f"({', '.join(str(path) for path in earlier)}): continue it with --resume, "
                  "or remove it, or choose another --run.name", file=sys.stderr)
            return EXIT_FAILED
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(to_toml(self.config))
        become_subreaper()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        # a resumed run's history goes on: its totals, restarts and wall time add up
        self.history = read_history(self.history_path) if self.resume else []
        self._first = len(self.history)  # this invocation's first snapshot
        self._scraper = RunScraper(self._urls(), self.history)
        began = self._began = time.monotonic()
        self._ends = RunEnds(self.config.learner.max_steps, self.config.run.max_minutes,
                             started=time.time())
        self._start_first()
        self._write_state()
        outcome, message = EXIT_FAILED, "up itself failed (see its output)"
        try:
            outcome, message = self._supervise(began)
        finally:
            self.learner.stop(LEARNER_STOP_S)  # first: it writes the final checkpoint
            self._snapshot(final=True)
            self._shutdown()
            summary = self._summary(ended=message)
            (self.run_dir / "summary.txt").write_text(
                "\n".join(f"{k}: {v}" for k, v in summary.items()) + "\n")
            write_report(self.run_dir, self.config.run.name)
            self._write_state(ended={"message": message, "exit_code": outcome,
                                     "wall_s": round(time.monotonic() - began, 1)})
        print(message)
        if outcome == EXIT_FAILED or outcome == EXIT_INTERRUPTED:
            print(f"resume with: {resume_command(self.config_path)}")
        print(f"run folder: {self.run_dir} (report.html, metrics.jsonl, logs/)")
        return outcome

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stop_reason = signal.Signals(signum).name

    def _supervise(self, began: float) -> tuple[int, str]:
        view = _View(self.interactive)
        last_scrape = 0.0
        try:
            while True:
                now = time.monotonic()
                if self._stop_reason:
                    return EXIT_INTERRUPTED, f"interrupted ({self._stop_reason}): stopped cleanly"
                minutes = self.config.run.max_minutes
                if minutes and now - began > minutes * 60:
                    return EXIT_FINISHED, f"wall time of {minutes} min reached"
                if self.learner.exit_code() == 0:
                    return EXIT_FINISHED, (f"finished: {self.config.learner.max_steps} "
                                           "learner steps")
                for service in (self.replay, self.learner):
                    if service.crash_looping():
                        return EXIT_FAILED, (
                            f"the {service.name} exited with code {service.exit_code()} "
                            f"{service.crashes} times in a row; see {service.log}")
                self._start_waiting(now)
                for child in (self.replay, self.learner, *self.actors):
                    self._restart_if_exited(child, now)
                if now - last_scrape >= SCRAPE_INTERVAL_S:
                    last_scrape = now
                    self._snapshot()
                    view.show(self._summary())
                time.sleep(0.2)
        finally:
            view.close()

    def _start_first(self) -> None:
        """Every process the plan does not hold back (a learner waits for the
        engines on its GPUs: ``_start_waiting``)."""
        for child in (self.replay, self.learner, *self.actors):
            if child.name in self._waiting:
                print(f"{child.name} starts once {', '.join(self._waiting[child.name])} "
                      "answers: they share GPUs, and vLLM measures free memory while it "
                      "starts", flush=True)
            else:
                child.start()

    def _start_waiting(self, now: float) -> None:
        """Start a process held back by the plan once all it waits for are ready."""
        if not self._waiting or now - self._last_ready_poll < READY_POLL_S:
            return
        self._last_ready_poll = now
        for name, awaited in list(self._waiting.items()):
            if all(self._engine_ready(actor) for actor in awaited):
                del self._waiting[name]
                child = next(c for c in (self.replay, self.learner, *self.actors)
                             if c.name == name)
                print(f"{', '.join(awaited)} ready: starting the {name}", flush=True)
                child.start()
                self._write_state()

    def _engine_ready(self, actor: str) -> bool:
        """An actor serves metrics once its engine has started (actors/process.py)."""
        return scrape(self._urls()[actor]) is not None

    def _restart_if_exited(self, child: Child, now: float) -> None:
        """Schedule the restart of a child that exited, or restart it when due."""
        code = child.exit_code()
        if code is not None and child.restart_at is None:
            delay = child.schedule_restart(now)
            # before its successor starts: on a GPU, what it left holds the memory
            orphans = stop_leftovers(child.process.pid, self._children_pids())
            print(f"{child.name} exited with code {code}; restarting in {delay:.0f} s "
                  f"(see {child.log})"
                  + (f"; stopped {len(orphans)} processes it left" if orphans else ""),
                  flush=True)
        elif child.restart_at is not None and now >= child.restart_at:
            child.restarts += 1
            if child.restart_args is not None:
                child.args = child.restart_args
            child.start()
            self._write_state()

    def _shutdown(self) -> None:
        """After the learner: the actors (they flush), then the replay."""
        deadline = self.config.actors.shutdown_deadline_s + 10
        for actor in self.actors:
            if actor.process is not None and actor.process.poll() is None:
                _signal_group(actor.process.pid, signal.SIGTERM)
        for actor in self.actors:
            actor.stop(deadline)
        self.replay.stop(REPLAY_STOP_S)
        stop_leftovers(None, set())

    def _children_pids(self) -> set[int]:
        return {child.process.pid for child in (self.replay, self.learner, *self.actors)
                if child.process is not None}

    # ------------------------------------------------------------------ metrics

    def _urls(self) -> dict[str, str]:
        host = self.config.transport.metrics_address
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        urls = {"replay": f"http://{host}:{self.config.replay.metrics_port}/metrics",
                "learner": f"http://{host}:{self.config.learner.metrics_port}/metrics"}
        for index in range(self.config.actors.count):
            urls[f"actor-{index}"] = (f"http://{host}:{self.config.actors.metrics_port + index}"
                                      "/metrics")
        return urls

    def _snapshot(self, final: bool = False) -> None:
        """Scrape into the history. The final one also takes the learner's
        version and step from its last checkpoint (a finished learner no
        longer serves metrics)."""
        snapshot = self._scraper.snapshot({
            "actor_restarts": float(sum(a.restarts for a in self.actors)),
            "replay_restarts": float(self.replay.restarts),
            "learner_restarts": float(self.learner.restarts),
            "up_invocations": 1.0, "run_seconds": time.monotonic() - self._began})
        checkpoint = latest_checkpoint(self.run_dir / "checkpoints") if final else None
        if checkpoint is not None:
            version, step = checkpoint_position(checkpoint)
            snapshot["learner_version"] = float(version)
            snapshot["learner_step"] = float(step)
        self.history.append(snapshot)
        with self.history_path.open("a") as history:
            history.write(json.dumps(snapshot) + "\n")

    def _summary(self, ended: str | None = None) -> dict[str, str]:
        if len(self.history) <= self._first:
            return {"run": "no metrics yet"}
        before = self.history[-2] if len(self.history) > self._first + 1 else None
        return summarise(self.history[-1], before, pace_start(self.history[self._first:]),
                         self._ends, ended)

    def _write_state(self, ended: dict | None = None) -> None:
        """``RUN/up.json``: what ``compactionrl status`` reads; rewritten when
        a child restarts, so that its pids are the live ones, and at the end
        with how the run ended."""
        atomic_write_text(self.run_dir / "up.json", json.dumps({
            "pid": os.getpid(), "finished": ended is not None, "ended": ended,
            "max_steps": self._ends.max_steps, "max_minutes": self._ends.max_minutes,
            "children": {c.name: c.process.pid for c in (self.replay, self.learner, *self.actors)
                         if c.process is not None},
            "started": self._ends.started}))


class _View:
    """A live table on a terminal; otherwise a summary line now and then."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self._live = None
        self._last_plain = 0.0
        if interactive:
            from rich.live import Live

            self._live = Live(refresh_per_second=2, transient=False)
            self._live.start()

    def show(self, summary: dict[str, str]) -> None:
        if self._live is not None:
            from rich.table import Table

            table = Table(title="CompactionRL", show_header=False)
            for key, value in summary.items():
                table.add_row(key, value)
            self._live.update(table)
        elif time.monotonic() - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = time.monotonic()
            print(" | ".join(f"{k}: {v}" for k, v in summary.items()), flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()


def prepare_model(config: JobConfig) -> None:
    """The embedded default's base policy, on first use, is the checkout's
    kept base (its digest checked), else bootstrapped (a few minutes); any
    other missing model folder is an error (actors and learner never
    download). A bootstrapped model made with other settings than these is
    used, with a note saying which differ."""
    model = Path(config.run.model)
    if (model / "config.json").is_file():
        from recipes.keyvault_bootstrap import differences

        changed = differences(model, config.actors, config.bootstrap)
        if changed:  # a base for the same game still trains; the user decides
            print(f"note: {model} was bootstrapped with other settings ({'; '.join(changed)}); "
                  f"remove it to bootstrap a base for these", flush=True)
        return
    if config.run.model != RunConfig().model:
        raise SystemExit(f"run.model = {config.run.model!r} has no config.json: point it at a "
                         "local HF-format model folder")
    from recipes.keyvault_bootstrap import KEPT_BASE, bootstrap, restore_kept_base

    why_not = restore_kept_base(model, config.actors, config.bootstrap)
    if why_not is None:
        print(f"the base policy: the kept one ({KEPT_BASE}, digest checked) copied to {model} "
              "(`compactionrl bootstrap` makes a new one)", flush=True)
        return
    print(f"bootstrapping the base policy in {model} (first run; {why_not})", flush=True)
    bootstrap(model, config.actors, config.bootstrap)


def resume_command(config_path: Path) -> str:
    """The command that resumes a run, as it can be pasted into any shell
    (the virtual environment need not be active)."""
    script = Path(sys.executable).parent / "compactionrl"
    program = [str(script)] if script.is_file() else [sys.executable, "-m", "deploy.cli"]
    return shlex.join([*program, "up", "--config", str(config_path.resolve()), "--resume"])


def status(run_dir: Path) -> int:
    """Print the summary of a running or finished run; 0 if it is running."""
    state_path = run_dir / "up.json"
    if not state_path.is_file():
        print(f"{run_dir} is not a run folder (no up.json)")
        return 2
    state = json.loads(state_path.read_text())
    running = not state["finished"] and _alive(state["pid"])
    history = read_history(run_dir / "metrics.jsonl")
    ended = state.get("ended")
    if running:
        print(f"run {run_dir}: running")
    elif ended:
        print(f"run {run_dir}: not running: {ended['message']} (exit code "
              f"{ended['exit_code']}, after {ended['wall_s']:.0f} s)")
    else:
        print(f"run {run_dir}: not running: up (pid {state['pid']}) stopped without "
              "finishing (killed?); resume it with --resume")
    if history:
        # this invocation's snapshots: the ETA's pace is measured over them
        first = pace_start([s for s in history if s["time"] >= state["started"]])
        before = history[-2] if len(history) > 1 else None
        ends = RunEnds(state["max_steps"], state.get("max_minutes", 0.0), state["started"])
        lines = summarise(history[-1], before, first, ends, ended=None if running else (
            ended["message"] if ended else "up stopped without finishing"))
        for key, value in lines.items():
            print(f"  {key}: {value}")
    return 0 if running else 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
