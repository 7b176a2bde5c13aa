"""Hostile input (issue item 6): a client that speaks the wire protocol badly
or dishonestly, against the real replay process (`compactionrl replay`) and
the learner's control socket (the ControlPlane that learner rank 0 runs).

Every kind of bad frame gets an ``Error`` reply naming the reason and a
counter under that reason; a flood of them does not stop a well-behaved
actor and learner from being served, and nothing of it reaches a batch.
Frames the transport itself refuses (longer than ``max_message_bytes``, or a
ZMTP length claim of 2^62 bytes) cost the sender its connection, before any
memory is allocated for them."""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgpack
import msgspec
import pytest
import zmq

from learner.control import ControlPlane
from learner.metrics import LearnerMetrics
from protocol import (
    LEARNER_ID,
    Abandon,
    Ack,
    Error,
    GroupInfo,
    Heartbeat,
    Hello,
    LearnerHello,
    MemberWelcome,
    Message,
    Segment,
    Stamp,
    TensorSpec,
    WeightManifest,
    WeightsAnnounce,
    WeightsLoaded,
    Welcome,
    decode,
    encode,
)
from protocol.synthetic import synthetic_hello, synthetic_segment
from protocol.transport import TransportConfig, connect_dealer
from tests.hostile_frames import (
    ENGINE,
    LEARNER_VERSION,
    TOKENS,
    VOCAB,
    control_catalogue,
    depth_bombs,
    replay_catalogue,
)
from tests.ports import loopback_addresses
from tests.processes import ReplayProcess, rss_bytes, wait_until
from tests.protocol_clients import ActorClient, ControlClient, LearnerClient, dealer

#: The replay's frame limit here: small, so that an oversized frame is cheap to send.
MAX_MESSAGE_BYTES = 1 << 20
#: Frames in the flood.
FLOOD = 10_000

# --------------------------------------------------------------------------- the replay


@pytest.fixture
def replay(tmp_path: Path) -> Iterator[ReplayProcess]:
    process = ReplayProcess(tmp_path, "--replay.vocab_size", str(VOCAB),
                            "--replay.rollouts_per_batch", "2", "--replay.max_staleness", "4",
                            "--transport.max_message_bytes", str(MAX_MESSAGE_BYTES))
    yield process
    process.stop()


def _hostile(context: zmq.Context, address: str) -> zmq.Socket:
    return connect_dealer(context, address, TransportConfig())


def _header_seq(frames: list[bytes]) -> int | None:
    """The ``seq`` an Error must name for a message of ``frames``: the
    header's, if the message is one frame, a map in which
    ``protocol_version``, ``kind`` and an integer ``seq`` in [0, 2^63) read before
    anything unreadable (read pair by pair with the plain msgpack package,
    as another implementation would, docs/protocol.md "Rejection")."""
    if len(frames) != 1:
        return None
    reader = msgpack.Unpacker(raw=False, strict_map_key=False)
    reader.feed(frames[0])
    found: dict[str, object] = {}
    try:
        for _ in range(reader.read_map_header()):
            key = reader.unpack()
            if key in ("protocol_version", "kind", "seq"):
                found[key] = reader.unpack()
            else:
                reader.skip()
            if len(found) == 3:
                seq = found["seq"]
                return seq if type(seq) is int and 0 <= seq < 2**63 else None
    except Exception:  # noqa: BLE001  (any way the bytes stop being MessagePack)
        return None
    return None


def _error(socket: zmq.Socket, timeout_ms: int = 10_000) -> Error:
    """The next Error; Acks (credits of a registered peer) are passed over."""
    while True:
        assert socket.poll(timeout_ms), "no reply"
        reply = decode(socket.recv())
        if not isinstance(reply, Ack):
            assert isinstance(reply, Error), reply
            return reply


def test_each_kind_of_bad_frame_gets_an_error_and_a_counter(replay: ReplayProcess,
                                                           context: zmq.Context) -> None:
    learner = LearnerClient(context, replay.learner_address)
    learner.request(2, version=LEARNER_VERSION)
    replay.wait_learner_version(LEARNER_VERSION)
    hostile = _hostile(context, replay.actor_address)
    stamp = Stamp("hostile", 1)
    hostile.send(encode(synthetic_hello(stamp)))  # registered: its frames reach every check
    assert hostile.poll(10_000) and isinstance(decode(hostile.recv()), Welcome)
    expected: Counter[str] = Counter()
    for what, frames, reason in replay_catalogue(stamp):
        hostile.send_multipart(frames)
        reply = _error(hostile)
        assert reply.code == reason, f"{what}: {reply.code} {reply.text}"
        assert reply.ref_seq == _header_seq(frames), what
        expected[reason] += 1
        assert replay.wait_rejected(sum(expected.values())) == expected, what
    assert replay.metric("crl_replay_segments_total", result="accepted") == 0
    assert replay.metric("crl_replay_buffer_bytes") == 0
    assert learner.receive(0.5) is None


