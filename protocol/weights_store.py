"""The weight groups' rendezvous store: a key-value store on learner rank 0,
reached over ZeroMQ like every other service of the run, so that CURVE
(``transport.curve``) authenticates and encrypts it too.

Why not ``torch.distributed.TCPStore``: it has no authentication, and any
process that reaches its port can ``list_keys()`` and read or overwrite the
addresses and handles a group generation forms from, and so join the group
and receive the weights. Here a client without an authorized key never
completes the CURVE handshake: it cannot read, write or list a key.

:class:`StoreClient` is a ``torch.distributed.Store`` (gloo, NCCL and the ipc
transport take it as they took a ``TCPStore``); :class:`StoreServer` answers
it. Requests and replies are MessagePack arrays (never pickle)::

    request: [request id, op, *arguments]      reply: [request id, ok, result]

``get`` and ``wait`` block on the server until their keys are set or their
deadline passes; other ops answer at once. ``abandon`` ends everything under
a prefix (a group generation that failed): its waits fail at once, and so do
later ones, so that a member still joining or receiving goes on to the next
generation instead of waiting out its deadline. Keys, values and the number of keys
are bounded: a request beyond them is refused with an error, counted.

Usage::

    store = HostedStore("tcp://0.0.0.0:5558", transport, timeout_s=30)  # learner rank 0
    store = StoreClient("tcp://learner:5558", transport, timeout_s=30)   # members
    store.set("k", b"v"); store.get("k")
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch.distributed as dist
import zmq

from protocol.transport import Authenticator, TransportConfig, bind_router, connect_dealer

log = logging.getLogger("compactionrl.weights.store")

#: Longest key, largest value, most keys held: a generation's keys are a few
#: per rank (addresses, NCCL ids, ipc handles of at most 2 buckets in flight).
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 1 << 20
MAX_KEYS = 100_000
POLL_MS = 50
#: The key an abandoned prefix holds: what marks it abandoned, for the
#: server's waits and a member's poll (:meth:`StoreClient.abandoned`).
ABANDONED = "abandoned"
#: A reply may take this long (or the client's timeout, if shorter) beyond
#: the request's own deadline before the client gives up on it.
REPLY_GRACE_S = 5.0

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class StoreRefused(ValueError):
    """A request the server does not take (malformed, or beyond a bound)."""


@dataclass
class _Waiter:
    identity: bytes
    request_id: int
    op: str
    keys: list[str]
    deadline: float


class StoreServer:
    """Learner rank 0's store, served by a thread until :meth:`close`."""

    def __init__(self, bind: str, transport: TransportConfig,
                 refused: Callable[[str], None] = lambda reason: None) -> None:
        """``bind``: ``tcp://HOST:PORT`` (port 0: any free port, see
        :attr:`port`); ``refused(reason)`` counts each refused request."""
        self._refused = refused
        self._data: dict[str, bytes] = {}
        self._waiters: list[_Waiter] = []
        self._context = zmq.Context()
        self._auth = Authenticator(self._context, transport.curve)
        host, _, port = bind.removeprefix("tcp://").rpartition(":")
        self._socket = bind_router(self._context, f"tcp://{host}:{port if int(port) else '*'}",
                                   transport)
        self.port = int(self._socket.last_endpoint.rpartition(b":")[2])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weight-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._auth.stop()
        self._context.term()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(POLL_MS, zmq.POLLIN):
                while True:
                    try:
                        identity, frame = self._socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:  # not two frames
                        self._refused("malformed")
                        continue
                    self._handle(identity, frame)
            self._expire(time.monotonic())

    def _reply(self, identity: bytes, request_id: int, ok: bool, result: object) -> None:
        try:
            self._socket.send_multipart([identity, _encoder.encode([request_id, ok, result])])
        except zmq.ZMQError:  # the client is gone (ROUTER_MANDATORY)
            pass

    def _handle(self, identity: bytes, frame: bytes) -> None:
        request_id = -1
        try:
            request = _decoder.decode(frame)
            if not (isinstance(request, list) and len(request) >= 2
                    and isinstance(request[0], int) and isinstance(request[1], str)):
                raise StoreRefused("a request is [id, op, *arguments]")
            request_id, op, arguments = request[0], request[1], request[2:]
            self._apply(identity, request_id, op, arguments)
        except (msgspec.DecodeError, RecursionError, StoreRefused, TypeError, ValueError) as exc:
            # nested past the decoder's recursion limit: malformed (protocol.codec.TOO_DEEP)
            reason = ("malformed" if isinstance(exc, (msgspec.DecodeError, RecursionError))
                      else "refused")
            self._refused(reason)
            self._reply(identity, request_id, False, f"{reason}: {exc}")

    def _apply(self, identity: bytes, request_id: int, op: str, arguments: list) -> None:
        def key(value: object) -> str:
            if not isinstance(value, str) or len(value.encode()) > MAX_KEY_BYTES:
                raise StoreRefused(f"a key is a string of at most {MAX_KEY_BYTES} bytes")
            return value

        def keys(value: object) -> list[str]:
            if not isinstance(value, list) or len(value) > MAX_KEYS:
                raise StoreRefused("keys are a list of keys")
            return [key(k) for k in value]

        def value(raw: object) -> bytes:
            if not isinstance(raw, bytes) or len(raw) > MAX_VALUE_BYTES:
                raise StoreRefused(f"a value is at most {MAX_VALUE_BYTES} bytes")
            return raw

        def seconds(raw: object) -> float:
            if not isinstance(raw, int | float) or not 0 <= raw <= 24 * 3600:
                raise StoreRefused("a timeout is 0 to 86400 seconds")
            return float(raw)

        if op == "set" and len(arguments) == 2:
            self._set(key(arguments[0]), value(arguments[1]))
            self._reply(identity, request_id, True, None)
        elif op in ("get", "wait") and len(arguments) == 2:
            wanted = [key(arguments[0])] if op == "get" else keys(arguments[0])
            waiter = _Waiter(identity, request_id, op, wanted,
                             time.monotonic() + seconds(arguments[1]))
            if not (self._refuse_abandoned(waiter) or self._answer(waiter)):
                self._waiters.append(waiter)
        elif op == "abandon" and len(arguments) == 1:
            prefix = key(arguments[0])
            if not prefix.endswith("/"):
                raise StoreRefused("an abandoned prefix ends with '/'")
            self._abandon(prefix)
            self._reply(identity, request_id, True, None)
        elif op == "add" and len(arguments) == 2 and isinstance(arguments[1], int):
            name = key(arguments[0])
            total = int(self._data.get(name, b"0")) + arguments[1]
            self._set(name, str(total).encode())
            self._reply(identity, request_id, True, total)
        elif op == "compare_set" and len(arguments) == 3:
            name, expected, desired = key(arguments[0]), value(arguments[1]), value(arguments[2])
            current = self._data.get(name)
            if (current is None and not expected) or current == expected:
                self._set(name, desired)
                current = desired
            self._reply(identity, request_id, True, expected if current is None else current)
        elif op == "check" and len(arguments) == 1:
            self._reply(identity, request_id, True,
                        all(k in self._data for k in keys(arguments[0])))
        elif op == "delete_key" and len(arguments) == 1:
            self._reply(identity, request_id, True,
                        self._data.pop(key(arguments[0]), None) is not None)
        elif op == "num_keys" and not arguments:
            self._reply(identity, request_id, True, len(self._data))
        else:  # list_keys among them: nobody learns what others stored
            raise StoreRefused(f"unknown op {op!r} with {len(arguments)} arguments")

    def _set(self, key: str, value: bytes) -> None:
        if key not in self._data and len(self._data) >= MAX_KEYS:
            raise StoreRefused(f"the store holds {MAX_KEYS} keys already")
        self._data[key] = value
        self._waiters = [w for w in self._waiters if not self._answer(w)]

    def _abandon(self, prefix: str) -> None:
        self._set(prefix + ABANDONED, b"1")
        self._waiters = [w for w in self._waiters if not self._refuse_abandoned(w)]

    def _refuse_abandoned(self, waiter: _Waiter) -> bool:
        """Fail ``waiter`` if one of its keys is under an abandoned prefix;
        returns whether it was."""
        over = next((p for k in waiter.keys if (p := self._abandoned_prefix(k))), None)
        if over is None:
            return False
        self._reply(waiter.identity, waiter.request_id, False, f"abandoned: {over}")
        return True

    def _abandoned_prefix(self, key: str) -> str | None:
        """The abandoned prefix ``key`` is under, if any (each of its own
        ``.../`` prefixes looked up: a few per key, however many were abandoned)."""
        end = key.find("/")
        while end != -1:
            if key[:end + 1] + ABANDONED in self._data:
                return key[:end + 1]
            end = key.find("/", end + 1)
        return None

    def _answer(self, waiter: _Waiter) -> bool:
        """Answer ``waiter`` if its keys are all set; returns whether it was."""
        if not all(k in self._data for k in waiter.keys):
            return False
        result = self._data[waiter.keys[0]] if waiter.op == "get" else None
        self._reply(waiter.identity, waiter.request_id, True, result)
        return True

    def _expire(self, now: float) -> None:
        late = [w for w in self._waiters if w.deadline <= now]
        if late:
            self._waiters = [w for w in self._waiters if w.deadline > now]
        for waiter in late:
            missing = [k for k in waiter.keys if k not in self._data]
            self._reply(waiter.identity, waiter.request_id, False,
                        f"timeout: {missing[:3]} not set in time")


