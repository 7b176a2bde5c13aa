"""Prometheus and Grafana as code: the checked-in files are what the code
generates, the rules pass promtool, dashboards refer to metrics that exist,
each panel's query is given in plain PromQL, the actors' targets file is
Prometheus's file_sd format, and `dashboards push` speaks Grafana's HTTP API
(against a local stand-in: no Grafana server can run here)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from deploy.cli import main
from deploy.config import load_config
from ops.observability import (
    ACTOR_TARGETS_FILE,
    DASHBOARDS,
    dashboards,
    panel_queries,
    promql_expressions,
    write_actor_targets,
    write_files,
)

ROOT = Path(__file__).parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
METRIC = re.compile(r"\b(crl_[a-z_]+)")


def test_checked_in_files_are_what_the_code_generates(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``dashboards export --all deploy/observability`` writes, run from
    the checkout (the run folder, and so the actors' targets file, is named
    relative to the current directory)."""
    monkeypatch.chdir(ROOT)
    for path in write_files(tmp_path, **load_config().observability_files(OBSERVABILITY)):
        checked_in = OBSERVABILITY / path.relative_to(tmp_path)
        assert checked_in.read_text() == path.read_text(), (
            f"{checked_in} is stale: run compactionrl dashboards export --all "
            "deploy/observability")


