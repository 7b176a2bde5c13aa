"""Serving Prometheus metrics and health over HTTP, the same way in every process.

On the metrics port, beside ``/metrics``:

- ``/readyz``: 200 ``ready`` once the process can do its work (the replay:
  its log recovered; the learner: resumed and joined to the replay; an
  actor: its engine started and registered with the replay), else 503 with
  what it waits for. Kubernetes routes nothing to it and counts it not
  started until then.
- ``/healthz``: 200 ``alive`` while the process's main loop makes progress
  (:meth:`Health.beat` within ``liveness_s``), else 503 saying for how long
  it has not: a stuck process is restarted, a slow one is not.

And one kind of counter every process keeps the same way: the seconds spent
waiting, counted as the wait goes (:class:`WaitSeconds`).
"""

from __future__ import annotations

import errno
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Gauge, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

#: Liveness, unless a process says otherwise: a main loop silent this long is stuck.
DEFAULT_LIVENESS_S = 300.0


class Health:
    """A process's readiness (what it still waits for) and liveness (when
    its main loop last made progress). Thread-safe: set by the process, read
    by the HTTP thread."""

    def __init__(self, waiting_for: str = "starting", liveness_s: float = DEFAULT_LIVENESS_S
                 ) -> None:
        self.waiting_for: str | None = waiting_for
        """None once ready; else what readiness waits for."""
        self.readiness: Callable[[], str | None] | None = None
        """Asked on each probe once set: None when ready, else what it waits for."""
        self.liveness_s = liveness_s
        self._beat = time.monotonic()

    def ready(self) -> None:
        self.waiting_for = None

    def beat(self) -> None:
        """The main loop made progress."""
        self._beat = time.monotonic()

    def not_ready(self) -> str | None:
        if self.readiness is not None:
            return self.readiness()
        return self.waiting_for

    def silent_for(self) -> float:
        return time.monotonic() - self._beat


class WaitSeconds(Collector):
    """A counter of seconds spent waiting (``<name>_total``), by ``reason``
    where ``reasons`` are given, each wait counted from its start: a read in
    the middle of a wait sees the part already waited. Counted only when a
    wait ended, a wait longer than the time between two reads would add
    nothing to the windows it spans but the last, and all of itself to that
    one: a share of time made of it would read 0, then over 100 % (the
    learner's idle share read 120 %). Counted as it goes, what it adds
    between two reads is at most the time between them times the waits
    under way. Thread-safe: waits begin and end on the process's own
    threads, scrapes read from the HTTP thread."""

    def __init__(self, name: str, documentation: str, reasons: tuple[str, ...] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelled = bool(reasons)
        self._lock = threading.Lock()
        self._ended = dict.fromkeys(reasons or ("",), 0.0)
        self._waiting: dict[object, tuple[str, float]] = {}
        """Waits under way: (reason, monotonic start), by a key of their own."""

    def add(self, reason: str, seconds: float) -> None:
        """A wait of ``seconds`` that is over."""
        with self._lock:
            self._ended[reason] += seconds

    @contextmanager
    def waiting(self, reason: str = "") -> Iterator[None]:
        """Count the time spent inside as a wait of ``reason``, from now on."""
        key = object()
        with self._lock:
            self._waiting[key] = (reason, time.monotonic())
        try:
            yield
        finally:
            # one step under the lock: a reader never sees the wait in
            # neither place, which would read as a counter going down
            with self._lock:
                _, began = self._waiting.pop(key)
                self._ended[reason] += time.monotonic() - began

    def totals(self) -> dict[str, float]:
        """Seconds waited by reason, the waits under way included."""
        now = time.monotonic()
        with self._lock:
            totals = dict(self._ended)
            for reason, began in self._waiting.values():
                totals[reason] += now - began
        return totals

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation,
                                     labels=["reason"] if self.labelled else [])
        for reason, seconds in self.totals().items():
            family.add_metric([reason] if self.labelled else [], seconds)
        yield family


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds
        pass


class PortInUse(OSError):
    """The metrics port is another process's: the message names the port and
    the settings that move it."""

    def __init__(self, port: int, address: str) -> None:
        super().__init__(
            errno.EADDRINUSE,
            f"metrics port {port} on {address} is in use by another process: give this one "
            "another port (an actor: --index N serves on actors.metrics_port + N, and `up`'s "
            "own actors hold indices 0 to actors.count - 1; or --actors.metrics_port; the "
            "replay: --replay.metrics_port; the learner: --learner.metrics_port)")


def port_in_use(host: str, port: int) -> bool:
    """Something listens on ``host``'s ``port`` (a port left in TIME_WAIT is
    free, as it is to a server that binds with SO_REUSEADDR). Any other
    failure to bind is left for the server that binds it to report."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


class MetricsServer:
    """``/metrics`` of one registry, ``/readyz`` and ``/healthz`` of one
    :class:`Health` on ``port`` (0 = not served), stopped with :meth:`close`
    so tests and restarts never leave a port bound. A port already in use
    raises :class:`PortInUse` (the process refuses to run unobserved)."""

    def __init__(self, registry: CollectorRegistry, port: int, address: str = "127.0.0.1",
                 health: Health | None = None) -> None:
        self.port = port
        self.health = health or Health(waiting_for=None)
        self._metrics = make_wsgi_app(registry)
        self._server = None
        if port:
            server_class = type("Server", (ThreadingWSGIServer,), {
                "address_family": socket.AF_INET6 if ":" in address else socket.AF_INET})
            try:
                self._server = make_server(address, port, self._app, server_class,
                                           handler_class=_Quiet)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUse(port, address) from None
                raise
            self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
            self._thread.start()

    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/readyz":
            waiting = self.health.not_ready()
            return _text(start_response, waiting is None,
                         "ready" if waiting is None else f"not ready: {waiting}")
        if path == "/healthz":
            silent = self.health.silent_for()
            alive = silent <= self.health.liveness_s
            return _text(start_response, alive, "alive" if alive else
                         f"no progress for {silent:.0f} s (liveness {self.health.liveness_s:g} s)")
        return self._metrics(environ, start_response)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def watch_disk(free: Gauge, size: Gauge, folder: Path) -> None:
    """``free`` and ``size`` read the filesystem holding ``folder`` at each
    scrape (nothing in between)."""
    folder.mkdir(parents=True, exist_ok=True)
    free.set_function(lambda: shutil.disk_usage(folder).free)
    size.set_function(lambda: shutil.disk_usage(folder).total)


def _text(start_response: Callable, ok: bool, text: str) -> list[bytes]:
    start_response("200 OK" if ok else "503 Service Unavailable",
                   [("Content-Type", "text/plain; charset=utf-8")])
    return [text.encode() + b"\n"]
