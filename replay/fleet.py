"""Every actor the replay registers, as the views count it: per-actor series
(replay/metrics.py, ``ActorSeries``) and Prometheus's list of targets.

The replay is the one process that hears from every actor, whether ``up``
started it, a user started it by hand or Kubernetes did; so the live view,
``compactionrl status``, ``summary.txt`` and the report take the fleet from
here, not from the processes ``up`` knows of (docs/running.md, "What each
actor did"). What it counts:

- while an incarnation is registered: ``registered`` 1 and its ``capacity``;
- at each of its heartbeats, two counters at once: ``slot_seconds``, its
  capacity x the time since its last heartbeat, and ``stall_seconds``, the
  increase of each reason's total it reports over that time; so a share of
  slot time, ``stall_seconds / slot_seconds`` over any window, is one of
  two counts of the same span, in one unit everywhere;
- credits granted and held; its complete rollouts by fate, their generated
  and summary tokens, compactions, and the staleness of those trained.

With a targets path it also keeps Prometheus's file-based discovery list
(``ops.observability.write_actor_targets``): each registered actor's
``Hello.metrics_address``, rewritten as actors register and leave, so a
Prometheus that reads it scrapes an actor added by hand at once and stops
judging one that left.

Usage::

    fleet = Fleet(metrics.by_actor, targets_path, run="local-cpu")
    fleet.joined(peer, hello.metrics_address)
    fleet.heartbeat(peer, heartbeat.stall_seconds, now)
    fleet.tick(registry.peers.values(), pacer.outstanding)
    fleet.left(peer)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from ops.observability import write_actor_targets
from protocol import STALL_REASONS
from protocol.registry import Peer
from replay.metrics import ActorSeries

log = logging.getLogger("compactionrl.replay")


class Fleet:
    def __init__(self, series: ActorSeries, targets_path: Path | None = None,
                 run: str | None = None) -> None:
        self.series = series
        self.targets_path = targets_path
        self.run = run
        self._targets: dict[str, str] = {}
        """Per registered actor with a metrics address: that address."""
        if targets_path is not None:
            self._write_targets()  # a restarted replay lists no actor until they say hello

    def joined(self, peer: Peer, metrics_address: str) -> None:
        actor = self.series.label(peer.actor_id)
        self.series.registered.labels(actor).set(1)
        self.series.capacity.labels(actor).set(peer.capacity)
        if metrics_address and self._targets.get(peer.actor_id) != metrics_address:
            self._targets[peer.actor_id] = metrics_address
            self._write_targets()

    def left(self, peer: Peer) -> None:
        """The incarnation is over (goodbye, silence or a successor)."""
        actor = self.series.label(peer.actor_id)
        self.series.registered.labels(actor).set(0)
        self.series.credits_held.labels(actor).set(0)
        if self._targets.pop(peer.actor_id, None) is not None:
            self._write_targets()

    def heartbeat(self, peer: Peer, stall_seconds: Mapping[str, float], now: float) -> None:
        """Count the incarnation's slot time since its last heartbeat (at
        monotonic ``now``) and the increase of each stall total it reports
        over that time (finite and not negative: the decoder's ranges);
        unknown reasons are ignored (a peer must not make up labels).

        The two move together: with slot time counted at each tick and
        stall at each heartbeat, a scrape read them up to a heartbeat
        interval apart, and a share over two snapshots 2 s apart read up to
        200 %. Counted together, a share over any window is the stall an
        actor reported between two of its heartbeats over the slot time
        between them: at most 1, while each of its slots is in one wait at
        a time, but for how much later the first of the two was handled
        here than the last (milliseconds, over seconds).

        The first heartbeat the replay hears of an incarnation is where both
        start: its totals hold waits from before the incarnation registered
        here (the whole process's, after a replay restart or a new
        incarnation of the same process), which no slot time of this
        replay's covers and an earlier replay may have counted."""
        actor = self.series.label(peer.actor_id)
        previous, peer.heartbeat_at = peer.heartbeat_at, now
        if previous is not None:
            self.series.slot_seconds.labels(actor).inc(peer.capacity * max(0.0, now - previous))
        for reason in STALL_REASONS:
            total = stall_seconds.get(reason)
            if total is None:
                continue
            increase = total - peer.stall_reported.get(reason, 0.0)
            if increase > 0:
                if previous is not None:
                    self.series.stall_seconds.labels(actor, reason).inc(increase)
                peer.stall_reported[reason] = total

    def granted(self, actor_id: str, credits: int) -> None:
        self.series.credits_granted.labels(self.series.label(actor_id)).inc(credits)

    def tick(self, peers: Iterable[Peer], outstanding: Mapping[str, int]) -> None:
        """The credits each actor holds."""
        for peer in peers:
            self.series.credits_held.labels(self.series.label(peer.actor_id)).set(
                outstanding.get(peer.actor_id, 0))

    def _write_targets(self) -> None:
        if self.targets_path is None:
            return
        try:
            write_actor_targets(self.targets_path, self._targets, self.run)
        except OSError as exc:  # the run goes on unobserved rather than stopping
            log.warning("cannot write Prometheus's actor targets to %s: %s",
                        self.targets_path, exc)
