"""Every actor the replay registers, as the views count it: per-actor series
(replay/metrics.py, ``ActorSeries``) and Prometheus's list of targets.

The replay is the one process that hears from every actor, whether ``up``
started it, a user started it by hand or Kubernetes did; so the live view,
``compactionrl status``, ``summary.txt`` and the report take the fleet from
here, not from the processes ``up`` knows of (docs/running.md, "What each
actor did"). What it counts:

- while an incarnation is registered: ``registered`` 1, its ``capacity``,
  and ``slot_seconds`` growing by capacity x time;
- the stall its heartbeats report, as increases of each reason's total
  (a new incarnation reports from 0), so that a share of slot time is
  ``stall_seconds / slot_seconds`` over any window, in one unit everywhere;
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
    fleet.heartbeat(peer, heartbeat.stall_seconds)
    fleet.tick(now, registry.peers.values(), pacer.outstanding)
    fleet.left(peer)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from ops.observability import write_actor_targets
from protocol import STALL_REASONS
from replay.metrics import ActorSeries
from replay.registry import Peer

log = logging.getLogger("compactionrl.replay")


class Fleet:
    def __init__(self, series: ActorSeries, targets_path: Path | None = None,
                 run: str | None = None) -> None:
        self.series = series
        self.targets_path = targets_path
        self.run = run
        self._targets: dict[str, str] = {}
        """Per registered actor with a metrics address: that address."""
        self._ticked = time.monotonic()
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

    def heartbeat(self, peer: Peer, stall_seconds: Mapping[str, float]) -> None:
        """Count the increase of each stall total since the incarnation's
        last report (finite and not negative: the decoder's ranges); unknown
        reasons are ignored (a peer must not make up labels)."""
        actor = self.series.label(peer.actor_id)
        for reason in STALL_REASONS:
            total = stall_seconds.get(reason)
            if total is None:
                continue
            increase = total - peer.stall_reported.get(reason, 0.0)
            if increase > 0:
                self.series.stall_seconds.labels(actor, reason).inc(increase)
                peer.stall_reported[reason] = total

    def granted(self, actor_id: str, credits: int) -> None:
        self.series.credits_granted.labels(self.series.label(actor_id)).inc(credits)

    def tick(self, now: float, peers: Iterable[Peer], outstanding: Mapping[str, int]) -> None:
        """Slot time since the last tick, and the credits each actor holds."""
        elapsed, self._ticked = max(0.0, now - self._ticked), now
        for peer in peers:
            actor = self.series.label(peer.actor_id)
            self.series.slot_seconds.labels(actor).inc(peer.capacity * elapsed)
            self.series.credits_held.labels(actor).set(outstanding.get(peer.actor_id, 0))

    def _write_targets(self) -> None:
        if self.targets_path is None:
            return
        try:
            write_actor_targets(self.targets_path, self._targets, self.run)
        except OSError as exc:  # the run goes on unobserved rather than stopping
            log.warning("cannot write Prometheus's actor targets to %s: %s",
                        self.targets_path, exc)
