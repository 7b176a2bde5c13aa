"""Weight publication: FSDP2 shards -> full tensors -> running actor engines.

Every learner rank calls :meth:`WeightPublisher.publish` at the same point
(gathering a full tensor is a collective). Rank 0 then:

1. takes the live members from the control plane; none -> nothing to do;
2. splits them into *lanes*, one per engine dtype (:func:`plan_lanes`): a
   lane is one broadcast group whose tensors travel in that dtype, converted
   once per tensor on the sender (bf16 to bf16 engines, never fp32 master
   weights); a tensor-parallel engine holds one rank per worker;
3. forms new group generations if the member set changed (or the last
   publication failed), announcing ``WeightsAnnounce`` to each member first,
   since members join when they read it;
4. gathers the policy's parameters one at a time, cast to the lanes' wire
   dtype before the gather where every lane has the same one
   (:func:`gather_dtype`: bf16 engines get bf16 over NVLink, half the bytes
   of fp32 masters), and feeds each to every lane (one bucket at most held
   per lane beyond the tensor being gathered).

A member that dies or stalls makes the join or a broadcast of its lane fail
within ``weight_timeout_s`` (an explicit completion wait, then the group is
aborted: :class:`protocol.weights.TransferFailed`), and rank 0 abandons that
generation in the store, so that the lane's other members stop waiting on it
at once (else each would wait out its own deadline, and join the next
generation as late as the learner gives up on it); rank 0 keeps feeding the
other lanes and taking part in the remaining gathers (the other ranks are in
them), counts the failure, and the next publication forms a new generation
with the members still alive. The learner never hangs on an actor.
Rank 0 serves the lanes in turn from one thread, so a lane whose member
stalls holds the others back until it fails; each member's deadline covers
that (:func:`member_timeout_s`).

Gathering and broadcasting are pipelined per tensor; the publication itself
runs between optimiser steps (training resumes when the last bucket is sent;
actors load while the learner trains).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from learner.config import LearnerConfig
from learner.control import ControlPlane
from learner.members import Member
from learner.metrics import LearnerMetrics
from learner.models import engine_parameters
from protocol import GroupInfo, WeightManifest
from protocol.transport import TransportConfig, listen_address
from protocol.weights import (
    WIRE_FLOAT_DTYPES,
    TransferFailed,
    WeightChannel,
    abandon_generation,
    host_store,
    manifest_of,
    member_ranks,
    ranks_not_joined,
)
from protocol.weights_backends import join_channel
from protocol.weights_collective import member_timeout_s, retired_groups

log = logging.getLogger("compactionrl.learner.publisher")


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def weight_backend(configured: str, learner_backend: str) -> str:
    """The transport weights travel on: ``learner.weight_transport``, where
    ``auto`` (outside a device plan) follows the learner's own backend; ``ipc``
    stages buffers the engines map (on the learner's GPU, or its host's memory)."""
    if configured == "auto":
        return learner_backend
    if configured == "nccl" and learner_backend != "nccl":
        raise ValueError("learner.weight_transport = 'nccl' needs a learner on GPUs "
                         f"(its backend is {learner_backend}): use 'gloo' or 'auto'")
    return configured


def wire_dtype(engine_dtype: str, trained: torch.dtype) -> torch.dtype:
    """The dtype floating-point weights travel in to an engine that runs
    ``engine_dtype`` (as it reports it: ``bfloat16``, ``float16``,
    ``float32``); an engine that names none (``auto``, an older actor) or one
    weights do not travel in gets the learner's own, so that a publication
    has at most :data:`protocol.weights_collective.MAX_LANES` lanes."""
    dtype = getattr(torch, engine_dtype, None)
    return dtype if dtype in WIRE_FLOAT_DTYPES else trained


@dataclass
class Lane:
    """The members that receive in one wire dtype, and their channel."""

    dtype: torch.dtype
    members: list[Member]
    bases: list[int]
    """Each member's first group rank (one rank per engine worker)."""
    world_size: int
    generation: int = 0
    group: WeightChannel | None = None

    def ranks(self, index: int) -> range:
        """The group ranks of ``members[index]`` (one per engine worker)."""
        return range(self.bases[index],
                     self.bases[index] + max(1, self.members[index].engine.tensor_parallel))


