"""Bad frames of every kind, as hostile or broken peers send them: for the
replay's actor socket and for the learner's control socket, each with the
reason the receiver must give (the hostile-input and flood tests share them).
Frames are encoded by hand where the typed encoder would refuse what they hold."""

from __future__ import annotations

import msgspec
import numpy as np

from protocol import (
    PROTOCOL_VERSION,
    BatchRequest,
    EngineInfo,
    Heartbeat,
    Stamp,
    WeightsLoaded,
    encode,
)
from protocol.synthetic import synthetic_segment

VOCAB = 100
TOKENS = 64
#: The learner version the good learner reports: trainable versions above it are out of window.
LEARNER_VERSION = 1
ENGINE = EngineInfo(device="cpu", dtype="float32", tensor_parallel=1, model="m")
#: A final segment's valid episode summary, as on the wire.
STATS = {"outcome": "done", "success": True, "steps": 3, "compactions": 1,
         "generated_tokens": 40, "summary_tokens": 10, "duration_s": 2.5}


def _array(dtype: str, values: np.ndarray) -> list:
    """An array as it is on the wire: [dtype, shape, little-endian bytes]."""
    return [dtype, list(values.shape), values.astype(dtype).tobytes()]


def _segment(stamp: Stamp, **changes: object) -> bytes:
    """A valid segment of ``stamp``'s sender with fields replaced, encoded by hand
    (so that it can hold what the typed encoder would refuse)."""
    plain = msgspec.msgpack.decode(encode(synthetic_segment(stamp, "h", 0, True,
                                                            version=LEARNER_VERSION)))
    return msgspec.msgpack.encode({**plain, **changes})


def _tokenwise(name: str, dtype: str, index: int, value: float) -> dict[str, list]:
    """One per-token array of the synthetic segment with element ``index`` set
    (odd indices are trainable, even ones are prompt)."""
    mask = np.arange(TOKENS) % 2
    base = {"tokens": np.arange(TOKENS) % VOCAB, "loss_mask": mask,
            "logprobs": np.where(mask, -1.0, 0.0),
            "versions": np.where(mask, LEARNER_VERSION, -1)}[name].astype(dtype)
    base[index] = value
    return {name: _array(dtype, base)}


def _claim_gib_bin(frame: bytes) -> bytes:
    """``frame`` with its first 256-byte bin (the token ids) claiming 1 GiB."""
    marker = b"\xc5\x01\x00"  # bin16 of length 256
    at = frame.index(marker)
    return frame[:at] + b"\xc6\x40\x00\x00\x00" + frame[at + len(marker):]


#: Nesting past the decoder's recursion limit (about 900 levels); the smallest
#: such frame is a heartbeat of about 1.3 KB.
BOMB_DEPTH = 1_100


def nested_under_a_key(plain: dict, depth: int = BOMB_DEPTH) -> bytes:
    """``plain`` encoded with one more key, unknown to the schema, whose value
    is ``depth`` arrays nested in one another."""
    body = msgspec.msgpack.encode(plain)
    assert 0x80 <= body[0] <= 0x8E, "a fixmap with room for one more key"
    return bytes([body[0] + 1]) + body[1:] + msgspec.msgpack.encode("x") \
        + b"\x91" * depth + b"\xc0"


def header_first(plain: dict) -> bytes:
    """``plain`` encoded with the header's keys first, as another
    implementation may write them (msgspec writes a kind's own fields first)."""
    header = ("protocol_version", "kind", "seq", "sender_id", "incarnation", "sent_at")
    return msgspec.msgpack.encode({key: plain[key] for key in header}
                                  | {k: v for k, v in plain.items() if k not in header})


def depth_bombs(plain: dict) -> list[tuple[str, list[bytes], str]]:
    """A valid message ``plain`` with a key nested past the decoder's limit,
    and cut short after its header."""
    return [
        (f"a {plain['kind']} with a key nested {BOMB_DEPTH} deep",
         [nested_under_a_key(plain)], "malformed"),
        (f"a {plain['kind']} with a key nested 100,000 deep",
         [nested_under_a_key(plain, 100_000)], "malformed"),
        (f"a {plain['kind']} cut short after its header",
         [header_first(plain)[:-3]], "malformed"),
    ]