def test_a_flood_of_bad_frames_leaves_good_clients_served_and_batches_clean(
        replay: ReplayProcess, context: zmq.Context) -> None:
    learner = LearnerClient(context, replay.learner_address)
    learner.request(2, version=LEARNER_VERSION)
    replay.wait_learner_version(LEARNER_VERSION)
    actor = ActorClient(context, replay.actor_address, actor_id="actor-good")
    actor.hello()
    hostile = _hostile(context, replay.actor_address)
    bad = [frames for _, frames, _ in replay_catalogue(Stamp("hostile", 1))]
    rss_before = rss_bytes(replay.pid)
    ack_seconds = []
    began = time.monotonic()
    for n in range(FLOOD):
        hostile.send_multipart(bad[n % len(bad)])  # replies are never read: they pile up
        if n % 1000 == 999:  # a good rollout in the middle of the flood
            pushed = time.monotonic()
            actor.push_rollout(segments=3, version=LEARNER_VERSION, tokens=TOKENS)
            assert actor.pump_until(lambda: not actor.unacked, timeout_s=30)
            ack_seconds.append(time.monotonic() - pushed)
    counts = replay.wait_rejected(FLOOD)
    flood_s = time.monotonic() - began
    rss_after = rss_bytes(replay.pid)
    assert sum(counts.values()) == FLOOD and not actor.errors

    served: dict[tuple[str, int], Segment] = {}
    for _ in range(len(ack_seconds) // 2):
        batch = learner.receive(10.0)
        assert batch is not None, f"{len(served)} segments served"
        learner.request(2, version=LEARNER_VERSION)
        served.update({(s.rollout_id, s.index): s for r in batch.rollouts for s in r.segments})
    sent = {(s.rollout_id, s.index): s for s in actor.acked.values()}
    assert served.keys() == sent.keys()
    assert all(encode(served[k]) == encode(sent[k]) for k in sent)  # byte for byte
    assert replay.metric("crl_replay_segments_total", result="accepted") == len(sent)
    print(f"{FLOOD} bad frames in {flood_s:.1f} s, all rejected ({dict(counts)}); good "
          f"rollouts acknowledged in at most {max(ack_seconds):.2f} s during the flood; "
          f"replay RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    assert rss_after - rss_before < 64 * 2**20  # rejected frames are not kept


def test_the_learner_socket_refuses_bombs_and_actor_messages_and_keeps_serving(
        replay: ReplayProcess, context: zmq.Context) -> None:
    # a client that says it is the learner: bombs are malformed, an actor's
    # message is not for this socket; any other sender is not the learner
    hostile = connect_dealer(context, replay.learner_address, TransportConfig())
    stamp, stranger = Stamp(LEARNER_ID, 1), Stamp("hostile", 1)
    hello = msgspec.msgpack.decode(encode(LearnerHello(**stamp.next())))
    catalogue = depth_bombs(hello) + [
        ("an actor's heartbeat", [encode(Heartbeat(**stamp.next(), active_rollouts=0,
                                                   stall_seconds={}, credit_ledger=0,
                                                   credits_seen=0))], "unexpected")]
    other = _hostile(context, replay.learner_address)
    other.send(encode(LearnerHello(**stranger.next())))
    assert _error(other).code == "identity"
    expected: Counter[str] = Counter(identity=1)
    assert replay.wait_rejected(1) == expected
    for what, frames, reason in catalogue:
        hostile.send_multipart(frames)
        reply = _error(hostile)
        assert (reply.code, reply.ref_seq) == (reason, _header_seq(frames)), \
            f"{what}: {reply.code} {reply.text}"
        expected[reason] += 1
        assert replay.wait_rejected(sum(expected.values())) == expected, what
    hostile.close(linger=0)
    actor = ActorClient(context, replay.actor_address, actor_id="actor-good")
    actor.hello()
    actor.push_rollout(segments=2, version=0, tokens=TOKENS)
    assert actor.pump_until(lambda: not actor.unacked) and not actor.errors
    learner = LearnerClient(context, replay.learner_address)
    learner.request(1, version=0)
    batch = learner.receive(10.0)
    assert batch is not None and len(batch.rollouts) == 1


def _refused_as(client: ActorClient, message: Message, code: str) -> None:
    client.send(message)
    assert client.pump_until(lambda: any(e.ref_seq == message.seq for e in client.errors))
    [error] = [e for e in client.errors if e.ref_seq == message.seq]
    assert error.code == code, error


def test_only_the_actor_that_began_a_rollout_may_add_to_finish_or_abandon_it(
        replay: ReplayProcess, context: zmq.Context) -> None:
    owner = ActorClient(context, replay.actor_address, actor_id="actor-owner")
    stranger = ActorClient(context, replay.actor_address, actor_id="actor-stranger")
    for client in (owner, stranger):
        client.hello()
        assert client.pump_until(lambda c=client: c.credits > 0)
    begun = synthetic_segment(owner.stamp, "r-owned", 0, final=False, tokens=TOKENS)
    owner.send(begun)
    assert owner.pump_until(lambda: replay.metric("crl_replay_segments_total",
                                                  result="accepted") == 1)
    # the stranger can neither finish, extend nor abandon it, and is told so
    _refused_as(stranger, synthetic_segment(stranger.stamp, "r-owned", 1, final=True,
                                            tokens=TOKENS), "owner")
    _refused_as(stranger, synthetic_segment(stranger.stamp, "r-owned", 2, final=False,
                                            tokens=TOKENS), "owner")
    _refused_as(stranger, Abandon(**stranger.stamp.next(), rollout_id="r-owned"), "owner")
    # the owner finishes it: served with its own segments only ...
    owner.send(synthetic_segment(owner.stamp, "r-owned", 1, final=True, tokens=TOKENS))
    learner = LearnerClient(context, replay.learner_address)
    learner.request(1, version=0)
    batch = learner.receive(10.0)
    assert batch is not None
    [rollout] = batch.rollouts
    assert [(s.sender_id, s.index) for s in rollout.segments] == [("actor-owner", 0),
                                                                  ("actor-owner", 1)]
    # ... and a served rollout stays the owner's: a stranger's segment of it is refused
    _refused_as(stranger, synthetic_segment(stranger.stamp, "r-owned", 3, final=False,
                                            tokens=TOKENS), "owner")
    assert replay.metric("crl_replay_rejected_messages_total", reason="owner") == 4
    assert replay.metric("crl_replay_dropped_total", reason="abandoned") == 0


def test_a_second_connection_cannot_speak_for_a_registered_actor(
        replay: ReplayProcess, context: zmq.Context) -> None:
    """Another process presenting a registered actor's id and incarnation on
    a connection of its own: its hello without the incarnation's token is
    refused (``identity``), anything else is ``unregistered``; one that
    presents the actor's exact routing id is not heard at all. The actor's
    acks, credits and batches go on."""
    genuine = ActorClient(context, replay.actor_address, actor_id="actor-1")
    genuine.hello()
    assert genuine.pump_until(lambda: genuine.credits > 0)
    impostor = ActorClient(context, replay.actor_address, actor_id="actor-1")
    impostor.stamp = Stamp("actor-1", genuine.stamp.incarnation, first_seq=10_000)
    _refused_as(impostor, synthetic_hello(impostor.stamp, 64), "identity")
    for message in (synthetic_segment(impostor.stamp, "r-impostor", 0, final=True,
                                      tokens=TOKENS),
                    Abandon(**impostor.stamp.next(), rollout_id="r-impostor")):
        _refused_as(impostor, message, "unregistered")
    impostor.close()
    # A client of another make may present a routing id; a second connection
    # presenting the same one is ignored by ZeroMQ (no ROUTER_HANDOVER):
    # the replay never hears it, and it takes nothing over.
    named = ActorClient(context, replay.actor_address, actor_id="actor-2",
                        routing_id=b"actor-2/5f0c9e2b")
    named.hello()
    assert named.pump_until(lambda: named.credits > 0)
    squatter = ActorClient(context, replay.actor_address, actor_id="actor-2",
                           routing_id=b"actor-2/5f0c9e2b")
    squatter.stamp = Stamp("actor-2", named.stamp.incarnation, first_seq=10_000)
    squatter.send(synthetic_segment(squatter.stamp, "r-squatter", 0, final=True, tokens=TOKENS))
    squatter.pump(1.0)
    assert not squatter.errors and not squatter.acked
    squatter.close()
    for client in (genuine, named):
        client.push_rollout(segments=2, tokens=TOKENS)
        assert client.pump_until(lambda c=client: not c.unacked) and not client.errors
    learner = LearnerClient(context, replay.learner_address)
    learner.request(2, version=0)
    batch = learner.receive(10.0)
    assert batch is not None and {s.sender_id for r in batch.rollouts for s in r.segments} == {
        "actor-1", "actor-2"}
    assert replay.metric("crl_replay_rejected_messages_total", reason="identity") == 1
    assert replay.metric("crl_replay_rejected_messages_total", reason="unregistered") == 2
    assert replay.metric("crl_replay_segments_total", result="accepted") == 4
    # the gauge is set each tick: the impostors never counted as actors
    wait_until(lambda: replay.metric("crl_replay_actors_alive") == 2, 10, "two actors alive")


def test_a_reconnect_moves_the_incarnation_with_its_token_and_the_old_connection_hears_why(
        replay: ReplayProcess, context: zmq.Context) -> None:
    """A reconnect is a new connection (clients set no routing id): the
    incarnation's hello on it, with its token, moves the incarnation there
    (ledger and rollouts kept) and the old connection is told it is
    displaced; a rollout begun on the old connection finishes on the new."""
    old = ActorClient(context, replay.actor_address, actor_id="actor-1")
    old.hello()
    assert old.pump_until(lambda: old.credits > 0)
    old.send_kept(synthetic_segment(old.stamp, "r-moved", 0, final=False, tokens=TOKENS))
    assert old.pump_until(lambda: len(old.acked) == 1)
    new = ActorClient(context, replay.actor_address, actor_id="actor-1")
    new.stamp, new.token = old.stamp, old.token
    new.hello()
    assert new.pump_until(lambda: new.credits_seen > 0)  # its Welcome: the same ledger
    assert (new.credit_ledger, new.credits_seen) == (old.credit_ledger, old.credits_seen)
    assert old.pump_until(lambda: bool(old.errors))
    [displaced] = old.errors
    assert displaced.code == "identity" and "displaced" in displaced.text
    new.send_kept(synthetic_segment(new.stamp, "r-moved", 1, final=True, tokens=TOKENS))
    assert new.pump_until(lambda: len(new.acked) == 1) and not new.errors
    _refused_as(old, synthetic_segment(old.stamp, "r-late", 0, final=True, tokens=TOKENS),
                "unregistered")
    learner = LearnerClient(context, replay.learner_address)
    learner.request(1, version=0)
    batch = learner.receive(10.0)
    assert batch is not None and [s.index for s in batch.rollouts[0].segments] == [0, 1]
    assert replay.metric("crl_replay_rejected_messages_total", reason="identity") == 1
    wait_until(lambda: replay.metric("crl_replay_actors_alive") == 1, 10, "one actor alive")


#: The routing ids libzmq gives the first peers without one, in a process
#: that never seeded ``rand()`` (glibc's first ``rand()`` is 0x6b8b4567).
UNSEEDED_ANONYMOUS_IDS = [b"\x00" + n.to_bytes(4, "big")
                          for n in range(0x6B8B4567, 0x6B8B4567 + 32)]


def test_a_peer_claiming_the_next_anonymous_routing_id_does_not_kill_the_replay(
        replay: ReplayProcess, context: zmq.Context) -> None:
    """Peers that present the routing ids libzmq would give the next peers
    without one, then such a peer: libzmq aborts a process whose numbering
    they guessed (two connections killed the replay before it seeded it).
    The replay answers the anonymous peer (it said no hello) and goes on
    serving an actor."""
    squatters = [dealer(context, replay.actor_address, routing_id=routing_id)
                 for routing_id in UNSEEDED_ANONYMOUS_IDS]
    stamp = Stamp("anonymous", 1)

    def heartbeat() -> bytes:
        return encode(Heartbeat(**stamp.next(), active_rollouts=0, stall_seconds={},
                                credit_ledger=0, credits_seen=0))

    for squatter in squatters:
        squatter.send(heartbeat())
    anonymous = context.socket(zmq.DEALER)
    anonymous.connect(replay.actor_address)
    try:
        for squatter in squatters:  # each refused: it said no hello
            assert _error(squatter).code == "unregistered"
        anonymous.send(heartbeat())
        assert _error(anonymous).code == "unregistered"
        assert replay.background.process.poll() is None, replay.background.log()[-3000:]
        actor = ActorClient(context, replay.actor_address, actor_id="actor-1")
        actor.hello()
        assert actor.pump_until(lambda: actor.credits > 0)
    finally:
        anonymous.close(linger=0)
        for squatter in squatters:
            squatter.close(linger=0)


class _RawZmtp:
    """A DEALER spoken by hand (ZMTP 3.0, NULL mechanism), to send what no
    ZeroMQ library would: a frame header claiming any length."""

    def __init__(self, address: str) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.socket = socket.create_connection((host, int(port)), timeout=10)
        self.socket.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0])
                            + b"NULL".ljust(20, b"\0") + b"\0" * 32)
        assert self._read(64)[:1] == b"\xff", "not a ZMTP peer"
        ready = b"\x05READY" + self._property(b"Socket-Type", b"DEALER") + \
            self._property(b"Identity", b"raw")
        self.socket.sendall(b"\x04" + bytes([len(ready)]) + ready)
        assert b"READY" in self._command(), "no READY from the peer"

    @staticmethod
    def _property(name: bytes, value: bytes) -> bytes:
        return bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.socket.recv(size - len(data))
            assert chunk, "the peer closed the connection"
            data += chunk
        return data

    def _command(self) -> bytes:
        """One frame or command from the peer (short or long size)."""
        flags = self._read(1)[0]
        size = int.from_bytes(self._read(8 if flags & 0x02 else 1), "big")
        return self._read(size)

    def send_frame(self, data: bytes) -> None:
        self.socket.sendall(b"\x02" + len(data).to_bytes(8, "big") + data)

    def receive(self) -> bytes:
        return self._command()

    def claim(self, size: int) -> None:
        """Announce a frame of ``size`` bytes and send only a few of them."""
        self.socket.sendall(b"\x02" + size.to_bytes(8, "big") + b"x" * 64)

    def closed_by_peer(self) -> bool:
        try:
            return self.socket.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.socket.close()