def gather_dtype(wire_dtypes: list[torch.dtype], trained: torch.dtype) -> torch.dtype:
    """What floating-point shards are cast to before they are gathered: the
    wire dtype of every lane where they share one (a cast commutes with the
    gather, so the bytes delivered are the same, and the gather moves half of
    them for bf16 engines of fp32 masters); else (lanes of several dtypes,
    or one this gather does not carry) the trained dtype, which each lane
    converts from."""
    distinct = set(wire_dtypes)
    if len(distinct) == 1 and (shared := distinct.pop()) in WIRE_FLOAT_DTYPES:
        return shared
    return trained


def plan_lanes(members: list[Member], trained: torch.dtype) -> list[Lane]:
    """One lane per distinct wire dtype, members in the control plane's order;
    ranks count every tensor-parallel worker."""
    by_dtype: dict[torch.dtype, list[Member]] = {}
    for member in members:
        by_dtype.setdefault(wire_dtype(member.engine.dtype, trained), []).append(member)
    lanes = []
    for dtype, group in by_dtype.items():
        bases, world_size = member_ranks([max(1, m.engine.tensor_parallel) for m in group])
        lanes.append(Lane(dtype, group, bases, world_size))
    return lanes


def reason_to_give_up(lane: Lane, members: list[Member], stopping: bool) -> str | None:
    """Why rank 0 stops waiting for ``lane``'s members to join a generation:
    the learner is ``stopping``, or a member is no longer among ``members``
    (it left, or a new incarnation replaced it; the next publication forms a
    generation with what is there). Else None: wait on."""
    if stopping:
        return "the learner is stopping"
    current = {(m.actor_id, m.incarnation) for m in members}
    gone = [m.actor_id for m in lane.members if (m.actor_id, m.incarnation) not in current]
    return f"{', '.join(gone)} left" if gone else None


