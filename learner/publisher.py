"""Weight publication: FSDP2 shards -> full tensors -> running actor engines.

Every learner rank calls :meth:`WeightPublisher.publish` at the same point
(gathering a full tensor is a collective). Rank 0 then:

1. takes the live members from the control plane; none -> nothing to do;
2. forms a new group generation if the member set changed (or the last
   publication failed), announcing ``WeightsAnnounce`` to each member first,
   since members join when they read it;
3. gathers the policy's parameters one at a time and broadcasts them in
   manifest order (one bucket at most held beyond the tensor being gathered).

A member that dies or stalls makes the join or a broadcast fail after the
group's timeout; rank 0 keeps taking part in the remaining gathers (the
other ranks are in them), counts the failure, and the next publication forms
a new generation with the members still alive. The learner never hangs on an
actor.

Gathering and broadcasting are pipelined per tensor; the publication itself
runs between optimiser steps (training resumes when the last bucket is sent;
actors load while the learner trains).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from learner.config import LearnerConfig
from learner.control import ControlPlane, Member
from learner.metrics import LearnerMetrics
from protocol import GroupInfo
from protocol.weights import WeightGroup, host_store, manifest_of

log = logging.getLogger("compactionrl.learner.publisher")


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class WeightPublisher:
    def __init__(self, policy: nn.Module, config: LearnerConfig, rank: int,
                 control: ControlPlane | None, metrics: LearnerMetrics,
                 agree: Callable[[int], int]) -> None:
        """``agree(value)`` broadcasts rank 0's ``value`` to every rank."""
        self.parameters = list(policy.named_parameters())  # tied weights once
        self.manifest = manifest_of(self.parameters, config.weight_bucket_bytes)
        self.config = config
        self.rank = rank
        self.control = control
        self.metrics = metrics
        self.agree = agree
        # actors join with the learner's own backend (placement chose it)
        self.backend = dist.get_backend()
        self.host, self.port = split_address(config.weight_store_address)
        self.store = host_store(self.port, config.weight_timeout_s) if rank == 0 else None
        self.generation = 0
        self.group: WeightGroup | None = None
        self.group_members: tuple[tuple[str, int], ...] = ()
        self._gather_seconds = 0.0

    def publish(self, version: int) -> bool:
        """Publish ``version`` to the current members. On rank 0, True if the
        broadcast reached every member."""
        members = self.control.members() if self.control else []
        if not self.agree(len(members)):
            return False
        if self.rank == 0:
            self._form_group(members, version)
        if not self.agree(1 if self.group is not None else 0):
            self.metrics.publications.labels("failed").inc()
            return False
        self._gather_seconds = 0.0
        gathered = self._gathered()
        if self.rank != 0:
            for _ in gathered:
                pass
            return True
        began = time.perf_counter()
        try:
            self.group.send(self.manifest, gathered)
        except RuntimeError as exc:  # a member died or timed out (torch's DistError)
            log.warning("publication of version %d failed: %s", version, exc)
            for _ in gathered:  # the other ranks are still gathering
                pass
            self.group, self.group_members = None, ()
            self.metrics.publications.labels("failed").inc()
            return False
        self.control.delivered(members, version)
        seconds = self.metrics.weight_sync_seconds
        seconds.labels("gather").observe(self._gather_seconds)
        seconds.labels("broadcast").observe(time.perf_counter() - began - self._gather_seconds)
        self.metrics.publications.labels("ok").inc()
        self.metrics.published_version.set(version)
        log.info("published version %d to %d actors (generation %d)", version,
                 len(members), self.generation)
        return True

    def _form_group(self, members: list[Member], version: int) -> None:
        """Rank 0: announce, and join a new generation if the member set changed."""
        key = tuple((m.actor_id, m.incarnation) for m in members)
        new = self.group is None or key != self.group_members
        if new:
            self.generation += 1
            self.group = None

        def group_for_rank(rank: int) -> GroupInfo:
            return GroupInfo(generation=self.generation, master_addr=self.host,
                             master_port=self.port,
                             world_size=len(members) + 1, rank=rank, backend=self.backend,
                             timeout_s=self.config.weight_timeout_s)

        self.control.announce(members, version, self.manifest, group_for_rank)
        if not new:
            return
        try:
            self.group = WeightGroup(self.store, self.generation, len(members) + 1, 0,
                                     self.backend, self.config.weight_timeout_s)
            self.group_members = key
        except RuntimeError as exc:  # a member never joined
            log.warning("group generation %d did not form: %s", self.generation, exc)
            self.group_members = ()

    def _gathered(self) -> Iterator[torch.Tensor]:
        """Full tensors, one at a time, in manifest order (a collective per
        tensor), adding the time spent to ``_gather_seconds``."""
        for _, parameter in self.parameters:
            began = time.perf_counter()
            full = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
            self._gather_seconds += time.perf_counter() - began
            yield full.detach()
