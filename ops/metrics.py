"""Serving Prometheus metrics over HTTP, the same way in every process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    """``/metrics`` of one registry on ``port`` (0 = not served), stopped with
    :meth:`close` so tests and restarts never leave a port bound."""

    def __init__(self, registry: CollectorRegistry, port: int, address: str = "127.0.0.1"
                 ) -> None:
        self.port = port
        self._server = None
        if port:
            self._server, self._thread = start_http_server(port, addr=address, registry=registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
