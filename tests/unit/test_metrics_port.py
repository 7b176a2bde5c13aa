"""A process whose metrics port is taken refuses to run, naming the port and
the settings that move it (issue 59: an actor added by hand with ``--index
0`` beside ``up``'s own actor-0)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from ops.metrics import MetricsServer, PortInUse
from tests.ports import free_ports


def test_a_taken_metrics_port_is_refused_with_the_port_and_the_flags_named() -> None:
    [port] = free_ports(1)
    first = MetricsServer(CollectorRegistry(), port)
    try:
        with pytest.raises(PortInUse) as refused:
            MetricsServer(CollectorRegistry(), port)
    finally:
        first.close()
    message = str(refused.value)
    assert f"metrics port {port} on 127.0.0.1 is in use" in message
    assert "--index N serves on actors.metrics_port + N" in message
    assert "--actors.metrics_port" in message
    MetricsServer(CollectorRegistry(), port).close()  # free again once its owner closed
