"""MessagePack encoding and validating decoding of :mod:`protocol.messages`.

Every frame is one standard MessagePack map (readable by any MessagePack
library); arrays inside are ``[dtype, shape, bin]`` triples. :func:`decode`
raises :class:`~protocol.errors.ProtocolError` and nothing else, whatever the
input bytes are.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from msgspec import inspect as schema

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import MAX_COUNTER, MESSAGE_TYPES, PROTOCOL_VERSION, Message

#: Why a frame nested deeper than the decoder's recursion allows is refused.
#: msgspec decodes (and skips an unknown key's value) recursively, and past
#: the interpreter's recursion limit (about 900 levels here) raises
#: ``RecursionError``: that is a malformed frame, not a dead process. No
#: message of the protocol nests deeper than 4 levels.
TOO_DEEP = "nested deeper than the decoder's recursion limit"



def nests_deeper(value: object, limit: int) -> bool:
    """Whether lists and dicts in a decoded ``value`` nest more than ``limit``
    levels deep (read without recursion). For bodies with free-form parts
    (JSON requests), which later code renders and encodes recursively."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item \
            if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


#: Default cap on one frame. A 128k-token segment is ~1.7 MB; batches of many
#: long rollouts are the large case. Sockets get the same cap (MAXMSGSIZE).
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class _Envelope(msgspec.Struct):
    """The header fields read before the body is typed. ``seq`` of any type
    here: the body's decoding says what is wrong with it."""

    protocol_version: int
    kind: str
    seq: Any = None


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_decoders: dict[str, msgspec.msgpack.Decoder] = {
    schema.type_info(t).tag: msgspec.msgpack.Decoder(t) for t in MESSAGE_TYPES
}
_types: dict[str, schema.Type] = {schema.type_info(t).tag: schema.type_info(t)
                                  for t in MESSAGE_TYPES}


#: The header keys a refusal needs: their values are scalars.
_HEADER_KEYS = frozenset({"protocol_version", "kind", "seq"})
#: Objects :func:`header_seq` reads before it gives up: msgspec writes a
#: header after its kind's own fields, within the first hundred objects of
#: any message of the protocol; the reading stays cheap (well under a
#: millisecond) whatever a hostile peer sends.
HEADER_SCAN_OBJECTS = 256
_FIXED_WIDTH = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4,
                0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5,
                0xD7: 9, 0xD8: 17}
#: Type byte -> width of the length that follows, for bin, ext and str.
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
#: Type byte -> width of the count that follows, for arrays and maps.
_COUNTED = {0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}


class _Reader:
    """Reads MessagePack objects one at a time from a frame, without
    recursion and within a budget of objects; ``ValueError`` when the frame
    is cut short, not MessagePack, or the budget is spent."""

    def __init__(self, frame: memoryview) -> None:
        self.frame, self.at, self.budget = frame, 0, HEADER_SCAN_OBJECTS

    def _take(self, size: int) -> bytes:
        if self.at + size > len(self.frame):
            raise ValueError("cut short")
        taken = bytes(self.frame[self.at:self.at + size])
        self.at += size
        return taken

    def head(self) -> tuple[str, int | bytes]:
        """The next object's kind and what its head says: ("map", its pairs),
        ("array", its items), ("int", its value), ("str", its UTF-8 bytes)
        or ("other", its bytes)."""
        self.budget -= 1
        if self.budget < 0:
            raise ValueError("too many objects before the header")
        first = self._take(1)[0]
        if first <= 0x7F or first >= 0xE0:  # positive and negative fixint
            return "int", first if first <= 0x7F else first - 0x100
        if first <= 0x8F:
            return "map", first & 0x0F
        if first <= 0x9F:
            return "array", first & 0x0F
        if first <= 0xBF:
            return "str", self._take(first & 0x1F)
        if first in _COUNTED:
            count = int.from_bytes(self._take(_COUNTED[first]))
            return ("map" if first >= 0xDE else "array"), count
        if first in _SIZED:
            size = int.from_bytes(self._take(_SIZED[first]))
            taken = self._take(size + (1 if 0xC7 <= first <= 0xC9 else 0))
            return ("str" if first >= 0xD9 else "other"), taken
        if first in _FIXED_WIDTH:
            raw = self._take(_FIXED_WIDTH[first])
            if 0xCC <= first <= 0xD3:  # uint8-64, int8-64
                return "int", int.from_bytes(raw, signed=first >= 0xD0)
            return "other", raw
        raise ValueError("not MessagePack")

    def skip(self, items: int) -> None:
        """Read past ``items`` objects, and everything they hold."""
        while items:
            items += _held(*self.head()) - 1


