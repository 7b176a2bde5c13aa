"""A client written from docs/protocol.md alone: plain ``msgpack`` maps and
ZeroMQ sockets, nothing of the project's protocol code. Against a real
replay and a real learner control socket it completes a rollout (which the
learner's socket is then served), has a resent segment acknowledged once,
and meets every error code of the Rejection table a socket can return, each
naming the refused message's seq whenever its header decoded (``oversized``
never comes back over a socket: its MAXMSGSIZE, the same bound, drops the
connection first; tests/unit/test_codec.py has the decoder's)."""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from learner.control import ControlPlane
from learner.metrics import LearnerMetrics
from protocol.transport import TransportConfig
from replay.service import ReplayService
from tests.ports import loopback_addresses
from tests.replay_thread import ReplayThread

#: docs/protocol.md, "Fields": the header's protocol_version.
PROTOCOL_VERSION = 8
VOCAB = 100
MAX_MESSAGE_BYTES = 64 * 1024
#: Room for a few small rollouts, not for a 4,096-token segment (~53 kB).
MAX_BUFFER_BYTES = 32_000
#: The replay's liveness: a silent client is declared dead after 10 x 0.2 s.
HEARTBEAT_S, LIVENESS = 0.2, 10


class PlainClient:
    """A DEALER with no routing id of its own, as docs/protocol.md's
    "Connections" says; its incarnation's token is 16 random bytes."""

    def __init__(self, context: zmq.Context, address: str, sender_id: str,
                 incarnation: int = 1, token: bytes | None = None) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.sender_id, self.incarnation = sender_id, incarnation
        self.token = secrets.token_bytes(16) if token is None else token
        self.seqs = itertools.count()

    def header(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"kind": kind, "protocol_version": PROTOCOL_VERSION,
                "sender_id": self.sender_id, "incarnation": self.incarnation,
                "seq": next(self.seqs), "sent_at": time.time(), **fields}

    def send(self, message: dict[str, Any]) -> int:
        self.socket.send(msgpack.packb(message, use_bin_type=True))
        return message["seq"]

    def receive(self, kind: str, timeout_s: float = 15.0) -> dict[str, Any]:
        """The next message of ``kind`` (acks and welcomes on the way are skipped)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.socket.poll(int(left * 1000)):
                message = msgpack.unpackb(self.socket.recv(), raw=False)
                if message["kind"] == kind:
                    return message
        raise AssertionError(f"no {kind} within {timeout_s} s")

    def hello(self, capacity: int = 4, answer: str = "welcome") -> dict[str, Any]:
        self.send(self.header("hello", capacity=capacity, token=self.token, engine={
            "device": "cpu", "dtype": "float32", "tensor_parallel": 1, "model": "plain"}))
        return self.receive(answer)


def array(dtype: str, values: list[float] | np.ndarray) -> list[Any]:
    """docs: ``[dtype, shape, data]``, data little-endian and C-ordered."""
    data = np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<"))
    return [dtype, list(data.shape), data.tobytes()]


def segment(client: PlainClient, rollout_id: str, index: int, final: bool,
            length: int = 8, **changes: Any) -> dict[str, Any]:
    """Half the tokens trainable, sampled by version 0; the final one with a
    reward and the episode's stats."""
    mask = [i % 2 for i in range(length)]
    fields: dict[str, Any] = {
        "rollout_id": rollout_id, "task_id": "task-1", "index": index,
        "segment_type": "execution", "tokens": array("int32", [3 + i % 90 for i in range(length)]),
        "loss_mask": array("uint8", mask), "logprobs": array("float32", [-0.5 * m for m in mask]),
        "versions": array("int32", [0 if m else -1 for m in mask]), "final": final}
    if final:
        fields.update(reward=1.0, stats={
            "outcome": "done", "success": True, "steps": 3, "compactions": index,
            "generated_tokens": length, "summary_tokens": 0, "duration_s": 0.5})
    message = client.header("segment", **fields)
    message.update(changes)  # header keys too
    return message


