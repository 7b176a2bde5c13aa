"""Which actor incarnation each connection speaks for, which are alive, and
which are over: the actor bookkeeping, without sockets, of the two sockets
actors register on (the replay's actor socket, replay/ingest.py, and the
learner's control socket, learner/control.py), so that both refuse the same
messages with the same codes.

Rules, for an actor id:

- a connection speaks for an incarnation once that incarnation's ``Hello``
  registered it; anything else on a connection not registered for the
  sender's incarnation is refused (``unregistered``: say hello), and a
  connection registered for one actor speaks for no other (``identity``);
- its *current* incarnation is the newest registered; an older one is
  refused for good (``stale_incarnation``): its rollouts were counted lost
  when the newer one appeared;
- an incarnation silent for the liveness timeout is declared *dead*
  (:meth:`ActorRegistry.expire`) and refused for good (``dead_incarnation``):
  its rollouts expire, so nothing it sends later may count twice; the
  process, if it lives, comes back as a new incarnation; one that says
  ``Goodbye`` is over the same way, at once (:meth:`ActorRegistry.leave`).
  Where silence loses nothing (the learner's member set: a member that fell
  silent only misses publications), a silent incarnation is unregistered
  instead (``silence_ends_incarnation=False``), and its next ``Hello``
  registers it again;
- a newer incarnation's ``Hello`` replaces the current one at once, on its
  connection or another (:meth:`ActorRegistry.register` returns the old
  one, gone): a restarted process reconnects before its old connection is
  noticed dead;
- the current incarnation speaks on one connection. Its ``Hello`` on
  another (a reconnect: clients set no routing id, so a new TCP connection
  is a new routing id) moves it there if it carries the token of the
  incarnation's first ``Hello``, and the old connection is displaced;
  without the token it is refused (``identity``), so no second connection
  shares an actor's ledger, acks or rollouts.

Bounds (docs/replay.md, "Memory"): at most ``max_actors`` incarnations are
registered at once (a new actor id's ``Hello`` beyond them is ``full``), and
of the ids no longer registered the newest ``REMEMBERED_ACTORS`` are
remembered as stale or dead; an older one is forgotten, so its old
incarnation, if it ever speaks again, is ``unregistered`` rather than
``dead_incarnation`` (its rollouts were settled long before).

Usage::

    registry = ActorRegistry(Liveness(interval_s, liveness), max_actors)
    token = message.token if isinstance(message, Hello) else None
    if (refusal := registry.refusal(identity, actor_id, incarnation, token)) is not None: ...
    if token is not None:
        replaced, displaced = registry.register(identity, actor_id, incarnation, token, capacity)
    else:
        registry.seen(identity)
    for identity, peer in registry.expire(now): ...               # declared dead
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from protocol.errors import ErrorCode
from protocol.transport import Liveness

#: ``replay.max_actors``' default, which the learner's control socket takes
#: as its own bound on members: every member is an actor of the replay too.
DEFAULT_MAX_ACTORS = 4096
#: Actor ids no longer registered whose newest incarnations the registry
#: remembers (for ``stale_incarnation`` and ``dead_incarnation``).
REMEMBERED_ACTORS = 65_536


@dataclass
class Peer:
    """One actor incarnation on one connection."""

    actor_id: str
    incarnation: int
    token: bytes
    """From its first ``Hello``: a ``Hello`` on another connection must carry it to move it."""
    capacity: int
    group_size: int = 1
    """G of its groups (``Hello.group_size``): its credits come in multiples of it."""
    active_rollouts: int = 0
    """In flight at its last heartbeat, including rollouts not yet seen here."""
    stall_reported: dict[str, float] = field(default_factory=dict)
    """Its stall totals by reason as its heartbeats last reported them."""
    heartbeat_at: float | None = None
    """When its last heartbeat was counted (monotonic; None: none yet)."""


class Registration(NamedTuple):
    """What a ``Hello`` changed besides registering its connection."""

    replaced: Peer | None
    """The older incarnation it replaces, gone (or None)."""
    displaced: bytes | None
    """The connection its incarnation moved from (a reconnect), or None."""


class ActorRegistry:
    def __init__(self, liveness: Liveness, max_actors: int,
                 silence_ends_incarnation: bool = True) -> None:
        self.liveness = liveness
        self.max_actors = max_actors
        self.silence_ends_incarnation = silence_ends_incarnation
        self.peers: dict[bytes, Peer] = {}
        """Per registered connection (routing id), the incarnation speaking on it."""
        self.current: dict[str, int] = {}
        """Per actor id, the newest incarnation registered, the id registered
        longest ago first (the first forgotten)."""
        self.dead: dict[str, int] = {}
        """Per actor id, the newest incarnation declared dead."""
        self.connection: dict[str, bytes] = {}
        """Per actor id, the connection its current incarnation speaks on."""

    def refusal(self, identity: bytes, actor_id: str, incarnation: int,
                token: bytes | None) -> tuple[ErrorCode, str] | None:
        """Why a message of this incarnation on connection ``identity`` is
        refused, or None. ``token``: the message's if it is a ``Hello``,
        None for any other kind."""
        current = self.current.get(actor_id)
        if current is not None and incarnation < current:
            return (ErrorCode.STALE_INCARNATION,
                    f"incarnation {incarnation} was replaced by {current}")
        if incarnation <= self.dead.get(actor_id, -1):
            return (ErrorCode.DEAD_INCARNATION,
                    f"incarnation {incarnation} is over (it said goodbye, or was silent for "
                    f"{self.liveness.timeout_s:g} s): register as a new one")
        here = self.peers.get(identity)
        if here is not None and here.actor_id != actor_id:
            return (ErrorCode.IDENTITY, f"this connection speaks for {here.actor_id}")
        if token is None:
            if here is None or here.incarnation != incarnation:
                return (ErrorCode.UNREGISTERED, f"this connection is not registered for "
                        f"incarnation {incarnation}: say hello on it first")
            return None
        bound = self.connection.get(actor_id)
        if bound is None and here is None and len(self.peers) >= self.max_actors:
            return (ErrorCode.FULL, f"at most {self.max_actors} actors register at once "
                    "(replay.max_actors)")
        elsewhere = self.peers.get(bound) if bound not in (None, identity) else None
        if elsewhere is not None and elsewhere.incarnation == incarnation \
                and token != elsewhere.token:
            return (ErrorCode.IDENTITY, f"incarnation {incarnation} of {actor_id} is registered "
                    "on another connection, and this hello lacks its token")
        return None

    def register(self, identity: bytes, actor_id: str, incarnation: int, token: bytes,
                 capacity: int, group_size: int = 1) -> Registration:
        """Record a ``Hello`` that :meth:`refusal` let through, seen now: the
        connection speaks for this incarnation from now on."""
        bound = self.connection.get(actor_id)
        previous = self.peers.pop(bound, None) if bound is not None else None
        if bound not in (None, identity):
            self.liveness.forget(bound)
        self.connection[actor_id] = identity
        self.current.pop(actor_id, None)  # re-inserted: the id registered last is forgotten last
        self.current[actor_id] = incarnation
        same = previous is not None and previous.incarnation == incarnation
        peer = previous if same else Peer(actor_id, incarnation, token, capacity)
        peer.capacity = max(1, capacity)
        peer.group_size = group_size
        self.peers[identity] = peer
        self.liveness.seen(identity)
        return Registration(replaced=None if same else previous,
                            displaced=bound if same and bound != identity else None)

    def seen(self, identity: bytes) -> None:
        """A registered connection spoke (any message but ``Hello``)."""
        self.liveness.seen(identity)

    def expire(self, now: float) -> list[tuple[bytes, Peer]]:
        """The peers silent past the liveness timeout, removed and their
        incarnations declared dead."""
        expired = [(identity, peer) for identity in self.liveness.expire(now)
                   if (peer := self._over(identity, self.silence_ends_incarnation))
                   is not None]
        self._forget_the_oldest()
        return expired

    def leave(self, identity: bytes) -> Peer | None:
        """The incarnation on ``identity`` said goodbye: removed, and over
        as if declared dead; returns it (None if the connection spoke for none)."""
        self.liveness.forget(identity)
        peer = self._over(identity)
        self._forget_the_oldest()
        return peer

    def _over(self, identity: bytes, dead: bool = True) -> Peer | None:
        """The incarnation on ``identity`` is unregistered and, if ``dead``,
        over: remembered dead."""
        peer = self.peers.pop(identity, None)
        if peer is not None:
            if dead:
                self.dead[peer.actor_id] = peer.incarnation
            if self.connection.get(peer.actor_id) == identity:
                del self.connection[peer.actor_id]
        return peer

    def _forget_the_oldest(self) -> None:
        """Keep at most ``REMEMBERED_ACTORS`` ids beyond those registered:
        forget the ids registered longest ago that no connection speaks for
        now, a sixteenth more than needed at once (each pass reads them all)."""
        excess = len(self.current) - len(self.connection) - REMEMBERED_ACTORS
        if excess <= 0:
            return
        excess += REMEMBERED_ACTORS // 16
        forgotten = [actor_id for actor_id in self.current
                     if actor_id not in self.connection][:excess]
        for actor_id in forgotten:
            del self.current[actor_id]
            self.dead.pop(actor_id, None)

    def alive(self) -> int:
        return len(self.liveness)
