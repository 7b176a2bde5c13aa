"""The replay's learner-facing side: batch requests, parked until enough
ready rollouts exist and then answered with a ``Batch``
(replay/batches.py keeps the requests and the batches served).

The last ``Batch`` is kept until the learner's next request: the same
request again (after a reconnect: the batch may have been lost with the
connection) gets the same bytes again, never a second batch. The socket is
the learner's alone: a message with another ``sender_id`` is refused, and
so is one of a learner incarnation older than the newest heard from
(``stale_incarnation``: nothing is served to a learner its successor
replaced). A reconnect is a new connection (clients set no routing id):
replies go to the connection the learner spoke on last.

Usage::

    serving = LearnerServing(endpoint, book, stamp, run_id)
    if serving.receive():         # a pass; True when a batch was asked for
        ingest.offer_credits()
    serving.serve_parked()        # after new rollouts became ready
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ops.timeline import span
from protocol import (
    LEARNER_ID,
    BatchRequest,
    ErrorCode,
    FramedBatch,
    LearnerHello,
    LearnerWelcome,
    Message,
    StalenessStats,
    Stamp,
    encode,
)
from protocol.endpoint import Handler, Received, ServerEndpoint
from replay.batches import BatchServer, ServedBatch
from replay.book import RolloutBook
from replay.buffer import to_rollout

log = logging.getLogger("compactionrl.replay")


class LearnerServing:
    def __init__(self, endpoint: ServerEndpoint, book: RolloutBook, stamp: Stamp,
                 run_id: str) -> None:
        self.endpoint = endpoint
        self.book = book
        self.run_id = run_id
        self.batches = BatchServer()
        self._stamp = stamp
        self._handlers: dict[type[Message], Handler] = {
            LearnerHello: self._on_learner_hello, BatchRequest: self._on_batch_request}
        self._asked = False
        """A batch request arrived in the pass under way."""
        self._connection = b""
        """The connection the learner spoke on last, where its batches go."""
        self._incarnation = -1
        """The newest learner incarnation heard from: an older one is fenced."""
        self._clock_set_by = -1
        """The learner incarnation whose first ``batch_request`` set the version clock."""
        self._trained_since_clock_moved = False
        """A batch was served since the clock last moved: the learner may have
        trained one more version."""

    def receive(self) -> bool:
        """One pass over what the learner socket holds, then serve what
        waits; True when a batch was asked for (a learner step is done: its
        credits are free)."""
        self._asked = False
        for received in self.endpoint.receive():
            if received.message.sender_id != LEARNER_ID:  # the socket is the learner's alone
                self.endpoint.refuse(received, ErrorCode.IDENTITY,
                                     f"the learner socket serves {LEARNER_ID!r} only")
                continue
            if received.message.incarnation < self._incarnation:
                # a learner that froze and came back after its successor
                # started: served, it would train again what its successor
                # trained (and publish weights beside it)
                self.endpoint.refuse(received, ErrorCode.STALE_INCARNATION,
                                     f"learner incarnation {received.message.incarnation} was "
                                     f"replaced by {self._incarnation}")
                continue
            self._incarnation = received.message.incarnation
            self._connection = received.identity
            self.endpoint.dispatch(self._handlers, received)
        self.serve_parked()
        return self._asked

    def _on_learner_hello(self, received: Received) -> None:
        config = self.book.config
        self.endpoint.send(received.identity, LearnerWelcome(
            **self._stamp.next(), run_id=self.run_id, policy_version=self.book.learner_version,
            rollouts_per_batch=config.rollouts_per_batch, max_staleness=config.max_staleness))

    def _on_batch_request(self, received: Received) -> None:
        learner, request = received.message.sender_id, received.message
        if (problem := self._request_problem(request)) is not None:
            # refused before anything moves: the batch before stays unreleased
            self.endpoint.refuse(received, ErrorCode.INVALID, problem)
            return
        if request.policy_version > self.book.learner_version:
            self._trained_since_clock_moved = False
        self._clock_set_by = request.incarnation
        self.book.set_learner_version(request.policy_version)
        if (frame := self.batches.resent(learner, request)) is not None:
            # asked again after a reconnect: the batch may be lost on the way
            self.book.metrics.batches_resent.inc()
            self.endpoint.send_frame(self._connection, frame)
            return
        self.book.pacer.learner_waiting()
        if (served := self.batches.ask(learner, request)) is not None:
            self._confirm(served, request)
        self._asked = True

    def _request_problem(self, request: BatchRequest) -> str | None:
        """Why a request is refused (``invalid``), or None. Its ``size`` is at
        most B: the credits are paced to fill B, and a larger request might
        never be filled. Its ``policy_version`` moves the version clock V
        (docs/protocol.md, "The version clock"): a learner incarnation's
        first request may set it anywhere (a learner resumed from a
        checkpoint), each later one to V + 1 at most, and only once a batch
        was served since V last moved: a learner trains one version per
        batch. One bad number would otherwise make every rollout stale for
        good."""
        batch = self.book.config.rollouts_per_batch
        if request.size > batch:
            return f"size {request.size} > rollouts_per_batch {batch}"
        clock = self.book.learner_version
        allowed = clock + 1 if self._trained_since_clock_moved else clock
        if request.incarnation == self._clock_set_by and request.policy_version > allowed:
            return (f"policy_version {request.policy_version} > {allowed}: a learner trains one "
                    f"version per batch (the version clock is at {clock}, and "
                    f"{'one' if self._trained_since_clock_moved else 'no'} batch was served "
                    "since it moved)")
        return None

    def _confirm(self, served: ServedBatch, request: BatchRequest) -> None:
        """A new request: the batch ``served`` before it arrived, or (from a
        new incarnation) its learner died with it."""
        book = self.book
        if request.incarnation == served.request[0]:
            for entry in served.entries:
                book.count_finished(entry, "trained", entry.staleness(served.version))
                book.release(entry)
        else:
            book.buffer.restore(served.entries)
            book.pacer.returned(len(served.entries))
            book.metrics.batches_returned.inc()
            log.info("a new learner incarnation asks: the %d rollouts served to the last one "
                     "are served again", len(served.entries))
            book.drop_stale()

    def serve_parked(self) -> None:
        """Answer the waiting requests, oldest first, while ready rollouts last."""
        book, metrics = self.book, self.book.metrics
        while (waiting := self.batches.waiting()) is not None:
            learner, request = waiting
            version = book.learner_version
            groups = book.buffer.take(request.size, version, time.monotonic())
            if not groups:
                return
            entries = [entry for group in groups for entry in group.ready.values()]
            for group in groups:
                if group.key[3]:  # a group of its own is no group
                    metrics.groups_served.labels(str(group.complete).lower()).inc()
                    metrics.group_rollouts_served.labels(str(group.complete).lower()).inc(
                        len(group.ready))
            book.pacer.consumed(len(entries))
            staleness = np.array([e.staleness(version) for e in entries])
            for value in staleness:
                metrics.staleness.observe(value)
            metrics.batches.inc()
            with span("batch", lane="batches", rollouts=len(entries), version=version):
                frame = encode(FramedBatch(
                    **self._stamp.next(), policy_version=version,
                    rollouts=[to_rollout(e, version) for e in entries],
                    staleness=StalenessStats(
                        min=int(staleness.min()), max=int(staleness.max()),
                        mean=float(staleness.mean()), p50=float(np.percentile(staleness, 50)),
                        p95=float(np.percentile(staleness, 95)))))
                self.batches.served(learner, request, frame, entries, version)
                self._trained_since_clock_moved = True
                self.endpoint.send_frame(self._connection, frame)
