"""The weight store's bounds under attack (protocol/weights_store.py) on real
ZeroMQ sockets: no request ends the serving thread, ``add`` stays within
int64, and one writer cannot fill the store for the others or the learner."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import msgspec
import pytest
import zmq

from protocol import weights_store
from protocol.transport import TransportConfig
from protocol.weights_store import (
    MAX_VALUE_BYTES,
    MAX_WRITER_BYTES,
    MAX_WRITER_KEYS,
    HostedStore,
)

INT64_MAX = 2**63 - 1
INT64_MIN = -2**63


@pytest.fixture
def hosted() -> Iterator[tuple[HostedStore, Counter]]:
    refused: Counter = Counter()
    store = HostedStore("tcp://127.0.0.1:0", TransportConfig(), timeout_s=2.0,
                        refused=lambda reason: refused.update([reason]))
    yield store, refused
    store.close()


@pytest.fixture
def raw(hosted) -> Iterator[zmq.Socket]:
    """A client speaking the store's protocol directly, as an attacker would."""
    store, _ = hosted
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(f"tcp://127.0.0.1:{store.port}")
    yield socket
    context.destroy(linger=0)


def _ask(socket: zmq.Socket, *request: object) -> tuple[bool, object]:
    socket.send(msgspec.msgpack.encode(list(request)))
    assert socket.poll(2000), f"no reply to {request[:2]}"
    _, ok, result = msgspec.msgpack.decode(socket.recv())
    return ok, result


@pytest.mark.parametrize("extreme", [INT64_MAX, INT64_MIN])
def test_an_add_past_int64_is_refused_and_the_store_serves_on(hosted, raw, extreme) -> None:
    store, refused = hosted
    assert _ask(raw, 1, "add", "n", extreme) == (True, extreme)
    ok, text = _ask(raw, 2, "add", "n", extreme)
    assert not ok and "int64" in text
    ok, text = _ask(raw, 3, "add", "n", 2 if extreme > 0 else -2)
    assert not ok and "int64" in text
    assert _ask(raw, 4, "add", "n", 0) == (True, extreme)  # the stored value is unchanged
    assert refused["refused"] == 2
    assert store.add("other", 1) == 1


def test_an_add_operand_or_stored_count_outside_int64_is_refused(hosted, raw) -> None:
    _, refused = hosted
    for operand in (INT64_MAX + 1, 2**64 - 1):  # MessagePack carries up to 2**64 - 1
        ok, text = _ask(raw, 1, "add", "n", operand)
        assert not ok and "int64" in text
    assert _ask(raw, 2, "set", "big", str(2**64).encode()) == (True, None)
    ok, text = _ask(raw, 3, "add", "big", 0)
    assert not ok and "int64" in text
    assert refused["refused"] == 3


def test_an_unexpected_failure_is_counted_and_the_store_serves_on(hosted, raw,
                                                                   monkeypatch) -> None:
    store, refused = hosted
    server = type(store.server)
    apply = server._apply

    def fails_on_num_keys(self, identity: bytes, request_id: int, op: str,
                          arguments: list) -> None:
        if op == "num_keys":
            raise RuntimeError("a bug")
        apply(self, identity, request_id, op, arguments)

    monkeypatch.setattr(server, "_apply", fails_on_num_keys)
    ok, text = _ask(raw, 1, "num_keys")
    assert not ok and "internal" in text
    assert refused["internal"] == 1
    assert _ask(raw, 2, "add", "n", 1) == (True, 1)


def _connect(store: HostedStore, context: zmq.Context) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.connect(f"tcp://127.0.0.1:{store.port}")
    return socket


def test_one_connection_holds_a_bounded_number_of_keys_and_bytes(hosted, raw) -> None:
    store, refused = hosted
    for index in range(MAX_WRITER_KEYS):
        assert _ask(raw, index, "set", f"k{index}", b"v") == (True, None)
    ok, text = _ask(raw, 0, "set", "one-too-many", b"v")
    assert not ok and f"{MAX_WRITER_KEYS} keys" in text
    for index in range(MAX_WRITER_KEYS):
        assert _ask(raw, index, "delete_key", f"k{index}") == (True, True)
    values = MAX_WRITER_BYTES // MAX_VALUE_BYTES
    for index in range(values - 1):  # each key's bytes count too: the last does not fit
        assert _ask(raw, index, "set", f"big{index}", b"x" * MAX_VALUE_BYTES) == (True, None)
    ok, text = _ask(raw, 0, "set", "big-last", b"x" * MAX_VALUE_BYTES)
    assert not ok and f"{MAX_WRITER_BYTES} bytes" in text
    assert refused["refused"] == 2
    store.set("learner", b"v")  # the others are served on
    assert store.num_keys() == values


def test_the_learners_own_keys_are_not_crowded_out_by_the_others(hosted, monkeypatch) -> None:
    store, _ = hosted
    monkeypatch.setattr(weights_store, "MAX_KEYS", 6)
    context = zmq.Context()
    try:
        writers = [_connect(store, context) for _ in range(3)]
        for number, writer in enumerate(writers):
            for index in range(2):
                assert _ask(writer, index, "set", f"w{number}/{index}", b"v") == (True, None)
        ok, text = _ask(_connect(store, context), 0, "set", "member", b"v")
        assert not ok and "6 keys" in text
        store.set("weights/25/join/0", b"1")  # the learner's own pool
        assert store.get("weights/25/join/0") == b"1"
    finally:
        context.destroy(linger=0)


def test_the_learner_makes_room_in_its_own_pool_from_its_oldest_keys(hosted,
                                                                      monkeypatch) -> None:
    store, _ = hosted
    monkeypatch.setattr(weights_store, "OWNER_KEYS", 3)
    for generation in range(5):
        store.set(f"weights/{generation}/join/0", b"1")
    assert store.num_keys() == 3
    assert not store.check(["weights/1/join/0"]) and store.check(["weights/4/join/0"])


def test_only_the_learners_client_owns_the_store(hosted, raw) -> None:
    _, refused = hosted
    ok, text = _ask(raw, 1, "own", b"\0" * 32)
    assert not ok and "owner" in text
    assert refused["refused"] == 1


def test_a_writers_keys_outlive_its_connection(hosted) -> None:
    """A member acknowledges its last bucket and leaves; the sender reads the
    acknowledgement after (the ipc transport's last bucket timed out when a
    gone writer's keys went with it)."""
    store, _ = hosted
    context = zmq.Context()
    try:
        writer = _connect(store, context)
        assert _ask(writer, 0, "set", "weights/7/p1/a3/1", b"1") == (True, None)
        writer.close(linger=0)
        time.sleep(0.5)
        store.wait(["weights/7/p1/a3/1"], timedelta(seconds=5))
    finally:
        context.destroy(linger=0)