def _held(kind: str, value: int | bytes) -> int:
    """How many objects follow a head as its contents."""
    if kind == "map":
        return 2 * value
    return value if kind == "array" else 0


def duplicate_key(frame: bytes | bytearray | memoryview) -> str | None:
    """The first key that a MessagePack map of ``frame`` holds twice (as
    text), or None: every object read in Python, so only to name the key of
    a frame :func:`holds_a_key_twice` refused. Reads a frame that has
    decoded already: every length in it is sound."""
    data = memoryview(frame).cast("B")
    at = 0
    # One entry per open container: [objects left in it, keys seen (a map) or None].
    open_containers: list[list[Any]] = [[1, None]]
    while open_containers:
        top = open_containers[-1]
        if top[0] == 0:
            open_containers.pop()
            continue
        is_key = top[1] is not None and top[0] % 2 == 0
        top[0] -= 1
        start, first = at, data[at]
        at += 1
        pairs_or_items = -1
        if first <= 0x7F or first >= 0xE0 or first in (0xC0, 0xC2, 0xC3):
            pass
        elif first <= 0x8F:
            pairs_or_items = 2 * (first & 0x0F)
        elif first <= 0x9F:
            pairs_or_items = first & 0x0F
        elif first <= 0xBF:
            at += first & 0x1F
        elif first in _COUNTED:
            width = _COUNTED[first]
            count = int.from_bytes(data[at:at + width])
            at += width
            pairs_or_items = 2 * count if first >= 0xDE else count
        elif first in _SIZED:
            width = _SIZED[first]
            at += width + int.from_bytes(data[at:at + width]) + (1 if 0xC7 <= first <= 0xC9
                                                                  else 0)
        else:
            at += _FIXED_WIDTH[first]
        if is_key:
            key = bytes(data[start:at])
            if key in top[1]:
                return key[1:].decode(errors="replace") if first <= 0xBF else repr(key)
            top[1].add(key)
        if pairs_or_items >= 0:
            is_map = first <= 0x8F or first >= 0xDE
            open_containers.append([pairs_or_items, set() if is_map else None])
    return None


_raw_map = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw])


def _pairs(raw: memoryview) -> int:
    """The pair count in a MessagePack map's head."""
    first = raw[0]
    if first <= 0x8F:
        return first & 0x0F
    return int.from_bytes(raw[1:3] if first == 0xDE else raw[1:5])


def holds_a_key_twice(raw: bytes | bytearray | memoryview | msgspec.Raw,
                      info: schema.Type) -> bool:
    """Whether a map in ``raw``, a value of type ``info`` that decoded, holds
    a key twice: msgspec keeps the last value of a repeated key without a
    word, so two peers could read one frame differently. Each map the type
    has is read once more as keys and undecoded values (at msgspec's speed,
    the arrays' bytes never copied) and its size compared with its head's."""
    kind, inner = _map_plan(info)
    if kind == "none":
        return False
    view = memoryview(raw)
    if view[0] == 0xC0:  # nil, where the type allows it
        return False
    if kind == "list":
        return any(holds_a_key_twice(item, inner) for item in _raw_list.decode(view))
    mapping = _raw_map.decode(view)
    if len(mapping) < _pairs(view):
        return True
    if kind == "dict":
        return inner is not None and any(holds_a_key_twice(value, inner)
                                         for value in mapping.values())
    return any(holds_a_key_twice(mapping[name], field) for name, field in inner
               if name in mapping)


def _map_plan(info: schema.Type) -> tuple[str, Any]:
    """How :func:`holds_a_key_twice` reads a value of ``info``: ``("map",
    [(key, type) of the fields that can hold maps])`` for a struct encoded as
    a map, ``("dict", value type or None)``, ``("list", item type)`` for a
    list of values that can hold maps, or ``("none", None)``; remembered per
    type object (the decoders' types live as long as the process)."""
    plan = _MAP_PLANS.get(id(info))
    if plan is None:
        members = [m for m in info.types if not isinstance(m, schema.NoneType)] \
            if isinstance(info, schema.UnionType) else [info]
        plan = ("none", None)
        for member in members:  # the protocol's unions hold one type besides nil
            if isinstance(member, schema.StructType) and not member.array_like:
                plan = ("map", [(f.encode_name, f.type) for f in member.fields
                                if _map_plan(f.type)[0] != "none"])
            elif isinstance(member, schema.DictType):
                value = member.value_type
                plan = ("dict", value if _map_plan(value)[0] != "none" else None)
            elif isinstance(member, schema.ListType) and _map_plan(member.item_type)[0] != "none":
                plan = ("list", member.item_type)
        _MAP_PLANS[id(info)] = plan
    return plan


