"""Learner rank 0's client of the replay's learner socket (docs/protocol.md).

``learner_hello`` (its ``learner_welcome`` says the batch size, the staleness
bound and the newest version the replay knows), then per step a
``batch_request`` and the ``batch`` it waits for. Replies are read by the
rules every client of the project follows (:func:`protocol.endpoint.read_reply`:
one decode, a handler per type, a frame it cannot take dropped and counted);
an ``error`` the replay sends is final here, since the learner's own
requests are never wrong unless one side is: ``stale_incarnation`` raises
:class:`LearnerReplaced`, any other code :class:`ReplayRefused`.

The replay may restart under the learner (``compactionrl up`` restarts it),
or the connection may drop with a ``batch`` on its way: the outstanding
request is sent again, byte for byte, whenever the connection is
re-established (a ZeroMQ monitor event). A replay that served it already
sends the same ``batch`` again, which is dropped and counted; rollouts taken
before (a restarted replay serves again what it never saw confirmed) are
dropped from a batch and counted. ZeroMQ's own heartbeats (ZMTP ``PING``)
notice a replay that froze: its connection drops after the transport's
liveness. The client gives up (:class:`ReplayUnreachable`) when the replay
does not answer its ``hello`` within ``timeout_s``, or stays disconnected for
``timeout_s`` while a batch is awaited.

Usage::

    client = ReplayClient(address, transport, timeout_s, counters)
    welcome = client.hello()
    taken = client.next_batch(size, version, interrupted)   # None once interrupted()
    client.close()
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import zmq
import zmq.utils.monitor
from prometheus_client import Counter

from ops.metrics import WaitSeconds
from protocol import (
    LEARNER_ID,
    Batch,
    BatchRequest,
    Error,
    ErrorCode,
    LearnerHello,
    LearnerWelcome,
    Message,
    ProtocolError,
    Stamp,
    encode,
)
from protocol.endpoint import read_reply
from protocol.transport import TransportConfig, connect_dealer

log = logging.getLogger("compactionrl.learner")

#: The client polls this often while waiting, to notice ``interrupted()``.
WAIT_SLICE_MS = 500
#: Rollout ids remembered as taken: a restarted replay serves again at most
#: the batch it had not seen confirmed, so a few batches' worth suffice.
TAKEN_ROLLOUTS_MEMORY = 4096
#: On closing, the last request gets this long to leave: without it the
#: replay would serve the last batch trained again after a restart.
CLOSE_LINGER_MS = 1000


class LearnerReplaced(RuntimeError):
    """The replay refuses this learner incarnation: a newer one of the run
    has asked it for batches since (this one froze, or was partitioned, and
    came back). It stops, writing nothing: the run's checkpoints and weights
    are its successor's now; torchrun stops the other ranks with it."""


class ReplayRefused(RuntimeError):
    """The replay refused a message of the learner's own (its ``error``'s
    code and text): the two disagree on the protocol or the run's facts, and
    waiting would wait for ever."""


class ReplayUnreachable(RuntimeError):
    """The replay did not answer ``hello``, or stayed disconnected, for the
    client's ``timeout_s``."""


@dataclass(frozen=True)
class ReplayClientCounters:
    """What the client counts (``LearnerMetrics`` holds them)."""

    duplicate_batches: Counter
    """Batches received again (a resend that crossed the original)."""
    duplicate_rollouts: Counter
    """Rollouts of a batch taken before (a restarted replay serves them again)."""
    idle_seconds: WaitSeconds
    """Time spent waiting for a batch, the wait under way included."""
    rejected_frames: Counter
    """Frames from the replay the client could not take, by ``reason``."""


@dataclass(frozen=True)
class TakenBatch:
    """A batch the learner takes: the frame the other ranks are broadcast,
    and the batch it holds, decoded once (rank 0 need not decode it again)."""

    frame: bytes
    batch: Batch


#: The kind of reply a wait is for.
Reply = TypeVar("Reply", bound=Message)


