"""The replay service: segment ingest, rollout assembly, pacing, batches.

One thread, one poll loop over two ROUTER sockets (actors, learner). Each
turn of the loop reads up to :data:`INGEST_BATCH` actor messages, writes the
accepted segments to the durable log, makes them durable (fsync policy), and
only then acknowledges them, with credits. Learner ``BatchRequest``s are
parked until enough ready rollouts exist, then answered with a ``Batch``. The
last ``Batch`` is kept until the learner's next request: the same request
again (after a reconnect: the batch may have been lost with the connection)
gets the same bytes again, never a second batch.

Every message from a peer is checked: undecodable frames, a ``sender_id``
that is not the socket identity, an old incarnation, segment contents outside
the vocabulary or the version window: each gets an ``Error`` reply and a
counter, never a crash.

Usage::

    service = ReplayService(config.replay, config.transport)
    service.serve(stop_event)      # until stop_event is set
    service.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import zmq

from ops.metrics import Health, MetricsServer, watch_disk
from protocol import (
    LEARNER_ID,
    Abandon,
    Ack,
    Batch,
    BatchRequest,
    ErrorCode,
    Heartbeat,
    Hello,
    LearnerHello,
    LearnerWelcome,
    Message,
    ProtocolError,
    Segment,
    StalenessStats,
    Stamp,
    Welcome,
    decode,
    encode,
)
from protocol.endpoint import Handler, Received, ServerEndpoint
from protocol.transport import (
    Authenticator,
    Liveness,
    TransportConfig,
    bind_router,
    listen_address,
)
from protocol.validation import check_segment_content
from replay.batches import BatchServer, ServedBatch
from replay.buffer import Owner, RolloutBuffer, RolloutEntry, to_rollout
from replay.config import ReplayConfig
from replay.log import RELEASED, SEGMENT, VERSION, DurableLog, decode_version
from replay.metrics import ReplayMetrics
from replay.pacing import CreditPacer
from replay.registry import ActorRegistry, Peer

log = logging.getLogger("compactionrl.replay")

#: Actor messages handled per loop turn: one fsync covers them all.
INGEST_BATCH = 64
#: Poll timeout: how late periodic work (expiry, liveness, interval fsync) may run.
POLL_MS = 100
#: Seconds between periodic checks.
TICK_S = 0.5
#: Sequence numbers remembered per sender for duplicate detection, beyond the
#: newest: resends come within seconds, so this window is generous.
DEDUP_WINDOW = 1 << 20
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
#: Compact the log once this many bytes in it are dead and they outweigh the live ones.
COMPACT_MIN_BYTES = 64 * 1024 * 1024


def _owner(message: Segment | Abandon) -> Owner:
    return message.sender_id, message.incarnation


class _SeenSeqs:
    """Seqs seen per (sender, incarnation), bounded by a window behind the newest."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], set[int]] = defaultdict(set)
        self._newest: dict[tuple[str, int], int] = {}

    def __contains__(self, key: tuple[str, int, int]) -> bool:
        sender, incarnation, seq = key
        return seq in self._seen.get((sender, incarnation), ())

    def add(self, key: tuple[str, int, int]) -> None:
        sender, incarnation, seq = key
        seen = self._seen[(sender, incarnation)]
        seen.add(seq)
        newest = max(self._newest.get((sender, incarnation), seq), seq)
        self._newest[(sender, incarnation)] = newest
        if len(seen) > 2 * DEDUP_WINDOW:
            self._seen[(sender, incarnation)] = {s for s in seen if s > newest - DEDUP_WINDOW}


