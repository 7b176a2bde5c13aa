"""Which actor incarnation each connection speaks for, which are alive, and
which are over: the replay's actor bookkeeping, without sockets.

Rules, for an actor id:

- its *current* incarnation is the newest that has spoken; an older one is
  refused for good (``stale_incarnation``): its rollouts were counted lost
  when the newer one appeared;
- an incarnation silent for the liveness timeout is declared *dead*
  (:meth:`ActorRegistry.expire`) and refused for good (``dead_incarnation``):
  its rollouts expire, so nothing it sends later may count twice; the
  process, if it lives, comes back as a new incarnation;
- a connection whose actor restarts before its old incarnation fell silent
  replaces that incarnation at once (:meth:`ActorRegistry.admit` returns the
  old one, gone); a restart keeps the capacity the actor said last. So does
  a newer incarnation on another connection (a restarted process draws a new
  routing id, ``protocol.endpoint.connection_id``);
- the current incarnation speaks on the connection it was admitted on: the
  same incarnation on another live connection is refused (``identity``), so
  no second connection shares an actor's ledger, acks or rollouts.

Usage::

    registry = ActorRegistry(Liveness(interval_s, liveness))
    if (refusal := registry.refusal(identity, actor_id, incarnation)) is not None: refuse(*refusal)
    replaced = registry.admit(identity, actor_id, incarnation)   # gone, if not None
    for identity, peer in registry.expire(now): ...               # declared dead
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ErrorCode
from protocol.transport import Liveness

#: Credits an actor may hold when it did not say its capacity (no Hello seen).
DEFAULT_CAPACITY = 1


@dataclass
class Peer:
    """One actor incarnation on one connection."""

    actor_id: str
    incarnation: int
    capacity: int = DEFAULT_CAPACITY
    active_rollouts: int = 0
    """In flight at its last heartbeat, including rollouts not yet seen here."""


class ActorRegistry:
    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness
        self.peers: dict[bytes, Peer] = {}
        """Per connection (routing id), the incarnation speaking on it."""
        self.current: dict[str, int] = {}
        """Per actor id, the newest incarnation that has spoken."""
        self.dead: dict[str, int] = {}
        """Per actor id, the newest incarnation declared dead."""
        self.connection: dict[str, bytes] = {}
        """Per actor id, the connection its current incarnation speaks on."""

    def refusal(self, identity: bytes, actor_id: str,
                incarnation: int) -> tuple[ErrorCode, str] | None:
        """Why a message of this incarnation on connection ``identity`` is
        refused, or None."""
        current = self.current.get(actor_id)
        if current is not None and incarnation < current:
            return (ErrorCode.STALE_INCARNATION,
                    f"incarnation {incarnation} was replaced by {current}")
        if incarnation <= self.dead.get(actor_id, -1):
            return (ErrorCode.DEAD_INCARNATION,
                    f"incarnation {incarnation} was declared dead (silent for "
                    f"{self.liveness.timeout_s:g} s): register as a new one")
        bound = self.connection.get(actor_id)
        if incarnation == current and bound not in (None, identity) and bound in self.peers:
            return (ErrorCode.IDENTITY, f"incarnation {incarnation} of {actor_id} speaks on "
                    "another connection")
        return None

    def admit(self, identity: bytes, actor_id: str, incarnation: int) -> Peer | None:
        """Record a message of an incarnation :meth:`refusal` let through,
        on connection ``identity``, seen now. Returns the older incarnation
        it replaces (on this connection or the actor's last one), which is
        gone (one declared dead was dealt with then and is no longer here),
        or None."""
        old = self.peers.get(identity)
        replaced = old if old is not None and incarnation > old.incarnation else None
        bound = self.connection.get(actor_id)
        if bound not in (None, identity) and bound in self.peers:  # restarted elsewhere
            replaced = self.peers.pop(bound)
            self.liveness.forget(bound)
            old = old or replaced  # its capacity carries over
        self.connection[actor_id] = identity
        self.current[actor_id] = incarnation
        if old is None or old.incarnation != incarnation:
            self.peers[identity] = Peer(actor_id, incarnation,
                                        old.capacity if old else DEFAULT_CAPACITY)
        self.liveness.seen(identity)
        return replaced

    def expire(self, now: float) -> list[tuple[bytes, Peer]]:
        """The peers silent past the liveness timeout, removed and their
        incarnations declared dead."""
        expired = []
        for identity in self.liveness.expire(now):
            peer = self.peers.pop(identity, None)
            if peer is not None:
                self.dead[peer.actor_id] = peer.incarnation
                expired.append((identity, peer))
        return expired

    def alive(self) -> int:
        return len(self.liveness)
