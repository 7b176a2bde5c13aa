"""The codec: round trips for every kind, each documented rejection, and a
mutation fuzz proving the decoder raises nothing but ProtocolError."""

from __future__ import annotations

import random

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Array,
    ErrorCode,
    Message,
    ProtocolError,
    Segment,
    Stamp,
    decode,
    encode,
)
from protocol.codec import HEADER_SCAN_OBJECTS, duplicate_key, header_seq
from protocol.synthetic import synthetic_hello
from tests.field_edges import field_probes, probe, ranged_fields
from tests.strategies import KINDS, messages


def _segment(n: int = 8, **changes) -> Segment:
    fields = dict(
        sender_id="actor-0", incarnation=1, seq=0, sent_at=1.0, rollout_id="r", task_id="t",
        index=0, segment_type="execution",
        tokens=Array.from_numpy(np.arange(n, dtype=np.int32)),
        loss_mask=Array.from_numpy(np.ones(n, np.uint8)),
        logprobs=Array.from_numpy(np.full(n, -1.0, np.float32)),
        versions=Array.from_numpy(np.zeros(n, np.int32)),
        final=True, reward=1.0)
    fields.update(changes)
    return Segment(**fields)


def _reencode(frame: bytes, **changes) -> bytes:
    """The frame as a plain map with some top-level keys changed."""
    raw = msgspec.msgpack.decode(frame)
    raw.update(changes)
    return msgspec.msgpack.encode(raw)


def test_strategies_know_every_kind() -> None:
    assert set(KINDS) == {msgspec.inspect.type_info(t).tag for t in MESSAGE_TYPES}


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_kind_round_trips(kind: str, data: st.DataObject) -> None:
    message = data.draw(messages(kind))
    decoded = decode(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_decoded_arrays_are_views_of_the_frame() -> None:
    frame = encode(_segment(1000))
    decoded = decode(frame)
    tokens = decoded.tokens.numpy()
    assert tokens.base is not None and not tokens.flags.writeable
    np.testing.assert_array_equal(tokens, np.arange(1000))


def test_arrays_are_little_endian_on_the_wire() -> None:
    big_endian = np.arange(4, dtype=">i4")
    array = Array.from_numpy(big_endian)
    assert bytes(array.data) == np.arange(4, dtype="<i4").tobytes()
    np.testing.assert_array_equal(array.numpy(), big_endian)


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(_reencode(encode(_segment()), kind="teleport"))
    assert info.value.code is ErrorCode.UNKNOWN_KIND


def test_wrong_protocol_version_is_rejected() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(_reencode(encode(_segment()), protocol_version=PROTOCOL_VERSION + 1))
    assert info.value.code is ErrorCode.PROTOCOL_VERSION


@pytest.mark.parametrize("tokens", [
    ["int32", [9], b"\0" * 32],       # byte length is not shape x itemsize
    ["int32", [-8], b"\0" * 32],      # negative dimension
    ["int64", [8], b"\0" * 64],       # allowed dtype, but not the segment's int32
    ["int32", [2, 4], b"\0" * 32],    # not 1-D
    *[[dtype, [8], b"\0" * 32] for dtype in ("object", "float16", "complex64", "<i4", "")],
], ids=["length", "negative", "wrong-dtype", "2-d", "object", "float16", "complex64", "<i4",
        "empty"])
def test_invalid_arrays_are_rejected(tokens: list) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(_reencode(encode(_segment(8)), tokens=tokens))
    assert info.value.code is ErrorCode.ARRAY


def test_per_token_arrays_must_agree_in_length() -> None:
    short = Array.from_numpy(np.full(7, -1.0, np.float32))
    with pytest.raises(ProtocolError) as info:
        decode(encode(_segment(8, logprobs=short)))
    assert info.value.code is ErrorCode.LENGTH_MISMATCH


def test_reward_only_on_the_final_segment() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(encode(_segment(final=False, reward=1.0)))
    assert info.value.code is ErrorCode.INVALID
    with pytest.raises(ProtocolError):
        decode(encode(_segment(final=True, reward=None)))
    with pytest.raises(ProtocolError):
        decode(encode(_segment(reward=float("nan"))))


def test_oversized_frame_is_rejected_before_parsing() -> None:
    frame = encode(_segment(1000))
    with pytest.raises(ProtocolError) as info:
        decode(frame, max_message_bytes=len(frame) - 1)
    assert info.value.code is ErrorCode.OVERSIZED


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x80", b"\x93\x01\x02\x03", b"\xdf\xff\xff\xff\xff",  # map claiming 4G entries
    b"\xc6\xff\xff\xff\xf0abc",  # bin claiming ~4 GiB
    msgspec.msgpack.encode({"protocol_version": PROTOCOL_VERSION, "kind": "segment"}),
])
def test_malformed_frames_are_rejected(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code in (ErrorCode.MALFORMED, ErrorCode.UNKNOWN_KIND)


@pytest.mark.parametrize("frame, code", [
    (_reencode(encode(_segment(seq=41)), protocol_version=PROTOCOL_VERSION + 1),
     ErrorCode.PROTOCOL_VERSION),
    (_reencode(encode(_segment(seq=41)), kind="teleport"), ErrorCode.UNKNOWN_KIND),
    (_reencode(encode(_segment(seq=41)), tokens=["int32", [9], b"\0" * 32]), ErrorCode.ARRAY),
    (encode(_segment(8, seq=41, logprobs=Array.from_numpy(np.zeros(7, np.float32)))),
     ErrorCode.LENGTH_MISMATCH),
    (encode(_segment(seq=41, reward=float("nan"))), ErrorCode.INVALID),
    (_reencode(encode(_segment(seq=41)), task_id=7), ErrorCode.MALFORMED),
], ids=["protocol-version", "unknown-kind", "array", "length-mismatch", "invalid-reward",
        "malformed-body"])
def test_a_rejection_names_the_seq_once_the_header_decoded(frame: bytes, code: ErrorCode
                                                           ) -> None:
    """The sender can tell which message was refused, and drop or mend it."""
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert (info.value.code, info.value.ref_seq) == (code, 41)


@pytest.mark.parametrize("frame", [
    b"\xff\x00 not msgpack",
    msgspec.msgpack.encode({"protocol_version": PROTOCOL_VERSION, "kind": "segment",
                            "seq": "41"}),
], ids=["not-msgpack", "seq-not-an-integer"])
def test_a_rejection_names_no_seq_without_an_integer_one(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.ref_seq is None


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    data = bytearray(frame)
    operation = rng.randrange(5)
    if operation == 0:  # flip bits in a few bytes
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif operation == 1:  # overwrite with random bytes (length claims, type markers)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif operation == 2:  # truncate
        del data[rng.randrange(len(data)):]
    elif operation == 3:  # extend
        data += rng.randbytes(rng.randint(1, 64))
    else:  # splice a slice of the frame into another place
        start = rng.randrange(len(data))
        piece = data[start:start + rng.randint(1, 32)]
        at = rng.randrange(len(data))
        data[at:at] = piece
    return bytes(data)


def test_mutated_frames_raise_only_protocol_error() -> None:
    rng = random.Random(20261129)
    corpus = [encode(_segment(n)) for n in (0, 1, 5, 64)]

    @settings(max_examples=200, deadline=None, database=None)
    @given(messages())
    def gather(message: Message) -> None:
        corpus.append(encode(message))

    gather()
    outcomes = {"accepted": 0, "rejected": 0}
    for case in range(30_000):
        frame = _mutate(corpus[case % len(corpus)], rng)
        try:
            decode(frame)
            outcomes["accepted"] += 1
        except ProtocolError:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 10_000, outcomes


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_protocol_error(frame: bytes) -> None:
    try:
        decode(frame)
    except ProtocolError:
        pass


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=512))
def test_reading_a_header_from_arbitrary_bytes_gives_a_seq_or_none(frame: bytes) -> None:
    seq = header_seq(frame)
    assert seq is None or type(seq) is int


