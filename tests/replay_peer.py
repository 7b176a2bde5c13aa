"""A minimal replay for testing actors: speaks the protocol on a real ROUTER.

It grants credits (under one ledger), records every segment frame it receives, acknowledges
them (or withholds acknowledgements on request), and drops duplicates by
``(sender_id, incarnation, seq)`` exactly as the real replay must.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import zmq

from protocol import Ack, Heartbeat, Hello, Segment, Stamp, Welcome, decode, encode
from protocol.transport import TransportConfig, bind_router

CREDIT_LEDGER = 1


@dataclass
class ReplayPeer:
    credits_on_welcome: int = 2
    withhold_acks: bool = False
    drop_first_ack: bool = True
    socket: zmq.Socket = field(init=False)
    frames: list[tuple[float, bytes]] = field(default_factory=list)
    """Every segment frame received, with its arrival time (duplicates included)."""
    unique: dict[tuple[str, int, int], Segment] = field(default_factory=dict)
    duplicates: int = 0
    heartbeats: int = 0
    hellos: int = 0
    credits_total: int = 0
    """Granted so far, under the one ledger this replay keeps."""
    credits_seen: int = 0
    """The actor's last heartbeat's ``credits_seen``."""
    _withheld: list[tuple[bytes, int]] = field(default_factory=list)
    _dropped_one: bool = False

    def __post_init__(self) -> None:
        self._context = zmq.Context()
        self.socket = bind_router(self._context, "tcp://127.0.0.1:*", TransportConfig())
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stamp = Stamp("test-replay", 0)
        self._peer: bytes | None = None

    def close(self) -> None:
        self.socket.close(linger=0)
        self._context.term()

    def grant(self, credits: int, lost: bool = False) -> None:
        """Grant ``credits``; ``lost``: as if the reply were lost on the way."""
        assert self._peer is not None
        self.credits_total += credits
        if not lost:
            self._send_ack(self._peer, [], credits)

    def release_acks(self) -> None:
        """Acknowledge everything withheld so far, and stop withholding."""
        self.withhold_acks = False
        for identity, seq in self._withheld:
            self._send_ack(identity, [seq], 0)
        self._withheld.clear()

    def _send_ack(self, identity: bytes, seqs: list[int], credits: int) -> None:
        self.socket.send_multipart([identity, encode(Ack(
            **self._stamp.next(), stored_seqs=seqs, credits=credits, policy_version=0,
            credit_ledger=CREDIT_LEDGER, credits_total=self.credits_total))])

    def pump(self, seconds: float) -> None:
        """Serve for ``seconds``."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if not self.socket.poll(int(left * 1000) + 1, zmq.POLLIN):
                continue
            identity, frame = self.socket.recv_multipart()
            message = decode(frame)
            if isinstance(message, Hello):
                self.hellos += 1
                self._peer = identity
                self.credits_total += self.credits_on_welcome
                self.socket.send_multipart([identity, encode(Welcome(
                    **self._stamp.next(), run_id="test", policy_version=0,
                    heartbeat_interval_s=1.0, heartbeat_liveness=5, max_staleness=2,
                    rollouts_per_batch=4, credits=self.credits_on_welcome,
                    credit_ledger=CREDIT_LEDGER, credits_total=self.credits_total,
                    max_message_bytes=1 << 20, vocab_size=2**31 - 1, stale_grace=0))])
            elif isinstance(message, Heartbeat):
                self.heartbeats += 1
                self.credits_seen = message.credits_seen
                if message.credits_seen < self.credits_total:  # as the replay does
                    self._send_ack(identity, [], 0)
            elif isinstance(message, Segment):
                self.frames.append((time.monotonic(), frame))
                key = (message.sender_id, message.incarnation, message.seq)
                if key in self.unique:
                    self.duplicates += 1
                else:
                    self.unique[key] = message
                if self.drop_first_ack and not self._dropped_one:
                    self._dropped_one = True
                elif self.withhold_acks:
                    self._withheld.append((identity, message.seq))
                else:
                    self._send_ack(identity, [message.seq], 0)

    def rollouts(self) -> dict[str, list[Segment]]:
        by_rollout: dict[str, list[Segment]] = defaultdict(list)
        for segment in self.unique.values():
            by_rollout[segment.rollout_id].append(segment)
        return {k: sorted(v, key=lambda s: s.index) for k, v in by_rollout.items()}

    def finished(self) -> int:
        return sum(1 for s in self.unique.values() if s.final)
