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
  old one, gone); a restart keeps the capacity the actor said last.

Usage::

    registry = ActorRegistry(Liveness(interval_s, liveness))
    if (refusal := registry.refusal(actor_id, incarnation)) is not None: refuse(*refusal)
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

    def refusal(self, actor_id: str, incarnation: int) -> tuple[ErrorCode, str] | None:
        """Why a message of this incarnation is refused, or None."""
        current = self.current.get(actor_id)
        if current is not None and incarnation < current:
            return (ErrorCode.STALE_INCARNATION,
                    f"incarnation {incarnation} was replaced by {current}")
        if incarnation <= self.dead.get(actor_id, -1):
            return (ErrorCode.DEAD_INCARNATION,
                    f"incarnation {incarnation} was declared dead (silent for "
                    f"{self.liveness.timeout_s:g} s): register as a new one")
        return None

    def admit(self, identity: bytes, actor_id: str, incarnation: int) -> Peer | None:
        """Record a message of an incarnation :meth:`refusal` let through,
        on connection ``identity``, seen now. Returns the older incarnation
        of that connection it replaces, which is gone (one declared dead was
        dealt with then and is no longer here), or None."""
        old = self.peers.get(identity)
        replaced = old if old is not None and incarnation > old.incarnation else None
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
        return len(self.liveness.alive())
