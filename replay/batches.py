"""The learner side of the replay, without sockets: batch requests waiting
for rollouts, and each batch served until its learner confirms it arrived.

Rules, per learner (its ``sender_id``; the socket serves one):

- at most one request waits (its newest; a request of size 0 wants nothing
  and only confirms), and requests are served oldest first;
- the batch served to it stays here until its next request: a connection
  that drops while the batch is on its way loses it, and the learner asks
  again with the same request (same incarnation and seq), which gets the
  same frame (:meth:`BatchServer.resent`);
- its next, different request hands the served batch back
  (:meth:`BatchServer.ask`) for the service to release (the same learner
  incarnation: it arrived) or serve again (a new incarnation: the old one
  died with it).

Usage::

    batches = BatchServer()
    if (frame := batches.resent(learner, request)) is not None: send(frame)
    previous = batches.ask(learner, request)        # confirm or restore it
    while (waiting := batches.waiting()) is not None: ...; batches.served(...)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from protocol.messages import BatchRequest
from replay.buffer import RolloutEntry


@dataclass
class ServedBatch:
    """A batch served to a learner and not yet confirmed.

    Its rollouts are released in the log only on confirmation. A replay
    killed before recovers them from its log and serves them again; the
    learner drops those it took already (by rollout id). A request from a
    new learner incarnation gets them again, first: each rollout is trained
    by a surviving learner once."""

    request: tuple[int, int]
    """(incarnation, seq) of the ``BatchRequest`` it answers."""
    frame: bytes
    entries: list[RolloutEntry]
    version: int
    """The learner version it was served at: its rollouts' staleness counts from it."""


class BatchServer:
    def __init__(self) -> None:
        self.parked: list[tuple[str, BatchRequest]] = []
        """Requests waiting for rollouts, oldest first, one per learner."""
        self.unconfirmed: dict[str, ServedBatch] = {}
        """Per learner, the batch served and not yet confirmed."""

    def resent(self, learner: str, request: BatchRequest) -> bytes | None:
        """The frame served for exactly this request (asked again after a
        reconnect), or None."""
        served = self.unconfirmed.get(learner)
        if served is not None and served.request == (request.incarnation, request.seq):
            return served.frame
        return None

    def ask(self, learner: str, request: BatchRequest) -> ServedBatch | None:
        """A new request of ``learner``: it waits (unless of size 0) in
        place of any older one. Returns the batch served to it before, no
        longer held here."""
        previous = self.unconfirmed.pop(learner, None)
        self.parked = [(asker, r) for asker, r in self.parked if asker != learner]
        if request.size:
            self.parked.append((learner, request))
        return previous

    def waiting(self) -> tuple[str, BatchRequest] | None:
        """The oldest request still waiting."""
        return self.parked[0] if self.parked else None

    def served(self, learner: str, request: BatchRequest, frame: bytes,
               entries: list[RolloutEntry], version: int) -> None:
        """The oldest waiting request, ``learner``'s, is answered (at ``version``)."""
        if not self.parked or self.parked[0][0] != learner:
            raise ValueError("only the oldest waiting request is served")
        self.parked.pop(0)
        self.unconfirmed[learner] = ServedBatch((request.incarnation, request.seq), frame,
                                                 entries, version)

    def unconfirmed_frames(self) -> Iterator[bytes | memoryview]:
        """The segment frames of the unconfirmed batches: the log keeps them."""
        for served in self.unconfirmed.values():
            for entry in served.entries:
                for segment in entry.segments.values():
                    yield segment.frame
