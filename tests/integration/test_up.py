"""`compactionrl up` end to end on CPU with the tiny model: replay, learner
under torchrun and an actor with a vLLM engine train until the learner has
stepped and published; Ctrl-C (SIGINT) then stops everything cleanly:
checkpoint, export, metrics history, report, the resume command, and no
process left. Before the stop the actor's engine core dies: the actor exits
(``ENGINE_DIED_EXIT``), and up restarts it with the current weights. (An
actor SIGKILLed, restarted and rejoining is phase 2 of the fault run,
tests/faults/test_up_faults.py, which starts the same `up`.)

A real Prometheus (Debian's package) scrapes the run with the project's
generated configuration; afterwards every PromQL expression of every
dashboard panel and alert returns data over the run's time range, every
process's exposition passes promtool's lint and each says it is ready."""

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

from actors.process import ENGINE_DIED_EXIT
from ops.observability import promql_expressions, scrape_config
from tests.processes import (
    SMALL_EPISODES,
    UpOnLoopback,
    compactionrl,
    engine_core,
    running,
    wait_until,
)
from tests.prometheus import PrometheusServer

ALERTS = Path(__file__).parents[2] / "deploy" / "observability" / "alerts.yml"

pytestmark = pytest.mark.slow

#: Learner steps the run must reach (after the restart) before it is stopped.
STEPS = 3


def _empty_panels(prometheus: PrometheusServer, since: float) -> list[str]:
    """The dashboard's PromQL expressions without data since ``since``."""
    return [where for where, expr in promql_expressions().items()
            if not prometheus.query_range(expr, since, time.time())]


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.read().decode()


def test_up_trains_serves_dashboards_and_stops_cleanly(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    up = UpOnLoopback(tmp_path, "up-test", tiny_model_dir, 1, "--learner.max_steps", "1000",
                      "--replay.rollouts_per_batch", "4", *SMALL_EPISODES,
                      "--transport.heartbeat_interval_s", "0.5")
    run, actor_ports = up.folder, up.actor_ports
    replay_metrics, learner_metrics = up.ports["replay"], up.ports["learner"]
    prometheus = PrometheusServer(tmp_path / "prometheus", scrape_config(
        replay_metrics, learner_metrics, list(actor_ports), interval_s=1),
        rules=ALERTS)
    began = time.time()
    process = up.start()

    def up_output() -> str:  # read once it has exited: a running up's pipe would block
        return (process.stdout.read()[-4000:]
                if process.poll() is not None and process.stdout else "")

    try:
        learner_log = run / "logs" / "learner.log"
        wait_until(lambda: learner_log.is_file() and f"step {STEPS}:" in learner_log.read_text(),
                   300, f"learner step {STEPS}", process, up_output)
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
        # the actor's engine core dies; the actor exits, up restarts it, and
        # the new one loads the current weights
        actor_log = run / "logs" / "actor-0.log"

        def actor_pid() -> int:
            return json.loads((run / "up.json").read_text())["children"]["actor-0"]

        dead = actor_pid()
        os.kill(engine_core(dead), signal.SIGKILL)
        wait_until(lambda: actor_pid() != dead, 180, "up to restart actor-0", process, up_output)
        restarted_at = len(actor_log.read_text())  # the exited process has written its last
        wait_until(lambda: "loaded version" in actor_log.read_text()[restarted_at:], 300,
                   "weights at the restarted actor-0", process, up_output)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=300)
    finally:
        up.stop_tree()  # failed before the clean stop
        prometheus.stop()
    assert process.returncode == 130, output[-4000:]
    assert "interrupted (SIGINT): stopped cleanly" in output
    assert f"actor-0 exited with code {ENGINE_DIED_EXIT}; restarting" in output
    assert "the vLLM engine died" in (run / "logs" / "actor-0.log").read_text()
    # the resume command can be pasted as it is: its program is a path
    [resume] = [line.removeprefix("resume with: ") for line in output.splitlines()
                if line.startswith("resume with: ")]
    program, *resume_args = shlex.split(resume)
    assert os.access(program, os.X_OK), resume
    assert resume_args == ["up", "--config", str((run / "config.toml").resolve()), "--resume"]
    assert "actor up-test-actor-0 joined" in learner_log.read_text()
    # a clean stop logs a clean stop: torchrun is not signalled, its ranks are
    assert "SignalException" not in learner_log.read_text()
    assert "stopped cleanly (signal)" in learner_log.read_text()
    assert "loaded version" in (run / "logs" / "actor-0.log").read_text()

    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = history[-1]
    checkpoint = json.loads(max((run / "checkpoints").glob("step-*/meta.json"),
                                key=lambda p: int(p.parent.name[5:])).read_text())
    assert last["learner_version"] == checkpoint["version"] >= STEPS  # the final checkpoint
    assert last["published_version"] >= 1
    assert last["actor_compactions"] > 0
    assert max(s["compactions_per_rollout"] or 0 for s in history) > 0  # trained on compactions
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
    for pid in state["children"].values():
        assert not running(pid)
    leftovers = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", leftovers.stdout