_MAP_PLANS: dict[int, tuple[str, Any]] = {}


#: How msgspec words a value of the right type outside its declared range or
#: set (``Expected `int` >= 0``, ``Expected `str` of length <= 256``, ``Expected
#: `str` matching regex``, ``Invalid enum value``): ``invalid``. Every other
#: decoding error is ``malformed``.
_OUT_OF_RANGE = re.compile(r"Expected `\w+` (>=|<=|>|<|of length|matching)|Invalid enum value")


def _is_seq(value: object) -> bool:
    """Whether ``value`` can be a ``seq`` (an ``error``'s ``ref_seq`` must be)."""
    return type(value) is int and 0 <= value <= MAX_COUNTER


def header_seq(frame: bytes | bytearray | memoryview) -> int | None:
    """The ``seq`` of a frame whose header reads: a MessagePack map in which
    ``protocol_version``, ``kind`` and an integer ``seq`` can be read before
    the frame stops being readable (cut short, a length past its end), in
    whatever order its keys come. None otherwise."""
    reader = _Reader(memoryview(frame).cast("B"))
    try:
        kind, pairs = reader.head()
        if kind != "map":
            return None
        found: dict[str, int | None] = {}
        for _ in range(pairs):
            key_kind, key = reader.head()
            reader.skip(_held(key_kind, key))
            name = key.decode(errors="replace") if key_kind == "str" else None
            value_kind, value = reader.head()
            reader.skip(_held(value_kind, value))
            if name in _HEADER_KEYS:
                found[name] = value if value_kind == "int" else None
                if _HEADER_KEYS <= found.keys():
                    return found["seq"] if _is_seq(found["seq"]) else None
    except ValueError:
        pass
    return None


def encode(message: Message) -> bytes:
    """Encode a message as one MessagePack map."""
    return _encoder.encode(message)


def decode(frame: bytes | bytearray | memoryview,
           max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode and validate one frame. Arrays in the result are views into
    ``frame``, which must stay unmodified while they are used. Once the
    header has decoded, a :class:`ProtocolError` carries its ``seq``
    (``ref_seq``): the sender can tell which message was refused."""
    size = memoryview(frame).nbytes
    if size > max_message_bytes:
        raise ProtocolError(ErrorCode.OVERSIZED, f"{size} bytes > limit {max_message_bytes}")
    try:
        envelope = _envelope_decoder.decode(frame)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"frame: {exc}", header_seq(frame)) from None
    except RecursionError:
        raise ProtocolError(ErrorCode.MALFORMED, TOO_DEEP, header_seq(frame)) from None
    ref_seq = envelope.seq if _is_seq(envelope.seq) else None
    if envelope.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.PROTOCOL_VERSION,
            f"peer speaks version {envelope.protocol_version}, this build {PROTOCOL_VERSION}",
            ref_seq)
    decoder = _decoders.get(envelope.kind)
    if decoder is None:
        raise ProtocolError(ErrorCode.UNKNOWN_KIND, f"no message kind {envelope.kind[:64]!r}",
                            ref_seq)
    try:
        message = decoder.decode(frame)
    except msgspec.MsgspecError as exc:
        code = ErrorCode.INVALID if _OUT_OF_RANGE.match(str(exc)) else ErrorCode.MALFORMED
        raise ProtocolError(code, f"{envelope.kind}: {exc}", ref_seq) from None
    except RecursionError:
        raise ProtocolError(ErrorCode.MALFORMED, f"{envelope.kind}: {TOO_DEEP}", ref_seq) from None
    try:
        repeated = holds_a_key_twice(frame, _types[envelope.kind])
    except msgspec.MsgspecError as exc:  # a key the typed decoding skipped (unknown) is no text
        raise ProtocolError(ErrorCode.MALFORMED, f"{envelope.kind}: {exc}", message.seq) from None
    if repeated:
        raise ProtocolError(ErrorCode.MALFORMED, f"{envelope.kind}: a map holds the key "
                            f"{(duplicate_key(frame) or '?')[:64]!r} twice", message.seq)
    try:
        message.validate()
    except ProtocolError as exc:
        exc.ref_seq = message.seq
        raise
    return message