@pytest.fixture
def services(tmp_path: Path) -> Iterator[tuple[ReplayService, str, str, ControlPlane, str]]:
    """A replay serving in a thread (tests/replay_thread.py) and a learner
    control socket, on loopback ports."""
    transport = TransportConfig(heartbeat_interval_s=HEARTBEAT_S, heartbeat_liveness=LIVENESS,
                                max_message_bytes=MAX_MESSAGE_BYTES)
    [control_address] = loopback_addresses(1)
    control = ControlPlane(control_address, transport, "plain", 1, "immediate",
                           LearnerMetrics(), tmp_path / "announced.json")
    with ReplayThread.on_loopback(transport, VOCAB, rollouts_per_batch=1, max_staleness=1,
                                  durable_log=False, max_buffer_bytes=MAX_BUFFER_BYTES) as replay:
        try:
            yield (replay.service, replay.config.actor_address, replay.config.learner_address,
                   control, control_address)
        finally:
            control.close()


def test_a_rollout_from_plain_maps_is_acknowledged_and_served(
        services: tuple, context: zmq.Context) -> None:
    replay, actor_address, learner_address, _, _ = services
    actor = PlainClient(context, actor_address, "plain-actor")
    welcome = actor.hello()
    assert welcome["credits"] >= 1 and welcome["max_staleness"] == 1
    learner = PlainClient(context, learner_address, "learner")
    learner.send(learner.header("learner_hello"))
    learner_welcome = learner.receive("learner_welcome")
    assert (learner_welcome["rollouts_per_batch"], learner_welcome["max_staleness"]) == (1, 1)
    learner.send(learner.header("batch_request", size=1, policy_version=0))
    seqs = [actor.send(segment(actor, "r-1", index, index == 1)) for index in (1, 0)]
    stored: list[int] = []
    while len(stored) < 2:
        stored += actor.receive("ack")["stored_seqs"]
    assert sorted(stored) == sorted(seqs)
    batch = learner.receive("batch")
    [rollout] = batch["rollouts"]
    assert rollout["rollout_id"] == "r-1" and rollout["staleness"] == 0
    assert [s["kind"] for s in rollout["segments"]] == ["segment", "segment"]
    assert [s["index"] for s in rollout["segments"]] == [0, 1]
    assert rollout["segments"][1]["stats"]["outcome"] == "done"
    # a resent segment: acknowledged again, stored once
    resent = segment(actor, "r-2", 0, True)
    actor.send(resent)
    assert actor.receive("ack")["stored_seqs"] == [resent["seq"]]
    actor.socket.send(msgpack.packb(resent, use_bin_type=True))
    assert actor.receive("ack")["stored_seqs"] == [resent["seq"]]
    sample = replay.metrics.registry.get_sample_value
    assert sample("crl_replay_segments_total", {"result": "duplicate"}) == 1
    assert sample("crl_replay_segments_total", {"result": "accepted"}) == 3