def replay_catalogue(stamp: Stamp) -> list[tuple[str, list[bytes], str]]:
    """(what, frames of one message, the reason the replay must give)."""
    segment = _segment(stamp)
    heartbeat = msgspec.msgpack.decode(encode(Heartbeat(
        **stamp.next(), active_rollouts=0, stall_seconds={}, credit_ledger=0, credits_seen=0)))
    return depth_bombs(heartbeat) + [
        ("not MessagePack", [b"\xff\x00 not msgpack"], "malformed"),
        ("a truncated segment", [segment[: len(segment) // 2]], "malformed"),
        ("a message in two frames", [segment, segment], "malformed"),
        ("a bin claiming 1 GiB", [_claim_gib_bin(segment)], "malformed"),
        ("a map claiming 4 billion fields", [b"\xdf\xff\xff\xff\xff\xa4kind"], "malformed"),
        ("an array shape claiming 2^40 tokens",
         [_segment(stamp, tokens=["int32", [2**40], b"\0" * 4 * TOKENS])], "array"),
        ("a newer protocol version", [_segment(stamp, protocol_version=PROTOCOL_VERSION + 1)],
         "protocol_version"),
        ("protocol version 0", [_segment(stamp, protocol_version=0)], "protocol_version"),
        ("an unknown kind", [_segment(stamp, kind="exploit")], "unknown_kind"),
        ("a dtype outside the allowed set",
         [_segment(stamp, tokens=["float16", [TOKENS], b"\0" * 2 * TOKENS])], "array"),
        ("token ids as float32", [_segment(stamp, **_tokenwise("tokens", "float32", 0, 1.0))],
         "array"),
        ("per-token arrays of different lengths",
         [_segment(stamp, logprobs=_array("float32", np.zeros(3)))], "length_mismatch"),
        ("a NaN log-probability on a trainable token",
         [_segment(stamp, **_tokenwise("logprobs", "float32", 1, float("nan")))], "invalid"),
        ("a NaN log-probability on a prompt token",
         [_segment(stamp, **_tokenwise("logprobs", "float32", 0, float("nan")))], "invalid"),
        ("an infinite log-probability",
         [_segment(stamp, **_tokenwise("logprobs", "float32", 1, float("-inf")))], "invalid"),
        ("a positive log-probability",
         [_segment(stamp, **_tokenwise("logprobs", "float32", 1, 0.5))], "invalid"),
        ("a NaN reward", [_segment(stamp, reward=float("nan"))], "invalid"),
        ("a token id equal to the vocabulary size",
         [_segment(stamp, **_tokenwise("tokens", "int32", 5, VOCAB))], "invalid"),
        ("a negative token id", [_segment(stamp, **_tokenwise("tokens", "int32", 5, -1))],
         "invalid"),
        ("a loss mask of 2", [_segment(stamp, **_tokenwise("loss_mask", "uint8", 3, 2))],
         "invalid"),
        ("a trainable version newer than the learner",
         [_segment(stamp, **_tokenwise("versions", "int32", 1, LEARNER_VERSION + 5))],
         "invalid"),
        ("a negative version on a trainable token",
         [_segment(stamp, **_tokenwise("versions", "int32", 1, -1))], "invalid"),
        ("a negative segment index", [_segment(stamp, index=-1)], "invalid"),
        ("a segment index of 2^40", [_segment(stamp, index=2**40)], "invalid"),
        ("a uint64 segment index", [_segment(stamp, index=2**64 - 1)], "invalid"),
        ("a segment of no tokens", [_segment(stamp, **{
            name: _array(dtype, np.zeros(0)) for name, dtype in (
                ("tokens", "int32"), ("loss_mask", "uint8"), ("logprobs", "float32"),
                ("versions", "int32"))})], "invalid"),
        ("an empty rollout_id", [_segment(stamp, rollout_id="")], "invalid"),
        ("a rollout that begins with a summary", [_segment(stamp, segment_type="summary")],
         "invalid"),
        ("stats on a segment that is not final",
         [_segment(stamp, final=False, reward=None, stats=STATS)], "invalid"),
        ("a NaN episode duration", [_segment(stamp, stats={**STATS, "duration_s": float("nan")})],
         "invalid"),
        ("a negative step count", [_segment(stamp, stats={**STATS, "steps": -5})], "invalid"),
        ("a negative incarnation", [_segment(stamp, incarnation=-5)], "invalid"),
        ("a negative seq", [_segment(stamp, seq=-1)], "invalid"),
        ("a NaN sent_at", [_segment(stamp, sent_at=float("nan"))], "invalid"),
        ("someone else's sender_id", [_segment(stamp, sender_id="actor-good")], "identity"),
        ("a learner's request on the actor socket",
         [encode(BatchRequest(**stamp.next(), size=1, policy_version=0))], "unexpected"),
    ]


def control_catalogue(stamp: Stamp) -> list[tuple[str, list[bytes], str]]:
    """Bad frames for the control socket from an actor that registered as ``stamp``."""
    plain = msgspec.msgpack.decode(encode(Heartbeat(**stamp.next(), active_rollouts=0,
                                                    stall_seconds={}, credit_ledger=0,
                                                    credits_seen=0)))
    return depth_bombs(plain) + [
        ("not MessagePack", [b"\xff\x00 not msgpack"], "malformed"),
        ("a message in two frames", [encode(Heartbeat(**stamp.next(), active_rollouts=0,
                                                      stall_seconds={}, credit_ledger=0,
                                                      credits_seen=0))] * 2, "malformed"),
        ("a map claiming 4 billion fields", [b"\xdf\xff\xff\xff\xff\xa4kind"], "malformed"),
        ("a newer protocol version",
         [msgspec.msgpack.encode({**plain, "protocol_version": PROTOCOL_VERSION + 1})],
         "protocol_version"),
        ("an unknown kind", [msgspec.msgpack.encode({**plain, "kind": "exploit"})],
         "unknown_kind"),
        ("someone else's sender_id (this connection speaks for another actor)",
         [msgspec.msgpack.encode({**plain, "sender_id": "a-1"})], "identity"),
        ("a segment with NaN log-probabilities",
         [_segment(stamp, **_tokenwise("logprobs", "float32", 1, float("nan")))], "unexpected"),
        ("a load of a version never announced",
         [encode(WeightsLoaded(**stamp.next(), version=10**9, seconds=1.0))], "invalid"),
        ("a load of a negative version",
         [encode(WeightsLoaded(**stamp.next(), version=-1, seconds=1.0))], "invalid"),
        ("a NaN load time", [encode(WeightsLoaded(**stamp.next(), version=0,
                                                  seconds=float("nan")))], "invalid"),
        ("a heartbeat of another incarnation",
         [encode(Heartbeat(**Stamp(stamp.sender_id, stamp.incarnation + 1).next(),
                           active_rollouts=0, stall_seconds={}, credit_ledger=0,
                           credits_seen=0))], "unregistered"),
    ]
