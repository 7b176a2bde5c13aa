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
generation instead of waiting out its deadline.

Every key is charged to the connection that wrote it last. Keys stay when
their writer's connection goes: a member acknowledges its last bucket and
leaves, and the sender reads that acknowledgement after (dropping a gone
writer's keys lost it). A key, a value,
what one connection holds and what all but the learner's own hold together
are bounded; the learner's own client (op ``own``, with a token only
:class:`HostedStore` knows) writes in a pool of its own, which the others
cannot fill. A request beyond a bound, or one the server fails on, is
refused with an error, counted; none ends the server.

Usage::

    store = HostedStore("tcp://0.0.0.0:5558", transport, timeout_s=30)  # learner rank 0
    store = StoreClient("tcp://learner:5558", transport, timeout_s=30)   # members
    store.set("k", b"v"); store.get("k")
"""

from __future__ import annotations

import hmac
import itertools
import logging
import secrets
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

#: Longest key, largest value: a generation's keys are a few per rank
#: (addresses, NCCL ids, ipc handles of at most 2 buckets in flight).
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 1 << 20
#: What one connection may hold (a member opens one per generation and
#: writes a few keys there), and what all connections but the learner's own
#: may hold together: one writer cannot fill the store for the others, and
#: filling it takes 17 connections of 16 MiB each. A generation's keys are
#: not yet removed with it, so writers that come and go fill it in time.
MAX_WRITER_KEYS = 1024
MAX_WRITER_BYTES = 16 << 20
MAX_KEYS = 100_000
MAX_BYTES = 256 << 20
#: The learner's own pool (:class:`HostedStore`'s client), apart from the
#: others so that they cannot crowd it out. The learner never deletes a
#: generation's keys, so at its bound its oldest keys (long retired
#: generations') make room instead of its set being refused.
OWNER_KEYS = 100_000
OWNER_BYTES = 64 << 20
POLL_MS = 50
#: ``add`` keeps a counter within int64, as ``torch.distributed.Store`` does:
#: its operands and results beyond are refused (MessagePack carries no more).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
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


def _key(value: object) -> str:
    if not isinstance(value, str) or len(value.encode()) > MAX_KEY_BYTES:
        raise StoreRefused(f"a key is a string of at most {MAX_KEY_BYTES} bytes")
    return value


def _keys(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_WRITER_KEYS:
        raise StoreRefused(f"keys are a list of at most {MAX_WRITER_KEYS} keys")
    return [_key(k) for k in value]


def _value(raw: object) -> bytes:
    if not isinstance(raw, bytes) or len(raw) > MAX_VALUE_BYTES:
        raise StoreRefused(f"a value is at most {MAX_VALUE_BYTES} bytes")
    return raw


def _int64(number: int) -> int:
    if not INT64_MIN <= number <= INT64_MAX:
        raise StoreRefused("add's operands and result are int64 (-2**63 to 2**63-1)")
    return number


def _seconds(raw: object) -> float:
    if not isinstance(raw, int | float) or not 0 <= raw <= 24 * 3600:
        raise StoreRefused("a timeout is 0 to 86400 seconds")
    return float(raw)


class _Ledger:
    """Who wrote each key (a connection's routing id), and what each writer
    and the shared pool hold: the bounds a ``set`` must stay within. A key
    is charged its key's and value's bytes to whoever wrote it last."""

    def __init__(self) -> None:
        self.owner: bytes | None = None
        self._writer_of: dict[str, bytes] = {}
        #: Per writer, its keys in the order written (the owner's oldest go
        #: first) and the bytes each is charged.
        self._held: dict[bytes, dict[str, int]] = {}
        self._bytes: dict[bytes, int] = {}
        self._keys_total = 0
        self._bytes_total = 0

    def admit(self, writer: bytes, key: str, nbytes: int) -> list[str]:
        """Charge ``key`` (``nbytes``) to ``writer``, or raise ``StoreRefused``
        with nothing changed; returns the owner's keys evicted to make room."""
        previous = self._release(key)
        try:
            evicted = self._make_room(writer, nbytes)
        except StoreRefused:
            if previous is not None:
                self._charge(previous[0], key, previous[1])
            raise
        self._charge(writer, key, nbytes)
        return evicted

    def release(self, key: str) -> None:
        """``key`` was deleted: its writer is charged for it no more."""
        self._release(key)

    def _make_room(self, writer: bytes, nbytes: int) -> list[str]:
        held, used = self._held.get(writer, {}), self._bytes.get(writer, 0)
        if writer == self.owner:
            evicted = []
            while held and (len(held) >= OWNER_KEYS or used + nbytes > OWNER_BYTES):
                evicted.append(next(iter(held)))
                self._release(evicted[-1])
                used = self._bytes.get(writer, 0)
            return evicted
        if len(held) >= MAX_WRITER_KEYS or used + nbytes > MAX_WRITER_BYTES:
            raise StoreRefused(f"a connection holds at most {MAX_WRITER_KEYS} keys and "
                               f"{MAX_WRITER_BYTES} bytes")
        own = self._held.get(self.owner, {}) if self.owner is not None else {}
        owned = self._bytes.get(self.owner, 0) if self.owner is not None else 0
        if (self._keys_total - len(own) >= MAX_KEYS
                or self._bytes_total - owned + nbytes > MAX_BYTES):
            raise StoreRefused(f"the store's writers hold {MAX_KEYS} keys or "
                               f"{MAX_BYTES} bytes already")
        return []

    def _charge(self, writer: bytes, key: str, nbytes: int) -> None:
        self._writer_of[key] = writer
        self._held.setdefault(writer, {})[key] = nbytes
        self._bytes[writer] = self._bytes.get(writer, 0) + nbytes
        self._keys_total += 1
        self._bytes_total += nbytes

    def _release(self, key: str) -> tuple[bytes, int] | None:
        writer = self._writer_of.pop(key, None)
        if writer is None:
            return None
        nbytes = self._held[writer].pop(key)
        self._bytes[writer] -= nbytes
        if not self._held[writer]:
            del self._held[writer], self._bytes[writer]
        self._keys_total -= 1
        self._bytes_total -= nbytes
        return writer, nbytes


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
        self._ledger = _Ledger()
        #: What :class:`HostedStore`'s client presents (op ``own``) to write
        #: in the learner's own pool; nobody else learns it.
        self.owner_token = secrets.token_bytes(32)
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
            try:
                self._serve_once()
            except Exception:
                # A bug must not end the thread: every group generation after
                # it would fail to form, for want of a store that answers.
                log.exception("the weight store failed outside a request; it serves on")
                self._refused("internal")

    def _serve_once(self) -> None:
        if self._socket.poll(POLL_MS, zmq.POLLIN):
            while True:
                try:
                    frames = self._socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2:
                    self._refused("malformed")
                    continue
                self._handle(frames[0], frames[1])
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
        except Exception:
            # A bug in one request is that request's refusal, not the store's end.
            log.exception("the weight store failed on a request; it serves on")
            self._refused("internal")
            self._reply(identity, request_id, False, "internal: the store failed on it")

    def _apply(self, identity: bytes, request_id: int, op: str, arguments: list) -> None:
        if op == "set" and len(arguments) == 2:
            self._set(identity, _key(arguments[0]), _value(arguments[1]))
            self._reply(identity, request_id, True, None)
        elif op in ("get", "wait") and len(arguments) == 2:
            wanted = [_key(arguments[0])] if op == "get" else _keys(arguments[0])
            waiter = _Waiter(identity, request_id, op, wanted,
                             time.monotonic() + _seconds(arguments[1]))
            if not (self._refuse_abandoned(waiter) or self._answer(waiter)):
                self._waiters.append(waiter)
        elif op == "abandon" and len(arguments) == 1:
            prefix = _key(arguments[0])
            if not prefix.endswith("/"):
                raise StoreRefused("an abandoned prefix ends with '/'")
            self._abandon(identity, prefix)
            self._reply(identity, request_id, True, None)
        elif op == "add" and len(arguments) == 2 and isinstance(arguments[1], int):
            name = _key(arguments[0])
            total = _int64(_int64(int(self._data.get(name, b"0"))) + _int64(arguments[1]))
            self._set(identity, name, str(total).encode())
            self._reply(identity, request_id, True, total)
        elif op == "compare_set" and len(arguments) == 3:
            name, expected, desired = _key(arguments[0]), _value(arguments[1]), _value(arguments[2])
            current = self._data.get(name)
            if (current is None and not expected) or current == expected:
                self._set(identity, name, desired)
                current = desired
            self._reply(identity, request_id, True, expected if current is None else current)
        elif op == "check" and len(arguments) == 1:
            self._reply(identity, request_id, True,
                        all(k in self._data for k in _keys(arguments[0])))
        elif op == "delete_key" and len(arguments) == 1:
            self._reply(identity, request_id, True, self._delete(_key(arguments[0])))
        elif op == "num_keys" and not arguments:
            self._reply(identity, request_id, True, len(self._data))
        elif op == "own" and len(arguments) == 1 and isinstance(arguments[0], bytes):
            if not hmac.compare_digest(arguments[0], self.owner_token):
                raise StoreRefused("not the store's owner")
            self._ledger.owner = identity
            self._reply(identity, request_id, True, None)
        else:  # list_keys among them: nobody learns what others stored
            raise StoreRefused(f"unknown op {op!r} with {len(arguments)} arguments")

    def _set(self, identity: bytes, key: str, value: bytes) -> None:
        for evicted in self._ledger.admit(identity, key, len(key.encode()) + len(value)):
            del self._data[evicted]
        self._data[key] = value
        self._waiters = [w for w in self._waiters if not self._answer(w)]

    def _delete(self, key: str) -> bool:
        self._ledger.release(key)
        return self._data.pop(key, None) is not None

    def _abandon(self, identity: bytes, prefix: str) -> None:
        self._set(identity, prefix + ABANDONED, b"1")
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
        try:
            self._call("own", self.server.owner_token)
        except dist.DistStoreError:  # a store the learner cannot own is no store to start
            self.close()
            raise

    @property
    def port(self) -> int:
        return self.server.port

    def close(self) -> None:
        super().close()
        self.server.close()