class WeightPublisher:
    def __init__(self, policy: nn.Module, config: LearnerConfig, transport: TransportConfig,
                 rank: int, control: ControlPlane | None, metrics: LearnerMetrics,
                 agree: Callable[[int], int], stopping: Callable[[], bool]) -> None:
        """``agree(value)`` broadcasts rank 0's ``value`` to every rank;
        ``stopping()``: whether the learner is stopping (a generation still
        forming is then given up)."""
        self.parameters = engine_parameters(policy)
        self.trained_dtype = self.parameters[0][1].dtype
        self.config = config
        self.rank = rank
        self.control = control
        self.metrics = metrics
        self.agree = agree
        self.stopping = stopping
        self.backend = weight_backend(config.weight_transport, dist.get_backend())
        # members connect to the advertised address; the store listens on the bind
        self.host, self.port = split_address(config.weight_store_address)
        bind_host, bind_port = split_address(listen_address(config.weight_store_bind,
                                                            config.weight_store_address))
        self.store = (host_store(bind_port, config.weight_timeout_s, transport, bind_host,
                                 lambda reason: metrics.rejected_frames.labels(reason).inc())
                      if rank == 0 else None)
        self.generation = 0
        self.lanes: list[Lane] = []
        self.lane_key: tuple = ()
        self._manifests: dict[torch.dtype, WeightManifest] = {}
        self._gather_seconds = 0.0

    def manifest(self, dtype: torch.dtype) -> WeightManifest:
        """The manifest of a lane: the policy's tensors in ``dtype`` on the wire."""
        if dtype not in self._manifests:
            self._manifests[dtype] = manifest_of(self.parameters, self.config.weight_bucket_bytes,
                                                 dtype)
        return self._manifests[dtype]

    def publish(self, version: int) -> bool:
        """Publish ``version`` to the current members. On rank 0, True if the
        broadcast reached every member."""
        try:
            return self._publish(version)
        finally:
            if self.control is not None:
                self.control.publication_ended()

    def _publish(self, version: int) -> bool:
        members = self.control.members() if self.control else []
        if not self.agree(len(members)):
            return False
        formed = self._form_lanes(members, version) if self.rank == 0 else []
        if not self.agree(len(formed)):
            self.metrics.publications.labels("failed").inc()
            return False
        cast = WIRE_FLOAT_DTYPES[self.agree(WIRE_FLOAT_DTYPES.index(
            gather_dtype([lane.dtype for lane in formed], self.trained_dtype)))]
        self._gather_seconds = 0.0
        gathered = self._gathered(cast)
        if self.rank != 0:
            for _ in gathered:
                pass
            return True
        began = time.perf_counter()
        senders = [lane.group.sender(self.manifest(lane.dtype)) for lane in formed]
        for index, tensor in enumerate(gathered):
            for sender in senders:  # a failed lane ignores the rest; the others go on
                sender.add(index, tensor)
        reached: list[Member] = []
        for lane, sender in zip(formed, senders, strict=True):
            try:
                sender.finish()
                reached += lane.members
            except (TransferFailed, ValueError) as exc:
                log.warning("publication of version %d to the %s lane (generation %d) "
                            "failed: %s", version, lane.dtype, lane.generation, exc)
                lane.group = None
                abandon_generation(self.store, lane.generation)
                self.control.table.broken(lane.members)  # the next step boundary publishes again
                if len(lane.members) == 1:  # the one member it can be put down to
                    self._left_out(lane.members, lane.generation)
        # a broadcast has completed at every receiver when its wait returns
        seconds = self.metrics.weight_sync_seconds
        seconds.labels("gather").observe(self._gather_seconds)
        seconds.labels("broadcast").observe(time.perf_counter() - began - self._gather_seconds)
        self.control.table.delivered(reached, version)
        self.metrics.members_excluded.set(self.control.table.excluded())
        self.metrics.retired_weight_groups.set(retired_groups())
        if len(reached) < len(members):
            self.lane_key = ()  # the next publication forms new generations
            self.metrics.publications.labels("failed").inc()
            return False
        self.metrics.publications.labels("ok").inc()
        self.metrics.published_version.set(version)
        log.info("published version %d to %d actors (generation %d)", version,
                 len(members), self.generation)
        return True

    def _form_lanes(self, members: list[Member], version: int) -> list[Lane]:
        """Rank 0: announce to every member, joining new group generations if
        the member set changed. Returns the lanes whose group formed."""
        key = tuple((m.actor_id, m.incarnation, m.engine.dtype, m.engine.tensor_parallel)
                    for m in members)
        if key != self.lane_key or any(lane.group is None for lane in self.lanes):
            self.lanes = plan_lanes(members, self.trained_dtype)
            for lane in self.lanes:
                self.generation += 1
                lane.generation = self.generation
            self.lane_key = key
            new = True
        else:
            new = False
        announcements = []
        for lane in self.lanes:
            manifest = self.manifest(lane.dtype)
            for member, base in zip(lane.members, lane.bases, strict=True):
                announcements.append((member, manifest, GroupInfo(
                    generation=lane.generation, master_addr=self.host, master_port=self.port,
                    world_size=lane.world_size, rank=base, backend=self.backend,
                    timeout_s=member_timeout_s(self.config.weight_timeout_s,
                                               len(self.lanes)))))
        self.control.announce(version, announcements)
        if new:
            for lane in self.lanes:
                try:
                    lane.group = join_channel(self.store, lane.generation, lane.world_size, 0,
                                              self.backend, self.config.weight_timeout_s,
                                              functools.partial(self._give_up, lane))
                except RuntimeError as exc:  # a member never joined
                    log.warning("group generation %d did not form: %s", lane.generation, exc)
                    lane.group = None
                    self._left_out([member for index, member in enumerate(lane.members)
                                    if ranks_not_joined(self.store, lane.generation,
                                                        lane.ranks(index))], lane.generation)
                    abandon_generation(self.store, lane.generation)
        formed = [lane for lane in self.lanes if lane.group is not None]
        if len(formed) < len(self.lanes):
            self.lane_key = ()
        return formed

    def _left_out(self, members: list[Member], generation: int) -> None:
        """``members`` made ``generation`` fail: publications leave them out
        for a while (learner/members.py ``exclusion_s``), for good after
        too many failures in a row."""
        if not members:
            return
        for_good = self.control.table.failed(members)
        self.metrics.member_exclusions.inc(len(members))
        log.warning("generation %d failed because of %s: left out of publications for a "
                    "while", generation, ", ".join(m.actor_id for m in members))
        for member in for_good:
            log.error("%s (incarnation %d) failed %d generations in a row: left out of "
                      "publications until it restarts", member.actor_id, member.incarnation,
                      member.failures)

    def _give_up(self, lane: Lane) -> str | None:
        return reason_to_give_up(lane, self.control.members(), self.stopping())

    def _gathered(self, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """Full tensors, one at a time, in manifest order (a collective per
        tensor), floating-point ones cast to ``dtype`` before the gather,
        adding the time spent to ``_gather_seconds``."""
        for _, parameter in self.parameters:
            began = time.perf_counter()
            shard = parameter.detach()
            if shard.is_floating_point():
                shard = shard.to(dtype)
            full = shard.full_tensor() if hasattr(shard, "full_tensor") else shard
            self._gather_seconds += time.perf_counter() - began
            yield full