def test_oversized_frames_cost_the_sender_its_connection(replay: ReplayProcess,
                                                         context: zmq.Context) -> None:
    before = replay.rejected()
    rss_before = rss_bytes(replay.pid)
    raw = _RawZmtp(replay.actor_address)
    try:
        raw.send_frame(b"hello")  # the application hears this peer ...
        assert decode(raw.receive()).code == "malformed"
        raw.claim(2**62)  # ... and the transport hangs up on this frame
        assert raw.closed_by_peer()
    finally:
        raw.close()
    before["malformed"] += 1
    oversized = _hostile(context, replay.actor_address)
    oversized.send(b"\0" * (MAX_MESSAGE_BYTES + 1))
    assert not oversized.poll(1000)  # dropped by the transport: no reply
    actor = ActorClient(context, replay.actor_address, actor_id="actor-good")
    actor.hello()
    actor.push_rollout(version=0)
    assert actor.pump_until(lambda: not actor.unacked) and not actor.errors
    # the transport drops such frames before the application sees them: nothing to count
    assert replay.rejected() == before
    assert rss_bytes(replay.pid) - rss_before < 16 * 2**20


# --------------------------------------------------------------------------- the learner


@pytest.fixture
def control() -> Iterator[tuple[ControlPlane, LearnerMetrics, str]]:
    [address] = loopback_addresses(1)
    metrics = LearnerMetrics()
    plane = ControlPlane(address, TransportConfig(max_message_bytes=MAX_MESSAGE_BYTES),
                         run_id="r", max_staleness=2, late_joiner="immediate", metrics=metrics)
    yield plane, metrics, address
    plane.close()


