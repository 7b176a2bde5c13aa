"""Credits: how many rollouts actors may start (docs/design.md §3.3).

Semantics (Reverb-style rate limiting, in rollouts):

- ``B`` = rollouts per learner batch, ``S`` = max staleness, ``v`` = batches
  the learner has finished since this replay started: batches served, less
  the one it is training on (served, and no new ``BatchRequest`` yet). One
  learner step advances the learner version by one, so ``v`` is the version
  the learner has reached, counted from this replay's start. Counting the
  batch in training too would let actors start the next batch under weights
  the learner is about to replace: at ``S = 0`` every such rollout is stale.
- *accepted* = rollouts that completed and were kept (served or waiting);
  rollouts dropped as stale, expired or over the memory bound are not
  counted. *running* = credits granted and not yet returned as a finished
  (or expired) rollout: started or about to start.
- Invariant: ``accepted + running <= (S + v + 1) * B``. Every rollout that
  will be trained was started at most ``S + 1`` batches ahead of the learner.
- Memory: no credit while ``buffer bytes + running * estimated rollout bytes``
  would exceed ``max_buffer_bytes``, except the one that keeps the learner
  fed (below). Ingest enforces the byte bound itself.
- Shares: credits are scarce whenever the learner is the bottleneck (the
  usual case), and who gets them is decided by water-filling, not by who asks
  first (:func:`fair_shares`): each credit goes to the actor with the
  smallest ``outstanding_i / capacity_i`` that still has room
  (``outstanding_i < capacity_i``), so each actor's share of the running
  credits tends to ``capacity_i / sum(capacity)``, whatever the order in
  which actors registered. An actor that returns its rollouts sooner holds
  fewer credits when the next ones free up, and so gets more of them: shares
  follow what actors return as well as what they declare.
- Groups: an actor whose rollouts come in groups of G (``Hello.group_size``)
  gets its credits in multiples of G, so that every group it starts can
  finish without waiting for a credit (the replay serves groups whole, and a
  group waiting for a credit that only a served batch frees would wait
  forever at S = 0).
- No deadlock: whenever the learner waits (it asked, fewer than B are ready)
  and nothing is running, at least one credit is available: ``(S + v + 1) * B - accepted >=
  (S + 1) * B - ready >= S * B + 1 >= 1``, and the memory rule yields to it. With
  groups of G dividing B the ready rollouts are whole groups, ``ready <= B - G``, so at
  least G are, a whole group (``floor``).

Usage::

    pacer = CreditPacer(rollouts_per_batch=8, max_staleness=2, max_buffer_bytes=1 << 30)
    n = pacer.grant("actor-1", wanted=4, buffer_bytes=buffer.nbytes, ready=len(buffer.ready))
    pacer.finished("actor-1", accepted=True, rollout_bytes=123_456)
    pacer.consumed(8)          # a batch served: the learner trains on it
    pacer.learner_waiting()    # its next BatchRequest: that step is done

Ledgers: a reply that carries credits can be lost with a dropped connection.
So each actor's grants are also counted in a *ledger*: an id and the total
granted under it. Replies carry both; the actor credits itself the difference
from the last total it saw, so any later reply makes up for a lost one, and
its heartbeats say which total it has seen, so the replay knows to repeat it.
A forgotten actor's next grant opens a new ledger, and a new ledger voids the
credits held under the old one (as does a replay restart: its ledgers are new).
"""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Mapping

#: Until rollouts have been seen, assume this size for the memory rule.
INITIAL_ROLLOUT_BYTES = 256 * 1024


