"""The replay's actor-facing side: what each actor message does, which
incarnation may speak (protocol/registry.py), and the acks and credits each
actor gets back.

One ingest pass reads up to :data:`INGEST_BATCH` actor messages, writes the
accepted segments to the durable log, makes them durable (the fsync policy),
and only then acknowledges them, with credits. Every message is checked
first: a connection not registered by its incarnation's ``Hello``, an old
or dead incarnation, a rollout another incarnation owns, segment contents outside
the vocabulary or the version window: each gets an ``Error`` reply and a
counter, never a crash.

Usage::

    ingest = ActorIngest(endpoint, book, registry, fleet, welcome, stamp)
    ingest.receive()              # a pass over what the actor socket holds
    ingest.offer_credits()        # a learner step freed credits: share them out now
    ingest.expire_silent(now)     # incarnations silent past the liveness timeout
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from protocol import (
    Abandon,
    Ack,
    ErrorCode,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Segment,
    Stamp,
    Welcome,
)
from protocol.endpoint import Handler, Received, ServerEndpoint
from protocol.registry import ActorRegistry, Peer
from protocol.validation import check_segment_content
from replay.book import RolloutBook, owner_of
from replay.buffer import SEGMENT_OVERHEAD_BYTES
from replay.fleet import Fleet
from replay.groups import check_group_size

log = logging.getLogger("compactionrl.replay")

#: Actor messages handled per ingest pass: one fsync covers them all.
INGEST_BATCH = 64
#: Versions a trainable token may be ahead of the newest one the learner has
#: asked with. The learner asks with a version before it publishes it, but
#: a request the replay never read before it restarted (frozen, then
#: killed) is sent again only when the learner's socket reconnects, and the
#: actors' first tokens of that version (their sockets reconnect too) can
#: arrive first: seen in the fault run, where a
#: replay restarted with V = 25 refused 35 segments of version 26 within a
#: second. The learner cannot publish a second version without a batch, so
#: one is the bound.
VERSION_AHEAD = 1


def group_refusal(hello: Hello | None, batch: int) -> tuple[ErrorCode, str] | None:
    """A hello whose groups no batch of ``batch`` rollouts could hold whole is refused."""
    if hello is None or hello.group_size <= batch:
        return None
    return ErrorCode.INVALID, (f"group_size {hello.group_size} > rollouts_per_batch {batch}: "
                               "a batch holds whole groups")


@dataclass(frozen=True)
class RunFacts:
    """What every actor's ``Welcome`` tells it about the run, besides the
    learner version and its credits."""

    run_id: str
    heartbeat_interval_s: float
    heartbeat_liveness: int
    max_staleness: int
    rollouts_per_batch: int
    max_message_bytes: int
    vocab_size: int
    stale_grace: int


class ActorIngest:
    def __init__(self, endpoint: ServerEndpoint, book: RolloutBook, registry: ActorRegistry,
                 fleet: Fleet, facts: RunFacts, stamp: Stamp) -> None:
        self.endpoint = endpoint
        self.book = book
        self.registry = registry
        self.fleet = fleet
        self.facts = facts
        self._stamp = stamp
        self._handlers: dict[type[Message], Handler] = {
            Hello: self._on_hello, Segment: self._on_segment, Heartbeat: self._on_heartbeat,
            Abandon: self._on_abandon, Goodbye: self._on_goodbye}
        self._behind: set[bytes] = set()
        """Actors whose heartbeat showed an older credit total than granted."""
        self._acks: dict[bytes, list[int]] = defaultdict(list)
        """Per actor, the seqs stored in the ingest pass under way (acknowledged at its end)."""
        self._now = time.monotonic()
        """The ingest pass's clock."""

    def receive(self) -> None:
        """One ingest pass: handle what arrived, make it durable, then
        acknowledge it with the credits each actor may take."""
        self._acks = defaultdict(list)
        self._now = time.monotonic()
        touched: set[bytes] = set()
        for received in self.endpoint.receive(INGEST_BATCH):
            touched.add(received.identity)
            self._handle(received)
        if self.book.log is not None and self._acks:
            self.book.log.sync()
        shares = self._grant_shares()
        for identity in touched | shares.keys():
            if identity not in self.registry.peers:  # refused: nothing of it was stored
                continue
            seqs = self._acks.get(identity, [])
            credits = shares.get(identity, 0)
            if seqs or credits or identity in self._behind:
                self._ack(identity, seqs, credits)
        self._behind.clear()

    def _handle(self, received: Received) -> None:
        """The incarnation rules (protocol/registry.py), then the handler of
        the message's type."""
        identity, message = received.identity, received.message
        hello = message if isinstance(message, Hello) else None
        refusal = (self.registry.refusal(identity, message.sender_id, message.incarnation,
                                         None if hello is None else hello.token)
                   or group_refusal(hello, self.book.config.rollouts_per_batch))
        if refusal is not None:  # a refused incarnation's rollouts are gone: none counts twice
            self.endpoint.refuse(received, *refusal)
            return
        if hello is None:
            self.registry.seen(identity)
        else:
            replaced, displaced = self.registry.register(
                identity, hello.sender_id, hello.incarnation, hello.token, hello.capacity,
                hello.group_size)
            if replaced is not None:  # restarted before its old incarnation fell silent
                self._actor_gone(replaced)
            if displaced is not None:  # it reconnected: the old connection hears why it ends
                self.endpoint.reject(displaced, ErrorCode.IDENTITY, f"displaced: incarnation "
                                     f"{hello.incarnation} of {hello.sender_id} said hello "
                                     "with its token on another connection")
        self.endpoint.dispatch(self._handlers, received)

    def _on_hello(self, received: Received) -> None:
        hello, identity = received.message, received.identity
        facts = self.facts
        self.fleet.joined(self.registry.peers[identity], hello.metrics_address)
        self.endpoint.send(identity, Welcome(
            **self._stamp.next(), run_id=facts.run_id, policy_version=self.book.learner_version,
            heartbeat_interval_s=facts.heartbeat_interval_s,
            heartbeat_liveness=facts.heartbeat_liveness, max_staleness=facts.max_staleness,
            rollouts_per_batch=facts.rollouts_per_batch,
            max_message_bytes=facts.max_message_bytes, vocab_size=facts.vocab_size,
            stale_grace=facts.stale_grace,
            # granted before the ledger fields are read: they count these credits
            credits=self._grant_shares(identity).get(identity, 0),
            **self._ledger_fields(hello.sender_id)))

    def _on_heartbeat(self, received: Received) -> None:
        heartbeat, identity = received.message, received.identity
        peer = self.registry.peers[identity]
        peer.active_rollouts = heartbeat.active_rollouts
        self.fleet.heartbeat(peer, heartbeat.stall_seconds, self._now)
        if ((heartbeat.credit_ledger, heartbeat.credits_seen)
                != self.book.pacer.ledger(heartbeat.sender_id)):
            self._behind.add(identity)  # a reply with credits was lost: repeat the total

    def _on_segment(self, received: Received) -> None:
        identity, segment, frame = received.identity, received.message, received.frame
        book, metrics = self.book, self.book.metrics
        if self._refused_stranger(received, segment.rollout_id):
            return
        key = (segment.sender_id, segment.incarnation, segment.seq)
        if key in book.seen:
            metrics.segments.labels("duplicate").inc()
            self._acks[identity].append(segment.seq)
            return
        try:
            check_group_size(segment, self.registry.peers[identity].group_size)
            oldest = check_segment_content(segment, vocab_size=book.vocab_size,
                                           oldest_version=0,
                                           newest_version=book.learner_version + VERSION_AHEAD)
        except ProtocolError as exc:
            self.endpoint.refuse(received, exc.code, str(exc))
            # its rollout can never complete: drop it now and return its credit
            # (a rollout left pending, or never stored, would hold the credit)
            if not book.buffer.settled(segment.rollout_id):
                book.drop(segment.rollout_id, "invalid", owner_of(segment))
            return
        # a late segment takes no memory: the bound must not drop its complete rollout
        if (not book.buffer.settled(segment.rollout_id)
                and book.buffer.nbytes + len(frame) + SEGMENT_OVERHEAD_BYTES
                > book.config.max_buffer_bytes):
            book.drop(segment.rollout_id, "full", owner_of(segment))
            self.endpoint.refuse(received, ErrorCode.FULL,
                                 "replay buffer at its memory bound: rollout dropped")
            return
        result = book.buffer.add(segment, frame, self._now, oldest)
        if result == "conflict":
            book.drop(segment.rollout_id, "invalid")
            self.endpoint.refuse(received, ErrorCode.INVALID,
                                 "segment index conflicts with the rollout's segments")
            return
        book.seen.add(key)
        self._acks[identity].append(segment.seq)
        if result == "late_member":  # its group was served or dropped: it would train alone
            book.drop(segment.rollout_id, "late_member", owner_of(segment))
            return
        if result == "late":  # its rollout was served or dropped already
            metrics.segments.labels("duplicate").inc()
            return
        metrics.segments.labels("accepted").inc()
        if book.log is not None:
            book.log.append_segment(frame)
        entry = book.buffer.promote(segment.rollout_id, self._now)
        if entry is not None:
            book.pacer.finished(entry.actor_id, accepted=True, rollout_bytes=entry.nbytes)

    def _on_abandon(self, received: Received) -> None:
        """A rollout its living actor gave up: dropped, its credit returned
        (once: a resent one is a duplicate, acknowledged again)."""
        identity, abandon = received.identity, received.message
        if self._refused_stranger(received, abandon.rollout_id):
            return
        try:
            check_group_size(abandon, self.registry.peers[identity].group_size)
        except ProtocolError as exc:
            self.endpoint.refuse(received, exc.code, str(exc))
            return
        key = (abandon.sender_id, abandon.incarnation, abandon.seq)
        self._acks[identity].append(abandon.seq)
        if key in self.book.seen:
            return
        self.book.seen.add(key)
        if not self.book.buffer.settled(abandon.rollout_id):
            self.book.drop(abandon.rollout_id, "abandoned", owner_of(abandon), abandon.group)

    def _on_goodbye(self, received: Received) -> None:
        """The incarnation ends cleanly: what it left unfinished is given up
        and its credits go to the other actors at the pass's end."""
        peer = self.registry.leave(received.identity)
        if peer is not None:
            log.info("actor %s (incarnation %d) said goodbye", peer.actor_id, peer.incarnation)
            self._actor_gone(peer, "abandoned")

    def _refused_stranger(self, received: Received, rollout_id: str) -> bool:
        """Refuse (``owner``) a segment or abandon of a rollout that another
        actor incarnation owns (the one that sent its first segment): no peer
        may add to, finish or drop a rollout of another."""
        owner = self.book.buffer.owner(rollout_id)
        message = received.message
        if owner is None or owner == (message.sender_id, message.incarnation):
            return False
        self.endpoint.refuse(received, ErrorCode.OWNER,
                             f"rollout {rollout_id[:64]!r} belongs to another actor incarnation")
        return True

    def _grant_shares(self, only: bytes | None = None) -> dict[bytes, int]:
        """Grant the credits the pacer allows now, split among all registered
        actors by their capacity (:func:`replay.pacing.fair_shares`, the
        invariant in replay/pacing.py), whichever actor's message this pass
        answers. ``only``: grant just that actor's share (its ``Welcome``);
        the others' stay available for the pass's end. Returns the grants
        by connection."""
        book, peers = self.book, self.registry.peers
        connection = {peer.actor_id: identity for identity, peer in peers.items()}
        unit = {peer.actor_id: peer.group_size for peer in peers.values()}
        shares = book.pacer.shares({peer.actor_id: (peer.capacity, peer.group_size)
                                    for peer in peers.values()},
                                   book.buffer.nbytes, len(book.buffer.ready))
        granted: dict[bytes, int] = {}
        for actor_id, share in shares.items():
            identity = connection[actor_id]
            if only not in (None, identity):
                continue
            granted[identity] = book.pacer.grant(actor_id, share, book.buffer.nbytes,
                                                 len(book.buffer.ready), unit[actor_id])
            book.metrics.credits_granted.inc(granted[identity])
            self.fleet.granted(actor_id, granted[identity])
        return granted

    def offer_credits(self) -> None:
        """Send the credits a learner step freed now, not in reply to each
        actor's next message: in synchronous mode (S = 0) idle actors would
        otherwise wait up to a heartbeat interval every step."""
        for identity, credits in self._grant_shares().items():
            self._ack(identity, [], credits)

    def _ack(self, identity: bytes, stored_seqs: list[int], credits: int) -> None:
        self.endpoint.send(identity, Ack(
            **self._stamp.next(), stored_seqs=stored_seqs, credits=credits,
            policy_version=self.book.learner_version,
            **self._ledger_fields(self.registry.peers[identity].actor_id)))

    def _ledger_fields(self, actor_id: str) -> dict[str, int]:
        ledger, total = self.book.pacer.ledger(actor_id)
        return {"credit_ledger": ledger, "credits_total": total}

    def expire_silent(self, now: float) -> None:
        """Declare dead the incarnations silent past the liveness timeout."""
        for _, peer in self.registry.expire(now):
            log.info("actor %s (incarnation %d) is silent: declared dead", peer.actor_id,
                     peer.incarnation)
            self._actor_gone(peer)

    def _actor_gone(self, peer: Peer, reason: str = "expired") -> None:
        """Count what an incarnation that is over (replaced, declared dead,
        or gone with a goodbye: ``reason``) leaves behind as lost, and forget
        its credits."""
        book = self.book
        actor_id, incarnation, active_rollouts = (peer.actor_id, peer.incarnation,
                                                  peer.active_rollouts)
        expired = book.buffer.expired(time.monotonic(), {(actor_id, incarnation)})
        for entry in expired:
            book.drop(entry.rollout_id, reason)
        # the rollouts it had started but sent nothing of are lost too; a
        # heartbeat's claim counts only up to the credits it still held
        outstanding = book.pacer.outstanding.get(actor_id, 0)
        unseen = max(0, min(active_rollouts - len(expired), outstanding))
        book.metrics.dropped.labels(reason).inc(unseen)
        log.info("actor %s (incarnation %d) gone: %d rollouts lost (%d pending, %d unseen; "
                 "%d in flight at its last report, %d credits outstanding)", actor_id,
                 incarnation, len(expired) + unseen, len(expired), unseen, active_rollouts,
                 outstanding)
        book.buffer.groups.owner_gone((actor_id, incarnation))
        book.pacer.forget(actor_id)
        book.seen.forget(actor_id, incarnation)
        self.fleet.left(peer)