def _replay_cases(actor: PlainClient, context: zmq.Context, address: str
                  ) -> list[tuple[str, list[bytes], int | None, str]]:
    """(what, frames, the seq the error must name, its code)."""
    def frame(message: dict[str, Any]) -> bytes:
        return msgpack.packb(message, use_bin_type=True)

    ok = segment(actor, "bad", 0, True)
    cases = [("not MessagePack", [b"\xc1\xc1"], None, "malformed")]
    cases.append(("two frames", [frame(ok), frame(ok)], None, "malformed"))
    missing = segment(actor, "bad", 0, True)
    del missing["task_id"]
    cases.append(("a required key missing", [frame(missing)], missing["seq"], "malformed"))
    for what, changes, code in [
        ("another protocol version", {"protocol_version": PROTOCOL_VERSION + 1},
         "protocol_version"),
        ("an unknown kind", {"kind": "teleport"}, "unknown_kind"),
        ("float16 token ids", {"tokens": array("float16", [1.0] * 8)}, "array"),
        ("arrays of two lengths", {"logprobs": array("float32", [0.0] * 7)}, "length_mismatch"),
        ("a reward on a non-final segment", {"final": False}, "invalid"),
        ("a token outside the vocabulary", {"tokens": array("int32", [VOCAB] * 8)}, "invalid"),
        ("a version newer than the learner's", {"versions": array("int32", [5] * 8)},
         "invalid"),
        ("someone else's sender_id", {"sender_id": "someone-else"}, "identity"),
    ]:
        message = segment(actor, f"bad-{code}", 0, True)
        message.update(changes)
        cases.append((what, [frame(message)], message["seq"], code))
    request = actor.header("batch_request", size=1, policy_version=0)
    cases.append(("a batch_request on the actor socket", [frame(request)], request["seq"],
                  "unexpected"))
    huge = segment(actor, "too-big", 0, True, length=MAX_MESSAGE_BYTES // 16)
    cases.append(("a rollout beyond the memory bound", [frame(huge)], huge["seq"], "full"))
    return cases


def test_every_replay_error_code_names_the_refused_seq(
        services: tuple, context: zmq.Context) -> None:
    replay, actor_address, _, _, _ = services
    actor = PlainClient(context, actor_address, "plain-actor")
    actor.hello()
    # Over max_message_bytes: the socket's MAXMSGSIZE (the same bound) drops
    # the connection before the replay reads it; the DEALER reconnects.
    actor.send(segment(actor, "bad", 0, True, length=MAX_MESSAGE_BYTES // 4))
    assert not actor.socket.poll(1000)
    # the new connection is registered nowhere: its hello with the
    # incarnation's token moves the incarnation to it (a reconnect)
    assert actor.hello()["credits_total"] >= 1
    codes = set()
    for what, frames, seq, code in _replay_cases(actor, context, actor_address):
        actor.send(actor.header("heartbeat", active_rollouts=0, stall_seconds={},
                                credit_ledger=0, credits_seen=0))
        actor.socket.send_multipart(frames)
        error = actor.receive("error")
        assert (error["code"], error["ref_seq"]) == (code, seq), (what, error["text"])
        codes.add(code)
    # a connection that said no hello: registered nowhere
    stranger = PlainClient(context, actor_address, "plain-actor", token=actor.token)
    seq = stranger.send(segment(stranger, "unregistered", 0, True))
    error = stranger.receive("error")
    assert (error["code"], error["ref_seq"]) == ("unregistered", seq)
    # its hello without the incarnation's token: the incarnation lives on its first connection
    stranger.token = secrets.token_bytes(16)
    assert stranger.hello(answer="error")["code"] == "identity"
    stranger.socket.close()
    codes |= {"unregistered"}
    # an old incarnation after a newer one registered
    newer = PlainClient(context, actor_address, "plain-actor", incarnation=2)
    newer.hello()
    actor.socket.close()
    old = PlainClient(context, actor_address, "plain-actor", incarnation=1)
    seq = old.send(segment(old, "old", 0, True))
    assert (old.receive("error")["code"], seq) == ("stale_incarnation", seq)
    # Incarnation 2 falls silent past the liveness: declared dead, refused
    # until it registers anew.
    old.socket.close()
    newer.socket.close()
    time.sleep(HEARTBEAT_S * (LIVENESS + 3))
    frozen = PlainClient(context, actor_address, "plain-actor", incarnation=2)
    frozen.seqs = itertools.count(100)  # after incarnation 2's earlier messages
    seq = frozen.send(segment(frozen, "late", 0, True))
    error = frozen.receive("error")
    assert (error["code"], error["ref_seq"]) == ("dead_incarnation", seq)
    codes |= {"stale_incarnation", "dead_incarnation"}
    sample = replay.metrics.registry.get_sample_value
    for code in codes:
        assert sample("crl_replay_rejected_messages_total", {"reason": code}) >= 1, code


def test_the_learner_s_control_socket_refuses_a_stranger_until_it_says_hello(
        services: tuple, context: zmq.Context) -> None:
    _, _, _, control, control_address = services
    actor = PlainClient(context, control_address, "plain-actor")
    seq = actor.send(actor.header("weights_loaded", version=1, seconds=0.5))
    error = actor.receive("error")
    assert (error["code"], error["ref_seq"]) == ("unregistered", seq)
    welcome = actor.hello(answer="member_welcome")
    assert welcome["run_id"] == "plain" and welcome["policy_version"] == 0
