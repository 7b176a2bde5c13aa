"""Learner rank 0's control socket: actor membership and weight announcements.

Actors register here (``Hello`` -> ``MemberWelcome`` with the learner's
version), heartbeat, and report ``WeightsLoaded``. An actor that
misses ``heartbeat_liveness`` heartbeats, or comes back as a new incarnation,
leaves the member set; the publisher forms a new group generation whenever
the set it announces to differs from the last one.

A background thread owns the ROUTER (ZeroMQ sockets are not thread-safe);
the training thread reads the member table under a lock and hands
announcements to the thread over an inproc PAIR, which also wakes it.

Usage::

    control = ControlPlane(address, transport, run_id="r", max_staleness=4,
                           late_joiner="immediate", metrics=metrics,
                           announced_record=run_dir / "checkpoints" / "announced.json")
    members = control.members()
    control.announce(version, [(member, manifest, group_info), ...])
    if control.publication_wanted(version): ...
    control.close()
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq

from learner.metrics import LearnerMetrics
from ops.files import atomic_write_text
from protocol import (
    EngineInfo,
    Error,
    ErrorCode,
    GroupInfo,
    Heartbeat,
    Hello,
    MemberWelcome,
    Message,
    ProtocolError,
    Stamp,
    WeightManifest,
    WeightsAnnounce,
    WeightsLoaded,
    decode,
    encode,
)
from protocol.transport import Authenticator, Liveness, TransportConfig, bind_router

log = logging.getLogger("compactionrl.learner.control")

#: The thread wakes at least this often to expire silent actors.
POLL_MS = 100
_instances = itertools.count()


@dataclass
class Member:
    """One registered actor incarnation."""

    actor_id: str
    incarnation: int
    identity: bytes
    engine: EngineInfo
    version: int
    """Version of the weights it reported holding (Hello, then WeightsLoaded),
    or that a successful broadcast delivered to it (its report may lag)."""
    fresh: bool = True
    """Joined after the last publication that included it."""


class ControlPlane:
    def __init__(self, address: str, transport: TransportConfig, run_id: str,
                 max_staleness: int, late_joiner: Literal["immediate", "next_publication"],
                 metrics: LearnerMetrics, announced_record: Path | None = None) -> None:
        """``announced_record``: a file that keeps the newest version ever
        announced in this run, written before the announcement: a learner
        restarted from an older checkpoint reads it and labels its weights
        above every version an actor may hold."""
        self.run_id = run_id
        self.max_staleness = max_staleness
        self.late_joiner = late_joiner
        self.metrics = metrics
        self.transport = transport
        self.version = 0
        """The learner's policy version, set by the training thread."""
        self._members: dict[str, Member] = {}
        self._record = announced_record
        self._announced = (json.loads(announced_record.read_text())["version"]
                           if announced_record is not None and announced_record.is_file() else 0)
        """The newest version announced (by this process or an earlier one of
        the run): no actor can have loaded a newer one."""
        self._lock = threading.Lock()
        self._stamp = Stamp("learner", time.time_ns())
        self._context = zmq.Context()
        self._auth = Authenticator(self._context, transport.curve)
        self._socket = bind_router(self._context, address, transport)
        inproc = f"inproc://learner-control-{next(_instances)}"
        self._inbox = self._context.socket(zmq.PAIR)
        self._inbox.bind(inproc)
        self._outbox = self._context.socket(zmq.PAIR)
        self._outbox.connect(inproc)
        self._liveness = Liveness(transport.heartbeat_interval_s, transport.heartbeat_liveness)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="learner-control", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread

    def members(self) -> list[Member]:
        """The live members, in a stable order (their broadcast ranks follow it)."""
        with self._lock:
            return sorted(self._members.values(), key=lambda m: m.actor_id)

    def publication_wanted(self, version: int) -> bool:
        """Whether a member needs weights now: one is older than the staleness
        bound (it cannot contribute), or a late joiner asks for them at once."""
        with self._lock:
            for member in self._members.values():
                behind = version - member.version
                if behind > self.max_staleness:
                    return True
                if behind > 0 and member.fresh and self.late_joiner == "immediate":
                    return True
        return False

    def delivered(self, members: list[Member], version: int) -> None:
        """A broadcast of ``version`` reached ``members``."""
        with self._lock:
            for member in members:
                member.version = max(member.version, version)

    @property
    def announced(self) -> int:
        with self._lock:
            return self._announced

    def announce(self, version: int,
                 announcements: list[tuple[Member, WeightManifest, GroupInfo]]) -> None:
        """Send ``WeightsAnnounce`` to each member with its manifest (its wire
        dtype) and its group (generation, ranks)."""
        if self._record is not None and version > self.announced:
            self._record.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self._record, json.dumps({"version": version}))
        with self._lock:
            self._announced = max(self._announced, version)
            for member, _, _ in announcements:
                member.fresh = False
        for member, manifest, group in announcements:
            frame = encode(WeightsAnnounce(**self._stamp.next(), version=version,
                                           manifest=manifest, group=group))
            self._outbox.send_multipart([member.identity, frame])

    def close(self) -> None:
        self._stop.set()
        self._outbox.send_multipart([b"", b""])  # wake the thread
        self._thread.join(timeout=5)
        self._outbox.close(linger=0)
        self._auth.stop()
        self._context.term()

    # ------------------------------------------------------------------ control thread

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if self._inbox in ready:
                    identity, frame = self._inbox.recv_multipart()
                    if identity:
                        self._send_frame(identity, frame)
                if self._socket in ready:
                    self._receive()
                for identity in self._liveness.expire():
                    self._drop(identity, "missed its heartbeats")
        finally:
            self._socket.close(linger=0)
            self._inbox.close(linger=0)

    def _receive(self) -> None:
        try:
            identity, *parts = self._socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(parts) != 1:
            self._reject(identity, ErrorCode.MALFORMED, "a message is exactly one frame", None)
            return
        frame = parts[0]
        try:
            message = decode(frame, self.transport.max_message_bytes)
        except ProtocolError as exc:
            self._reject(identity, exc.code, str(exc), exc.ref_seq)
            return
        if message.sender_id.encode() != identity:
            self._reject(identity, ErrorCode.IDENTITY, "sender_id differs from the connection's "
                         "identity", message.seq)
            return
        self._handle(identity, message)

    def _handle(self, identity: bytes, message: Message) -> None:
        problem = ""
        with self._lock:
            member = self._members.get(message.sender_id)
            if isinstance(message, Hello):
                if member is None or message.incarnation >= member.incarnation:
                    self._members[message.sender_id] = Member(
                        message.sender_id, message.incarnation, identity, message.engine,
                        message.policy_version)
                    self.metrics.members.set(len(self._members))
                    log.info("actor %s joined (incarnation %d, version %d)",
                             message.sender_id, message.incarnation, message.policy_version)
            elif member is None or member.incarnation != message.incarnation:
                member = None
            elif isinstance(message, WeightsLoaded):
                problem = self._implausible(message)
                if not problem:
                    member.version = max(member.version, message.version)
                    self.metrics.weight_sync_seconds.labels("load").observe(message.seconds)
        if isinstance(message, Hello):
            self._liveness.seen(identity)
            self._send(identity, MemberWelcome(
                **self._stamp.next(), run_id=self.run_id, policy_version=self.version,
                heartbeat_interval_s=self.transport.heartbeat_interval_s,
                heartbeat_liveness=self.transport.heartbeat_liveness))
        elif member is None:
            # unknown, or a replaced incarnation: it must say Hello (again)
            self._reject(identity, ErrorCode.UNREGISTERED, "send Hello first", message.seq)
        elif problem:
            self._reject(identity, ErrorCode.INVALID, problem, message.seq)
        elif isinstance(message, (Heartbeat, WeightsLoaded)):
            self._liveness.seen(identity)
        else:
            self._reject(identity, ErrorCode.UNEXPECTED,
                         f"{type(message).__name__} is not for the learner", message.seq)

    def _implausible(self, loaded: WeightsLoaded) -> str:
        """Why a load report cannot be true ('' if it can): a version never
        announced would hold the member back from publications, a non-finite
        time would poison the load-time histogram for the rest of the run."""
        if not 0 <= loaded.version <= self._announced:
            return f"version {loaded.version} was never announced (newest {self._announced})"
        if not (math.isfinite(loaded.seconds) and loaded.seconds >= 0):
            return f"load time {loaded.seconds} is not a finite duration"
        return ""

    def _drop(self, identity: bytes, why: str) -> None:
        with self._lock:
            for actor_id, member in list(self._members.items()):
                if member.identity == identity:
                    del self._members[actor_id]
                    log.info("actor %s left: %s", actor_id, why)
            self.metrics.members.set(len(self._members))

    def _reject(self, identity: bytes, code: ErrorCode, text: str, ref_seq: int | None) -> None:
        self.metrics.rejected_frames.labels(code).inc()
        self._send(identity, Error(**self._stamp.next(), code=code, text=text[:500],
                                   ref_seq=ref_seq))

    def _send(self, identity: bytes, message: Message) -> None:
        self._send_frame(identity, encode(message))

    def _send_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            self._socket.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue full
            log.debug("cannot reach %r: %s", identity, exc)
