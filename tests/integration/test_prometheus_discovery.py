"""A real Prometheus (Debian's package) with the project's generated
configuration: an actor the run's targets file lists is scraped without a
restart or a new configuration, with the labels the dashboards filter by; one
taken off the file is no longer judged (no ``up`` series for ActorDown); each
panel's plain PromQL runs; and the Prometheus ``compactionrl up`` starts reads
the run folder's configuration and stops with its process tree."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from deploy.children import start_prometheus
from deploy.config import ConfigError, load_config
from ops.observability import (
    ACTOR_TARGETS_FILE,
    panel_queries,
    scrape_config,
    write_actor_targets,
)
from tests.ports import free_ports
from tests.processes import wait_until
from tests.prometheus import PrometheusApi, PrometheusServer, ensure_prometheus

RUN = "discovery"
ALERTS = Path(__file__).parents[2] / "deploy" / "observability" / "alerts.yml"
#: Scrapes every second: a target the file lists is up within a few.
DISCOVERED_S = 30.0
#: What the stand-in actor serves.
EXPOSITION = (b"# TYPE crl_actor_episode_slots gauge\ncrl_actor_episode_slots 4\n"
              b"# TYPE crl_actor_stall_seconds_total counter\n"
              b'crl_actor_stall_seconds_total{reason="credits"} 1.5\n')


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(EXPOSITION)))
        self.end_headers()
        self.wfile.write(EXPOSITION)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def stand_in_actor() -> Iterator[str]:
    """An actor's /metrics, served until the block ends: its ``host:port``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[PrometheusServer, Path]]:
    """A server with a run's configuration and rules, and the run's actor
    targets file (the replay's to rewrite), empty at the start."""
    root = tmp_path_factory.mktemp("discovery")
    targets = root / "run" / ACTOR_TARGETS_FILE
    write_actor_targets(targets, {}, RUN)
    replay, learner = free_ports(2)  # nothing serves there: not what these tests judge
    server = PrometheusServer(root / "prometheus", scrape_config(
        replay, learner, str(targets), interval_s=1, run=RUN), rules=ALERTS)
    try:
        yield server, targets
    finally:
        server.stop()


def test_an_actor_listed_in_the_file_is_scraped_without_a_restart_and_gone_once_taken_off(
        prometheus: tuple[PrometheusServer, Path]) -> None:
    server, targets = prometheus
    [silent] = free_ports(1)  # listed, and nothing answers: the case ActorDown judges
    with stand_in_actor() as address:
        write_actor_targets(targets, {"extra-1": address, "mute-2": f"127.0.0.1:{silent}"}, RUN)
        wait_until(lambda: server.query('up{job="actors", actor="extra-1"} == 1'), DISCOVERED_S,
                   "the added actor scraped")
        [slots] = server.query("crl_actor_episode_slots")
        assert {k: slots["metric"][k] for k in ("actor", "run", "instance", "job")} == {
            "actor": "extra-1", "run": RUN, "instance": address, "job": "actors"}
        # the per-actor panels name it by its id, not by its scrape address
        [(legend, share)] = panel_queries(RUN)[
            "CompactionRL: actors / Stall share by actor and reason"]
        assert legend == "{{actor}} {{reason}}"
        wait_until(lambda: server.query(share), DISCOVERED_S, "two scrapes for a rate")
        assert [series["metric"] for series in server.query(share)] == [
            {"actor": "extra-1", "reason": "credits"}]
        wait_until(lambda: server.query('up{job="actors", actor="mute-2"} == 0'), DISCOVERED_S,
                   "the listed actor that does not answer seen down")
        # both leave (the replay rewrites the file whole): neither is judged any more
        write_actor_targets(targets, {}, RUN)
        wait_until(lambda: not server.active_targets("actors"), DISCOVERED_S,
                   "the actors taken off the file dropped")
        wait_until(lambda: not server.query('up{job="actors"}'), DISCOVERED_S,
                   "no up series left for the actors that left")


def test_each_panel_s_plain_query_runs_on_prometheus(
        prometheus: tuple[PrometheusServer, Path]) -> None:
    """What ``compactionrl dashboards promql`` prints parses and evaluates
    (the server answers an error for a query that does not)."""
    server, _ = prometheus
    for series in panel_queries(RUN).values():
        for _, expr in series:
            server.query(expr)


def test_up_s_prometheus_watches_the_run_folder_and_stops_with_its_tree(tmp_path: Path) -> None:
    ensure_prometheus()
    [port] = free_ports(1)
    config = load_config(None, ["--run.out_dir", str(tmp_path), "--run.name", RUN,
                                "--observability.prometheus", "on",
                                "--observability.prometheus_address", f"127.0.0.1:{port}"])
    run_dir = tmp_path / RUN
    child = start_prometheus(config, run_dir)
    assert child is not None and child.process is not None
    try:
        api = PrometheusApi(f"http://127.0.0.1:{port}")
        wait_until(api.ready, DISCOVERED_S, "up's Prometheus ready", child.process,
                   lambda: child.log.read_text()[-2000:])
        with stand_in_actor() as address:
            write_actor_targets(run_dir / ACTOR_TARGETS_FILE, {"extra-1": address}, RUN)
            # its own scrape interval (5 s) paces the first scrape
            wait_until(lambda: api.query(f'up{{actor="extra-1", run="{RUN}"}} == 1'),
                       DISCOVERED_S, "the actor listed in the run folder scraped")
        # the static targets too (down: no replay here), each scraped at its own offset
        wait_until(lambda: api.query(f'up{{job="replay", run="{RUN}"}}'), DISCOVERED_S,
                   "the replay's static target scraped")
    finally:
        child.stop(10)
    assert child.exit_code() is not None
    with pytest.raises(ProcessLookupError):  # nothing of its process group is left
        os.killpg(child.process.pid, 0)
    promtool = subprocess.run(["promtool", "check", "config", "prometheus.yml"],
                              cwd=run_dir / "prometheus", capture_output=True, text=True)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr


def test_without_a_prometheus_program_up_says_so_or_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``auto``: not started, said once, the configuration written all the
    same; ``on``: refused, naming the setting."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    overrides = ["--run.out_dir", str(tmp_path), "--run.name", RUN]
    assert start_prometheus(load_config(None, overrides), tmp_path / RUN) is None
    assert "prometheus: not started (no prometheus program is on PATH" in capsys.readouterr().out
    assert (tmp_path / RUN / "prometheus" / "prometheus.yml").is_file()
    assert (tmp_path / RUN / ACTOR_TARGETS_FILE).read_text() == "[]\n"
    with pytest.raises(ConfigError, match='observability.prometheus = "on", but no prometheus'):
        start_prometheus(load_config(None, [*overrides, "--observability.prometheus", "on"]),
                         tmp_path / RUN)


def test_a_taken_address_is_said_and_left_to_its_owner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Another run's Prometheus on the address: this run's is not started
    (it would exit at once), and the output says why."""
    program = tmp_path / "bin" / "prometheus"  # never run: found, then not started
    program.parent.mkdir()
    program.write_text("#!/bin/sh\nexit 1\n")
    program.chmod(0o755)
    monkeypatch.setenv("PATH", str(program.parent))
    with stand_in_actor() as address:
        config = load_config(None, ["--run.out_dir", str(tmp_path), "--run.name", RUN,
                                    "--observability.prometheus_address", address])
        assert start_prometheus(config, tmp_path / RUN) is None
    assert f"observability.prometheus_address {address} is in use" in capsys.readouterr().out
