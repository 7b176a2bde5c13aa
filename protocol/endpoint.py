"""The service side of one ROUTER socket, written once for every service.

A :class:`ServerEndpoint` owns what every service does the same way: the
one-frame rule, decoding within the size bound, the identity rule
(``sender_id`` is the connection's routing id), refusing with an ``Error``
that names the message's ``seq`` and a counter, replies that never block on
a peer that has gone, and dispatch through a ``{message type: handler}``
table. A service is then its handler tables over its state: where a message
is handled is one lookup in that table.

Usage::

    endpoint = ServerEndpoint(socket, Stamp("replay", incarnation), max_bytes, refused)
    handlers = {Hello: on_hello, Segment: on_segment, Heartbeat: on_heartbeat}
    for received in endpoint.receive(limit=256):
        endpoint.dispatch(handlers, received)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import zmq

from protocol.codec import decode, encode
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Error, Message, Stamp

log = logging.getLogger("compactionrl.protocol.endpoint")

#: An ``Error``'s text is cut to this many characters.
MAX_ERROR_TEXT = 500


@dataclass(frozen=True)
class Received:
    """A decoded message that passed the endpoint's checks."""

    identity: bytes
    """The connection's routing id."""
    message: Message
    frame: memoryview
    """The bytes it came in (arrays in ``message`` are views into them)."""


Handler = Callable[[Received], None]
#: Told of every refusal: its code, and the message if it decoded.
Refused = Callable[[ErrorCode, Message | None], None]


class ServerEndpoint:
    def __init__(self, socket: zmq.Socket, stamp: Stamp, max_message_bytes: int,
                 refused: Refused, undelivered: Callable[[], None] | None = None,
                 check_identity: bool = True) -> None:
        """``refused`` counts each refusal; ``undelivered`` each reply that
        could not be sent (the peer gone, or its queue full)."""
        self.socket = socket
        self.stamp = stamp
        self.max_message_bytes = max_message_bytes
        self.refused = refused
        self.undelivered = undelivered
        self.check_identity = check_identity

    def receive(self, limit: int | None = None) -> Iterator[Received]:
        """The messages waiting on the socket (at most ``limit``), without
        blocking; whatever breaks a rule is refused here and not yielded."""
        taken = 0
        while limit is None or taken < limit:
            try:
                first, *parts = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            taken += 1
            identity = first.bytes
            if len(parts) != 1:  # the client sent a multi-part message
                self.reject(identity, ErrorCode.MALFORMED, "a message is exactly one frame")
                continue
            frame = parts[0].buffer  # zero-copy: a stored segment keeps the frame alive
            try:
                message = decode(frame, self.max_message_bytes)
            except ProtocolError as exc:
                self.reject(identity, exc.code, str(exc), ref_seq=exc.ref_seq)
                continue
            if self.check_identity and message.sender_id.encode() != identity:
                self.refuse(Received(identity, message, frame), ErrorCode.IDENTITY,
                            "sender_id differs from the connection's identity")
                continue
            yield Received(identity, message, frame)

    def dispatch(self, handlers: Mapping[type[Message], Handler], received: Received) -> None:
        """Hand ``received`` to the handler of its type; a type the table
        lacks is refused as ``unexpected``."""
        handler = handlers.get(type(received.message))
        if handler is None:
            self.refuse(received, ErrorCode.UNEXPECTED,
                        f"{type(received.message).__name__} is not for this socket")
        else:
            handler(received)

    def refuse(self, received: Received, code: ErrorCode, text: str) -> None:
        """Refuse a decoded message: an ``Error`` naming its seq, counted."""
        self.reject(received.identity, code, text, ref_seq=received.message.seq,
                    message=received.message)

    def reject(self, identity: bytes, code: ErrorCode, text: str, ref_seq: int | None = None,
               message: Message | None = None) -> None:
        self.refused(code, message)
        self.send(identity, Error(**self.stamp.next(), code=code, text=text[:MAX_ERROR_TEXT],
                                  ref_seq=ref_seq))

    def send(self, identity: bytes, message: Message) -> None:
        self.send_frame(identity, encode(message))

    def send_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            self.socket.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue full
            if self.undelivered is not None:
                self.undelivered()
            log.debug("cannot reply to %r: %s", identity, exc)
