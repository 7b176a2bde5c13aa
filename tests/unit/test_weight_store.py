"""The weight groups' rendezvous store (protocol/weights_store.py) on real
ZeroMQ sockets: the torch Store operations gloo, NCCL and the ipc transport
use, blocking reads with deadlines, hostile requests refused and counted,
nothing listed, and with CURVE on no answer at all to a client without an
authorized key."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
import torch.distributed as dist
import zmq

from protocol.transport import CurveConfig, TransportConfig, generate_keys
from protocol.weights_store import MAX_VALUE_BYTES, HostedStore, StoreClient
from tests.hostile_frames import BOMB_DEPTH


@pytest.fixture
def hosted() -> tuple[HostedStore, Counter]:
    refused: Counter = Counter()
    store = HostedStore("tcp://127.0.0.1:0", TransportConfig(), timeout_s=2.0,
                        refused=lambda reason: refused.update([reason]))
    yield store, refused
    store.close()


def _client(store: HostedStore, transport: TransportConfig | None = None,
            timeout_s: float = 2.0) -> StoreClient:
    return StoreClient(f"tcp://127.0.0.1:{store.port}", transport or TransportConfig(), timeout_s)


def test_the_store_operations_a_process_group_uses(hosted) -> None:
    store, _ = hosted
    member = _client(store)
    try:
        store.set("a", "1")
        assert member.get("a") == b"1"
        assert member.add("n", 2) == 2 and store.add("n", 3) == 5
        assert member.check(["a", "n"]) and not member.check(["a", "missing"])
        assert member.compare_set("c", "", "x") == b"x"
        assert member.compare_set("c", "wrong", "y") == b"x"
        assert member.compare_set("c", "x", "y") == b"y"
        assert store.num_keys() == 3
        assert member.delete_key("c") and not member.delete_key("c")
        view = member.prefixed("weights/3")
        view.set("rank_1", b"addr")
        assert store.get("weights/3/rank_1") == b"addr"
        assert view.prefixed("p1").prefix == "weights/3/p1/"
    finally:
        member.close()


def test_a_read_waits_for_the_key_and_times_out_without_it(hosted) -> None:
    store, _ = hosted
    member = _client(store)
    try:
        threading.Timer(0.3, lambda: store.set("late", b"v")).start()
        began = time.monotonic()
        assert member.get("late") == b"v"
        assert time.monotonic() - began >= 0.25
        member.wait(["late"], timedelta(seconds=1))
        began = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="not set in time"):
            member.wait(["never"], timedelta(seconds=0.5))
        assert 0.4 <= time.monotonic() - began < 2.0
        with pytest.raises(dist.DistStoreError):
            member.get("never")  # its own timeout: 2 s
        store.set("after", b"ok")  # the connection is still in step
        assert member.get("after") == b"ok"
    finally:
        member.close()


def test_hostile_requests_are_refused_counted_and_others_still_served(hosted) -> None:
    store, refused = hosted
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.connect(f"tcp://127.0.0.1:{store.port}")
    try:
        encode = msgspec.msgpack.encode
        for frame in (b"\xff\x00 not msgpack", encode({"op": "set"}), encode([1, "list_keys"]),
                      encode([2, "set", "k"]), encode([3, "set", 7, b"v"]),
                      encode([4, "set", "k", b"x" * (MAX_VALUE_BYTES + 1)]),
                      encode([5, "wait", "not-a-list", 1.0]), encode([6, "get", "k", -1]),
                      # a request nested past the decoder's recursion limit
                      b"\x93\x07\xa3set" + b"\x91" * BOMB_DEPTH + b"\xc0"):
            raw.send(frame)
            assert raw.poll(2000), frame[:20]
            request_id, ok, text = msgspec.msgpack.decode(raw.recv())
            assert not ok and ("refused" in text or "malformed" in text)
        assert refused == Counter(malformed=2, refused=7)
        assert store.num_keys() == 0  # nothing was stored
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        context.destroy(linger=0)


def test_with_curve_a_client_without_an_authorized_key_gets_no_answer(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys", ["server", "learner", "actor"])
    intruder_keys = generate_keys(tmp_path / "elsewhere", ["server", "intruder"])

    def curve(client: str, directory: Path = tmp_path / "keys") -> TransportConfig:
        return TransportConfig(curve=CurveConfig(
            enabled=True, server_secret_key=str(keys["server"][1]),
            client_secret_key=str(directory / f"{client}.key_secret"),
            server_public_key=str(keys["server"][0]),
            authorized_keys_dir=str(tmp_path / "keys" / "authorized")))

    store = HostedStore("tcp://127.0.0.1:0", curve("learner"), timeout_s=1.0)
    member = _client(store, curve("actor"))
    intruder = _client(store, curve("intruder", tmp_path / "elsewhere"), timeout_s=0.5)
    plain = _client(store, timeout_s=0.5)
    try:
        assert intruder_keys["intruder"][0].exists()
        store.set("weights/1/rank_0", b"addr")
        assert member.get("weights/1/rank_0") == b"addr"
        for outsider in (intruder, plain):
            with pytest.raises(dist.DistStoreError, match="did not answer"):
                outsider.get("weights/1/rank_0")
            with pytest.raises(dist.DistStoreError, match="did not answer"):
                outsider.set("weights/1/rank_1", b"mine")
        assert store.num_keys() == 1
    finally:
        for client in (member, intruder, plain):
            client.close()
        store.close()


def test_an_abandoned_prefix_fails_its_waits_at_once_and_no_others(hosted) -> None:
    store, refused = hosted
    waiting, other = _client(store, timeout_s=30.0), _client(store, timeout_s=30.0)
    outcome: dict[str, BaseException | None] = {}

    def wait(client: StoreClient, key: str) -> None:
        try:
            client.wait([key], timedelta(seconds=30))
            outcome[key] = None
        except dist.DistStoreError as exc:
            outcome[key] = exc

    threads = [threading.Thread(target=wait, args=(waiting, "weights/4/join/1")),
               threading.Thread(target=wait, args=(other, "weights/41/join/1"))]
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        began = time.monotonic()
        view = store.prefixed("weights/4")
        assert not view.abandoned()
        view.abandon()
        threads[0].join(timeout=10)
        assert time.monotonic() - began < 5  # its deadline is 30 s
        assert "abandoned: weights/4/" in str(outcome["weights/4/join/1"])
        assert view.abandoned() and not store.prefixed("weights/41").abandoned()
        with pytest.raises(dist.DistStoreError, match="abandoned"):  # later waits too
            waiting.prefixed("weights/4").get("p1/b0")
        store.set("weights/41/join/1", b"1")  # a prefix that merely starts alike waits on
        threads[1].join(timeout=10)
        assert outcome["weights/41/join/1"] is None
        with pytest.raises(dist.DistStoreError, match="ends with '/'"):
            store._call("abandon", "weights/5")
        assert refused["refused"] == 1
    finally:
        waiting.close()
        other.close()
