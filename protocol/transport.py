"""ZeroMQ socket helpers: DEALER/ROUTER with the project's transport rules.

Rules (docs/design.md §3.2): DEALER/ROUTER only, explicit high-water marks,
``ROUTER_MANDATORY`` (a reply to a vanished peer raises instead of vanishing),
``MAXMSGSIZE`` (the library drops a peer that announces a larger frame before
it is buffered), heartbeats with a liveness count, optional CURVE. Clients
set no routing id: the ROUTER names each connection itself, with a number
that never crosses the wire, so no peer can present another's.

Usage::

    ctx = zmq.Context()
    router = bind_router(ctx, "tcp://127.0.0.1:5555", TransportConfig())
    dealer = connect_dealer(ctx, "tcp://127.0.0.1:5555", TransportConfig())
"""

from __future__ import annotations

import ctypes
import ipaddress
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from protocol.bounds import bound_problems, bounded
from protocol.codec import DEFAULT_MAX_MESSAGE_BYTES

#: Messages queued per peer before a send blocks (DEALER) or fails (ROUTER).
#: Segments are acknowledged by the application, so a bounded queue only
#: delays, never loses; 1000 covers a burst of an actor's finished segments.
DEFAULT_HWM = 1000
#: A closing socket drops what it could not send after this long, so that a
#: process never hangs at exit on a dead peer. Unacknowledged data is resent
#: by the application after reconnecting.
LINGER_MS = 500
#: Reconnect back-off of DEALERs: quick first retry, capped so a restarted
#: service is found within seconds.
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 2000


@dataclass
class CurveConfig:
    """CURVE authentication and encryption (off by default: loopback only)."""

    enabled: bool = False
    """Encrypt every socket and accept only clients whose public key is in
    ``authorized_keys_dir``."""
    server_secret_key: str = ""
    """Path to the service's secret key file (``compactionrl keys init``)."""
    client_secret_key: str = ""
    """Path to this client's secret key file."""
    server_public_key: str = ""
    """Path to the service's public key file, for clients."""
    authorized_keys_dir: str = ""
    """Folder of ``*.key`` public key files of clients allowed to connect."""

    def validate(self, section: str) -> list[str]:
        if not self.enabled:
            return []
        problems = []
        for name in ("server_secret_key", "client_secret_key", "server_public_key",
                     "authorized_keys_dir"):
            if not getattr(self, name):
                problems.append(f"{section}.curve.{name} is empty but curve.enabled = true: "
                                f"generate keys with `compactionrl keys init DIR`")
        if not zmq.has("curve"):
            problems.append(f"{section}.curve.enabled = true but libzmq lacks CURVE support")
        return problems


