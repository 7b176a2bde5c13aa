"""A rollout's group, served whole (docs/replay.md, "Groups").

A group is the rollouts of one actor incarnation whose segments carry the
same ``GroupTag`` id; G, the tag's size, is how many the actor starts in it.
A rollout without a tag is a group of its own (G = 1). Each known member is
*pending* (a segment stored, not complete), *ready*, or *dropped*
(abandoned, expired, invalid, over the memory bound); a member the replay
has not heard of yet is *unseen* (an actor sends a rollout's first segment
only once its second closes). A group is **servable** when

    ready >= 1  and  pending = 0  and
    (ready + dropped >= G  or  closed to members  or  age > rollout_timeout_s)

so a group whose G members all finish is served with all of them, one that
lost members is served with the rest once the rest are settled, and one
whose unseen members will never come (its actor left, or lost the credits
for them) waits at most ``rollout_timeout_s`` from its first member. A group
is *closed to members* once its actor incarnation is over, or once it was
served or dropped: a member that arrives after that is dropped
(``late_member``). Staleness is the group's, its oldest ready member's: a
group is dropped whole once that passes the bound (it only grows while the
group waits), never member by member.

Usage::

    groups = RolloutGroups(rollout_timeout_s=600)
    group = groups.join(key, size, rollout_id, now)   # None: closed, a late member
    groups.ready(key, entry); groups.left(key, rollout_id)
    for group in groups.servable(now): ...
    groups.close(group)                               # served or dropped whole
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from protocol import Abandon, ErrorCode, ProtocolError, Segment

#: Remember this many closed groups' keys (served or dropped), so that a
#: member arriving late is recognised instead of opening a group that could
#: never fill. A key holds an id of at most 256 characters, as a released
#: rollout's does (docs/replay.md, "Memory").
CLOSED_MEMORY = 100_000

#: An actor incarnation: (actor id, incarnation).
Owner = tuple[str, int]
#: (actor id, incarnation, group id): one actor incarnation's group. A
#: rollout without a tag is keyed by its own id, marked apart (the last
#: field) so that no group id can name it.
GroupKey = tuple[str, int, str, bool]


class Member(Protocol):
    """What a group reads of its rollouts (:class:`replay.buffer.Member`)."""

    rollout_id: str
    first_seen: float
    ready_at: float | None
    min_version: int | None
    group: GroupKey
    group_size: int

    def staleness(self, learner_version: int) -> int: ...


def check_group_size(message: Segment | Abandon, declared: int) -> None:
    """A segment's or abandon's group has the size its actor declared
    (``Hello.group_size``): the credits were granted for groups of that size."""
    if message.group is not None and message.group.size != declared:
        raise ProtocolError(ErrorCode.INVALID, f"group size {message.group.size} is not the "
                            f"{declared} the actor's hello declared")


def group_key(owner: Owner, group_id: str | None, rollout_id: str) -> GroupKey:
    """The key of the group a rollout of ``owner`` belongs to (``group_id``
    None: its own)."""
    if group_id is None:
        return owner[0], owner[1], rollout_id, False
    return owner[0], owner[1], group_id, True


@dataclass
class Group:
    key: GroupKey
    size: int
    """G: the members its actor starts."""
    opened_at: float
    ready: dict[str, Member] = field(default_factory=dict)
    """Its ready members, in readiness order."""
    pending: set[str] = field(default_factory=set)
    dropped: int = 0
    closed_to_members: bool = False
    """Its actor incarnation is over, or it was served before (its learner
    died): no member joins any more."""
    served_before: bool = False
    """Served to a learner that died: served again first."""

    @property
    def complete(self) -> bool:
        return len(self.ready) == self.size

    @property
    def empty(self) -> bool:
        return not self.ready and not self.pending

    def servable(self, now: float, timeout_s: float) -> bool:
        return bool(self.ready) and not self.pending and (
            len(self.ready) + self.dropped >= self.size or self.closed_to_members
            or now - self.opened_at > timeout_s)

    def finished(self) -> bool:
        """Nothing of it is held and nothing more can come."""
        return self.empty and (self.dropped >= self.size or self.closed_to_members)

    def staleness(self, learner_version: int) -> int:
        return max((e.staleness(learner_version) for e in self.ready.values()), default=0)

    def oldest_version(self, learner_version: int) -> int:
        """The oldest policy version among its ready members' trainable tokens."""
        return min(learner_version if e.min_version is None else e.min_version
                   for e in self.ready.values())

    def ready_since(self) -> float:
        """When its last ready member became ready (when it could first be served)."""
        return max(e.ready_at or 0.0 for e in self.ready.values())


class RolloutGroups:
    def __init__(self, rollout_timeout_s: float) -> None:
        self.timeout_s = rollout_timeout_s
        self.open: dict[GroupKey, Group] = {}
        self._closed: OrderedDict[GroupKey, None] = OrderedDict()

    def join(self, key: GroupKey, size: int, rollout_id: str, now: float) -> Group | None:
        """A member's first segment is stored: it is pending in its group
        (opened now if new). None: the group is closed (the member is late)."""
        group = self.open.get(key)
        if key in self._closed or (group is not None and group.closed_to_members):
            return None
        if group is None:
            group = self.open[key] = Group(key, size, now)
        group.pending.add(rollout_id)
        return group

    def ready(self, key: GroupKey, entry: Member) -> None:
        group = self.open[key]
        group.pending.discard(entry.rollout_id)
        group.ready[entry.rollout_id] = entry

    def left(self, key: GroupKey, size: int, rollout_id: str, now: float) -> None:
        """A member is dropped, known or unseen (given up before its first
        segment): it is settled, and its group closed once nothing is left."""
        group = self.open.get(key)
        if group is None:
            if key in self._closed or not key[3]:  # closed, or a rollout's own
                return
            group = self.open[key] = Group(key, size, now)
        group.pending.discard(rollout_id)
        group.ready.pop(rollout_id, None)
        group.dropped += 1
        if group.finished():
            self.close(group)

    def owner_gone(self, owner: Owner) -> None:
        """The actor incarnation is over: its groups take no more members."""
        for group in list(self.open.values()):
            if group.key[:2] == owner:
                group.closed_to_members = True
                if group.finished():
                    self.close(group)

    def sweep(self, now: float) -> None:
        """Forget the groups that hold nothing and waited past the timeout for
        members that never came."""
        for group in [g for g in self.open.values()
                      if g.empty and now - g.opened_at > self.timeout_s]:
            self.close(group)

    def servable(self, now: float) -> Iterator[Group]:
        return (g for g in self.open.values() if g.servable(now, self.timeout_s))

    def stale(self, learner_version: int, bound: int) -> list[Group]:
        """Groups whose oldest ready member is beyond ``bound`` (not yet closed)."""
        return [g for g in self.open.values() if g.staleness(learner_version) > bound]

    def close(self, group: Group) -> None:
        """Served or dropped whole: forgotten, its key remembered (a rollout's
        own key need not be: nothing else can join it)."""
        self.open.pop(group.key, None)
        if group.key[3]:
            self._closed[group.key] = None
            if len(self._closed) > CLOSED_MEMORY:
                self._closed.popitem(last=False)

    def reopen(self, entries: Iterable[Member]) -> None:
        """Groups served to a learner that died, back whole: servable at once,
        first, and closed to members as they were."""
        for entry in entries:
            self._closed.pop(entry.group, None)
            group = self.open.get(entry.group)
            if group is None:
                group = self.open[entry.group] = Group(
                    entry.group, entry.group_size, entry.first_seen, closed_to_members=True,
                    served_before=True)
            group.ready[entry.rollout_id] = entry
