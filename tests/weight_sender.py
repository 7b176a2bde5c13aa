"""Rank 0 of a weight broadcast group in a thread of the test process (as
learner rank 0 would be), sending to a running engine: what the tests of
weights pushed into vLLM engines share.

Usage::

    sender = WeightSender()
    sender.join(engine_loop, engine)                      # a new group generation
    engine_loop.run(sender.push(engine, tensors, version=1))
"""

from __future__ import annotations

import threading

import torch

from actors.engine import Engine
from protocol import GroupInfo
from protocol.weights import WeightChannel, host_store, manifest_of, member_ranks
from protocol.weights_backends import join_channel
from tests.ports import free_ports

#: Longer than one KV block (128 tokens on CPU): the prefix cache must be cleared.
PROMPTS = [list(range(10, 200)), list(range(300, 460)), [7, 8, 9] * 50]


class WeightSender:
    """Rank 0 of a broadcast group, in a thread (as learner rank 0 would be),
    with one engine of ``workers`` tensor-parallel workers."""

    def __init__(self, workers: int = 1, timeout_s: float = 30.0) -> None:
        [self.port] = free_ports(1)
        self.timeout_s = timeout_s
        self.store = host_store(self.port)
        self.generation = 0
        self.backend = "gloo"
        self.group: WeightChannel | None = None
        [self.base], self.world_size = member_ranks([workers])

    def group_info(self) -> GroupInfo:
        return GroupInfo(generation=self.generation, master_addr="127.0.0.1",
                         master_port=self.port, world_size=self.world_size, rank=self.base,
                         backend=self.backend, timeout_s=self.timeout_s)

    def join(self, engine_loop, engine: Engine, backend: str = "gloo") -> None:
        self.generation += 1
        self.backend = backend
        thread = threading.Thread(target=lambda: setattr(self, "group", join_channel(
            self.store, self.generation, self.world_size, 0, backend, self.timeout_s)))
        thread.start()
        engine_loop.run(engine.join_weight_group(self.group_info()))
        thread.join(timeout=60)

    async def push(self, engine: Engine, tensors: list[tuple[str, torch.Tensor]],
                   version: int, bucket_bytes: int = 0) -> None:
        """Broadcast from a thread while the engine receives and loads."""
        manifest = manifest_of(tensors, bucket_bytes)
        sender = threading.Thread(target=lambda: self.group.send(manifest,
                                                                 (t for _, t in tensors)))
        sender.start()
        await engine.load_weights(version, manifest)
        sender.join(timeout=60)