@dataclass
class TransportConfig:
    """Network settings shared by every process."""

    send_hwm: int = bounded(DEFAULT_HWM, ge=1, why="0 would mean unbounded")
    """Outgoing messages queued per peer."""
    recv_hwm: int = bounded(DEFAULT_HWM, ge=1, why="0 would mean unbounded")
    """Incoming messages queued per peer."""
    max_message_bytes: int = bounded(DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    """Largest frame accepted, enforced by the socket (MAXMSGSIZE) and the codec."""
    heartbeat_interval_s: float = bounded(1.0, gt=0)
    """How often a client sends ``Heartbeat``."""
    heartbeat_liveness: int = bounded(5, ge=1)
    """Missed heartbeats after which a peer is declared dead."""
    metrics_address: str = "127.0.0.1"
    """Interface every process serves ``/metrics`` on (0.0.0.0 for a remote Prometheus)."""
    curve: CurveConfig = field(default_factory=CurveConfig)
    allow_insecure_network: bool = False
    """Allow service addresses beyond loopback with CURVE off. Whoever reaches
    such a port can register as an actor, push segments that get trained on
    and take batches (docs/reliability.md): only for a network you trust."""

    def validate(self, section: str) -> list[str]:
        return bound_problems(self, section) + self.curve.validate(section)


def listen_address(bind: str, address: str) -> str:
    """Where a service listens: its bind setting, or (empty) the address it
    advertises to its clients."""
    return bind or address


def advertised_address(bind_host: str, port: int, peer_address: str) -> str:
    """``host:port`` under which a server bound on ``bind_host`` is reached by
    whoever reaches ``peer_address`` (``tcp://HOST:PORT``): its bind host if
    it names one, else (a wildcard bind) the local address this machine uses
    to reach that peer, which the peer's side of the network can route back
    to. Sends nothing: a UDP socket's connect only picks a route."""
    host = bind_host
    if host in ("", "0.0.0.0", "::", "*"):
        peer_host = peer_address.partition("://")[2].rpartition(":")[0].strip("[]")
        family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((peer_host, 9))
                host = probe.getsockname()[0]
        except OSError:  # no route (or no such host): the name others may resolve
            host = socket.getfqdn()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bound_endpoint(address: str) -> str:
    """What binding ``address`` (``tcp://HOST:PORT``, ``HOST:PORT``, ``ipc://...``
    or ``inproc://...``) takes on its machine: ``port N`` for TCP, whatever
    the host (a wildcard bind takes the port on every interface), else the
    address itself."""
    scheme, separator, rest = address.partition("://")
    if separator and scheme != "tcp":
        return address
    return f"port {(rest if separator else address).rpartition(':')[2]}"


def is_loopback(address: str) -> bool:
    """Whether ``address`` (``tcp://HOST:PORT``, ``HOST:PORT``, ``ipc://...`` or
    ``inproc://...``) can be reached only from this machine."""
    scheme, separator, rest = address.partition("://")
    if not separator:
        scheme, rest = "tcp", address
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or an interface name ("*", "eth0"): not loopback
        return False


def _common_options(socket: zmq.Socket, config: TransportConfig) -> None:
    socket.setsockopt(zmq.SNDHWM, config.send_hwm)
    socket.setsockopt(zmq.RCVHWM, config.recv_hwm)
    socket.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    socket.setsockopt(zmq.LINGER, LINGER_MS)


def seed_anonymous_routing_ids() -> None:
    """Seed the C library's ``rand()`` from the OS; called before each ROUTER
    is made.

    libzmq names a peer that presents no routing id with a 5-byte number
    counted from ``rand()``, drawn when the ROUTER is made, and nothing seeds
    it: in every process here the first is ``00 6b 8b 45 67`` (glibc's first
    ``rand()``). A peer that presents the next such number as its own routing
    id, before a peer without one connects, makes libzmq abort the whole
    process (an assertion in ``add_out_pipe``, measured with libzmq 4.3.5,
    with ``ROUTER_HANDOVER`` on or off): two connections would kill the
    replay. Seeded from the OS, the numbering starts at one of 2**32 places
    that no peer can learn (no reply carries a routing id). Where the C
    library cannot be reached (not Linux or macOS), nothing is done."""
    try:
        ctypes.CDLL(None).srand(secrets.randbits(32))
    except (OSError, AttributeError):
        pass


def bind_router(context: zmq.Context, address: str, config: TransportConfig) -> zmq.Socket:
    """A ROUTER bound to ``address``; a CURVE server when ``config.curve`` is on
    (start :class:`Authenticator` on the same context first)."""
    seed_anonymous_routing_ids()
    socket = context.socket(zmq.ROUTER)
    _common_options(socket, config)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # No ROUTER_HANDOVER (libzmq's default, said here because it is the
    # security rule): a peer that presents a routing id in use is not heard,
    # instead of taking the connection over. The project's clients present
    # none, so a reconnect is a new connection with a new id, and a service
    # moves an incarnation to it only on a hello with the incarnation's token.
    socket.setsockopt(zmq.ROUTER_HANDOVER, 0)
    if config.curve.enabled:
        public, secret = zmq.auth.load_certificate(config.curve.server_secret_key)
        socket.curve_publickey = public
        socket.curve_secretkey = secret
        socket.curve_server = True
    socket.bind(address)
    return socket


def connect_dealer(context: zmq.Context, address: str, config: TransportConfig,
                   zmtp_heartbeats: bool = False) -> zmq.Socket:
    """A DEALER connected to ``address``, with no routing id of its own (the
    ROUTER names each of its connections). ``zmtp_heartbeats``: ZeroMQ pings
    the peer every ``heartbeat_interval_s`` and drops the connection when it
    stays silent for the liveness, for a client that otherwise hears nothing
    from a frozen peer (the learner waiting for a batch)."""
    socket = context.socket(zmq.DEALER)
    _common_options(socket, config)
    if zmtp_heartbeats:
        socket.setsockopt(zmq.HEARTBEAT_IVL, int(config.heartbeat_interval_s * 1000))
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(
            config.heartbeat_interval_s * config.heartbeat_liveness * 1000))
    socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    if config.curve.enabled:
        public, secret = zmq.auth.load_certificate(config.curve.client_secret_key)
        server_public, _ = zmq.auth.load_certificate(config.curve.server_public_key)
        socket.curve_publickey = public
        socket.curve_secretkey = secret
        socket.curve_serverkey = server_public
    socket.connect(address)
    return socket


