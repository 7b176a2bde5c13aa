"""The replay service: one thread, one poll loop over two ROUTER sockets,
and the parts it composes (a reader finds each message's handler here):

- replay/ingest.py, :class:`ActorIngest`: the actor socket (``hello``,
  ``segment``, ``heartbeat``, ``abandon``): ingest passes, acks, credits,
  liveness;
- replay/serving.py, :class:`LearnerServing`: the learner socket
  (``learner_hello``, ``batch_request``): batches, parked, served, resent
  and confirmed;
- replay/book.py, :class:`RolloutBook`: what both change: the rollouts held,
  the credits out, the seqs seen, the durable log and the learner version.

Usage::

    service = ReplayService(config.replay, config.transport)
    service.serve(stop_event)      # until stop_event is set
    service.close()
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq

from ops.metrics import Health, MetricsServer
from protocol import ErrorCode, Message, Segment, Stamp
from protocol.endpoint import ServerEndpoint
from protocol.registry import ActorRegistry
from protocol.transport import (
    Authenticator,
    Liveness,
    TransportConfig,
    bind_router,
    listen_address,
)
from replay.book import RolloutBook
from replay.config import ReplayConfig
from replay.fleet import Fleet
from replay.ingest import ActorIngest, RunFacts
from replay.metrics import ReplayMetrics
from replay.serving import LearnerServing

#: Poll timeout: how late periodic work (expiry, liveness, interval fsync) may run.
POLL_MS = 100
#: Seconds between periodic checks.
TICK_S = 0.5


class ReplayService:
    def __init__(self, config: ReplayConfig, transport: TransportConfig, run_id: str = "run",
                 vocab_size: int | None = None) -> None:
        self.config = config
        self.metrics = ReplayMetrics()
        self._context = zmq.Context()
        self._auth = Authenticator(self._context, transport.curve)
        self.actor_socket = bind_router(
            self._context, listen_address(config.actor_bind, config.actor_address), transport)
        self.learner_socket = bind_router(
            self._context, listen_address(config.learner_bind, config.learner_address), transport)
        # served from the start: liveness answers while a long log is recovered
        self.health = Health("recovering the segment log")
        self._metrics_server = MetricsServer(self.metrics.registry, config.metrics_port,
                                             transport.metrics_address, self.health)
        vocab_size = vocab_size or config.vocab_size or 2**31 - 1
        self.book = RolloutBook(config, transport, vocab_size, self.metrics)
        self.registry = ActorRegistry(Liveness(transport.heartbeat_interval_s,
                                               transport.heartbeat_liveness), config.max_actors)
        self.fleet = Fleet(self.metrics.by_actor, Path(config.actor_targets_path)
                           if config.actor_targets_path else None, run_id)
        stamp = Stamp("replay", time.time_ns())
        undelivered = self.metrics.replies_undelivered.inc
        keys = transport.curve.enabled
        self.ingest = ActorIngest(
            ServerEndpoint(self.actor_socket, stamp, transport.max_message_bytes,
                           self._refused, undelivered, bind_keys=keys),
            self.book, self.registry, self.fleet, RunFacts(
                run_id, transport.heartbeat_interval_s, transport.heartbeat_liveness,
                config.max_staleness, config.rollouts_per_batch,
                transport.max_message_bytes, vocab_size, config.stale_grace), stamp)
        self.serving = LearnerServing(
            ServerEndpoint(self.learner_socket, stamp, transport.max_message_bytes,
                           self._refused, undelivered, bind_keys=keys),
            self.book, stamp, run_id)
        self._update_gauges()
        self.health.ready()

    def serve(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.actor_socket, zmq.POLLIN)
        poller.register(self.learner_socket, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        while not stop.is_set():
            self.health.beat()
            events = dict(poller.poll(POLL_MS))
            if self.actor_socket in events:
                self.ingest.receive()
                self.serving.serve_parked()
            if self.learner_socket in events and self.serving.receive():
                self.ingest.offer_credits()
            self.book.swap_compacted_log()
            if time.monotonic() >= next_tick:
                self._tick()
                next_tick = time.monotonic() + TICK_S

    def close(self) -> None:
        self.book.close()
        self.actor_socket.close(linger=0)
        self.learner_socket.close(linger=0)
        self._auth.stop()
        self._context.term()
        self._metrics_server.close()

    def _refused(self, code: ErrorCode, message: Message | None) -> None:
        self.metrics.rejected.labels(code).inc()
        if isinstance(message, Segment):
            self.metrics.segments.labels("rejected").inc()

    def _tick(self) -> None:
        now = time.monotonic()
        self.ingest.expire_silent(now)
        self.fleet.tick(self.registry.peers.values(), self.book.pacer.outstanding)
        self.book.expire(now)
        self.book.sync_and_compact(self.serving.batches.unconfirmed_frames())
        self._update_gauges()
        self.serving.serve_parked()

    def _update_gauges(self) -> None:
        metrics, book = self.metrics, self.book
        metrics.rollouts.labels("pending").set(len(book.buffer.pending))
        metrics.rollouts.labels("ready").set(len(book.buffer.ready))
        metrics.buffer_bytes.set(book.buffer.nbytes)
        metrics.credits_outstanding.set(book.pacer.running)
        metrics.actors_alive.set(self.registry.alive())
        if book.log is not None:
            metrics.log_bytes.set(book.log.bytes_written)
