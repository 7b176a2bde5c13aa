"""Readiness and liveness on the metrics port (ops/metrics.py), over real HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from ops.metrics import Health, MetricsServer
from tests.ports import free_ports


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode().strip()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode().strip()


def test_readiness_says_what_it_waits_for_and_liveness_follows_the_beat() -> None:
    registry = CollectorRegistry()
    Counter("crl_test_things", "Things", registry=registry).inc()
    health = Health("recovering the segment log", liveness_s=3600.0)
    [port] = free_ports(1)
    server = MetricsServer(registry, port, health=health)
    try:
        assert get(port, "/readyz") == (503, "not ready: recovering the segment log")
        assert get(port, "/healthz") == (200, "alive")
        health.ready()
        assert get(port, "/readyz") == (200, "ready")
        status, text = get(port, "/metrics")
        assert status == 200 and "crl_test_things_total 1.0" in text
        health.liveness_s = 0.0  # any silence is too long: no wall-clock wait in the test
        status, text = get(port, "/healthz")
        assert status == 503 and text.startswith("no progress for")
        health.liveness_s = 3600.0
        health.beat()
        assert get(port, "/healthz") == (200, "alive")
        registered = False
        health.readiness = lambda: None if registered else "registering with the replay"
        assert get(port, "/readyz") == (503, "not ready: registering with the replay")
        registered = True
        assert get(port, "/readyz") == (200, "ready")
    finally:
        server.close()