class Authenticator:
    """ZAP handler that admits only CURVE clients whose public key file is in
    ``authorized_keys_dir``. Without it a CURVE server accepts any key pair.
    A no-op when CURVE is off. Use as a context manager around the sockets."""

    def __init__(self, context: zmq.Context, curve: CurveConfig) -> None:
        self._auth: ThreadAuthenticator | None = None
        if curve.enabled:
            self._auth = ThreadAuthenticator(context)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=curve.authorized_keys_dir)

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def __enter__(self) -> Authenticator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def generate_keys(directory: Path, names: list[str]) -> dict[str, tuple[Path, Path]]:
    """Write a CURVE key pair per name into ``directory`` (``NAME.key`` public,
    ``NAME.key_secret`` secret, mode 0600) and copy every public key except
    ``server``'s into ``directory/authorized``. Returns name -> (public, secret)."""
    directory.mkdir(parents=True, exist_ok=True)
    authorized = directory / "authorized"
    authorized.mkdir(exist_ok=True)
    paths = {}
    for name in names:
        public, secret = (Path(p) for p in zmq.auth.create_certificates(directory, name))
        secret.chmod(0o600)
        if name != "server":
            (authorized / public.name).write_bytes(public.read_bytes())
        paths[name] = (public, secret)
    return paths


class Liveness:
    """Which peers are alive: a peer is dead after ``liveness`` heartbeat
    intervals without any message from it.

    Usage::

        live = Liveness(interval_s=1.0, liveness=5)
        live.seen(b"actor-1")           # on every message from the peer
        for peer in live.expire():      # periodically
            ...declare peer dead...
    """

    def __init__(self, interval_s: float, liveness: int) -> None:
        self.timeout_s = interval_s * liveness
        self._last_seen: dict[bytes, float] = {}

    def seen(self, peer: bytes, now: float | None = None) -> None:
        self._last_seen[peer] = time.monotonic() if now is None else now

    def forget(self, peer: bytes) -> None:
        self._last_seen.pop(peer, None)

    def __contains__(self, peer: bytes) -> bool:
        """Whether ``peer`` is alive: seen, and not expired or forgotten since."""
        return peer in self._last_seen

    def __len__(self) -> int:
        return len(self._last_seen)

    def expire(self, now: float | None = None) -> list[bytes]:
        """Remove and return the peers not seen within the timeout."""
        now = time.monotonic() if now is None else now
        dead = [p for p, t in self._last_seen.items() if now - t > self.timeout_s]
        for peer in dead:
            del self._last_seen[peer]
        return dead