def test_promtool_accepts_the_rules_and_the_config() -> None:
    if not shutil.which("promtool"):
        pytest.skip("promtool missing (deploy/observability/install-prometheus.sh installs it)")
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"]):
        result = subprocess.run(["promtool", *args], cwd=OBSERVABILITY, capture_output=True,
                                text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_expression_names_metrics_the_processes_export() -> None:
    from actors.metrics import ActorMetrics
    from learner.metrics import LearnerMetrics
    from replay.metrics import ReplayMetrics

    learner = LearnerMetrics()
    learner.resumed(version=0, step=0)  # its position is served once it has resumed
    exported = set()
    for metrics in (ActorMetrics(), learner, ReplayMetrics()):
        for family in metrics.registry.collect():
            exported |= {family.name, f"{family.name}_total", f"{family.name}_bucket",
                         f"{family.name}_sum", f"{family.name}_count"}
    for where, expr in promql_expressions().items():
        for name in METRIC.findall(expr):
            assert name in exported, f"{where}: {name} is not exported"


def test_push_uploads_every_dashboard_through_the_http_api() -> None:
    received: list[tuple[str, dict]] = []

    class Grafana(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append((self.path, body))
            assert self.headers["Authorization"] == "Bearer secret-token"
            reply = json.dumps({"status": "success", "uid": body.get("dashboard", {}).get(
                "uid", "folder"), "title": "CompactionRL"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Grafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert main(["dashboards", "push", "--url", f"http://127.0.0.1:{server.server_port}",
                     "--token", "secret-token"]) == 0
    finally:
        server.shutdown()
    pushed = [body["dashboard"]["uid"] for path, body in received
              if path == "/api/dashboards/db"]
    assert sorted(pushed) == sorted(dashboards())
    assert all(body["overwrite"] for _, body in received)


def test_dashboards_import_anywhere_and_filter_by_run_job_actor_and_gpu_type() -> None:
    """No data source uid of ours in a panel; Grafana's rate interval, never
    a fixed window; the variables Grafana offers; the local scrape labels
    its series with the run's name."""
    for stem, model in dashboards().items():
        names = [variable["name"] for variable in model["templating"]["list"]]
        assert names == ["datasource", "run", "job", "actor", "gpu"], stem
        for panel in model["panels"]:
            for target in [panel, *panel["targets"]]:
                assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            for target in panel["targets"]:
                assert "[1m]" not in target["expr"], (stem, panel["title"])
                if "rate(" in target["expr"]:
                    assert "[$__rate_interval]" in target["expr"], (stem, panel["title"])
    assert set(dashboards()) == {"compactionrl-training", "compactionrl-system",
                                 "compactionrl-actors"}
    prometheus = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert all(config["labels"] == {"run": "local-cpu"}
               for name in ("replay", "learner") for config in jobs[name]["static_configs"])
    # the actors: the file the replay of the default run keeps, beside the checkout
    assert jobs["actors"]["file_sd_configs"][0]["files"] == [
        f"../../runs/local-cpu/{ACTOR_TARGETS_FILE}"]


def test_the_actors_file_lists_each_actor_labelled_for_the_dashboards(tmp_path: Path) -> None:
    """Prometheus's file_sd JSON: a target group per actor, labelled with
    its id and the run's name; rewritten whole (the actor that left is gone)."""
    path = tmp_path / ACTOR_TARGETS_FILE
    write_actor_targets(path, {"b-1": "10.0.0.2:9110", "a-0": "127.0.0.1:9110"}, "my-run")
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:9110"], "labels": {"actor": "a-0", "run": "my-run"}},
        {"targets": ["10.0.0.2:9110"], "labels": {"actor": "b-1", "run": "my-run"}}]
    write_actor_targets(path, {"b-1": "10.0.0.2:9110"}, None)
    assert json.loads(path.read_text()) == [
        {"targets": ["10.0.0.2:9110"], "labels": {"actor": "b-1"}}]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


def test_each_panel_s_query_is_given_in_plain_promql(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """Outside Grafana: no variable or macro left, the run's name matched
    exactly, the other variables' matchers dropped (every value), one query
    per series; ``dashboards promql`` prints them with the alert rules."""
    queries = panel_queries("my-run", "2m")
    assert sum(map(len, queries.values())) == sum(len(panel.exprs) for panels in
                                                  DASHBOARDS.values() for panel in panels)
    for where, series in queries.items():
        for legend, expr in series:
            assert "$" not in expr and "=~" not in expr, (where, legend, expr)
            if "crl_" in expr or "up{" in expr:
                assert 'run="my-run"' in expr, (where, legend, expr)
    [(_, tokens)] = queries["CompactionRL: actors / Tokens/s by actor"]
    assert tokens == ('sum by (actor) (rate(crl_actor_generated_tokens_total{run="my-run"}'
                      "[2m]))")
    [(_, engines)] = queries["CompactionRL: actors / Engines"]
    assert engines == 'crl_actor_engine_info{run="my-run"}'
    [(_, every_run)] = panel_queries()["CompactionRL: actors / Engines"]
    assert every_run == "crl_actor_engine_info"
    assert main(["dashboards", "promql", "--run", "my-run"]) == 0
    printed = capsys.readouterr().out
    assert f"  {{{{actor}}}}: {tokens.replace('[2m]', '[1m]')}\n" in printed
    assert "CompactionRLStalenessAtBound (for 10m): " in printed


def test_vllm_engine_metrics_are_served_renamed_and_lint_clean() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from actors.metrics import EngineMetrics

    vllm = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "KV-cache usage", ["model_name"],
          registry=vllm).labels("m").set(0.5)
    Counter("vllm:prompt_tokens", "Prompt tokens", ["model_name"],
            registry=vllm).labels("m").inc(3)
    Histogram("vllm:time_to_first_token_seconds", "Time to first token", ["model_name"],
              registry=vllm).labels("m").observe(0.2)
    Histogram("vllm:iteration_tokens_total", "Tokens per engine step", ["model_name"],
              registry=vllm).labels("m").observe(7)
    Gauge("unrelated", "not vLLM's", registry=vllm).set(1)
    served = CollectorRegistry()
    served.register(EngineMetrics(vllm))
    text = generate_latest(served).decode()
    assert 'vllm_kv_cache_usage_perc{model_name="m"} 0.5' in text
    assert 'vllm_prompt_tokens_total{model_name="m"} 3.0' in text
    assert "vllm_time_to_first_token_seconds_bucket" in text
    assert 'vllm_iteration_tokens_bucket{le="10.0",model_name="m"} 1.0' in text
    names = [line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if not line.startswith("#")]
    assert "unrelated" not in text and not any(":" in name for name in names)
    if shutil.which("promtool"):
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                              text=True, timeout=60)
        assert lint.returncode == 0, lint.stdout + lint.stderr
