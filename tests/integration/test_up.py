"""`compactionrl up` end to end on CPU with the tiny model: replay, learner
under torchrun, two actors with vLLM engines. One actor is SIGKILLed with
episodes in flight: it is restarted, rejoins and gets the current weights, and
its lost rollouts expire. The learner keeps stepping and publishing; Ctrl-C
(SIGINT) then stops everything cleanly: checkpoint, export, metrics history,
report, the resume command, and no process left.

A real Prometheus (Debian's package) scrapes the run with the project's
generated configuration; afterwards every PromQL expression of every
dashboard panel and alert returns data over the run's time range."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from ops.observability import promql_expressions, scrape_config
from ops.summary import scrape
from tests.processes import SMALL_EPISODES, UpOnLoopback, compactionrl, process_tree, running
from tests.prometheus import PrometheusServer

ALERTS = Path(__file__).parents[2] / "deploy" / "observability" / "alerts.yml"

pytestmark = pytest.mark.slow

#: Learner steps the run must reach (after the restart) before it is stopped.
STEPS = 3


def _active_rollouts(port: int) -> float:
    samples = scrape(f"http://127.0.0.1:{port}/metrics") or {}
    return sum(value for _, value in samples.get("crl_actor_active_rollouts", []))


def _wait(condition, timeout: float, what: str, process: subprocess.Popen) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            output = process.stdout.read() if process.stdout else ""
            raise AssertionError(f"up exited with {process.returncode} before {what}:\n"
                                 f"{output[-4000:]}")
        assert time.monotonic() < end, f"no {what} within {timeout} s"
        time.sleep(0.5)


def _empty_panels(prometheus: PrometheusServer, since: float) -> list[str]:
    """The dashboard's PromQL expressions without data since ``since``."""
    return [where for where, expr in promql_expressions().items()
            if not prometheus.query_range(expr, since, time.time())]


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.read().decode()


def test_up_trains_survives_an_actor_kill_and_cleans_up(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    up = UpOnLoopback(tmp_path, "up-test", tiny_model_dir, 2, "--learner.max_steps", "1000",
                      "--replay.rollouts_per_batch", "4", *SMALL_EPISODES,
                      "--transport.heartbeat_interval_s", "0.5")
    run, actor_ports = up.folder, up.actor_ports
    replay_metrics, learner_metrics, actor_metrics = (up.ports[name] for name in
                                                      ("replay", "learner", "actor"))
    prometheus = PrometheusServer(tmp_path / "prometheus", scrape_config(
        replay_metrics, learner_metrics, list(actor_ports), interval_s=1),
        rules=ALERTS)
    began = time.time()
    process = up.start()
    try:
        actor_log = run / "logs" / "actor-0.log"
        learner_log = run / "logs" / "learner.log"
        # kill actor-0 with episodes in flight (it may be idle, waiting for credits)
        _wait(lambda: _active_rollouts(actor_metrics) > 0, 300,
              "episodes in flight at actor-0", process)
        time.sleep(1.5)  # a heartbeat (0.5 s) has told the replay about them
        _wait(lambda: _active_rollouts(actor_metrics) > 0, 60,
              "episodes still in flight at actor-0", process)
        children = json.loads((run / "up.json").read_text())["children"]
        # the actor alone, as a crash or the OOM killer would: its engine's
        # processes must not outlive it
        dead_tree = process_tree(children["actor-0"])
        os.kill(children["actor-0"], signal.SIGKILL)
        killed_at = len(actor_log.read_text())
        # restarted, it rejoins and loads the learner's current weights
        _wait(lambda: "loaded version" in actor_log.read_text()[killed_at:], 300,
              "weights at the restarted actor-0", process)
        left = [pid for pid in dead_tree if running(pid)]
        assert left == [], f"the killed actor's processes outlived its restart: {left}"
        _wait(lambda: f"step {STEPS}:" in learner_log.read_text(), 300,
              f"learner step {STEPS}", process)
        # every panel has data while the run is up (a rate needs two scrapes
        # after the first publication, which can come just before step 3)
        deadline = time.monotonic() + 120
        while empty := _empty_panels(prometheus, began):
            assert time.monotonic() < deadline, f"PromQL without data over the run: {empty}"
            assert process.poll() is None, "up exited while waiting for dashboard data"
            time.sleep(2)
        # every process's exposition passes promtool's lint, and each is ready
        for port in (replay_metrics, learner_metrics, *actor_ports):
            exposition = _get(port, "/metrics")
            lint = subprocess.run(["promtool", "check", "metrics"], input=exposition,
                                  capture_output=True, text=True, timeout=60)
            assert lint.returncode == 0, (port, lint.stdout + lint.stderr)
            assert _get(port, "/readyz").strip() == "ready", port
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=300)
    finally:
        up.stop_tree()  # failed before the clean stop
        prometheus.stop()
    assert process.returncode == 130, output[-4000:]
    assert "interrupted (SIGINT): stopped cleanly" in output
    # the resume command can be pasted as it is: its program is a path
    [resume] = [line.removeprefix("resume with: ") for line in output.splitlines()
                if line.startswith("resume with: ")]
    program, *resume_args = shlex.split(resume)
    assert os.access(program, os.X_OK), resume
    assert resume_args == ["up", "--config", str((run / "config.toml").resolve()), "--resume"]
    assert "actor-0 exited with code -9; restarting" in output
    assert learner_log.read_text().count("actor up-test-actor-0 joined") >= 2
    # a clean stop logs a clean stop: torchrun is not signalled, its ranks are
    assert "SignalException" not in learner_log.read_text()
    assert "stopped cleanly (signal)" in learner_log.read_text()
    assert "loaded version" in (run / "logs" / "actor-1.log").read_text()

    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = history[-1]
    checkpoint = json.loads(max((run / "checkpoints").glob("step-*/meta.json"),
                                key=lambda p: int(p.parent.name[5:])).read_text())
    assert last["learner_version"] == checkpoint["version"] >= STEPS  # the final checkpoint
    assert last["published_version"] >= 1
    assert last["actor_compactions"] > 0
    assert max(s["compactions_per_rollout"] or 0 for s in history) > 0  # trained on compactions
    assert last["expired_rollouts"] >= 1  # the killed actor's in-flight rollouts
    assert last["actor_restarts"] == 1

    assert (run / "export" / "config.json").is_file()
    report = (run / "report.html").read_text()
    assert report.count("<svg") >= 4
    state = json.loads((run / "up.json").read_text())
    assert state["finished"]
    assert state["ended"]["message"] == "interrupted (SIGINT): stopped cleanly"
    summary = (run / "summary.txt").read_text()
    assert "ended: interrupted (SIGINT): stopped cleanly; wall time" in summary
    assert f"step {checkpoint['step']}/1000" in summary  # the checkpoint's step, not a count
    assert "nan" not in summary and "DOWN" not in summary and "ETA" not in summary
    status = compactionrl("status", "--run", str(run), timeout=60)
    assert status.returncode == 1
    assert "not running: interrupted (SIGINT): stopped cleanly" in status.stdout
    # nothing left: the processes up started, nor their process groups
    for pid in [*state["children"].values(), *dead_tree]:
        assert not running(pid)
    leftovers = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", leftovers.stdout
