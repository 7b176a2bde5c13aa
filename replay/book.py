"""The replay's books on rollouts, whichever socket a message came on: the
rollouts held (:class:`~replay.buffer.RolloutBuffer`), the credits out
(:class:`~replay.pacing.CreditPacer`), the seqs seen, the durable log and the
newest learner version. Every drop, release and recovery goes through here,
so that the counters, the credits and the log always tell the same story.

Usage::

    book = RolloutBook(config, transport, vocab_size, metrics)   # recovers the log
    book.drop(rollout_id, "stale")          # counted, its credit or place freed
    book.set_learner_version(version)       # durable, and what is now stale dropped
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from ops.metrics import watch_disk
from protocol import Abandon, GroupTag, ProtocolError, Segment, decode
from protocol.transport import TransportConfig
from protocol.validation import check_segment_content
from replay.buffer import Owner, RolloutBuffer, RolloutEntry
from replay.config import ReplayConfig
from replay.log import RELEASED, SEGMENT, VERSION, DurableLog, decode_version
from replay.metrics import ReplayMetrics
from replay.pacing import CreditPacer

log = logging.getLogger("compactionrl.replay")

#: Seqs remembered per sender for duplicate detection, beyond the newest:
#: resends come within seconds, so this window is generous.
DEDUP_WINDOW = 1 << 20
#: Compact the log once this many bytes in it are dead and they outweigh the live ones.
COMPACT_MIN_BYTES = 64 * 1024 * 1024


def owner_of(message: Segment | Abandon) -> Owner:
    """The actor incarnation a segment or abandon speaks for."""
    return message.sender_id, message.incarnation


class SeenSeqs:
    """Seqs seen per (sender, incarnation), bounded by a window behind the newest."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], set[int]] = defaultdict(set)
        self._newest: dict[tuple[str, int], int] = {}

    def __contains__(self, key: tuple[str, int, int]) -> bool:
        sender, incarnation, seq = key
        return seq in self._seen.get((sender, incarnation), ())

    def add(self, key: tuple[str, int, int]) -> None:
        sender, incarnation, seq = key
        seen = self._seen[(sender, incarnation)]
        seen.add(seq)
        newest = max(self._newest.get((sender, incarnation), seq), seq)
        self._newest[(sender, incarnation)] = newest
        if len(seen) > 2 * DEDUP_WINDOW:
            self._seen[(sender, incarnation)] = {s for s in seen if s > newest - DEDUP_WINDOW}

    def forget(self, sender: str, incarnation: int) -> None:
        """The incarnation is over: the registry refuses its messages from
        now on, before any could be taken for a resend."""
        self._seen.pop((sender, incarnation), None)
        self._newest.pop((sender, incarnation), None)