class StoreClient(dist.Store):
    """A ``torch.distributed.Store`` backed by a :class:`StoreServer`. Calls
    are serialised (one request in flight per connection); blocking ones time
    out after ``timeout_s`` (or the timeout they are given) with
    ``DistStoreError``, which is what gloo, NCCL and the ipc transport expect
    of a store.

    Use :meth:`prefixed` rather than ``dist.PrefixStore``: a C++ wrapper
    neither reaches every method of a store written in Python nor keeps the
    Python object alive (its methods then fail once it is collected)."""

    def __init__(self, address: str, transport: TransportConfig, timeout_s: float) -> None:
        super().__init__()
        self.address = address
        self.timeout_s = timeout_s
        self.prefix = ""
        # the process's shared context: a context of its own, collected
        # before its socket, would block the collector (and the GIL) in term()
        self._socket = connect_dealer(zmq.Context.instance(), address, transport)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._root: StoreClient | None = None

    def prefixed(self, prefix: str) -> StoreClient:
        """A view of this store whose keys all start with ``prefix/``, on the
        same connection (kept open while the view lives)."""
        view = StoreClient.__new__(StoreClient)
        dist.Store.__init__(view)
        view.__dict__.update(self.__dict__)
        view.prefix = f"{self.prefix}{prefix}/"
        view._root = self._root or self
        return view

    def close(self) -> None:
        """Close the connection (a view leaves it to its root): every later
        call raises ``DistStoreError``, as a store that does not answer does."""
        if self._root is None:
            with self._lock:
                self._socket.close(linger=0)

    def _call(self, op: str, *arguments: object, wait_s: float = 0.0,
              reply_s: float | None = None) -> object:
        """``op``'s result; ``wait_s``: how long the server may wait (a
        ``wait`` or ``get``), ``reply_s``: how long a reply may take beyond
        it (default: ``REPLY_GRACE_S``, or the client's timeout if shorter)."""
        grace = min(REPLY_GRACE_S, self.timeout_s) if reply_s is None else reply_s
        with self._lock:
            if self._socket.closed:  # a retired group's C++ side may still call
                raise dist.DistStoreError(f"the weight store client of {self.address} is "
                                          "closed (its generation was left)")
            request_id = next(self._ids)
            deadline = time.monotonic() + wait_s + grace
            late = dist.DistStoreError(f"the weight store at {self.address} did not answer "
                                       f"{op} in time")
            # no connection (the server is down, or refused our key) is no
            # peer to queue for: a blocking send would wait forever
            if not self._socket.poll(self._left_ms(deadline), zmq.POLLOUT):
                raise late
            try:
                self._socket.send(_encoder.encode([request_id, op, *arguments]), zmq.NOBLOCK)
            except zmq.Again:  # the connection went between the poll and the send
                raise late from None
            while True:
                if not self._socket.poll(self._left_ms(deadline), zmq.POLLIN):
                    raise late
                reply = _decoder.decode(self._socket.recv())
                if isinstance(reply, list) and len(reply) == 3 and reply[0] == request_id:
                    break  # (a reply to an earlier request that timed out is dropped)
        _, ok, result = reply
        if not ok:
            raise dist.DistStoreError(f"weight store {op}: {result}")
        return result

    @staticmethod
    def _left_ms(deadline: float) -> int:
        return max(0, int((deadline - time.monotonic()) * 1000))

    def _keys(self, keys: list[str]) -> list[str]:
        return [self.prefix + key for key in keys]

    # ------------------------------------------------------------ torch.distributed.Store
    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", self.prefix + key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", self.prefix + key, self.timeout_s, wait_s=self.timeout_s)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self.timeout_s if timeout is None else timeout.total_seconds()
        self._call("wait", self._keys(keys), seconds, wait_s=seconds)

    def add(self, key: str, value: int) -> int:
        return self._call("add", self.prefix + key, int(value))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call("compare_set", self.prefix + key, _bytes(expected), _bytes(desired))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", self._keys(keys))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", self.prefix + key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    # ------------------------------------------------------------ beyond torch's Store
    def abandon(self) -> None:
        """End everything under this view's prefix: waits on its keys fail at once."""
        self._call("abandon", self.prefix)

    def abandoned(self, within_s: float | None = None) -> bool:
        """Whether this view's prefix was abandoned; raises ``DistStoreError``
        when the store does not answer within ``within_s`` (default: the
        reply grace), so that a caller's own deadline holds."""
        return self._call("check", self._keys([ABANDONED]), reply_s=within_s)

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class HostedStore(StoreClient):
    """Learner rank 0's store: the server, and rank 0's own client of it."""

    def __init__(self, bind: str, transport: TransportConfig, timeout_s: float,
                 refused: Callable[[str], None] = lambda reason: None) -> None:
        self.server = StoreServer(bind, transport, refused)
        host = bind.removeprefix("tcp://").rpartition(":")[0]
        own = "127.0.0.1" if host in ("0.0.0.0", "*", "") else host
        super().__init__(f"tcp://{own}:{self.server.port}", transport, timeout_s)

    @property
    def port(self) -> int:
        return self.server.port

    def close(self) -> None:
        super().close()
        self.server.close()
