"""Both ends of a link, written once: the service side of a ROUTER socket
(:class:`ServerEndpoint`) and the client side of a DEALER (:class:`ClientEndpoint`).

A :class:`ServerEndpoint` owns what every service does the same way: the
one-frame rule, decoding within the size bound, the client-key rule (with
CURVE, a ``sender_id`` belongs to the key it first spoke with), refusing
with an ``Error`` that names the message's ``seq`` and a counter, replies
that never block on a peer that has gone, and dispatch through a
``{message type: handler}`` table. Which connection speaks for which actor
incarnation is the services' registry's rule (``protocol/registry.py``, which
the replay and the learner's control socket share): it reads ``Hello``s,
which an endpoint does not. A service is then its handler tables over its
state: where a message is handled is one lookup in that table.

A client (the actor's replay and learner links) is likewise its handler
table over its state; its endpoint owns decoding, dropping what cannot be
taken (counted, never a crash), registration (``Hello`` until welcomed, again
whenever the peer forgets it) and disconnect counting.

Usage::

    endpoint = ServerEndpoint(socket, Stamp("replay", incarnation), max_bytes, refused)
    handlers = {Hello: on_hello, Segment: on_segment, Heartbeat: on_heartbeat}
    for received in endpoint.receive(limit=256):
        endpoint.dispatch(handlers, received)

    link = ClientEndpoint(dealer, max_bytes)
    await asyncio.gather(link.serve({Welcome: on_welcome, Ack: on_ack}, dropped),
                         link.register(make_hello, retry_s=1.0))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from protocol.codec import decode, encode
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import MAX_ERROR_TEXT, Error, Message, Stamp

log = logging.getLogger("compactionrl.protocol.endpoint")


@dataclass(frozen=True)
class Received:
    """A decoded message that passed the endpoint's checks."""

    identity: bytes
    """The connection's routing id, drawn by the ROUTER (clients set none)."""
    message: Message
    frame: memoryview
    """The bytes it came in (arrays in ``message`` are views into them)."""


Handler = Callable[[Received], None]
#: Told of every refusal: its code, and the message if it decoded.
Refused = Callable[[ErrorCode, Message | None], None]


#: Messages one :meth:`ServerEndpoint.receive` pass takes by default.
MESSAGES_PER_PASS = 64


class ServerEndpoint:
    def __init__(self, socket: zmq.Socket, stamp: Stamp, max_message_bytes: int,
                 refused: Refused, undelivered: Callable[[], None] | None = None,
                 bind_keys: bool = False) -> None:
        """``refused`` counts each refusal; ``undelivered`` each reply that
        could not be sent (the peer gone, or its queue full). ``bind_keys``
        (the socket is a CURVE server): a ``sender_id`` belongs to the client
        key it first spoke with, for the process's life; another key's
        message for it is refused (``identity``), so no authorized client
        speaks for another's actors."""
        self.socket = socket
        self.stamp = stamp
        self.max_message_bytes = max_message_bytes
        self.refused = refused
        self.undelivered = undelivered
        self.bind_keys = bind_keys
        self._keys: dict[str, str] = {}
        """Per sender_id, the client key it first spoke with (``bind_keys``)."""

    def receive(self, limit: int = MESSAGES_PER_PASS) -> Iterator[Received]:
        """The messages waiting on the socket (at most ``limit``), without
        blocking; whatever breaks a rule is refused here and not yielded.
        Never all of them: a peer sending faster than they are handled would
        keep the caller's loop from everything else it serves (a stop, other
        sockets, timers); what is left waits for the next pass."""
        taken = 0
        while taken < limit:
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
            # the ZAP handler names an authenticated client by its public key
            if self.bind_keys and (key := parts[0].get("User-Id")) != self._keys.setdefault(
                    message.sender_id, key):
                self.refuse(Received(identity, message, frame), ErrorCode.IDENTITY,
                            "sender_id belongs to another client key")
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
            # no copy of a large frame (a batch): bytes cannot change under ZeroMQ
            self.socket.send_multipart([identity, frame], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue full
            if self.undelivered is not None:
                self.undelivered()
            log.debug("cannot reply to %r: %s", identity, exc)


#: Told of every frame a client could not take: why, as the decoder says it.
Dropped = Callable[[ProtocolError], None]


def read_reply(frame: bytes | memoryview, max_message_bytes: int,
               handlers: Mapping[type[Message], Callable[[Any], None]],
               dropped: Dropped) -> Message | None:
    """The client rule for one frame, for every client of the project (the
    actors' asyncio links, the learner's replay client): decode it once and
    hand it to the handler of its type; a frame that does not decode, or of
    a type the table lacks, is told to ``dropped`` (a client never answers a
    reply). Returns the message handled (None: dropped), so that a client
    that waits for a reply takes it from here, not from a handler's state."""
    try:
        message = decode(frame, max_message_bytes)
    except ProtocolError as exc:
        dropped(exc)
        return None
    handler = handlers.get(type(message))
    if handler is None:
        dropped(ProtocolError(ErrorCode.UNEXPECTED, f"{type(message).__name__} is not for "
                              "this link", ref_seq=message.seq))
        return None
    handler(message)
    return message


class ClientEndpoint:
    """The client side of one DEALER link (asyncio).

    A frame that does not decode, or whose type the handler table lacks, is
    dropped and told to ``dropped``: a client never answers a reply, so
    nothing goes back. Registration is an invariant, not a step: after
    :meth:`welcomed` the link stays registered until :meth:`forgotten` (the
    peer restarted or declared this client dead), when ``Hello`` starts again.
    """

    def __init__(self, socket: zmq.asyncio.Socket, max_message_bytes: int) -> None:
        self.socket = socket
        self.max_message_bytes = max_message_bytes
        self.registered = asyncio.Event()
        self._forgotten = asyncio.Event()

    async def send(self, message: Message) -> None:
        await self.socket.send(encode(message), copy=False)

    async def send_frame(self, frame: bytes) -> None:
        await self.socket.send(frame, copy=False)

    async def serve(self, handlers: Mapping[type[Message], Callable[[Any], None]],
                    dropped: Dropped) -> None:
        """Hand each reply to the handler of its type, forever."""
        while True:
            frame = await self.socket.recv(copy=False)
            read_reply(frame.buffer, self.max_message_bytes, handlers, dropped)

    async def register(self, hello: Callable[[], Message], retry_s: float) -> None:
        """Say ``hello()`` every ``retry_s`` until :meth:`welcomed`; again
        after each :meth:`forgotten`. Runs forever."""
        while True:
            if self.registered.is_set():
                await self._forgotten.wait()
                self._forgotten.clear()
                self.registered.clear()
                continue
            await self.send(hello())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.registered.wait(), retry_s)

    def welcomed(self) -> None:
        self.registered.set()

    def forgotten(self) -> None:
        """The peer no longer knows this client on this connection: register
        again. Told while a ``Hello`` is under way, it says ``Hello`` once more
        after the ``Welcome``: that one may predate what changed (a weight
        load that failed since)."""
        self._forgotten.set()

    async def count_disconnects(self, disconnected: Callable[[], None]) -> None:
        """Tell ``disconnected`` each time the connection drops: ZeroMQ
        reconnects by itself and what was lost is resent, so without this a
        flaky network would show only as resends. Runs forever."""
        monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await monitor.recv_multipart()
                disconnected()
        finally:
            self.socket.disable_monitor()
            monitor.close(linger=0)
