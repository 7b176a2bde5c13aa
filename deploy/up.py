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
The children, their arguments, cores and environments are
:func:`deploy.placement.place_children`'s, and ``up`` prints each one's CPU
cores and GPUs as it starts them (:func:`deploy.placement.placement_lines`);
each child's start, stop and restart back-off are :class:`deploy.children.Child`'s.

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
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.children import Child, signal_group, start_prometheus, stop_leftovers
from deploy.config import ConfigError, JobConfig, to_toml
from deploy.device_plan import DevicePlan, plan_devices
from deploy.placement import gpus_present, place_children, placement_lines
from ops.files import atomic_write_text
from ops.lifetime import become_subreaper
from ops.report import read_history, write_report
from ops.summary import RunEnds, RunScraper, pace_start, scrape, summarise, window_start

SCRAPE_INTERVAL_S = 2.0
#: Without a terminal (CI, pipes), one summary line this often.
PLAIN_EVERY_S = 15.0
#: The learner's checkpoint and export at shutdown can take this long.
LEARNER_STOP_S = 120.0
#: The replay's final log sync.
REPLAY_STOP_S = 20.0
#: Prometheus writes its head block at shutdown.
PROMETHEUS_STOP_S = 10.0
#: How often a learner waiting for a co-located engine asks whether it is up.
READY_POLL_S = 2.0
EXIT_FINISHED, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


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
            self.plan = plan_devices(self.config, gpus_present())
        if self.plan.problems:
            raise ConfigError(list(self.plan.problems))
        self.config_path = self.run_dir / "config.toml"
        self.history_path = self.run_dir / "metrics.jsonl"
        placed = place_children(self.config, self.plan, self.run_dir, self.resume)
        self.replay, self.learner, self.actors = placed.replay, placed.learner, placed.actors
        self._waiting = placed.waiting
        self._last_ready_poll = 0.0
        self.prometheus: tuple[Child, ...] = ()
        """The Prometheus server watching the run, where up started one."""

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
        # the replay counts every actor (ops/summary.py): the actors' own
        # endpoints are read only to see that an engine started
        self._scraper = RunScraper({name: url for name, url in self._urls().items()
                                    if name in ("replay", "learner")}, self.history)
        began = self._began = time.monotonic()
        self._ends = RunEnds(self.config.learner.max_steps, self.config.run.max_minutes,
                             started=time.time())
        started = start_prometheus(self.config, self.run_dir)
        self.prometheus = (started,) if started is not None else ()
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
            self._write_viewer()
            write_report(self.run_dir, self.config.run.name)
            self._write_state(ended={"message": message, "exit_code": outcome,
                                     "wall_s": round(time.monotonic() - began, 1)})
        print(message)
        if outcome == EXIT_FAILED or outcome == EXIT_INTERRUPTED:
            print(f"resume with: {resume_command(self.config_path)}")
        written = [name for name in ("report.html", "viewer.html", "summary.txt")
                   if (self.run_dir / name).is_file()]
        print(f"run folder: {self.run_dir} ({', '.join([*written, 'metrics.jsonl', 'logs/'])})")
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
        """Say where each process runs, then start every one the plan does
        not hold back (a learner waits for the engines on its GPUs:
        ``_start_waiting``)."""
        print("\n".join(placement_lines([self.replay, self.learner, *self.actors],
                                         sorted(os.sched_getaffinity(0)))), flush=True)
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
                signal_group(actor.process.pid, signal.SIGTERM)
        for actor in self.actors:
            actor.stop(deadline)
        self.replay.stop(REPLAY_STOP_S)
        for prometheus in self.prometheus:  # last: it has watched it all
            prometheus.stop(PROMETHEUS_STOP_S)
        stop_leftovers(None, set())

    def _children_pids(self) -> set[int]:
        return {child.process.pid for child in (self.replay, self.learner, *self.actors,
                                                *self.prometheus)
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
        if final:
            # Imported here, not at the top: learner.checkpoint imports torch
            # (2 s), which neither `compactionrl status` nor the supervision needs.
            from learner.checkpoint import checkpoint_position, latest_checkpoint

            if (checkpoint := latest_checkpoint(self.run_dir / "checkpoints")) is not None:
                version, step = checkpoint_position(checkpoint)
                snapshot["learner_version"] = float(version)
                snapshot["learner_step"] = float(step)
        self.history.append(snapshot)
        with self.history_path.open("a") as history:
            history.write(json.dumps(snapshot) + "\n")

    def _write_viewer(self) -> None:
        """The rollout viewer, where the learner kept samples; a viewer that
        cannot be written is said, and the run's ending goes on."""
        from deploy.viewer import write_viewer  # torch and transformers: only at the end
        from learner.samples import SAMPLES_FOLDER

        if not (self.run_dir / SAMPLES_FOLDER).is_dir():
            return
        try:
            write_viewer(self.run_dir)
        except Exception as exc:  # the run's results are written whatever the page does
            print(f"rollout viewer not written: {exc!r}")

    def _summary(self, ended: str | None = None) -> dict[str, str]:
        if len(self.history) <= self._first:
            return {"run": "no metrics yet"}
        before = window_start(self.history[self._first:])
        return summarise(self.history[-1], before, pace_start(self.history[self._first:]),
                         self._ends, ended)

    def _write_state(self, ended: dict | None = None) -> None:
        """``RUN/up.json``: what ``compactionrl status`` reads; rewritten when
        a child restarts, so that its pids are the live ones, and at the end
        with how the run ended."""
        atomic_write_text(self.run_dir / "up.json", json.dumps({
            "pid": os.getpid(), "finished": ended is not None, "ended": ended,
            "max_steps": self._ends.max_steps, "max_minutes": self._ends.max_minutes,
            "children": {c.name: c.process.pid
                         for c in (self.replay, self.learner, *self.actors, *self.prometheus)
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
    """A base policy a checkout keeps (``KEPT_BASES``: the embedded default's
    and the size-range recipe's) is, on first use, restored from the checkout
    (its digest checked), else bootstrapped (a few minutes); any other missing
    model folder is an error (actors and learner never download). A
    bootstrapped model made with other settings than these is used, with a
    note saying which differ."""
    model = Path(config.run.model)
    if (model / "config.json").is_file():
        from starting_points.keyvault_bootstrap import differences

        changed = differences(model, config.actors, config.bootstrap)
        if changed:  # a base for the same game still trains; the user decides
            print(f"note: {model} was bootstrapped with other settings ({'; '.join(changed)}); "
                  f"remove it to bootstrap a base for these", flush=True)
        return
    from starting_points.keyvault_bootstrap import KEPT_BASES, bootstrap, restore_kept_base

    kept = KEPT_BASES.get(config.run.model)
    if kept is None:
        raise SystemExit(f"run.model = {config.run.model!r} has no config.json: point it at a "
                         "local HF-format model folder")
    why_not = restore_kept_base(model, config.actors, config.bootstrap, kept)
    if why_not is None:
        print(f"the base policy: the kept one ({kept.folder}, digest checked) copied to {model} "
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
    """Print the summary of a running or finished run. Exit code
    (:func:`status_code`): 0 while it runs or after it ended as asked, 1 where
    it failed or ``up`` stopped without finishing, 2 where ``run_dir`` is no run."""
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
        before = window_start(history)
        ends = RunEnds(state["max_steps"], state.get("max_minutes", 0.0), state["started"])
        lines = summarise(history[-1], before, first, ends, ended=None if running else (
            ended["message"] if ended else "up stopped without finishing"))
        for key, value in lines.items():
            print(f"  {key}: {value}")
    return status_code(running, ended)


def status_code(running: bool, ended: dict[str, Any] | None) -> int:
    """0 for a run that goes on or ended as asked (its budget reached, or
    stopped cleanly by a signal: nothing failed), 1 for one that failed or
    whose ``up`` stopped without writing how it ended (killed)."""
    if running:
        return 0
    return 0 if ended and ended["exit_code"] in (EXIT_FINISHED, EXIT_INTERRUPTED) else 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
