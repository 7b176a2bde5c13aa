"""MessagePack encoding and validating decoding of :mod:`protocol.messages`.

Every frame is one standard MessagePack map (readable by any MessagePack
library); arrays inside are ``[dtype, shape, bin]`` triples. :func:`decode`
raises :class:`~protocol.errors.ProtocolError` and nothing else, whatever the
input bytes are.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message

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
    msgspec.inspect.type_info(t).tag: msgspec.msgpack.Decoder(t) for t in MESSAGE_TYPES
}


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
        raise ProtocolError(ErrorCode.MALFORMED, f"header: {exc}") from None
    ref_seq = envelope.seq if type(envelope.seq) is int else None
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
        raise ProtocolError(ErrorCode.MALFORMED, f"{envelope.kind}: {exc}", ref_seq) from None
    try:
        message.validate()
    except ProtocolError as exc:
        exc.ref_seq = message.seq
        raise
    return message