class ReplayService:
    def __init__(self, config: ReplayConfig, transport: TransportConfig, run_id: str = "run",
                 vocab_size: int | None = None) -> None:
        self.config = config
        self.transport = transport
        self.run_id = run_id
        self.vocab_size = vocab_size or config.vocab_size or 2**31 - 1
        self.metrics = ReplayMetrics()
        self.buffer = RolloutBuffer(config.max_staleness + config.stale_grace,
                                    config.serve_order, config.rollout_timeout_s)
        self.pacer = CreditPacer(config.rollouts_per_batch, config.max_staleness,
                                 config.max_buffer_bytes)
        self.seen = _SeenSeqs()
        self.registry = ActorRegistry(Liveness(transport.heartbeat_interval_s,
                                               transport.heartbeat_liveness))
        self.learner_version = 0
        """The newest policy version the learner has asked with (kept in the
        durable log): trainable tokens of a newer version are refused from
        the first segment on, since the learner asks with a version before
        it publishes it."""
        self.compact_min_bytes = COMPACT_MIN_BYTES
        self._stamp = Stamp("replay", time.time_ns())
        self.batches = BatchServer()
        self._behind: set[bytes] = set()
        """Actors whose heartbeat showed an older credit total than granted."""
        self._context = zmq.Context()
        self._auth = Authenticator(self._context, transport.curve)
        self.actor_socket = bind_router(
            self._context, listen_address(config.actor_bind, config.actor_address), transport)
        self.learner_socket = bind_router(
            self._context, listen_address(config.learner_bind, config.learner_address), transport)
        undelivered = self.metrics.replies_undelivered.inc
        keys = transport.curve.enabled
        self.actors = ServerEndpoint(self.actor_socket, self._stamp,
                                     transport.max_message_bytes, self._refused, undelivered,
                                     bind_keys=keys)
        self.learners = ServerEndpoint(self.learner_socket, self._stamp,
                                       transport.max_message_bytes, self._refused, undelivered,
                                       bind_keys=keys)
        self._actor_handlers: dict[type[Message], Handler] = {
            Hello: self._on_hello, Segment: self._on_segment, Heartbeat: self._on_heartbeat,
            Abandon: self._on_abandon}
        self._learner_handlers: dict[type[Message], Handler] = {
            LearnerHello: self._on_learner_hello, BatchRequest: self._on_batch_request}
        self._acks: dict[bytes, list[int]] = defaultdict(list)
        """Per actor, the seqs stored in the ingest pass under way (acknowledged at its end)."""
        self._now = time.monotonic()
        """The ingest pass's clock."""
        self._asked = False
        """A batch request arrived in the learner pass under way."""
        # served from the start: liveness answers while a long log is recovered
        self.health = Health("recovering the segment log")
        self._metrics_server = MetricsServer(self.metrics.registry, config.metrics_port,
                                             transport.metrics_address, self.health)
        self.log: DurableLog | None = None
        if config.durable_log:
            watch_disk(self.metrics.disk_free, self.metrics.disk_size,
                       Path(config.log_path).parent)
            self.log = DurableLog(Path(config.log_path), config.fsync, config.fsync_interval_s)
            self._recover()
        self._update_gauges()
        self.health.ready()

    # ------------------------------------------------------------------ lifecycle

    def _recover(self) -> None:
        now = time.monotonic()
        recovered, skipped = 0, []
        for kind, payload in self.log.recover():
            if kind == SEGMENT:
                try:  # a log written by another build, or for another model
                    segment = decode(payload, self.transport.max_message_bytes)
                    oldest = check_segment_content(segment, vocab_size=self.vocab_size,
                                                   oldest_version=0, newest_version=2**31 - 1)
                except ProtocolError as exc:
                    skipped.append(str(exc))
                    continue
                self.seen.add((segment.sender_id, segment.incarnation, segment.seq))
                if self.buffer.add(segment, payload, now, oldest) == "stored":
                    recovered += 1
                    if self.buffer.promote(segment.rollout_id, now) is not None:
                        self.pacer.accepted += 1
            elif kind == RELEASED:
                entry = self.buffer.remove(payload.decode())
                if entry is not None and entry.ready_at is not None:
                    self.pacer.accepted -= 1
            elif kind == VERSION:
                self.learner_version = max(self.learner_version, decode_version(payload))
        self.metrics.learner_version.set(self.learner_version)
        # recovered pending rollouts may still complete: their actors resend or go on
        self.metrics.recovered_segments.inc(recovered)
        self.metrics.unrecoverable_segments.inc(len(skipped))
        if skipped:
            log.warning("%d segments in %s cannot be recovered and were skipped (first: %s)",
                        len(skipped), self.config.log_path, skipped[0])
        log.info("recovered %d segments: %d rollouts ready, %d pending", recovered,
                 len(self.buffer.ready), len(self.buffer.pending))

    def serve(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.actor_socket, zmq.POLLIN)
        poller.register(self.learner_socket, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        while not stop.is_set():
            self.health.beat()
            events = dict(poller.poll(POLL_MS))
            if self.actor_socket in events:
                self._ingest()
            if self.learner_socket in events:
                self._serve_learner()
            if self.log is not None and self.log.compacting:
                self._swap_compacted_log()
            if time.monotonic() >= next_tick:
                self._tick()
                next_tick = time.monotonic() + TICK_S

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        self.actor_socket.close(linger=0)
        self.learner_socket.close(linger=0)
        self._auth.stop()
        self._context.term()
        self._metrics_server.close()

    # ------------------------------------------------------------------ actors

    def _ingest(self) -> None:
        self._acks = defaultdict(list)
        self._now = time.monotonic()
        touched: set[bytes] = set()
        for received in self.actors.receive(INGEST_BATCH):
            touched.add(received.identity)
            self._handle_actor(received)
        if self.log is not None and self._acks:
            self.log.sync()
        for identity in touched:
            if identity not in self.registry.peers:  # refused: nothing of it was stored
                continue
            seqs = self._acks.get(identity, [])
            credits = self._top_up(identity)
            if seqs or credits or identity in self._behind:
                self._ack(identity, seqs, credits)
        self._behind.clear()
        self._try_serve_parked()

    def _refused(self, code: ErrorCode, message: Message | None) -> None:
        self.metrics.rejected.labels(code).inc()
        if isinstance(message, Segment):
            self.metrics.segments.labels("rejected").inc()

    def _handle_actor(self, received: Received) -> None:
        """The incarnation rules (replay/registry.py), then the handler of
        the message's type."""
        identity, message = received.identity, received.message
        refusal = self.registry.refusal(identity, message.sender_id, message.incarnation)
        if refusal is not None:  # its rollouts are gone: nothing of it may count twice
            self.actors.refuse(received, *refusal)
            return
        replaced = self.registry.admit(identity, message.sender_id, message.incarnation)
        if replaced is not None:  # restarted before its old incarnation fell silent
            self._actor_gone(replaced)
        self.actors.dispatch(self._actor_handlers, received)

    def _on_hello(self, received: Received) -> None:
        hello, identity = received.message, received.identity
        self.registry.peers[identity].capacity = max(1, hello.capacity)
        self.actors.send(identity, Welcome(
            **self._stamp.next(), run_id=self.run_id, policy_version=self.learner_version,
            heartbeat_interval_s=self.transport.heartbeat_interval_s,
            heartbeat_liveness=self.transport.heartbeat_liveness,
            max_staleness=self.config.max_staleness,
            rollouts_per_batch=self.config.rollouts_per_batch,
            max_message_bytes=self.transport.max_message_bytes, vocab_size=self.vocab_size,
            stale_grace=self.config.stale_grace,
            credits=self._top_up(identity),  # before the ledger: it counts them
            **self._ledger_fields(hello.sender_id)))

    def _on_heartbeat(self, received: Received) -> None:
        heartbeat, identity = received.message, received.identity
        self.registry.peers[identity].active_rollouts = heartbeat.active_rollouts
        if ((heartbeat.credit_ledger, heartbeat.credits_seen)
                != self.pacer.ledger(heartbeat.sender_id)):
            self._behind.add(identity)  # a reply with credits was lost: repeat the total

    def _on_segment(self, received: Received) -> None:
        identity, segment, frame = received.identity, received.message, received.frame
        acks, now = self._acks, self._now
        if self._refused_stranger(received, segment.rollout_id):
            return
        key = (segment.sender_id, segment.incarnation, segment.seq)
        if key in self.seen:
            self.metrics.segments.labels("duplicate").inc()
            acks[identity].append(segment.seq)
            return
        try:
            oldest = check_segment_content(segment, vocab_size=self.vocab_size,
                                           oldest_version=0,
                                           newest_version=self.learner_version + VERSION_AHEAD)
        except ProtocolError as exc:
            self.actors.refuse(received, exc.code, str(exc))
            # its rollout can never complete: drop it now and return its credit
            # (a rollout left pending, or never stored, would hold the credit)
            if not self.buffer.settled(segment.rollout_id):
                self._drop(segment.rollout_id, "invalid", _owner(segment))
            return
        # a late segment takes no memory: the bound must not drop its complete rollout
        if (not self.buffer.settled(segment.rollout_id)
                and self.buffer.nbytes + len(frame) > self.config.max_buffer_bytes):
            self._drop(segment.rollout_id, "full", _owner(segment))
            self.actors.refuse(received, ErrorCode.FULL,
                               "replay buffer at its memory bound: rollout dropped")
            return
        result = self.buffer.add(segment, frame, now, oldest)
        if result == "conflict":
            self._drop(segment.rollout_id, "invalid")
            self.actors.refuse(received, ErrorCode.INVALID,
                               "segment index conflicts with the rollout's segments")
            return
        self.seen.add(key)
        acks[identity].append(segment.seq)
        if result == "late":  # its rollout was served or dropped already
            self.metrics.segments.labels("duplicate").inc()
            return
        self.metrics.segments.labels("accepted").inc()
        if self.log is not None:
            self.log.append_segment(frame)
        entry = self.buffer.promote(segment.rollout_id, now)
        if entry is not None:
            self.pacer.finished(entry.actor_id, accepted=True, rollout_bytes=entry.nbytes)

    def _on_abandon(self, received: Received) -> None:
        """A rollout its living actor gave up: dropped, its credit returned
        (once: a resent one is a duplicate, acknowledged again)."""
        identity, abandon = received.identity, received.message
        if self._refused_stranger(received, abandon.rollout_id):
            return
        key = (abandon.sender_id, abandon.incarnation, abandon.seq)
        self._acks[identity].append(abandon.seq)
        if key in self.seen:
            return
        self.seen.add(key)
        if not self.buffer.settled(abandon.rollout_id):
            self._drop(abandon.rollout_id, "abandoned", _owner(abandon))

    def _refused_stranger(self, received: Received, rollout_id: str) -> bool:
        """Refuse (``owner``) a segment or abandon of a rollout that another
        actor incarnation owns (the one that sent its first segment): no peer
        may add to, finish or drop a rollout of another."""
        owner = self.buffer.owner(rollout_id)
        message = received.message
        if owner is None or owner == (message.sender_id, message.incarnation):
            return False
        self.actors.refuse(received, ErrorCode.OWNER,
                           f"rollout {rollout_id[:64]!r} belongs to another actor incarnation")
        return True

    def _top_up(self, identity: bytes) -> int:
        peer = self.registry.peers[identity]
        wanted = peer.capacity - self.pacer.outstanding.get(peer.actor_id, 0)
        if wanted <= 0:
            return 0
        granted = self.pacer.grant(peer.actor_id, wanted, self.buffer.nbytes,
                                   len(self.buffer.ready))
        if granted:
            self.metrics.credits_granted.inc(granted)
        return granted

    def _actor_gone(self, peer: Peer) -> None:
        """Count what an incarnation that is over (replaced, or declared
        dead) leaves behind as lost, and forget its credits."""
        actor_id, incarnation, active_rollouts = (peer.actor_id, peer.incarnation,
                                                  peer.active_rollouts)
        expired = self.buffer.expired(time.monotonic(), {(actor_id, incarnation)})
        for entry in expired:
            self._drop(entry.rollout_id, "expired")
        # the rollouts it had started but sent nothing of are lost too; a
        # heartbeat's claim counts only up to the credits it still held
        outstanding = self.pacer.outstanding.get(actor_id, 0)
        unseen = max(0, min(active_rollouts - len(expired), outstanding))
        self.metrics.dropped.labels("expired").inc(unseen)
        log.info("actor %s (incarnation %d) gone: %d rollouts lost (%d pending, %d unseen; "
                 "%d in flight at its last report, %d credits outstanding)", actor_id,
                 incarnation, len(expired) + unseen, len(expired), unseen, active_rollouts,
                 outstanding)
        self.pacer.forget(actor_id)

    # ------------------------------------------------------------------ learner

    def _serve_learner(self) -> None:
        self._asked = False
        for received in self.learners.receive():
            if received.message.sender_id != LEARNER_ID:  # the socket is the learner's alone
                self.learners.refuse(received, ErrorCode.IDENTITY,
                                     f"the learner socket serves {LEARNER_ID!r} only")
                continue
            self.learners.dispatch(self._learner_handlers, received)
        self._try_serve_parked()
        if self._asked:
            self._offer_credits()

    def _on_learner_hello(self, received: Received) -> None:
        self.learners.send(received.identity, LearnerWelcome(
            **self._stamp.next(), run_id=self.run_id, policy_version=self.learner_version,
            rollouts_per_batch=self.config.rollouts_per_batch,
            max_staleness=self.config.max_staleness))

    def _on_batch_request(self, received: Received) -> None:
        identity, request = received.identity, received.message
        if request.size < 0:
            self.learners.refuse(received, ErrorCode.INVALID, f"size {request.size} < 0")
            return
        self._set_learner_version(request.policy_version)
        if (frame := self.batches.resent(identity, request)) is not None:
            # asked again after a reconnect: the batch may be lost on the way
            self.metrics.batches_resent.inc()
            self.learners.send_frame(identity, frame)
            return
        self.pacer.learner_waiting()
        if (served := self.batches.ask(identity, request)) is not None:
            self._confirm(served, request)
        self._asked = True

    def _offer_credits(self) -> None:
        """Send the credits a learner step freed now, not in reply to each
        actor's next message: in synchronous mode (S = 0) idle actors would
        otherwise wait up to a heartbeat interval every step."""
        for identity in list(self.registry.peers):
            if not self.pacer.available(self.buffer.nbytes, len(self.buffer.ready)):
                return  # none left to offer: asking the other actors is O(actors) for nothing
            credits = self._top_up(identity)
            if credits:
                self._ack(identity, [], credits)

    def _ack(self, identity: bytes, stored_seqs: list[int], credits: int) -> None:
        self.actors.send(identity, Ack(
            **self._stamp.next(), stored_seqs=stored_seqs, credits=credits,
            policy_version=self.learner_version,
            **self._ledger_fields(self.registry.peers[identity].actor_id)))

    def _ledger_fields(self, actor_id: str) -> dict[str, int]:
        ledger, total = self.pacer.ledger(actor_id)
        return {"credit_ledger": ledger, "credits_total": total}

    def _confirm(self, served: ServedBatch, request: BatchRequest) -> None:
        """A new request: the batch ``served`` before it arrived, or (from a
        new incarnation) its learner died with it."""
        if request.incarnation == served.request[0]:
            for entry in served.entries:
                self._count_finished(entry, "trained")
                self._release(entry)
        else:
            self.buffer.restore(served.entries)
            self.pacer.returned(len(served.entries))
            self.metrics.batches_returned.inc()
            log.info("a new learner incarnation asks: the %d rollouts served to the last one "
                     "are served again", len(served.entries))
            self._drop_stale()

    def _set_learner_version(self, version: int) -> None:
        if version > self.learner_version:
            self.learner_version = version
            self.metrics.learner_version.set(version)
            if self.log is not None:
                # durable before any actor samples with it (the learner
                # publishes a version after asking with it)
                self.log.append_version(version)
                self.log.sync(force=True)
        self._drop_stale()

    def _drop_stale(self) -> None:
        for entry in self.buffer.stale(self.learner_version):
            self._drop(entry.rollout_id, "stale")

    def _try_serve_parked(self) -> None:
        while (waiting := self.batches.waiting()) is not None:
            identity, request = waiting
            entries = self.buffer.take(request.size, self.learner_version)
            if not entries:
                return
            self.pacer.consumed(len(entries))
            staleness = np.array([e.staleness(self.learner_version) for e in entries])
            for value in staleness:
                self.metrics.staleness.observe(value)
            self.metrics.batches.inc()
            frame = encode(Batch(
                **self._stamp.next(), policy_version=self.learner_version,
                rollouts=[to_rollout(e, self.learner_version) for e in entries],
                staleness=StalenessStats(
                    min=int(staleness.min()), max=int(staleness.max()),
                    mean=float(staleness.mean()), p50=float(np.percentile(staleness, 50)),
                    p95=float(np.percentile(staleness, 95)))))
            self.batches.served(identity, request, frame, entries)
            self.learners.send_frame(identity, frame)

    # ------------------------------------------------------------------ shared

    def _release(self, entry: RolloutEntry) -> None:
        if self.log is not None:
            self.log.append_released(entry.rollout_id, entry.nbytes)

    def _count_finished(self, entry: RolloutEntry, fate: str) -> None:
        final = entry.segments[entry.final_index].segment
        success = (final.stats.success if final.stats is not None
                   else (final.reward or 0.0) > 0)
        self.metrics.finished.labels(fate, str(success).lower()).inc()
        self.metrics.finished_tokens.labels(fate).inc(
            sum(int(s.segment.loss_mask.numpy().sum()) for s in entry.segments.values()))

    def _drop(self, rollout_id: str, reason: str, owner: Owner | None = None) -> None:
        """Drop a rollout, counted, and free its place. With ``owner`` the
        rollout may have nothing stored yet (its first segment was refused):
        it is dropped all the same, its id and owner remembered (its later
        segments are late, not a rollout that could never complete) and the
        credit its actor spent on it returned."""
        entry = self.buffer.remove(rollout_id, owner)
        if entry is None:
            if owner is not None:
                self.metrics.dropped.labels(reason).inc()
                self.pacer.finished(owner[0], accepted=False)
            return
        self.metrics.dropped.labels(reason).inc()
        if entry.ready_at is not None:
            self._count_finished(entry, reason)
            self.pacer.dropped()
        else:
            self.pacer.finished(entry.actor_id, accepted=False)
        self._release(entry)

    def _tick(self) -> None:
        now = time.monotonic()
        for _, peer in self.registry.expire(now):
            log.info("actor %s (incarnation %d) is silent: declared dead", peer.actor_id,
                     peer.incarnation)
            self._actor_gone(peer)
        for entry in self.buffer.expired(now, set()):
            self._drop(entry.rollout_id, "expired")
        if self.log is not None:
            self.log.sync()
            self._compact_log()
        self._update_gauges()
        self._try_serve_parked()

    def _swap_compacted_log(self) -> None:
        """Put a finished background compaction in the log's place, as soon as
        it is done: what the log gains until then is copied in the loop."""
        try:
            self.log.finish_compaction()
        except OSError as exc:  # the old log is whole: the next tick tries again
            log.warning("%s", exc)

    def _compact_log(self) -> None:
        """Start a background compaction once released records outweigh the
        live ones (the log's write amplification stays under 2x and its size
        under twice the live bytes plus the minimum)."""
        if (not self.log.compacting
                and self.log.released_bytes > max(self.compact_min_bytes, self.buffer.nbytes)):
            self.log.start_compaction(self.buffer.live_frames()  # and batches not confirmed
                                      + list(self.batches.unconfirmed_frames()),
                                      self.learner_version)

    def _update_gauges(self) -> None:
        self.metrics.rollouts.labels("pending").set(len(self.buffer.pending))
        self.metrics.rollouts.labels("ready").set(len(self.buffer.ready))
        self.metrics.buffer_bytes.set(self.buffer.nbytes)
        self.metrics.credits_outstanding.set(self.pacer.running)
        self.metrics.actors_alive.set(self.registry.alive())
        if self.log is not None:
            self.metrics.log_bytes.set(self.log.bytes_written)
