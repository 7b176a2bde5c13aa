"""Scripted protocol clients on real DEALER sockets, speaking only through
the wire protocol: an actor and a learner of the replay, and an actor of the
learner's control socket."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator

import msgspec
import zmq

from learner.control import ControlPlane
from learner.metrics import LearnerMetrics
from learner.replay_client import ReplayClient
from protocol import (
    Ack,
    Batch,
    BatchRequest,
    EngineInfo,
    Error,
    GroupTag,
    Heartbeat,
    Hello,
    Message,
    Segment,
    Stamp,
    TensorSpec,
    WeightManifest,
    Welcome,
    decode,
    encode,
)
from protocol.messages import new_token
from protocol.synthetic import synthetic_hello, synthetic_segment
from protocol.transport import TransportConfig, connect_dealer
from tests.ports import loopback_addresses


def dealer(context: zmq.Context, address: str, transport: TransportConfig | None = None,
           routing_id: bytes | None = None) -> zmq.Socket:
    """A client socket as the project's (no routing id of its own), or one
    presenting ``routing_id``, as a client of another make may."""
    if routing_id is None:
        return connect_dealer(context, address, transport or TransportConfig())
    assert transport is None, "a routing id of its own is for plain sockets here"
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.ROUTING_ID, routing_id)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


class ActorClient:
    """Sends segments, keeps them until acknowledged, resends on request."""

    def __init__(self, context: zmq.Context, address: str, actor_id: str = "actor-x",
                 incarnation: int = 1, capacity: int = 4,
                 transport: TransportConfig | None = None,
                 routing_id: bytes | None = None, metrics_address: str = "",
                 group_size: int = 1) -> None:
        """``routing_id``: one the socket presents (default: none, as the project's);
        ``metrics_address`` and ``group_size``: its hello's."""
        self.socket = dealer(context, address, transport, routing_id)
        self.stamp = Stamp(actor_id, incarnation)
        self.token = new_token()
        """Its incarnation's: a hello with it moves the incarnation to a new connection."""
        self.capacity = capacity
        self.metrics_address = metrics_address
        self.group_size = group_size
        self.credits = 0
        """To spend: a test starts a rollout by taking one."""
        self.credit_ledger = 0
        self.credits_seen = 0
        self.unacked: dict[int, bytes] = {}
        self.acked: dict[int, Segment] = {}
        self.sent: dict[int, Segment] = {}
        self.errors: list[Error] = []
        self.registered = False
        """Welcomed on this connection, as far as it knows."""
        self.policy_version = 0
        self._rollouts = itertools.count()

    def hello(self) -> None:
        self.send(msgspec.structs.replace(synthetic_hello(self.stamp, self.capacity, self.token),
                                          metrics_address=self.metrics_address,
                                          group_size=self.group_size))

    def heartbeat(self, active_rollouts: int = 0,
                  stall_seconds: dict[str, float] | None = None) -> None:
        self.send(Heartbeat(**self.stamp.next(), active_rollouts=active_rollouts,
                            stall_seconds=stall_seconds or {}, credit_ledger=self.credit_ledger,
                            credits_seen=self.credits_seen))

    def send(self, message: Message) -> None:
        self.socket.send(encode(message))

    def push_rollout(self, segments: int = 3, version: int = 0,
                     tokens: int | list[int] = 64, group: str | None = None,
                     final: bool = True) -> str:
        """Send a rollout's segments in order; ``tokens`` is each one's length,
        or a list of lengths (one segment each, overriding ``segments``);
        ``group``: the id of its group (of ``group_size``); ``final`` False:
        the last segment sent is not its last (the rollout stays pending)."""
        rollout_id = f"{self.stamp.sender_id}-{self.stamp.incarnation}-{next(self._rollouts)}"
        lengths = tokens if isinstance(tokens, list) else [tokens] * segments
        tag = None if group is None else GroupTag(id=group, size=self.group_size)
        for index, length in enumerate(lengths):
            segment = synthetic_segment(self.stamp, rollout_id, index,
                                        final and index == len(lengths) - 1, version, length)
            self.send_kept(msgspec.structs.replace(segment, group=tag))
        return rollout_id

    def send_kept(self, segment: Segment) -> None:
        """Send a segment and keep it until acknowledged (then in ``acked``)."""
        frame = encode(segment)
        self.unacked[segment.seq] = frame
        self.sent[segment.seq] = segment
        self.socket.send(frame)

    def resend_unacked(self) -> None:
        for frame in self.unacked.values():
            self.socket.send(frame)

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if not self.socket.poll(max(1, int(left * 1000)), zmq.POLLIN):
                continue
            message = decode(self.socket.recv())
            if isinstance(message, Welcome):
                self.registered = True
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
                if message.code == "unregistered":
                    # not final (the replay restarted, or the connection is
                    # new): say hello again, as an actor does; the refused
                    # message stays kept for its resend
                    if self.registered:
                        self.registered = False
                        self.hello()
                elif message.ref_seq is None:  # displaced: registered nowhere now
                    self.registered = False
                else:
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
        self.socket = connect_dealer(context, address, transport or TransportConfig())
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
        self.socket = dealer(context, address, transport, routing_id)
        self.stamp = Stamp(actor_id, time.time_ns() if incarnation is None else incarnation)
        self.token = new_token()
        """Its incarnation's, in each ``Hello`` unless the test gives one."""

    def send(self, message_type: type, **fields: object) -> None:
        if message_type is Hello:
            fields.setdefault("token", self.token)
        self.socket.send(encode(message_type(**self.stamp.next(), **fields)))

    def receive(self, timeout_ms: int = 5000) -> Message:
        assert self.socket.poll(timeout_ms), "no reply from the control socket"
        return decode(self.socket.recv(), 1 << 20)


#: An engine and a manifest for control-socket peers that need valid ones.
CONTROL_ENGINE = EngineInfo(device="cpu", dtype="float32", tensor_parallel=1, model="m")
CONTROL_MANIFEST = WeightManifest(tensors=[TensorSpec("w", "float32", (2, 2))], bucket_bytes=0)


@contextlib.contextmanager
def control_plane(**options: object) -> Iterator[tuple[ControlPlane, LearnerMetrics, str]]:
    """A learner's control plane on a free loopback address (heartbeats every
    0.2 s, silent after 3), counting into metrics of its own; ``options``
    add to or override its settings. Closed when the block ends."""
    [address] = loopback_addresses(1)
    metrics = LearnerMetrics()
    settings: dict[str, object] = {"run_id": "r", "max_staleness": 2,
                                   "late_joiner": "immediate", "metrics": metrics, **options}
    plane = ControlPlane(address, TransportConfig(heartbeat_interval_s=0.2,
                                                  heartbeat_liveness=3), **settings)
    try:
        yield plane, metrics, address
    finally:
        plane.close()


def replay_client(address: str, timeout_s: float = 60.0,
                  transport: TransportConfig | None = None
                  ) -> tuple[ReplayClient, LearnerMetrics]:
    """The learner's own client of the replay, counting into a metrics
    registry of its own (``metrics.registry``)."""
    metrics = LearnerMetrics()
    return ReplayClient(address, transport or TransportConfig(), timeout_s,
                        metrics.replay_client()), metrics


class ControlServer:
    """A learner's control socket, scripted: reads what actors send and
    answers the one that spoke last."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.stamp = Stamp("learner", time.time_ns())
        self.peer = b""

    def receive(self, timeout_ms: int = 5000) -> Message:
        assert self.socket.poll(timeout_ms), "nothing from an actor"
        self.peer, frame = self.socket.recv_multipart()
        return decode(frame, 1 << 20)

    def receive_until(self, kind: type[Message], timeout_s: float) -> Message:
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"no {kind.__name__} from an actor"
            if isinstance(message := self.receive(left_ms), kind):
                return message

    def send(self, message_type: type, **fields: object) -> None:
        self.socket.send_multipart([self.peer, encode(message_type(**self.stamp.next(),
                                                                   **fields))])