class CreditPacer:
    def __init__(self, rollouts_per_batch: int, max_staleness: int, max_buffer_bytes: int
                 ) -> None:
        if rollouts_per_batch < 1 or max_staleness < 0 or max_buffer_bytes < 1:
            raise ValueError("rollouts_per_batch >= 1, max_staleness >= 0, max_buffer_bytes >= 1")
        self.batch = rollouts_per_batch
        self.max_staleness = max_staleness
        self.max_buffer_bytes = max_buffer_bytes
        self.rollouts_consumed = 0
        self.rollouts_in_training = 0
        """The last batch served, until the learner asks for the next one."""
        self.accepted = 0
        self.outstanding: dict[str, int] = {}
        self.running = 0
        """sum(outstanding.values()), kept as it changes: read for every
        grant, it would cost O(actors) each time, O(actors^2) an ingest pass."""
        self._ledgers: dict[str, tuple[int, int]] = {}
        """actor -> (ledger id, credits granted under it)."""
        self._bytes_seen = 0
        self._rollouts_seen = 0

    @property
    def estimated_rollout_bytes(self) -> int:
        if not self._rollouts_seen:
            return INITIAL_ROLLOUT_BYTES
        return max(1, self._bytes_seen // self._rollouts_seen)

    def available(self, buffer_bytes: int, ready: int, floor: int = 1) -> int:
        """Credits that may be granted now, to anyone; the memory rule yields
        ``floor`` (one group) to a waiting learner when nothing runs."""
        by_staleness = ((self.max_staleness + 1) * self.batch + self.rollouts_trained
                        - self.accepted - self.running)
        free = self.max_buffer_bytes - buffer_bytes
        by_memory = free // self.estimated_rollout_bytes - self.running
        if ready < self.batch and self.running == 0 and free > 0:
            by_memory = max(by_memory, floor)  # never starve a waiting learner
        return max(0, min(by_staleness, by_memory))

    def grant(self, actor: str, wanted: int, buffer_bytes: int, ready: int, unit: int = 1
              ) -> int:
        """Grant up to ``wanted`` credits to ``actor``, a multiple of its
        ``unit`` (its group size); returns how many."""
        granted = max(0, min(wanted, self.available(buffer_bytes, ready, unit))) // unit * unit
        if granted:
            self.outstanding[actor] = self.outstanding.get(actor, 0) + granted
            self.running += granted
            ledger, total = self.ledger(actor)
            self._ledgers[actor] = ledger, total + granted
        return granted

    def shares(self, actors: Mapping[str, tuple[int, int]], buffer_bytes: int, ready: int
               ) -> dict[str, int]:
        """Who gets the credits available now: :func:`fair_shares` over
        ``actors`` (actor -> ``(capacity, group size)``) with what each holds;
        the memory rule yields the largest group to a waiting learner."""
        largest_group = max((unit for _, unit in actors.values()), default=1)
        available = self.available(buffer_bytes, ready, largest_group)
        return fair_shares(available, {actor: (capacity, self.outstanding.get(actor, 0), unit)
                                       for actor, (capacity, unit) in actors.items()})

    def ledger(self, actor: str) -> tuple[int, int]:
        """``actor``'s ledger id and the credits granted under it so far."""
        if actor not in self._ledgers:
            # random, not counted: a restarted replay must not reuse an id
            self._ledgers[actor] = secrets.randbits(63), 0
        return self._ledgers[actor]

    def finished(self, actor: str, accepted: bool, rollout_bytes: int = 0) -> None:
        """A rollout of ``actor`` completed (``accepted``) or was lost."""
        if self.outstanding.get(actor, 0) > 0:
            self.outstanding[actor] -= 1
            self.running -= 1
        if accepted:
            self.accepted += 1
            self._bytes_seen += rollout_bytes
            self._rollouts_seen += 1

    def dropped(self) -> None:
        """An accepted rollout will never be trained (stale): its place frees up."""
        self.accepted -= 1

    def consumed(self, rollouts: int) -> None:
        """The learner took ``rollouts`` (a batch) and trains on it."""
        self.rollouts_consumed += rollouts
        self.rollouts_in_training = rollouts

    def returned(self, rollouts: int) -> None:
        """Rollouts consumed are back, untrained (their learner died)."""
        self.rollouts_consumed -= rollouts

    def learner_waiting(self) -> None:
        """The learner asked for a batch: it is done with the one it took."""
        self.rollouts_in_training = 0

    @property
    def rollouts_trained(self) -> int:
        return self.rollouts_consumed - self.rollouts_in_training

    @property
    def batches_trained(self) -> float:
        return self.rollouts_trained / self.batch

    def forget(self, actor: str) -> None:
        """The actor is gone: its unreturned credits are void, and so is its ledger."""
        self.running -= self.outstanding.pop(actor, 0)
        self._ledgers.pop(actor, None)


def fair_shares(available: int, actors: Mapping[str, tuple[int, int, int]]) -> dict[str, int]:
    """Split ``available`` credits among ``actors`` (actor -> ``(capacity,
    outstanding, unit)``) by water-filling: one unit (the actor's group size)
    at a time, each to the actor with the lowest ``(outstanding + given) /
    capacity`` that still has room for it; ties go to the actor holding fewer
    credits, then by id, so the split does not depend on the order of
    ``actors``. Returns only the actors given some."""
    heap = [(outstanding / capacity, outstanding, actor, capacity, unit)
            for actor, (capacity, outstanding, unit) in actors.items()
            if 0 <= outstanding and outstanding + unit <= capacity]
    heapq.heapify(heap)
    given: dict[str, int] = {}
    while available > 0 and heap:
        _, held, actor, capacity, unit = heapq.heappop(heap)
        if unit > available:
            continue  # a whole group does not fit: the others may still get theirs
        given[actor] = given.get(actor, 0) + unit
        available -= unit
        if held + 2 * unit <= capacity:
            heapq.heappush(heap, ((held + unit) / capacity, held + unit, actor, capacity, unit))
    return given