class RolloutBook:
    def __init__(self, config: ReplayConfig, transport: TransportConfig, vocab_size: int,
                 metrics: ReplayMetrics) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.max_message_bytes = transport.max_message_bytes
        self.metrics = metrics
        self.buffer = RolloutBuffer(config.max_staleness + config.stale_grace,
                                    config.serve_order, config.rollout_timeout_s)
        self.pacer = CreditPacer(config.rollouts_per_batch, config.max_staleness,
                                 config.max_buffer_bytes)
        self.seen = SeenSeqs()
        self.learner_version = 0
        """The newest policy version the learner has asked with (kept in the
        durable log): trainable tokens of a newer version are refused from
        the first segment on, since the learner asks with a version before
        it publishes it."""
        self.compact_min_bytes = COMPACT_MIN_BYTES
        self.log: DurableLog | None = None
        if config.durable_log:
            watch_disk(metrics.disk_free, metrics.disk_size, Path(config.log_path).parent)
            self.log = DurableLog(Path(config.log_path), config.fsync, config.fsync_interval_s)
            self._recover()

    def _recover(self) -> None:
        """Rebuild the rollouts and the learner version from the log: what
        was stored and not released is held again, ready or pending."""
        now = time.monotonic()
        recovered, skipped = 0, []
        for kind, payload in self.log.recover():
            if kind == SEGMENT:
                try:  # a log written by another build, or for another model
                    segment = decode(payload, self.max_message_bytes)
                    oldest = check_segment_content(segment, vocab_size=self.vocab_size,
                                                   oldest_version=0, newest_version=2**31 - 1)
                except ProtocolError as exc:
                    skipped.append(str(exc))
                    continue
                self.seen.add((segment.sender_id, segment.incarnation, segment.seq))
                if self.buffer.add(segment, payload, now, oldest) == "stored":
                    recovered += 1
                    if self.buffer.promote(segment.rollout_id, now) is not None:
                        self.pacer.accepted += 1
            elif kind == RELEASED:
                entry = self.buffer.remove(payload.decode())
                if entry is not None and entry.ready_at is not None:
                    self.pacer.accepted -= 1
            elif kind == VERSION:
                self.learner_version = max(self.learner_version, decode_version(payload))
        self.metrics.learner_version.set(self.learner_version)
        # recovered pending rollouts may still complete: their actors resend or go on
        self.metrics.recovered_segments.inc(recovered)
        self.metrics.unrecoverable_segments.inc(len(skipped))
        if skipped:
            log.warning("%d segments in %s cannot be recovered and were skipped (first: %s)",
                        len(skipped), self.config.log_path, skipped[0])
        log.info("recovered %d segments: %d rollouts ready, %d pending", recovered,
                 len(self.buffer.ready), len(self.buffer.pending))

    def set_learner_version(self, version: int) -> None:
        """The learner asked with ``version``: a newer one is made durable
        before any actor samples with it (the learner publishes a version
        after asking with it), and what it makes stale is dropped."""
        if version > self.learner_version:
            self.learner_version = version
            self.metrics.learner_version.set(version)
            if self.log is not None:
                self.log.append_version(version)
                self.log.sync(force=True)
        self.drop_stale()

    def drop_stale(self) -> None:
        for entry in self.buffer.stale(self.learner_version):
            self.drop(entry.rollout_id, "stale")

    def drop(self, rollout_id: str, reason: str, owner: Owner | None = None,
             group: GroupTag | None = None) -> None:
        """Drop a rollout, counted, and free its place. With ``owner`` the
        rollout may have nothing stored yet (its first segment was refused,
        or its actor gave it up first): it is dropped all the same, its id
        and owner remembered (its later segments are late, not a rollout that
        could never complete), the credit its actor spent on it returned, and
        ``group``, its group if it said, counts it settled."""
        entry = self.buffer.remove(rollout_id, owner, group)
        if entry is None:
            if owner is not None:
                self.metrics.dropped.labels(reason).inc()
                self.pacer.finished(owner[0], accepted=False)
            return
        self.metrics.dropped.labels(reason).inc()
        if entry.ready_at is not None:
            self.count_finished(entry, reason)
            self.pacer.dropped()
        else:
            self.pacer.finished(entry.actor_id, accepted=False)
        self.release(entry)

    def release(self, entry: RolloutEntry) -> None:
        """The rollout is gone for good (trained or dropped): the log may forget it."""
        if self.log is not None:
            self.log.append_released(entry.rollout_id, entry.nbytes)

    def count_finished(self, entry: RolloutEntry, fate: str, staleness: int = 0) -> None:
        """Count a complete rollout's end (``trained`` or why it was dropped),
        by whether its episode succeeded, and its trainable tokens; and per
        actor, with its compactions and (trained) its ``staleness``."""
        final = entry.segments[entry.final_index].segment
        success = (final.stats.success if final.stats is not None
                   else (final.reward or 0.0) > 0)
        sampled = sum(int(s.segment.loss_mask.numpy().sum()) for s in entry.segments.values())
        self.metrics.finished.labels(fate, str(success).lower()).inc()
        self.metrics.finished_tokens.labels(fate).inc(sampled)
        series = self.metrics.by_actor
        actor = series.label(entry.actor_id)
        series.rollouts.labels(actor, fate).inc()
        series.staleness.labels(actor).inc(staleness)
        # a harness's rollout may carry no stats: its sampled tokens are what it generated
        stats = final.stats
        series.tokens.labels(actor, "all").inc(sampled if stats is None
                                               else stats.generated_tokens)
        if stats is not None:
            series.tokens.labels(actor, "summary").inc(stats.summary_tokens)
            series.compactions.labels(actor).inc(stats.compactions)

    def expire(self, now: float) -> None:
        """Drop the pending rollouts that waited past ``rollout_timeout_s``."""
        for entry in self.buffer.expired(now, set()):
            self.drop(entry.rollout_id, "expired")
        self.buffer.groups.sweep(now)

    def sync_and_compact(self, unconfirmed_frames: Iterable[bytes | memoryview]) -> None:
        """The periodic log work: an interval fsync, and a background
        compaction once released records outweigh the live ones (the log's
        write amplification stays under 2x and its size under twice the live
        bytes plus the minimum). The compacted log keeps the live rollouts
        and ``unconfirmed_frames``, the batches served and not yet confirmed."""
        if self.log is None:
            return
        self.log.sync()
        if (not self.log.compacting
                and self.log.released_bytes > max(self.compact_min_bytes, self.buffer.nbytes)):
            self.log.start_compaction(self.buffer.live_frames() + list(unconfirmed_frames),
                                      self.learner_version)

    def swap_compacted_log(self) -> None:
        """Put a finished background compaction in the log's place, as soon as
        it is done: what the log gains until then is copied in the loop."""
        if self.log is None or not self.log.compacting:
            return
        try:
            self.log.finish_compaction()
        except OSError as exc:  # the old log is whole: the next tick tries again
            log.warning("%s", exc)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
