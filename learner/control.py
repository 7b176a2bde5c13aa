"""Learner rank 0's control socket: actor membership and weight announcements.

Actors register here (``Hello`` -> ``MemberWelcome`` with the learner's
version), heartbeat, and report ``WeightsLoaded``. An actor that says
``Goodbye``, misses ``heartbeat_liveness`` heartbeats, or comes back as a new
incarnation leaves the member set; the publisher forms a new group
generation whenever the set it announces to differs from the last one.
Which connection speaks for which incarnation, which incarnations are over
(replaced, or said goodbye) and how many may register are the replay's rules
(protocol/registry.py), so both sockets refuse the same peers alike.

A background thread owns the ROUTER (ZeroMQ sockets are not thread-safe);
the training thread reads the member table (learner/members.py) under its
lock and hands announcements to the thread over an inproc PAIR, which also
wakes it.

Usage::

    control = ControlPlane(address, transport, run_id="r", max_staleness=4,
                           late_joiner="immediate", metrics=metrics,
                           announced_record=run_dir / "checkpoints" / "announced.json")
    members = control.members()
    control.announce(version, [(member, manifest, group_info), ...])
    ...  # the broadcast
    control.publication_ended()
    if control.table.publication_wanted(version): ...
    control.close()
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from pathlib import Path
from typing import Literal

import msgspec
import zmq

from learner.members import ExclusionPolicy, Member, MemberTable
from learner.metrics import LearnerMetrics
from ops.files import atomic_write_text
from protocol import (
    LEARNER_ID,
    NO_COMPLETE_VERSION,
    ErrorCode,
    Goodbye,
    GroupInfo,
    Heartbeat,
    Hello,
    MemberWelcome,
    Message,
    Stamp,
    WeightManifest,
    WeightsAnnounce,
    WeightsLoaded,
    encode,
)
from protocol.endpoint import Handler, Received, ServerEndpoint
from protocol.registry import DEFAULT_MAX_ACTORS, ActorRegistry, Peer
from protocol.transport import Authenticator, Liveness, TransportConfig, bind_router

log = logging.getLogger("compactionrl.learner.control")

#: The thread wakes at least this often to expire silent actors.
POLL_MS = 100
_instances = itertools.count()


class ControlPlane:
    def __init__(self, address: str, transport: TransportConfig, run_id: str,
                 max_staleness: int, late_joiner: Literal["immediate", "next_publication"],
                 metrics: LearnerMetrics, announced_record: Path | None = None,
                 exclusion: ExclusionPolicy | None = None,
                 max_members: int = DEFAULT_MAX_ACTORS) -> None:
        """``announced_record``: a file that keeps the newest version ever
        announced in this run, written before the announcement: a learner
        restarted from an older checkpoint reads it and labels its weights
        above every version an actor may hold. ``exclusion``: how members
        that make generations fail are left out (learner/members.py).
        ``max_members``: incarnations registered at once (a new actor's
        ``Hello`` beyond them is ``full``), as the replay's ``max_actors``."""
        self.run_id = run_id
        self.metrics = metrics
        self.transport = transport
        self.version = 0
        """The learner's policy version, set by the training thread."""
        self.table = MemberTable(max_staleness, late_joiner, exclusion)
        self._members = self.table.by_id
        self._record = announced_record
        self._announced = (json.loads(announced_record.read_text())["version"]
                           if announced_record is not None and announced_record.is_file() else 0)
        """The newest version announced (by this process or an earlier one of
        the run): no actor can have loaded a newer one."""
        self._lock = self.table.lock
        self._stamp = Stamp(LEARNER_ID, time.time_ns())
        self._context = zmq.Context()
        self._auth = Authenticator(self._context, transport.curve)
        self._socket = bind_router(self._context, address, transport)
        self._endpoint = ServerEndpoint(
            self._socket, self._stamp, transport.max_message_bytes,
            lambda code, message: metrics.rejected_frames.labels(code).inc(),
            bind_keys=transport.curve.enabled)
        self._handlers: dict[type[Message], Handler] = {
            Hello: self._on_hello, Heartbeat: self._on_heartbeat,
            WeightsLoaded: self._on_loaded, Goodbye: self._on_goodbye}
        inproc = f"inproc://learner-control-{next(_instances)}"
        self._inbox = self._context.socket(zmq.PAIR)
        self._inbox.bind(inproc)
        self._outbox = self._context.socket(zmq.PAIR)
        self._outbox.connect(inproc)
        # The replay's incarnation rules (protocol/registry.py), except that
        # a silent member may say hello again as the same incarnation: here
        # silence loses nothing that could count twice.
        self._registry = ActorRegistry(
            Liveness(transport.heartbeat_interval_s, transport.heartbeat_liveness), max_members,
            silence_ends_incarnation=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="learner-control", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread

    def members(self) -> list[Member]:
        """The members a publication goes to (:meth:`MemberTable.publishable`)."""
        return self.table.publishable()

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
            for member in self.table.current([member for member, _, _ in announcements]):
                member.fresh = False
        for member, manifest, group in announcements:
            announce = WeightsAnnounce(**self._stamp.next(), version=version,
                                       manifest=manifest, group=group)
            with self._lock:
                member.pending = member.unacknowledged = announce
                identity = member.identity
            self._outbox.send_multipart([identity, encode(announce)])

    def publication_ended(self) -> None:
        """The publication announced last is over (delivered, failed or never
        formed): a member that reconnects now needs no announcement of it."""
        with self._lock:
            for member in self._members.values():
                member.pending = None

    def close(self) -> None:
        """Stop the control thread and close the sockets (again: nothing)."""
        if self._context.closed:
            return
        self._stop.set()
        try:  # wake the thread now rather than at its next poll
            self._outbox.send_multipart([b"", b""], flags=zmq.NOBLOCK)
        except zmq.Again:
            # it saw the stop already and closed its end: a blocking send
            # would wait for a peer that never comes (measured: a teardown
            # held 600 s), and the context's term() after it for ever
            pass
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
                        self._endpoint.send_frame(identity, frame)
                if self._socket in ready:
                    for received in self._endpoint.receive():
                        self._handle(received)
                for _, peer in self._registry.expire(time.monotonic()):
                    self._drop(peer, "missed its heartbeats")
        finally:
            self._socket.close(linger=0)
            self._inbox.close(linger=0)

    def _handle(self, received: Received) -> None:
        """A message goes to the handler of its type once the incarnation
        rules (protocol/registry.py, shared with the replay) let it through:
        an older or ended incarnation, a connection that is not the
        incarnation's, and a new actor beyond ``max_members`` are refused;
        a ``Hello`` for a member registered on another live connection must
        carry its token (a reconnect), else it would take the member's
        announcements (and so the weights) over."""
        message, identity = received.message, received.identity
        hello = message if isinstance(message, Hello) else None
        refusal = self._registry.refusal(identity, message.sender_id, message.incarnation,
                                         None if hello is None else hello.token)
        if refusal is not None:
            self._endpoint.refuse(received, *refusal)
            return
        if hello is None:
            self._registry.seen(identity)
        self._endpoint.dispatch(self._handlers, received)
        with self._lock:
            member = self._members.get(message.sender_id)
            if member is not None and member.identity == identity:
                member.heard_at = time.monotonic()

    def _on_hello(self, received: Received) -> None:
        hello, identity = received.message, received.identity
        _, displaced = self._registry.register(identity, hello.sender_id, hello.incarnation,
                                               hello.token, hello.capacity, hello.group_size)
        if displaced is not None:  # told why it hears no more (it is usually gone)
            self._endpoint.reject(displaced, ErrorCode.IDENTITY, f"displaced: incarnation "
                                  f"{hello.incarnation} of {hello.sender_id!r} said hello with "
                                  "its token on another connection")
        pending = None
        with self._lock:
            member = self._members.get(hello.sender_id)
            if member is not None and hello.incarnation == member.incarnation:
                # its Hello again (retried, after a failed load, or on a new
                # connection with its token): the same member; an older report
                # may be late, a broken one is not
                if member.identity != identity:
                    pending = member.pending
                member.identity = identity
                member.version = (NO_COMPLETE_VERSION
                                  if hello.policy_version == NO_COMPLETE_VERSION
                                  else max(member.version, hello.policy_version))
            else:  # new, or a newer incarnation replacing the member (the registry's rule)
                self._members[hello.sender_id] = Member(
                    hello.sender_id, hello.incarnation, identity, hello.token, hello.engine,
                    hello.policy_version)
                self.metrics.members.set(len(self._members))
                log.info("actor %r joined (incarnation %d, version %d)",
                         hello.sender_id, hello.incarnation, hello.policy_version)
        self._endpoint.send(identity, MemberWelcome(
            **self._stamp.next(), run_id=self.run_id, policy_version=self.version,
            heartbeat_interval_s=self.transport.heartbeat_interval_s,
            heartbeat_liveness=self.transport.heartbeat_liveness))
        if pending is not None:
            log.info("announcing version %d again to %r on its new connection",
                     pending.version, hello.sender_id)
            self._endpoint.send(identity, msgspec.structs.replace(pending, **self._stamp.next()))

    def _on_heartbeat(self, received: Received) -> None:
        """Liveness only, which :meth:`_handle` noted."""

    def _on_goodbye(self, received: Received) -> None:
        """A member leaving cleanly is dropped now, not after its heartbeats
        stop: a generation still forming gives up on it at once
        (:func:`learner.publisher.reason_to_give_up`), and the next publication
        goes to the others without waiting for it."""
        peer = self._registry.leave(received.identity)
        if peer is not None:
            self._drop(peer, "said goodbye")

    def _on_loaded(self, received: Received) -> None:
        """A member's report that it loaded the version announced to it: it
        counts (the member's version, the load-time histogram) once, and
        only for that announcement; any other would hold the member at a
        version it never received, or skew the histogram."""
        loaded = received.message
        with self._lock:
            member = self._members.get(loaded.sender_id)
            announced = None if member is None else member.unacknowledged
            if announced is None or announced.version != loaded.version:
                problem = (f"version {loaded.version} was not announced to this member, or "
                           "its load was reported already")
            else:
                member.unacknowledged = None
                member.version = max(member.version, loaded.version)
                problem = ""
        if problem:
            self._endpoint.refuse(received, ErrorCode.INVALID, problem)
            return
        self.metrics.weight_sync_seconds.labels("load").observe(loaded.seconds)

    def _drop(self, peer: Peer, why: str) -> None:
        """The registry unregistered ``peer``: its member leaves the set
        (unless a newer incarnation replaced it there already)."""
        with self._lock:
            member = self._members.get(peer.actor_id)
            if member is not None and member.incarnation == peer.incarnation:
                del self._members[peer.actor_id]
                log.info("actor %r left: %s", peer.actor_id, why)
            self.metrics.members.set(len(self._members))
