"""Values at and just beyond every range edge of every field of every
message kind, read from the ranges declared on the fields' types
(protocol/messages.py, the tables of docs/protocol.md): each edge value is
accepted, each value beyond it refused ``invalid``.

A *probe* is one message: a valid message of its kind (:func:`valid_message`)
with one field set to one edge value, encoded with the plain MessagePack
package from builtins, so that no struct of the project stands between the
value and the wire.

Usage::

    for probe in probes(stamp):
        socket.send(probe.frame)   # probe.accepted: whether the range admits it
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
import numpy as np
from msgspec import inspect as schema

from protocol import (
    MESSAGE_TYPES,
    Abandon,
    Ack,
    Array,
    Batch,
    BatchRequest,
    Error,
    GroupInfo,
    GroupTag,
    Heartbeat,
    LearnerWelcome,
    MemberWelcome,
    Message,
    Rollout,
    RolloutStats,
    StalenessStats,
    Stamp,
    TensorSpec,
    WeightManifest,
    WeightsAnnounce,
    WeightsLoaded,
    Welcome,
)
from protocol.messages import MAX_CAPACITY, new_token
from protocol.synthetic import synthetic_hello, synthetic_segment

#: The header's fields: probed on their own (every kind shares them).
HEADER = tuple(field.name for field in schema.type_info(Message).fields)
_FLOAT_MAX = sys.float_info.max
_unique = itertools.count()


@dataclass(frozen=True)
class Probe:
    kind: str
    """The message's kind (its tag)."""
    path: tuple[str | int, ...]
    """Keys from the message map to the field probed (an int: a list's item)."""
    value: Any
    accepted: bool
    """Whether the field's declared range admits ``value``."""
    frame: bytes
    seq: int


def valid_message(kind: type[Message], stamp: Stamp) -> Message:
    """A valid message of ``kind`` with every optional part present and every
    list holding one item, so that every field has a place to be probed."""
    header = stamp.next()
    segment = synthetic_segment(stamp, f"probe-{next(_unique)}", 1, final=True, tokens=4)
    # generated_tokens at its top: summary_tokens (at most it) reaches its own
    stats = RolloutStats(outcome="done", success=True, steps=1, compactions=0,
                         generated_tokens=2**63 - 1, summary_tokens=0, duration_s=1.0,
                         tags={"family": "probe"})
    segment = msgspec.structs.replace(
        segment, **header, segment_type="execution", stats=stats,
        token_rewards=Array.from_numpy(np.zeros(4, np.float32)),
        group=GroupTag(id="probe-group", size=1))
    facts = {"run_id": "probe", "policy_version": 0}
    return {
        # its capacity at the top, so that any group size fits in it
        "hello": lambda: msgspec.structs.replace(synthetic_hello(stamp, token=new_token()),
                                                 **header, metrics_address="127.0.0.1:9",
                                                 capacity=MAX_CAPACITY),
        "welcome": lambda: Welcome(
            **header, **facts, heartbeat_interval_s=1.0, heartbeat_liveness=3,
            max_staleness=1, rollouts_per_batch=2, credits=0, credit_ledger=1,
            credits_total=0, max_message_bytes=1 << 20, vocab_size=100, stale_grace=0),
        "member_welcome": lambda: MemberWelcome(**header, **facts, heartbeat_interval_s=1.0,
                                                heartbeat_liveness=3),
        "segment": lambda: segment,
        "abandon": lambda: Abandon(**header, rollout_id=f"probe-{next(_unique)}",
                                   group=GroupTag(id="probe-group", size=1)),
        "goodbye": lambda: kind(**header),
        "ack": lambda: Ack(**header, stored_seqs=[0], credits=0, policy_version=0,
                           credit_ledger=1, credits_total=0),
        "heartbeat": lambda: Heartbeat(**header, active_rollouts=0,
                                       stall_seconds={"credits": 1.0}, credit_ledger=0,
                                       credits_seen=0),
        "learner_hello": lambda: kind(**header),
        "learner_welcome": lambda: LearnerWelcome(**header, **facts, rollouts_per_batch=2,
                                                  max_staleness=1),
        "batch_request": lambda: BatchRequest(**header, size=0, policy_version=0),
        "batch": lambda: Batch(
            **header, policy_version=0,
            rollouts=[Rollout(rollout_id=segment.rollout_id, staleness=0, segments=[
                msgspec.structs.replace(segment, index=0)])],
            staleness=StalenessStats(min=0, max=0, mean=0.0, p50=0.0, p95=0.0)),
        "weights_announce": lambda: WeightsAnnounce(
            **header, version=1,
            manifest=WeightManifest(tensors=[TensorSpec("w", "float32", (2,))], bucket_bytes=0),
            group=GroupInfo(generation=1, master_addr="127.0.0.1", master_port=1, world_size=2,
                            rank=1, backend="gloo")),
        "weights_loaded": lambda: WeightsLoaded(**header, version=1, seconds=1.0),
        "error": lambda: Error(**header, code="invalid", text="probe", ref_seq=0),
    }[schema.type_info(kind).tag]()


