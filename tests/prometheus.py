"""A real Prometheus server for tests: Debian's package, installed by the
project's own script, started with a given scrape configuration and stopped
by the test (its process group is killed even when the test fails)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ports import free_ports

INSTALLER = Path(__file__).parents[1] / "deploy" / "observability" / "install-prometheus.sh"
READY_TIMEOUT_S = 60.0


def ensure_prometheus() -> None:
    """Install Prometheus if missing; skip the test, saying why, if impossible."""
    if shutil.which("prometheus") and shutil.which("promtool"):
        return
    if os.geteuid() != 0:
        pytest.skip("Prometheus is not installed and installing it needs root "
                    f"(run {INSTALLER} as root)")
    result = subprocess.run(["sh", str(INSTALLER)], capture_output=True, text=True, timeout=600)
    if result.returncode != 0 or not shutil.which("prometheus"):
        pytest.skip(f"could not install Prometheus with {INSTALLER}: {result.stderr[-500:]}")


class PrometheusApi:
    """Prometheus's HTTP API at ``url`` (a server this test started, or one
    that ``compactionrl up`` started)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0
                    ) -> list[dict]:
        return self._get("query_range", query=expr, start=start, end=end, step=step_s)[
            "result"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector of ``expr`` now."""
        return self._get("query", query=expr)["result"]

    def active_targets(self, job: str) -> list[dict]:
        """The targets Prometheus scrapes now for ``job`` (discovered ones included)."""
        return [target for target in self._get("targets", state="active")["activeTargets"]
                if target["labels"].get("job") == job]

    def _get(self, endpoint: str, **parameters: object) -> dict:
        """The ``data`` of an HTTP API answer, which must be a success (an
        expression that does not parse is not)."""
        query = urllib.parse.urlencode(parameters)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{endpoint}?{query}",
                                        timeout=30) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:  # a bad query answers 400 with the reason
            body = json.loads(error.read())
        assert body["status"] == "success", (parameters, body)
        return body["data"]


class PrometheusServer(PrometheusApi):
    def __init__(self, folder: Path, config: dict[str, Any], rules: Path | None = None) -> None:
        ensure_prometheus()
        folder.mkdir(parents=True, exist_ok=True)
        if rules is not None:
            shutil.copy(rules, folder / rules.name)
            config = {**config, "rule_files": [rules.name]}
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        [port] = free_ports(1)
        super().__init__(f"http://127.0.0.1:{port}")
        self.log = (folder / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=self.log, stderr=self.log, start_new_session=True)
        end = time.monotonic() + READY_TIMEOUT_S
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() > end:
                self.stop()
                raise AssertionError(f"Prometheus did not start: "
                                     f"{(folder / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.log.close()
