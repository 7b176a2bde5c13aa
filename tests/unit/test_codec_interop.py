"""The bytes are standard MessagePack: the reference ``msgpack`` package reads
what the project writes, and the project reads what ``msgpack`` writes."""

from __future__ import annotations

import msgpack
import numpy as np
from hypothesis import given, settings

from protocol import PROTOCOL_VERSION, EngineInfo, Hello, Message, Segment, decode, encode
from tests.strategies import messages


@settings(max_examples=200, deadline=None)
@given(messages())
def test_plain_msgpack_reads_every_kind(message: Message) -> None:
    plain = msgpack.unpackb(encode(message), raw=False, strict_map_key=False)
    assert plain["protocol_version"] == PROTOCOL_VERSION
    assert plain["sender_id"] == message.sender_id
    assert plain["seq"] == message.seq
    # Re-packing the plain objects gives a frame the project decodes to the same message.
    assert decode(msgpack.packb(plain, use_bin_type=True)) == message


def test_segment_arrays_are_dtype_shape_bytes_triples() -> None:
    tokens = np.array([3, 1, 4, 1, 5], dtype=np.int32)
    frame = msgpack.packb({
        "kind": "segment", "protocol_version": PROTOCOL_VERSION, "sender_id": "py-msgpack",
        "incarnation": 2, "seq": 7, "sent_at": 0.5, "rollout_id": "r", "task_id": "t",
        "index": 1, "segment_type": "summary",
        "tokens": ["int32", [5], tokens.astype("<i4").tobytes()],
        "loss_mask": ["uint8", [5], bytes([0, 0, 1, 1, 1])],
        "logprobs": ["float32", [5], np.array([0, 0, -1, -2, -3], "<f4").tobytes()],
        "versions": ["int32", [5], np.array([-1, -1, 4, 4, 5], "<i4").tobytes()],
        "final": False,
    }, use_bin_type=True)
    segment = decode(frame)
    assert isinstance(segment, Segment)
    np.testing.assert_array_equal(segment.tokens.numpy(), tokens)
    np.testing.assert_array_equal(segment.versions.numpy(), [-1, -1, 4, 4, 5])
    assert segment.loss_mask.numpy().sum() == 3 and segment.reward is None

    plain = msgpack.unpackb(encode(segment), raw=False)
    assert plain["tokens"] == ["int32", [5], tokens.astype("<i4").tobytes()]


def test_fields_are_named_in_the_map() -> None:
    hello = Hello(sender_id="a", incarnation=0, seq=0, sent_at=0.0, capacity=4,
                  engine=EngineInfo(device="cpu", dtype="bfloat16", tensor_parallel=1,
                                    model="tiny"), token=bytes(16))
    plain = msgpack.unpackb(encode(hello), raw=False)
    assert plain["kind"] == "hello"
    assert plain["engine"] == {"device": "cpu", "dtype": "bfloat16", "tensor_parallel": 1,
                               "model": "tiny"}
