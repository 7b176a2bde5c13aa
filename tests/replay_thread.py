"""A replay service serving in a thread of the test process, for tests that
need a real replay (real sockets) but not its process: they read its metrics
from its registry and stop it with ``close()``, pass or fail.

Usage::

    with ReplayThread.on_loopback(rollouts_per_batch=2, durable_log=False) as replay:
        actor = replay.actor()
        ...
"""

from __future__ import annotations

import threading
from typing import Any

import zmq

from protocol.transport import TransportConfig
from replay.config import ReplayConfig
from replay.service import ReplayService
from tests.ports import loopback_addresses
from tests.protocol_clients import ActorClient, LearnerClient

#: The tiny model's vocabulary (starting_points/tiny_model.py): what its segments hold.
TINY_VOCAB = 1054


class ReplayThread:
    def __init__(self, service: ReplayService) -> None:
        self.service = service
        self.config = service.config
        self.stop = threading.Event()
        self.thread = threading.Thread(target=service.serve, args=(self.stop,), daemon=True)
        self.thread.start()
        self.context = zmq.Context()

    @classmethod
    def on_loopback(cls, transport: TransportConfig | None = None, vocab_size: int = TINY_VOCAB,
                    **options: Any) -> ReplayThread:
        """A replay on two free loopback ports, metrics off unless ``options`` say."""
        actor_address, learner_address = loopback_addresses(2)
        config = ReplayConfig(**{"actor_address": actor_address,
                                 "learner_address": learner_address, "metrics_port": 0,
                                 **options})
        return cls(ReplayService(config, transport or TransportConfig(), vocab_size=vocab_size))

    def actor(self, **kwargs: Any) -> ActorClient:
        return ActorClient(self.context, self.config.actor_address, **kwargs)

    def learner(self, incarnation: int = 1) -> LearnerClient:
        return LearnerClient(self.context, self.config.learner_address,
                             incarnation=incarnation)

    def metric(self, name: str, **labels: str) -> float:
        value = self.service.metrics.registry.get_sample_value(name, labels or None)
        return 0.0 if value is None else value

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.context.destroy(linger=0)
        self.service.close()

    def __enter__(self) -> ReplayThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
