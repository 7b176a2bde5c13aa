"""The service side of a ROUTER socket (protocol/endpoint.py), over a real
ZeroMQ pair: the rules every service shares, and dispatch by message type."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from protocol import BatchRequest, Error, ErrorCode, Heartbeat, Message, Stamp, decode, encode
from protocol.endpoint import Received, ServerEndpoint


@pytest.fixture
def pair() -> Iterator[tuple[ServerEndpoint, zmq.Socket, list]]:
    """An endpoint on a ROUTER, a DEALER named ``client`` connected to it,
    and the refusals the endpoint counted."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind("inproc://endpoint")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"client")
    dealer.connect("inproc://endpoint")
    refused: list[tuple[ErrorCode, Message | None]] = []
    endpoint = ServerEndpoint(router, Stamp("server", 1), 1 << 20,
                              lambda code, message: refused.append((code, message)))
    yield endpoint, dealer, refused
    dealer.close(linger=0)
    router.close(linger=0)
    context.term()


def received(endpoint: ServerEndpoint) -> list[Received]:
    assert endpoint.socket.poll(5000)
    return list(endpoint.receive())


def reply(dealer: zmq.Socket) -> Message:
    assert dealer.poll(5000)
    return decode(dealer.recv())


def test_a_message_goes_to_the_handler_of_its_type(pair) -> None:
    endpoint, dealer, refused = pair
    stamp = Stamp("client", 1)
    dealer.send(encode(BatchRequest(**stamp.next(), size=2, policy_version=3)))
    handled = []
    for message in received(endpoint):
        endpoint.dispatch({BatchRequest: handled.append}, message)
    [one] = handled
    assert (one.identity, one.message.size) == (b"client", 2) and not refused


def test_a_type_the_table_lacks_is_refused_as_unexpected_naming_its_seq(pair) -> None:
    endpoint, dealer, refused = pair
    heartbeat = Heartbeat(**Stamp("client", 1, first_seq=41).next(), active_rollouts=0,
                          stall_seconds={}, credit_ledger=0, credits_seen=0)
    dealer.send(encode(heartbeat))
    for message in received(endpoint):
        endpoint.dispatch({BatchRequest: lambda _: None}, message)
    error = reply(dealer)
    assert isinstance(error, Error)
    assert (error.code, error.ref_seq) == (ErrorCode.UNEXPECTED, 41)
    assert refused == [(ErrorCode.UNEXPECTED, heartbeat)]


@pytest.mark.parametrize("frames, code, ref_seq", [
    ([b"\xc1"], ErrorCode.MALFORMED, None),
    ([b"a", b"b"], ErrorCode.MALFORMED, None),
    ([encode(BatchRequest(**Stamp("someone-else", 1, first_seq=7).next(), size=1,
                          policy_version=0))], ErrorCode.IDENTITY, 7),
], ids=["not-msgpack", "two-frames", "identity"])
def test_a_frame_that_breaks_a_rule_is_refused_before_any_handler(
        pair, frames: list[bytes], code: ErrorCode, ref_seq: int | None) -> None:
    endpoint, dealer, refused = pair
    dealer.send_multipart(frames)
    assert received(endpoint) == []
    error = reply(dealer)
    assert (error.code, error.ref_seq) == (code, ref_seq)
    assert [c for c, _ in refused] == [code]


def test_a_reply_to_a_peer_that_has_gone_is_counted_not_raised(pair) -> None:
    endpoint, _, _ = pair
    undelivered = []
    endpoint.undelivered = lambda: undelivered.append(1)
    endpoint.send_frame(b"nobody", b"frame")
    assert undelivered == [1]