def _rejected(metrics: LearnerMetrics) -> Counter[str]:
    samples = metrics.registry.collect()
    return Counter({s.labels["reason"]: int(s.value) for family in samples
                    for s in family.samples if s.name == "crl_learner_rejected_frames_total"})


def test_the_control_socket_rejects_and_counts_bad_frames_through_a_flood(control) -> None:
    plane, metrics, address = control
    context = zmq.Context()
    try:
        hostile = ControlClient(context, address, "hostile")
        hostile.send(Hello, engine=ENGINE, capacity=1)  # with CURVE off anyone may register
        assert isinstance(hostile.receive(), MemberWelcome)
        catalogue = control_catalogue(hostile.stamp)
        expected: Counter[str] = Counter()
        for what, frames, reason in catalogue:
            hostile.socket.send_multipart(frames)
            reply = hostile.receive()
            assert isinstance(reply, Error) and reply.code == reason, f"{what}: {reply}"
            expected[reason] += 1
        assert _rejected(metrics) == expected
        for n in range(FLOOD):
            hostile.socket.send_multipart(catalogue[n % len(catalogue)][1])
        total = sum(expected.values()) + FLOOD
        end = time.monotonic() + 30
        while sum(_rejected(metrics).values()) < total:
            assert time.monotonic() < end, f"{_rejected(metrics)}, {total} expected"
            time.sleep(0.1)
        # a good actor registers, is announced to and reports its load as usual
        actor = ControlClient(context, address, "actor-good")
        actor.send(Hello, engine=ENGINE, capacity=1)
        assert isinstance(actor.receive(), MemberWelcome)
        members = [m for m in plane.members() if m.actor_id == "actor-good"]
        manifest = WeightManifest(tensors=[TensorSpec("w", "float32", (2,))], bucket_bytes=0)
        plane.announce(3, [(member, manifest, GroupInfo(
            generation=1, master_addr="h", master_port=1, world_size=2, rank=rank,
            backend="gloo")) for rank, member in enumerate(members, start=1)])
        assert isinstance(actor.receive(), WeightsAnnounce)
        actor.send(WeightsLoaded, version=3, seconds=0.5)
        end = time.monotonic() + 10
        while members[0].version != 3:
            assert time.monotonic() < end, "the good load was not recorded"
            time.sleep(0.05)
        load = {s.name: s.value for family in metrics.registry.collect()
                for s in family.samples if s.labels.get("phase") == "load"}
        assert load["crl_learner_weight_sync_seconds_count"] == 1
        assert load["crl_learner_weight_sync_seconds_sum"] == 0.5  # no NaN got in
    finally:
        context.destroy(linger=0)


