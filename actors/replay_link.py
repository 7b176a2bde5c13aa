"""An actor's link to the replay: registration, credits, and every segment
or abandon kept until the replay acknowledges it (docs/protocol.md, "actor
(replay link)").

``Hello`` until a ``Welcome`` arrives; the ``Welcome`` sets the credits and
each ``Ack`` brings more. Credits are counted by the replay's ledger total,
so credits in a reply lost with a dropped connection are made up (counted).
Every closed segment is sent at once and kept until an ``Ack`` lists its
seq; unacknowledged ones are resent after ``ack_timeout_s`` with the same
``(actor_id, incarnation, seq)``, so the replay can drop duplicates. An
``unregistered`` refusal (the replay restarted, or the connection is new)
registers again, its ``Hello`` carrying the incarnation's token that moves
it to the new connection; the refused message is resent. A
``dead_incarnation`` refusal is handed to the actor, which alone knows
whether it still concerns its current incarnation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from actors.config import ActorConfig
from actors.context import ClosedSegment
from actors.episode import EpisodeResult
from actors.metrics import ActorMetrics
from actors.state import CreditAccount, Incarnation, LearnerView, Outbox
from protocol import (
    Abandon,
    Ack,
    EngineInfo,
    Error,
    ErrorCode,
    Goodbye,
    GroupTag,
    Hello,
    Message,
    ProtocolError,
    Welcome,
    encode,
)
from protocol.endpoint import ClientEndpoint

#: How often the resend loop looks for overdue segments, as a fraction of the
#: ack timeout: fine enough that a resend is at most 25 % late.
RESEND_CHECK_FRACTION = 0.25


class IncarnationOwner(Protocol):
    """Who renews the actor's incarnation (:class:`actors.process.Actor`)."""

    def declared_dead(self, ref_seq: int) -> None:
        """The replay refused the message ``ref_seq`` as of an incarnation it
        declared dead."""


class ReplayLink:
    """The replay link's handler table, its credits and its outbox."""

    def __init__(self, link: ClientEndpoint, engine_info: EngineInfo, config: ActorConfig,
                 weights: LearnerView, metrics: ActorMetrics, incarnation: Incarnation,
                 owner: IncarnationOwner) -> None:
        """``incarnation``: the actor's, whose header and token its messages
        carry; ``owner``: whom to tell the replay declared it dead."""
        self.link = link
        self.engine_info = engine_info
        self.config = config
        self.weights = weights
        self.metrics = metrics
        self.incarnation = incarnation
        self.owner = owner
        self.credits = CreditAccount()
        self.outbox = Outbox()
        self.handlers: dict[type[Message], Callable[[Any], None]] = {
            Welcome: self._on_welcome, Ack: self._on_ack, Error: self._on_error}
        self.metrics_address = ""
        """``Hello.metrics_address``: set once the actor's metrics server listens."""

    def coroutines(self, dropped: Callable[[ProtocolError], None]
                   ) -> list[Coroutine[Any, Any, None]]:
        """What runs for the link's life: its replies, its registration, the
        resends and the count of dropped connections."""
        return [self.link.serve(self.handlers, dropped),
                self.link.register(self.hello, self.config.hello_retry_s), self._resend(),
                self.link.count_disconnects(self.metrics.disconnects.labels("replay").inc)]

    def hello(self) -> Hello:
        return Hello(**self.incarnation.header(), engine=self.engine_info,
                     capacity=self.config.concurrent_episodes, token=self.incarnation.token,
                     metrics_address=self.metrics_address, group_size=self.config.group_size)

    async def leave(self) -> None:
        """Say goodbye, the incarnation's last message: the replay gives its
        unfinished rollouts up and its credits to the other actors at once."""
        await self.link.send(Goodbye(**self.incarnation.header()))

    async def send_segment(self, rollout_id: str, task_id: str, group: GroupTag | None,
                           index: int, segment: ClosedSegment, result: EpisodeResult | None
                           ) -> None:
        """Send a closed segment (``result``: the episode's, with the final one)."""
        header = self.incarnation.header()
        message = segment.to_message(header, rollout_id, task_id, group, index,
                                     None if result is None else result.reward,
                                     None if result is None else result.stats)
        self.metrics.segments_sent.inc()
        await self._send_kept(header["seq"], encode(message))

    async def send_abandon(self, rollout_id: str, group: GroupTag | None) -> None:
        """Tell the replay a rollout (of ``group``) is given up: it drops it
        and returns its credit."""
        header = self.incarnation.header()
        await self._send_kept(header["seq"], encode(Abandon(**header, rollout_id=rollout_id,
                                                            group=group)))

    async def _send_kept(self, seq: int, frame: bytes) -> None:
        """Send a frame the replay acknowledges by seq, kept and resent until it does."""
        self.outbox.sent(seq, frame, time.monotonic())
        self.metrics.unacked_segments.set(len(self.outbox))
        await self.link.send_frame(frame)

    def forfeit(self) -> None:
        """The replay declared this incarnation dead: what it has not
        acknowledged is abandoned (counted), its credits are void, and the
        link registers again."""
        self.metrics.segments_abandoned.inc(self.outbox.abandon())
        self.metrics.unacked_segments.set(0)
        self.credits.forfeit()
        self.metrics.credits_held.set(0)
        self.link.forgotten()

    def _on_welcome(self, welcome: Welcome) -> None:
        # the staleness bound's one source: the replay's configuration
        self.weights.max_staleness = welcome.max_staleness
        # counted by the ledger: a second Welcome (a Hello retried) or an Ack
        # before it adds only what it has that was not seen
        self._grant(welcome)
        self.link.welcomed()

    def _on_ack(self, ack: Ack) -> None:
        self.outbox.settle(ack.stored_seqs)
        self.metrics.unacked_segments.set(len(self.outbox))
        # The replay hears of a new learner version before the weights are
        # announced: credits granted for it must wait for them.
        self.weights.heard(ack.policy_version)
        self._grant(ack)

    def _grant(self, reply: Ack | Welcome) -> None:
        # more than this reply granted: the rest came in replies that were lost
        self.metrics.credits_recovered.inc(
            self.credits.grant(reply.credit_ledger, reply.credits_total, reply.credits))
        self.metrics.credits_held.set(self.credits.credits)

    def _on_error(self, error: Error) -> None:
        self.metrics.refused("replay", error)
        if error.code == ErrorCode.UNREGISTERED:
            # this connection is new to the replay (it restarted, or ours did):
            # register on it; what it refused stays kept and is resent
            self.link.forgotten()
            return
        # any other rejection is final: the same bytes would be rejected again
        if error.ref_seq is not None and self.outbox.settle([error.ref_seq]):
            self.metrics.unacked_segments.set(len(self.outbox))
        if error.code == ErrorCode.DEAD_INCARNATION and error.ref_seq is not None:
            self.owner.declared_dead(error.ref_seq)

    async def _resend(self) -> None:
        timeout = self.config.ack_timeout_s
        while True:
            await asyncio.sleep(timeout * RESEND_CHECK_FRACTION)
            for frame in self.outbox.overdue(time.monotonic(), timeout):
                self.metrics.segments_resent.inc()
                await self.link.send_frame(frame)