def _text(length: int, path: tuple[str | int, ...]) -> str:
    """A string of ``length`` characters of the field's form: unique (ids
    must not collide with an earlier probe's), ``host:port`` for addresses."""
    if path[-1] == "metrics_address":
        return "" if length == 0 else "h" * (length - 5) + ":9100"
    stem = f"{next(_unique)}-"
    return (stem + "x" * length)[-length:] if length else ""


def edges(info: schema.Type, path: tuple[str | int, ...]) -> list[tuple[Any, bool]]:
    """``(value, accepted)`` at and beyond each edge of ``info``'s range."""
    if isinstance(info, schema.UnionType):  # T or nil: T's edges
        return [edge for member in info.types for edge in edges(member, path)]
    if isinstance(info, schema.IntType):
        if info.ge is None and info.gt is None:  # protocol_version: one value, its own code
            return []
        low = info.ge if info.ge is not None else info.gt + 1
        high = info.le if info.le is not None else info.lt - 1
        return [(low, True), (high, True), (low - 1, False), (high + 1, False)]
    if isinstance(info, schema.FloatType):
        found = [(float("nan"), False)]
        if info.le == _FLOAT_MAX:
            found += [(_FLOAT_MAX, True), (float("inf"), False)]
        if info.ge == -_FLOAT_MAX:
            found += [(-_FLOAT_MAX, True), (float("-inf"), False)]
        if info.ge == 0:
            found += [(0.0, True), (-5e-324, False)]
        if info.gt == 0:
            found += [(5e-324, True), (0.0, False)]
        return found
    if isinstance(info, schema.StrType):
        low, high = info.min_length or 0, info.max_length
        found = [(_text(low, path), True), (_text(high, path), True),
                 (_text(high + 1, path), False)]
        return found + ([(_text(low - 1, path), False)] if low else [])
    if isinstance(info, schema.BytesType):
        return [(bytes(info.min_length), True), (bytes(info.max_length), True),
                (bytes(info.min_length - 1), False), (bytes(info.max_length + 1), False)]
    if isinstance(info, schema.LiteralType):
        return [(value, True) for value in sorted(info.values)] + [("other", False)]
    if isinstance(info, (schema.ListType, schema.VarTupleType)):
        return [([value], accepted) for value, accepted in edges(info.item_type, path)]
    if isinstance(info, schema.DictType):
        key, value = _any_valid(info.key_type, path), _any_valid(info.value_type, path)
        found = [({k: value}, accepted) for k, accepted in edges(info.key_type, path)
                 if isinstance(k, str)]
        found += [({key: v}, accepted) for v, accepted in edges(info.value_type, path)]
        if info.max_length is not None:
            found += [({f"{key}{i}": value for i in range(info.max_length)}, True),
                      ({f"{key}{i}": value for i in range(info.max_length + 1)}, False)]
        return found
    return []


def _any_valid(info: schema.Type, path: tuple[str | int, ...]) -> Any:
    return next(value for value, accepted in edges(info, path) if accepted)


def ranged_fields(info: schema.StructType, path: tuple[str | int, ...] = ()
                  ) -> Iterator[tuple[tuple[str | int, ...], schema.Type]]:
    """Every field below ``info`` with a range to probe, by its path. A
    segment inside a batch is probed as a segment of its own."""
    for position, field in enumerate(info.fields):
        key: str | int = position if info.array_like else field.encode_name
        yield from _ranged((*path, key), field.type)


def _ranged(path: tuple[str | int, ...], info: schema.Type
            ) -> Iterator[tuple[tuple[str | int, ...], schema.Type]]:
    members = info.types if isinstance(info, schema.UnionType) else (info,)
    for member in members:
        if isinstance(member, schema.StructType):
            if member.cls is not Array and not issubclass(member.cls, Message):
                yield from ranged_fields(member, path)
            return
        if isinstance(member, schema.ListType) and isinstance(member.item_type,
                                                              schema.StructType):
            yield from _ranged((*path, 0), member.item_type)
            return
    if edges(info, path):
        yield path, info


def probe(kind: type[Message], stamp: Stamp, path: tuple[str | int, ...], value: Any,
          accepted: bool) -> Probe:
    """``kind``'s valid message with the field at ``path`` set to ``value``."""
    message = valid_message(kind, stamp)
    body = msgspec.to_builtins(message, builtin_types=(bytes, memoryview))
    place = body
    for key in path[:-1]:
        place = place[key]
    place[path[-1]] = value
    if path[-1] == "rollout_id" and "segments" in place:  # a rollout's segments carry its id
        for segment in place["segments"]:
            segment["rollout_id"] = value
    return Probe(schema.type_info(kind).tag, path, value, accepted,
                 msgpack.packb(body, use_bin_type=True), message.seq)


def field_probes(stamp: Stamp, kinds: tuple[type[Message], ...] = MESSAGE_TYPES
                 ) -> Iterator[Probe]:
    """A probe per edge of every field of ``kinds`` beyond the header."""
    for kind in kinds:
        for path, info in ranged_fields(schema.type_info(kind)):
            if path[0] in HEADER:
                continue
            for value, accepted in edges(info, path):
                yield probe(kind, stamp, path, value, accepted)
