"""Scripted protocol clients on real DEALER sockets, speaking only through
the wire protocol: an actor and a learner of the replay, and an actor of the
learner's control socket."""

from __future__ import annotations

import itertools
import time

import zmq

from protocol import (
    Ack,
    Batch,
    BatchRequest,
    EngineInfo,
    Error,
    Heartbeat,
    Hello,
    Message,
    Segment,
    Stamp,
    Welcome,
    decode,
    encode,
)
from protocol.synthetic import synthetic_segment
from protocol.transport import TransportConfig, connect_dealer


class ActorClient:
    """Sends segments, keeps them until acknowledged, resends on request."""

    def __init__(self, context: zmq.Context, address: str, actor_id: str = "actor-x",
                 incarnation: int = 1, capacity: int = 4,
                 transport: TransportConfig | None = None,
                 routing_id: bytes | None = None) -> None:
        """``routing_id``: the connection's (default ``actor_id`` itself)."""
        self.socket = connect_dealer(context, address, transport or TransportConfig(),
                                     routing_id or actor_id.encode())
        self.stamp = Stamp(actor_id, incarnation)
        self.capacity = capacity
        self.credits = 0
        """To spend: a test starts a rollout by taking one."""
        self.credit_ledger = 0
        self.credits_seen = 0
        self.unacked: dict[int, bytes] = {}
        self.acked: dict[int, Segment] = {}
        self.sent: dict[int, Segment] = {}
        self.errors: list[Error] = []
        self.policy_version = 0
        self._rollouts = itertools.count()

    def hello(self) -> None:
        self.send(Hello(**self.stamp.next(), capacity=self.capacity,
                        engine=EngineInfo(device="cpu", dtype="bfloat16", tensor_parallel=1,
                                          model="m")))

    def heartbeat(self, active_rollouts: int = 0) -> None:
        self.send(Heartbeat(**self.stamp.next(), active_rollouts=active_rollouts,
                            stall_seconds={}, credit_ledger=self.credit_ledger,
                            credits_seen=self.credits_seen))

    def send(self, message: Message) -> None:
        self.socket.send(encode(message))

    def push_rollout(self, segments: int = 3, version: int = 0,
                     tokens: int | list[int] = 64) -> str:
        """Send a rollout's segments in order; ``tokens`` is each one's length,
        or a list of lengths (one segment each, overriding ``segments``)."""
        rollout_id = f"{self.stamp.sender_id}-{self.stamp.incarnation}-{next(self._rollouts)}"
        lengths = tokens if isinstance(tokens, list) else [tokens] * segments
        for index, length in enumerate(lengths):
            segment = synthetic_segment(self.stamp, rollout_id, index, index == len(lengths) - 1,
                                        version, length)
            frame = encode(segment)
            self.unacked[segment.seq] = frame
            self.sent[segment.seq] = segment
            self.socket.send(frame)
        return rollout_id

    def resend_unacked(self) -> None:
        for frame in self.unacked.values():
            self.socket.send(frame)

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if not self.socket.poll(max(1, int(left * 1000)), zmq.POLLIN):
                continue
            message = decode(self.socket.recv())
            if isinstance(message, Welcome | Ack):
                if message.credit_ledger != self.credit_ledger:
                    self.credit_ledger, self.credits_seen, self.credits = (
                        message.credit_ledger, 0, 0)
                self.credits += max(0, message.credits_total - self.credits_seen)
                self.credits_seen = max(self.credits_seen, message.credits_total)
            if isinstance(message, Ack):
                self.policy_version = message.policy_version
                for seq in message.stored_seqs:
                    if self.unacked.pop(seq, None) is not None:
                        self.acked[seq] = self.sent[seq]
            elif isinstance(message, Error):
                self.errors.append(message)
                self.unacked.pop(message.ref_seq, None)

    def pump_until(self, condition, timeout_s: float = 15.0) -> bool:
        """Pump until ``condition()`` holds (True) or the timeout passes (False):
        tests wait on events, not on fixed sleeps, so a loaded machine is slower
        but not wrong."""
        end = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > end:
                return False
            self.pump(0.05)
        return True

    def close(self) -> None:
        self.socket.close(linger=0)


class LearnerClient:
    def __init__(self, context: zmq.Context, address: str,
                 transport: TransportConfig | None = None, incarnation: int = 1) -> None:
        self.socket = connect_dealer(context, address, transport or TransportConfig(), b"learner")
        self.stamp = Stamp("learner", incarnation)

    def request(self, size: int, version: int) -> bytes:
        """Send a BatchRequest; returns its frame (to send it again)."""
        frame = encode(BatchRequest(**self.stamp.next(), size=size, policy_version=version))
        self.socket.send(frame)
        return frame

    def receive(self, timeout_s: float) -> Batch | None:
        if not self.socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        message = decode(self.socket.recv())
        assert isinstance(message, Batch), message
        return message

    def close(self) -> None:
        self.socket.close(linger=0)


class ControlClient:
    """An actor of the learner's control socket: sends typed messages, reads replies."""

    def __init__(self, context: zmq.Context, address: str, actor_id: str,
                 transport: TransportConfig | None = None, routing_id: bytes | None = None,
                 incarnation: int | None = None) -> None:
        self.socket = connect_dealer(context, address, transport or TransportConfig(),
                                     routing_id or actor_id.encode())
        self.stamp = Stamp(actor_id, time.time_ns() if incarnation is None else incarnation)

    def send(self, message_type: type, **fields: object) -> None:
        self.socket.send(encode(message_type(**self.stamp.next(), **fields)))

    def receive(self, timeout_ms: int = 5000) -> Message:
        assert self.socket.poll(timeout_ms), "no reply from the control socket"
        return decode(self.socket.recv(), 1 << 20)