def test_a_second_connection_cannot_take_a_members_announcements(control) -> None:
    """The learner's control socket: an impostor of a member's incarnation is
    refused (its hello lacks the token, its load report is unregistered) and
    hears no weights; the member's own reconnect, with its token, moves the
    membership and the announcements to the new connection."""
    plane, metrics, address = control
    context = zmq.Context()
    try:
        genuine = ControlClient(context, address, "actor-1")
        genuine.send(Hello, engine=ENGINE, capacity=1)
        assert isinstance(genuine.receive(), MemberWelcome)
        impostor = ControlClient(context, address, "actor-1",
                                 incarnation=genuine.stamp.incarnation)
        for kind, fields, code in ((Hello, {"engine": ENGINE, "capacity": 1}, "identity"),
                                   (WeightsLoaded, {"version": 0, "seconds": 0.1},
                                    "unregistered")):
            impostor.send(kind, **fields)
            reply = impostor.receive()
            assert isinstance(reply, Error) and reply.code == code, reply
        assert _rejected(metrics) == Counter(identity=1, unregistered=1)
        manifest = WeightManifest(tensors=[TensorSpec("w", "float32", (2,))], bucket_bytes=0)

        def announce(version: int) -> None:
            [member] = plane.members()
            plane.announce(version, [(member, manifest, GroupInfo(
                generation=1, master_addr="h", master_port=1, world_size=2, rank=1,
                backend="gloo"))])

        announce(1)
        assert isinstance(genuine.receive(), WeightsAnnounce)
        assert not impostor.socket.poll(500)  # nothing of the weights reaches it
        moved = ControlClient(context, address, "actor-1")
        moved.stamp, moved.token = genuine.stamp, genuine.token
        moved.send(Hello, engine=ENGINE, capacity=1)
        assert isinstance(moved.receive(), MemberWelcome)
        # the publication under way, announced again (the first may have
        # been lost with the old connection)
        assert moved.receive().version == 1
        displaced = genuine.receive()
        assert displaced.code == "identity" and "displaced" in displaced.text
        announce(2)
        assert moved.receive().version == 2
        assert not genuine.socket.poll(500)
    finally:
        context.destroy(linger=0)
