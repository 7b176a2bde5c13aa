"""Free loopback ports for services that tests start.

A port is free when chosen and bound by the service a moment later, so two
things can take it in between: another port this test process handed out
(two calls in one test), and any process's ``bind(0)`` or ``connect()``,
which the kernel serves from its ephemeral range (vLLM picks its internal
ports so). Ports here are handed out once per test process and chosen below
that range. Under ``pytest -n N`` each xdist worker draws from its own
slice of that range, so two workers never hand out the same port.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

#: Lowest port handed out: above the well-known and commonly configured ones.
LOWEST_PORT = 20000
#: Linux's default ephemeral range starts here (used if /proc cannot be read).
DEFAULT_EPHEMERAL_START = 32768

_handed_out: set[int] = set()
_choice = random.Random()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _worker_slice() -> tuple[int, int]:
    """[lowest, top) of the ports this process may hand out: the whole range,
    or the xdist worker's share of it."""
    top = max(_ephemeral_start(), LOWEST_PORT + 1000)
    share = xdist_share()
    if share is None:
        return LOWEST_PORT, top
    worker, workers = share
    width = (top - LOWEST_PORT) // workers
    lowest = LOWEST_PORT + worker * width
    return lowest, lowest + width


def xdist_share() -> tuple[int, int] | None:
    """(this xdist worker's number, the number of workers) under ``pytest -n
    N`` with N > 1; None otherwise. Ports and cores are split by it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or workers <= 1:
        return None
    return int(worker.removeprefix("gw")) % workers, workers


def free_port_range(length: int) -> range:
    """``length`` consecutive ports free on 127.0.0.1 now, none handed out
    before by this process (for actor i's ``actors.metrics_port + i``)."""
    lowest, top = _worker_slice()
    top -= length
    for _ in range(1000):
        start = _choice.randrange(lowest, top)
        ports = range(start, start + length)
        if not _handed_out.intersection(ports) and all(map(_bindable, ports)):
            _handed_out.update(ports)
            return ports
    raise RuntimeError(f"no {length} consecutive free ports in {lowest}..{top}")


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now, none handed out before
    by this process."""
    return [free_port_range(1).start for _ in range(count)]


def loopback_addresses(count: int) -> list[str]:
    return [f"tcp://127.0.0.1:{port}" for port in free_ports(count)]