def test_a_frame_cut_short_after_its_header_names_its_seq() -> None:
    header = {"protocol_version": PROTOCOL_VERSION, "kind": "heartbeat", "seq": 41}
    frame = msgspec.msgpack.encode(header | {"sender_id": "a", "incarnation": 1,
                                             "sent_at": 1.0, "active_rollouts": 0})
    for cut in range(len(msgspec.msgpack.encode(header)), len(frame)):
        with pytest.raises(ProtocolError) as refused:
            decode(frame[:cut])
        assert (refused.value.code, refused.value.ref_seq) == (ErrorCode.MALFORMED, 41)
    # before the header is whole there is no seq to name
    with pytest.raises(ProtocolError) as refused:
        decode(frame[:len(msgspec.msgpack.encode(header)) - 1])
    assert refused.value.ref_seq is None
    # the header's keys in any order, behind other fields, if within the scan
    late = msgspec.msgpack.encode({"pad": list(range(HEADER_SCAN_OBJECTS // 2))} | header)
    assert header_seq(late) == 41
    far = msgspec.msgpack.encode({"pad": list(range(HEADER_SCAN_OBJECTS))} | header)
    assert header_seq(far) is None


@pytest.mark.parametrize("address", ["localhost", ":9110", "host:0", "host:65536", "host:9x",
                                     "a b:9110", "h" * 300 + ":1"],
                         ids=["no-port", "no-host", "port-0", "port-high", "port-text",
                              "space", "long"])
def test_a_hello_s_metrics_address_must_be_host_and_port(address: str) -> None:
    """The replay writes it into Prometheus's discovery file: what Prometheus
    cannot read as a target is refused where it arrives."""
    hello = synthetic_hello(Stamp("actor-1", 1))
    with pytest.raises(ProtocolError) as info:
        decode(_reencode(encode(hello), metrics_address=address))
    assert info.value.code is ErrorCode.INVALID
    assert decode(_reencode(encode(hello), metrics_address="10.0.0.5:9111")).metrics_address


def test_every_field_takes_its_range_edges_and_refuses_beyond_them() -> None:
    """The decoder alone, against the ranges declared on the types (the
    replay process's answers to the same probes: tests/faults/test_field_ranges.py)."""
    probes = list(field_probes(Stamp("probe", 1)))
    assert len(probes) > 300
    for each in probes:
        try:
            decode(each.frame)
            code = None
        except ProtocolError as exc:
            code = exc.code
        assert code == (None if each.accepted else ErrorCode.INVALID), (
            each.kind, each.path, repr(each.value)[:80])


_INT_FIELDS = [(kind, path, info) for kind in MESSAGE_TYPES
               for path, info in ranged_fields(msgspec.inspect.type_info(kind))
               if isinstance(info, msgspec.inspect.IntType) and info.ge is not None]


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(_INT_FIELDS), value=st.integers(-(2**63), 2**64 - 1))
def test_an_integer_field_is_taken_exactly_inside_its_range(field: tuple, value: int) -> None:
    kind, path, info = field
    high = info.le if info.le is not None else info.lt - 1
    message = probe(kind, Stamp("probe", 1), path, value, info.ge <= value <= high)
    try:
        decode(message.frame)
        taken = True
    except ProtocolError as exc:
        assert exc.code is ErrorCode.INVALID, exc
        taken = False
    assert taken == message.accepted, (path, value)


def test_a_string_outside_its_set_is_invalid() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(_reencode(encode(_segment()), segment_type="other"))
    assert info.value.code is ErrorCode.INVALID and "'other'" in info.value.detail


def test_an_array_of_four_elements_is_malformed() -> None:
    raw = msgspec.msgpack.decode(encode(_segment()))
    raw["tokens"].append("extra")
    with pytest.raises(ProtocolError) as info:
        decode(msgspec.msgpack.encode(raw))
    assert info.value.code is ErrorCode.MALFORMED and info.value.ref_seq == 0


@pytest.mark.parametrize("where", ["top", "nested"])
def test_a_key_held_twice_is_malformed_wherever_the_map_is(where: str) -> None:
    """msgspec keeps the last of two values without a word: two readers of
    one frame could disagree, so the frame is refused."""
    frame = encode(synthetic_hello(Stamp("actor-0", 1)))
    key = msgpack.packb("capacity" if where == "top" else "device")
    if where == "top":
        twice = bytes([frame[0] + 1]) + frame[1:] + key + msgpack.packb(3)
    else:  # the engine map gets a second 'device'
        at = frame.index(msgpack.packb("engine")) + len(msgpack.packb("engine"))
        twice = frame[:at] + bytes([frame[at] + 1]) + key + msgpack.packb("gpu") + frame[at + 1:]
    assert duplicate_key(frame) is None
    with pytest.raises(ProtocolError) as info:
        decode(twice)
    assert info.value.code is ErrorCode.MALFORMED and "twice" in info.value.detail


def test_a_message_of_a_past_version_is_refused_for_its_version_whatever_else_is_wrong() -> None:
    """One order of refusals (docs/protocol.md, "Which refusal wins"): the
    version comes before the kind's fields and ranges."""
    frame = _reencode(encode(_segment()), protocol_version=PROTOCOL_VERSION - 1,
                      segment_type="other", index=-1, rollout_id=7)
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code is ErrorCode.PROTOCOL_VERSION and info.value.ref_seq == 0


def test_ref_seq_is_read_wherever_a_whole_map_holds_it() -> None:
    """Past the first 256 objects, when the frame is one whole map."""
    raw = msgspec.msgpack.decode(encode(_segment()))
    seq = raw.pop("seq")
    raw["padding"] = list(range(HEADER_SCAN_OBJECTS * 2))  # an unknown key: ignored
    raw["seq"], raw["index"] = seq + 41, -1
    with pytest.raises(ProtocolError) as info:
        decode(msgspec.msgpack.encode(raw))
    assert info.value.code is ErrorCode.INVALID and info.value.ref_seq == seq + 41


@pytest.mark.parametrize("character", ["\n", "\r", "\x1b", "\x7f", "\x85", "\u2028"])
def test_an_identifier_holding_a_control_character_is_invalid(character: str) -> None:
    """Identifiers are written into logs: one that could end a line (or
    rewrite a terminal) is refused by the decoder both sockets share."""
    hello = msgspec.msgpack.decode(encode(synthetic_hello(Stamp("actor-1", 1))))
    frame = msgspec.msgpack.encode({**hello, "sender_id": f"actor{character}forged"})
    with pytest.raises(ProtocolError) as refused:
        decode(frame)
    assert refused.value.code == ErrorCode.INVALID
