"""Rollout assembly and staleness-aware serving, as a plain data structure.

Segments arrive in any order, possibly twice. A rollout is *pending* until
its final segment has arrived and no index below it is missing; then it is
*ready*. Pending rollouts expire (their actor died, or they grew too old);
ready rollouts beyond the staleness bound are dropped when the learner's
version moves. Nothing is served twice: a rollout leaves the buffer when it
is served or dropped, and late segments of it are recognised and ignored.

A rollout belongs to the actor incarnation that sent its first segment (its
*owner*, remembered also once it is served or dropped): only the owner's
segments and abandon may touch it (the replay refuses the others).

Rollouts are served by groups, whole (replay/groups.py: a rollout without a
group is one of its own), and dropped stale by groups. Serving order
(``serve_order``) among the servable groups: ``fifo`` serves the groups that
became servable first; ``freshest`` those whose oldest token has the newest
version (least stale), ``oldest`` those with the oldest (nearest the bound),
ties by readiness; groups served to a learner that died come first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from protocol import FramedRollout, GroupTag, Segment
from replay.groups import Group, GroupKey, Owner, RolloutGroups, group_key

#: Remember this many served or dropped rollout ids, so late resends of
#: their segments are recognised instead of starting a ghost rollout.
RELEASED_MEMORY = 100_000
#: What remembering one id of the longest length (``MAX_ID_CHARS``) costs at
#: most, the id, its owner and its place in the table: the memory above is
#: bounded by ``RELEASED_MEMORY * RELEASED_ID_BYTES`` (docs/replay.md, "Memory").
RELEASED_ID_BYTES = 1024

#: What holding one stored segment costs beyond its frame: the decoded
#: message, its array views and the tables' entries. Measured at 3,204 bytes
#: for a one-token segment with 256-character ids (docs/replay.md, "Memory"):
#: counted, so that ``max_buffer_bytes`` bounds memory even when a peer sends
#: many tiny segments.
SEGMENT_OVERHEAD_BYTES = 4096



@dataclass
class StoredSegment:
    segment: Segment
    frame: bytes | memoryview
    """The wire frame (kept for log compaction; the arrays are views into it)."""

    @property
    def nbytes(self) -> int:
        return len(self.frame)


@dataclass
class RolloutEntry:
    rollout_id: str
    actor_id: str
    incarnation: int
    first_seen: float
    group: GroupKey
    """The group it is served with (its first segment's ``group``)."""
    group_size: int
    segments: dict[int, StoredSegment] = field(default_factory=dict)
    final_index: int | None = None
    ready_at: float | None = None
    nbytes: int = 0
    """Its segments' frames, in bytes (what the log holds of it)."""
    min_version: int | None = None
    """Oldest policy version among its segments' trainable tokens (None: none
    trainable), kept as segments arrive: staleness reads it for every ready
    rollout on every learner request."""

    @property
    def owner(self) -> Owner:
        return self.actor_id, self.incarnation

    @property
    def held_bytes(self) -> int:
        """What holding it costs: its frames and each segment's overhead."""
        return self.nbytes + SEGMENT_OVERHEAD_BYTES * len(self.segments)

    @property
    def complete(self) -> bool:
        return self.final_index is not None and len(self.segments) == self.final_index + 1

    def staleness(self, learner_version: int) -> int:
        """Versions its oldest trainable token is behind ``learner_version``
        (0 for tokens of a version the learner's request has not yet named)."""
        oldest = self.min_version
        return 0 if oldest is None else max(0, learner_version - oldest)


AddResult = Literal["stored", "late", "conflict", "late_member"]


class RolloutBuffer:
    def __init__(self, max_staleness: int, serve_order: Literal["fifo", "freshest", "oldest"],
                 rollout_timeout_s: float) -> None:
        """``max_staleness``: the most a rollout may be served at (the
        configured bound plus its grace)."""
        self.max_staleness = max_staleness
        self.serve_order = serve_order
        self.rollout_timeout_s = rollout_timeout_s
        self.pending: dict[str, RolloutEntry] = {}
        self.ready: dict[str, RolloutEntry] = {}  # insertion order = readiness order
        self.nbytes = 0
        """The memory its rollouts hold (their ``held_bytes``), which
        ``max_buffer_bytes`` bounds."""
        self._released: OrderedDict[str, Owner | None] = OrderedDict()
        """Served or dropped rollout ids, oldest first, with their owners."""
        self.groups = RolloutGroups(rollout_timeout_s)

    def add(self, segment: Segment, frame: bytes | memoryview, now: float,
            min_version: int | None) -> AddResult:
        """Store a segment whose oldest trainable version is ``min_version``
        (from the content check). ``late``: its rollout was already served or dropped.
        ``conflict``: another segment already holds this index, a second
        final segment arrived, or its group differs from the rollout's first
        segment's: the rollout is inconsistent (the caller drops it).
        ``late_member``: the first segment of a rollout whose group was
        already served or dropped, or whose actor is gone (the caller drops it)."""
        if self.settled(segment.rollout_id):
            return "late"
        tag = segment.group
        entry = self.pending.get(segment.rollout_id)
        if entry is None:
            key = group_key((segment.sender_id, segment.incarnation),
                            None if tag is None else tag.id, segment.rollout_id)
            size = 1 if tag is None else tag.size
            if self.groups.join(key, size, segment.rollout_id, now) is None:
                return "late_member"
            entry = self.pending[segment.rollout_id] = RolloutEntry(
                segment.rollout_id, segment.sender_id, segment.incarnation, now,
                group=key, group_size=size)
        if (entry.group[3], entry.group[2], entry.group_size) != (
                (False, segment.rollout_id, 1) if tag is None else (True, tag.id, tag.size)):
            return "conflict"
        if segment.index in entry.segments or (
                segment.final and entry.final_index is not None) or (
                entry.final_index is not None and segment.index > entry.final_index) or (
                segment.final and any(i > segment.index for i in entry.segments)):
            return "conflict"
        stored = StoredSegment(segment, frame)
        entry.segments[segment.index] = stored
        entry.nbytes += stored.nbytes
        self.nbytes += stored.nbytes + SEGMENT_OVERHEAD_BYTES
        if min_version is not None and (entry.min_version is None
                                        or min_version < entry.min_version):
            entry.min_version = min_version
        if segment.final:
            entry.final_index = segment.index
        return "stored"

    def owner(self, rollout_id: str) -> Owner | None:
        """The actor incarnation the rollout belongs to, if it is known."""
        entry = self.pending.get(rollout_id) or self.ready.get(rollout_id)
        return entry.owner if entry is not None else self._released.get(rollout_id)

    def settled(self, rollout_id: str) -> bool:
        """Whether the rollout is complete, served or dropped: a segment of it
        that arrives now is late."""
        return rollout_id in self._released or rollout_id in self.ready

    def promote(self, rollout_id: str, now: float) -> RolloutEntry | None:
        """Move the rollout to ready if it is complete; returns it if so."""
        entry = self.pending.get(rollout_id)
        if entry is None or not entry.complete:
            return None
        del self.pending[rollout_id]
        entry.ready_at = now
        self.ready[rollout_id] = entry
        self.groups.ready(entry.group, entry)
        return entry

    def remove(self, rollout_id: str, owner: Owner | None = None,
               group: GroupTag | None = None) -> RolloutEntry | None:
        """Drop a rollout wherever it is, remembering its id and owner, also
        when none of its segments is stored (``owner`` is then the actor
        whose first segment was refused or that gave it up, ``group`` its
        group if it said): its later segments are then late, not the start
        of a rollout that could never complete; its group counts it settled."""
        entry = self._discard(rollout_id, owner)
        if entry is not None:
            self.groups.left(entry.group, entry.group_size, rollout_id, time.monotonic())
        elif owner is not None and group is not None:
            self.groups.left(group_key(owner, group.id, rollout_id), group.size, rollout_id,
                             time.monotonic())
        return entry

    def _discard(self, rollout_id: str, owner: Owner | None = None) -> RolloutEntry | None:
        """Forget a rollout's segments (served or dropped), remembering its id."""
        entry = self.pending.pop(rollout_id, None) or self.ready.pop(rollout_id, None)
        if entry is not None:
            self.nbytes -= entry.held_bytes
            owner = entry.owner
        self._remember(rollout_id, owner)
        return entry

    def restore(self, entries: list[RolloutEntry]) -> None:
        """Put rollouts taken by ``take`` back, their groups whole and first
        in serving order: their batch never reached a learner that survived."""
        for entry in entries:
            self._released.pop(entry.rollout_id, None)
            self.nbytes += entry.held_bytes
        self.ready = {entry.rollout_id: entry for entry in entries} | self.ready
        self.groups.reopen(entries)

    def _remember(self, rollout_id: str, owner: Owner | None) -> None:
        self._released[rollout_id] = owner
        if len(self._released) > RELEASED_MEMORY:
            self._released.popitem(last=False)

    def expired(self, now: float, dead: set[tuple[str, int]]) -> list[RolloutEntry]:
        """Pending rollouts whose actor incarnation is dead or that are older
        than the timeout (not yet removed)."""
        return [e for e in self.pending.values()
                if (e.actor_id, e.incarnation) in dead
                or now - e.first_seen > self.rollout_timeout_s]

    def stale(self, learner_version: int) -> list[RolloutEntry]:
        """The members, ready and pending, of the groups beyond the staleness
        bound; the groups are closed (the caller drops the members)."""
        members = []
        for group in self.groups.stale(learner_version, self.max_staleness):
            self.groups.close(group)
            members += [*group.ready.values(), *(self.pending[r] for r in group.pending)]
        return members

    def take(self, size: int, learner_version: int, now: float) -> list[Group]:
        """Remove and return whole servable groups in serving order, the
        fewest that hold ``size`` rollouts or more (the caller has dropped
        stale ones first). Empty if the servable groups hold fewer."""
        if len(self.ready) < size:  # no group can make up for it: the usual wait, at once
            return []
        def order(group: Group) -> tuple[bool, int, float]:
            oldest = 0 if self.serve_order == "fifo" else group.oldest_version(learner_version)
            return (not group.served_before,
                    -oldest if self.serve_order == "freshest" else oldest, group.ready_since())
        chosen, count = [], 0
        for group in sorted(self.groups.servable(now), key=order):
            if count >= size:
                break
            chosen.append(group)
            count += len(group.ready)
        if count < size:
            return []
        for group in chosen:
            self.groups.close(group)
            for rollout_id in group.ready:
                self._discard(rollout_id)
        return chosen

    def live_frames(self) -> list[bytes | memoryview]:
        """Frames of every stored segment (what log compaction keeps)."""
        return [s.frame for entries in (self.pending, self.ready) for e in entries.values()
                for s in e.segments.values()]


def to_rollout(entry: RolloutEntry, learner_version: int) -> FramedRollout:
    """The rollout as a batch serves it: its segments' frames as stored, in
    index order (nothing is decoded or encoded again)."""
    return FramedRollout(rollout_id=entry.rollout_id,
                         staleness=entry.staleness(learner_version),
                         segments=[msgspec.Raw(entry.segments[i].frame)
                                   for i in range(len(entry.segments))])
