"""Free loopback ports for services that tests start."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now (held open together
    while choosing, so they differ)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def loopback_addresses(count: int) -> list[str]:
    return [f"tcp://127.0.0.1:{port}" for port in free_ports(count)]