class ReplayClient:
    def __init__(self, address: str, transport: TransportConfig, timeout_s: float,
                 counters: ReplayClientCounters) -> None:
        self.context = zmq.Context()
        self.socket = connect_dealer(self.context, address, transport, zmtp_heartbeats=True)
        self.events = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.timeout_s = timeout_s
        self.counters = counters
        self.max_bytes = transport.max_message_bytes
        self.stamp = Stamp(LEARNER_ID, time.time_ns())
        self.request_frame: bytes | None = None
        """The outstanding ``batch_request`` (its batch not yet received), as sent."""
        self.disconnected_since: float | None = time.monotonic()
        """Since when no connection is up (None: one is)."""
        self._last_batch: tuple[int, int] | None = None
        """(incarnation, seq) of the last batch taken: a resend of it is dropped."""
        self._taken: OrderedDict[str, None] = OrderedDict()
        """Rollout ids taken, newest last (``TAKEN_ROLLOUTS_MEMORY`` of them)."""
        self._handlers = {LearnerWelcome: self._awaited, Batch: self._awaited,
                          Error: self._refused}

    def hello(self) -> LearnerWelcome:
        """Register; :class:`ReplayUnreachable` after ``timeout_s`` without an answer."""
        self.socket.send(encode(LearnerHello(**self.stamp.next())))
        deadline = time.monotonic() + self.timeout_s
        while (reply := self._next(LearnerWelcome)) is None:
            if time.monotonic() > deadline:
                raise ReplayUnreachable(f"the replay did not answer hello within "
                                        f"{self.timeout_s:g} s (learner.replay_timeout_s)")
        self._reconnected()  # the first connection is not a reconnection
        return reply[0]

    def request(self, size: int, version: int) -> None:
        """Send a ``batch_request`` unless one is outstanding."""
        if self.request_frame is None:
            self.request_frame = encode(BatchRequest(**self.stamp.next(), size=size,
                                                     policy_version=version))
            self.socket.send(self.request_frame)

    def next_batch(self, size: int, version: int, interrupted: Callable[[], bool]
                   ) -> TakenBatch | None:
        """The next batch, or None once ``interrupted()`` (the request stays
        outstanding: its batch is the next one taken)."""
        self.request(size, version)
        with self.counters.idle_seconds.waiting():
            while not interrupted():
                if self._reconnected() and self.request_frame is not None:
                    # the request, or its batch, may have been lost with the connection
                    log.info("reconnected to the replay: asking for the batch again")
                    self.socket.send(self.request_frame)
                self._give_up_if_disconnected()
                reply = self._next(Batch)
                if reply is None:
                    continue
                if (taken := self._fresh(*reply)) is not None:
                    return taken
                self.request(size, version)  # nothing new in it: ask again
            return None

    def close(self) -> None:
        self.socket.disable_monitor()
        self.events.close(linger=0)
        self.socket.close(linger=CLOSE_LINGER_MS)
        self.context.term()

    def _next(self, kind: type[Reply]) -> tuple[Reply, bytes] | None:
        """The next reply within one wait slice and its frame, if it is of
        ``kind``; None otherwise: other kinds are not awaited now."""
        if not self.socket.poll(WAIT_SLICE_MS, zmq.POLLIN):
            return None
        frame = self.socket.recv()
        message = read_reply(frame, self.max_bytes, self._handlers, self._dropped)
        return (message, frame) if isinstance(message, kind) else None

    def _awaited(self, message: Message) -> None:
        """A welcome or a batch: in the table so that it is taken, and
        handled where it is awaited (:meth:`_next` returns it)."""

    def _fresh(self, batch: Batch, frame: bytes) -> TakenBatch | None:
        """The batch in ``frame`` without the rollouts taken before (None:
        nothing new)."""
        if (batch.incarnation, batch.seq) == self._last_batch:
            self.counters.duplicate_batches.inc()
            log.info("dropped a batch taken before (resent after a reconnect)")
            return None
        self._last_batch = (batch.incarnation, batch.seq)
        self.request_frame = None
        fresh = [r for r in batch.rollouts if r.rollout_id not in self._taken]
        if len(fresh) < len(batch.rollouts):
            self.counters.duplicate_rollouts.inc(len(batch.rollouts) - len(fresh))
            log.info("dropped %d rollouts taken before (the replay restarted)",
                     len(batch.rollouts) - len(fresh))
        for rollout in fresh:
            self._taken[rollout.rollout_id] = None
        while len(self._taken) > TAKEN_ROLLOUTS_MEMORY:
            self._taken.popitem(last=False)
        if not fresh:
            return None
        if len(fresh) == len(batch.rollouts):
            return TakenBatch(frame, batch)
        batch = msgspec.structs.replace(batch, rollouts=fresh)
        return TakenBatch(encode(batch), batch)

    def _refused(self, error: Error) -> None:
        if error.code == ErrorCode.STALE_INCARNATION:
            raise LearnerReplaced(f"the replay serves a newer learner: {error.text}")
        raise ReplayRefused(f"the replay refused the learner's message {error.ref_seq}: "
                            f"{error.code}: {error.text}")

    def _dropped(self, error: ProtocolError) -> None:
        self.counters.rejected_frames.labels(error.code.value).inc()
        log.warning("dropped a frame from the replay: %s", error)

    def _reconnected(self) -> bool:
        """Whether a connection to the replay was (re)established since the
        last call; notes when the connection went down."""
        reconnected = False
        while self.events.poll(0, zmq.POLLIN):
            event = zmq.utils.monitor.parse_monitor_message(self.events.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                reconnected, self.disconnected_since = True, None
            elif self.disconnected_since is None:
                self.disconnected_since = time.monotonic()
        return reconnected

    def _give_up_if_disconnected(self) -> None:
        since = self.disconnected_since
        if since is not None and time.monotonic() - since > self.timeout_s:
            raise ReplayUnreachable(f"no connection to the replay for {self.timeout_s:g} s "
                                    "(learner.replay_timeout_s)")
