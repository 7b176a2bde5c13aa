"""Snapshots of a run from its processes' ``/metrics``: what the live view,
the metrics history, ``compactionrl status`` and the report all show.

A snapshot is a flat dict of numbers (JSON-serialisable; ``None`` where a
figure has no data yet), named after what it shows. It describes the whole
run, not the processes answering now:

- totals (rollouts, tokens, drops, stall, staleness counts) add up over
  process incarnations: a counter that went down is a process that
  restarted, and its new count adds to the total (as PromQL's ``increase``);
  a :class:`RunScraper` resumed from a run's history adds to that history's
  totals (``up --resume`` starts every process afresh);
- the learner's step, version and published version only go up within a
  run; a learner that has not resumed yet serves none of them, and the last
  known value stands;
- the last batch's figures (reward, success, loss) stand while the learner is
  away; a figure of a kind the batch did not hold (NaN) is ``None``.

Rates (tokens per second) come from two consecutive snapshots.

Usage::

    scraper = RunScraper({"replay": url, "learner": url, "actor-0": url}, history)
    snapshot = scraper.snapshot()
    lines = summarise(snapshot, previous, first, RunEnds(max_steps=500))
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from ops.fleet import (
    ACTOR_KEY,
    STALL_REASONS,
    actor_rows,
    bottleneck,
    stall_shares,
    window_label,
)

#: A scrape slower than this counts as a process not answering (a busy
#: learner answers late: its HTTP thread waits for the GIL).
SCRAPE_TIMEOUT_S = 2.5

Samples = dict[str, list[tuple[dict[str, str], float]]]
Snapshot = dict[str, float | None]

#: Run totals: snapshot key -> (the process that counts it, counter, labels).
#: What actors did is the replay's count (it sums its per-actor series): it
#: registers every actor, whoever started it, where ``up`` scrapes only its own.
#: Rollouts by how many times they compacted, the last bucket open: the labels
#: of the learner's loss-weight and rollout counters (docs/learner.md, "Loss
#: weight by compaction count").
COMPACTION_BUCKETS = ("0", "1", "2", "3", "4", "5", "6", "7", "8+")


def compaction_bucket(compactions: int) -> str:
    """The bucket of a rollout that compacted ``compactions`` times."""
    return COMPACTION_BUCKETS[min(compactions, len(COMPACTION_BUCKETS) - 1)]


TOTALS: dict[str, tuple[str, str, dict[str, str]]] = {
    "learner_tokens": ("learner", "crl_learner_tokens_total", {}),
    "learner_idle_s": ("learner", "crl_learner_idle_seconds_total", {}),
    "actor_rollouts": ("replay", "crl_replay_actor_rollouts_total", {}),
    "actor_compactions": ("replay", "crl_replay_actor_compactions_total", {}),
    "actor_generated_tokens": ("replay", "crl_replay_actor_tokens_total", {"kind": "all"}),
    "actor_summary_tokens": ("replay", "crl_replay_actor_tokens_total", {"kind": "summary"}),
    "actor_slot_s": ("replay", "crl_replay_actor_slot_seconds_total", {}),
    "stall_weights_s": ("replay", "crl_replay_actor_stall_seconds_total", {"reason": "weights"}),
    "stall_credits_s": ("replay", "crl_replay_actor_stall_seconds_total", {"reason": "credits"}),
    "stall_summary_s": ("replay", "crl_replay_actor_stall_seconds_total", {"reason": "summary"}),
    "expired_rollouts": ("replay", "crl_replay_dropped_total", {"reason": "expired"}),
    "stale_rollouts": ("replay", "crl_replay_dropped_total", {"reason": "stale"}),
    "trained_rollouts": ("replay", "crl_replay_finished_rollouts_total", {"fate": "trained"}),
    "trained_successes": ("replay", "crl_replay_finished_rollouts_total",
                          {"fate": "trained", "success": "true"}),
    "trained_tokens": ("replay", "crl_replay_finished_rollout_tokens_total", {"fate": "trained"}),
    "stale_successes": ("replay", "crl_replay_finished_rollouts_total",
                        {"fate": "stale", "success": "true"}),
    "stale_tokens": ("replay", "crl_replay_finished_rollout_tokens_total", {"fate": "stale"}),
    "batches": ("replay", "crl_replay_batches_total", {}),
    "summary_factor_sum": ("learner", "crl_learner_cross_factor_sum_total",
                           {"segment_type": "summary"}),
    "summary_segments": ("learner", "crl_learner_trained_segments_total",
                         {"segment_type": "summary"}),
    "execution_factor_sum": ("learner", "crl_learner_cross_factor_sum_total",
                             {"segment_type": "execution"}),
    "execution_segments": ("learner", "crl_learner_trained_segments_total",
                           {"segment_type": "execution"}),
    "staleness_count": ("replay", "crl_replay_staleness_count", {}),
    "group_rollouts_complete": ("learner", "crl_learner_group_rollouts_total",
                                {"complete": "true"}),
    "group_rollouts_broken": ("learner", "crl_learner_group_rollouts_total",
                              {"complete": "false"}),
    **{f"loss_weight_c{bucket}": ("learner", "crl_learner_loss_weight_total",
                                  {"compactions": bucket}) for bucket in COMPACTION_BUCKETS},
    **{f"rollouts_c{bucket}": ("learner", "crl_learner_trained_rollouts_total",
                               {"compactions": bucket}) for bucket in COMPACTION_BUCKETS},
}
#: The learner's position: it only goes up within a run (snapshot key -> gauge).
LEARNER_POSITION = {
    "learner_step": "crl_learner_step",
    "learner_version": "crl_learner_policy_version",
    "published_version": "crl_learner_published_version",
}
#: The learner's last batch (snapshot key -> gauge, labels).
LAST_BATCH: dict[str, tuple[str, dict[str, str]]] = {
    "reward": ("crl_learner_reward", {}),
    "success_compacted": ("crl_learner_success_rate", {"compacted": "true"}),
    "success_uncompacted": ("crl_learner_success_rate", {"compacted": "false"}),
    "compactions_per_rollout": ("crl_learner_compactions_per_rollout", {}),
    "policy_loss": ("crl_learner_policy_loss", {}),
    "explained_variance": ("crl_learner_explained_variance", {}),
    "approx_kl": ("crl_learner_approx_kl", {}),
}
#: Per actor, from the replay's series: figure -> (counter, labels). Snapshot
#: keys are ``actor/<id>/<figure>``, totals over restarts like :data:`TOTALS`.
ACTOR_TOTALS: dict[str, tuple[str, dict[str, str]]] = {
    "trained": ("crl_replay_actor_rollouts_total", {"fate": "trained"}),
    "stale": ("crl_replay_actor_rollouts_total", {"fate": "stale"}),
    "tokens": ("crl_replay_actor_tokens_total", {"kind": "all"}),
    "credits": ("crl_replay_actor_credits_granted_total", {}),
    "staleness_sum": ("crl_replay_actor_staleness_total", {}),
    "slot_s": ("crl_replay_actor_slot_seconds_total", {}),
    **{f"stall_{reason}_s": ("crl_replay_actor_stall_seconds_total", {"reason": reason})
       for reason in STALL_REASONS},
}
#: Per actor, the replay's gauges now: figure -> gauge.
ACTOR_GAUGES = {"registered": "crl_replay_actor_registered",
                "capacity": "crl_replay_actor_capacity",
                "credits_held": "crl_replay_actor_credits_held"}
#: Run-level counts that ``up`` adds (restarts), summed over ``up`` invocations.
UP_COUNTS = ("actor_restarts", "replay_restarts", "learner_restarts", "up_invocations",
             "run_seconds")
STALENESS_BUCKET = "staleness_le_"


def scrape(url: str) -> Samples | None:
    """Every sample at ``url`` by name, or None if the process does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
            text = response.read().decode()
    except OSError:
        return None
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def _value(samples: Samples | None, name: str, **labels: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``labels``; None
    if there is none (the process does not answer or serves no such sample)."""
    found = [value for sample_labels, value in (samples or {}).get(name, [])
             if all(sample_labels.get(k) == x for k, x in labels.items())]
    return sum(found) if found else None


def _counters(samples: Samples, source: str) -> dict[str, float]:
    """The raw counters one process serves, by snapshot key."""
    raw = {key: _value(samples, name, **labels) or 0.0
           for key, (owner, name, labels) in TOTALS.items() if owner == source}
    if source == "replay":
        for labels, count in samples.get("crl_replay_staleness_bucket", []):
            if labels["le"] != "+Inf":
                raw[f"{STALENESS_BUCKET}{float(labels['le']):g}"] = count
        for figure, (name, wanted) in ACTOR_TOTALS.items():
            for labels, count in samples.get(name, []):
                if all(labels.get(k) == v for k, v in wanted.items()):
                    key = f"{ACTOR_KEY}{labels['actor']}/{figure}"
                    raw[key] = raw.get(key, 0.0) + count
    return raw


def training_window(history: list[Snapshot], steps: int | None = None
                    ) -> tuple[Snapshot, Snapshot]:
    """The snapshots of a run's ``metrics.jsonl`` at its first completed
    learner step and at its last (or the first at ``steps``, if given): the
    window a benchmark divides counters over. A snapshot taken while the
    learner was down carries no step of its own (``learner_step`` None)."""
    trained = [h for h in history if h.get("learner_up") and (h.get("learner_step") or 0) >= 1]
    if len(trained) < 2:
        raise ValueError("fewer than two metric snapshots with the learner training")
    last = trained[-1] if steps is None else next(
        (h for h in trained if h["learner_step"] >= steps), trained[-1])
    return trained[0], last


def finished_rollouts(snapshot: Snapshot) -> dict[str, float] | None:
    """What dropping stale rollouts does, from the replay's complete
    rollouts: ``stale_fraction`` of them dropped, and the mean sampled tokens
    and success of those trained against all of them (a bias toward short or
    easy episodes shows as a gap). None before any finished."""
    trained, stale = snapshot.get("trained_rollouts") or 0.0, snapshot.get("stale_rollouts") or 0.0
    if not trained:
        return None
    finished = trained + stale
    return {"stale_fraction": stale / finished,
            "trained_tokens_mean": (snapshot.get("trained_tokens") or 0.0) / trained,
            "finished_tokens_mean": ((snapshot.get("trained_tokens") or 0.0)
                                     + (snapshot.get("stale_tokens") or 0.0)) / finished,
            "trained_success": (snapshot.get("trained_successes") or 0.0) / trained,
            "finished_success": ((snapshot.get("trained_successes") or 0.0)
                                 + (snapshot.get("stale_successes") or 0.0)) / finished}


def stale_bias(snapshot: Snapshot) -> str:
    figures = finished_rollouts(snapshot)
    if figures is None:
        return ""
    return (f" ({100 * figures['stale_fraction']:.1f} % of finished); trained vs all finished: "
            f"{figures['trained_tokens_mean']:.0f} vs {figures['finished_tokens_mean']:.0f} "
            f"sampled tokens, success {figures['trained_success']:.2f} vs "
            f"{figures['finished_success']:.2f}")


def cross_factors(snapshot: Snapshot) -> dict[str, float]:
    """The mean cross-trajectory factor (gamma*lambda)^N_>s of the trained
    segments of each type (``summary``, ``execution``) over the run so far;
    a type with none trained yet is absent."""
    return {kind: (snapshot.get(f"{kind}_factor_sum") or 0.0) / count
            for kind in ("summary", "execution")
            if (count := snapshot.get(f"{kind}_segments") or 0.0)}


def weight_by_compactions(snapshot: Snapshot) -> dict[str, dict[str, float]]:
    """Per compaction bucket with any rollout trained: its share of the
    rollouts trained so far and its share of the loss weight they got (the
    sum of c_t over their tokens, over every minibatch); under token-level
    normalisation a bucket's weight share over its rollout share is its
    rollouts' length over the mean."""
    rollouts = {b: snapshot.get(f"rollouts_c{b}") or 0.0 for b in COMPACTION_BUCKETS}
    weights = {b: snapshot.get(f"loss_weight_c{b}") or 0.0 for b in COMPACTION_BUCKETS}
    total_rollouts, total_weight = sum(rollouts.values()), sum(weights.values())
    if not total_rollouts or not total_weight:
        return {}
    return {b: {"rollouts": rollouts[b] / total_rollouts, "weight": weights[b] / total_weight}
            for b in COMPACTION_BUCKETS if rollouts[b]}


def staleness_quantile(snapshot: Snapshot, q: float) -> float | None:
    """Quantile of the served rollouts' staleness from the run's cumulative
    buckets (the upper bound of the bucket); None without data or beyond the
    largest bound."""
    total = snapshot.get("staleness_count") or 0.0
    if total <= 0:
        return None
    bounds = sorted(float(k.removeprefix(STALENESS_BUCKET)) for k in snapshot
                    if k.startswith(STALENESS_BUCKET))
    return next((b for b in bounds if (snapshot[f"{STALENESS_BUCKET}{b:g}"] or 0.0) >= q * total),
                None)


def _finite(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


class RunScraper:
    """Snapshots of one run across process restarts and ``up`` invocations.

    Invariant, per total ``T`` and process ``p`` with raw counter ``c_p``::

        T(now) = T(start) + sum_p sum_scrapes (c_p(now) - c_p(before)  if c_p(now) >= c_p(before)
                                                c_p(now)               otherwise: p restarted)

    where ``T(start)`` is the last snapshot of the history it resumes (0 for a
    new run) and every process of this invocation starts from 0.
    """

    def __init__(self, urls: dict[str, str], history: list[Snapshot] | None = None) -> None:
        self.urls = urls
        self._last: Snapshot | None = dict(history[-1]) if history else None
        self._raw: dict[str, dict[str, float]] = {}
        #: what earlier ``up`` invocations counted
        self._earlier = {key: float((self._last or {}).get(key) or 0.0) for key in UP_COUNTS}

    def snapshot(self, counts: dict[str, float] | None = None) -> Snapshot:
        """Scrape every process once. ``counts``: this invocation's figures of
        :data:`UP_COUNTS` (restarts, its wall time); they add to the history's."""
        # the learner last: its idle count is then read when the snapshot is
        # stamped, and a share of the time between two snapshots made of it
        # is not skewed by the other scrapes (each up to SCRAPE_TIMEOUT_S)
        scraped = {name: scrape(url) for name, url in sorted(
            self.urls.items(), key=lambda item: item[0] == "learner")}
        return self.fold(scraped, counts or {})

    def fold(self, scraped: dict[str, Samples | None], counts: dict[str, float]) -> Snapshot:
        """The snapshot after the scrapes ``scraped`` (process name -> samples,
        None for a process that did not answer)."""
        last = self._last or {}
        learner, replay = scraped.get("learner"), scraped.get("replay")
        snapshot: Snapshot = {
            "time": time.time(),
            "learner_up": float(learner is not None),
            "replay_up": float(replay is not None),
            # the actors the replay has registered, whoever started them
            "actors_up": (_value(replay, "crl_replay_actor_registered") or 0.0
                          if replay is not None else last.get("actors_up")),
        }
        totals: dict[str, float] = {key: last.get(key) or 0.0 for key in TOTALS}
        totals.update({k: v or 0.0 for k, v in last.items()
                       if k.startswith(STALENESS_BUCKET) or k.startswith(ACTOR_KEY)})
        if replay is not None:  # else the last known stand
            for figure, gauge in ACTOR_GAUGES.items():
                for labels, value in replay.get(gauge, []):
                    totals[f"{ACTOR_KEY}{labels['actor']}/{figure}"] = value
        for name, samples in scraped.items():
            if samples is None:
                continue  # its counts stand; a restart shows as a decrease later
            raw = _counters(samples, name)
            before = self._raw.get(name, {})
            for key, value in raw.items():
                previous = before.get(key, 0.0)
                totals[key] = totals.get(key, 0.0) + (value - previous if value >= previous
                                                      else value)
            self._raw[name] = raw
        snapshot.update(totals)
        for key, gauge in LEARNER_POSITION.items():
            values = [v for v in (last.get(key), _value(learner, gauge)) if v is not None]
            snapshot[key] = max(values) if values else None
        for key, (gauge, labels) in LAST_BATCH.items():
            value = _value(learner, gauge, **labels)
            snapshot[key] = _finite(value) if value is not None else last.get(key)
        for key in UP_COUNTS:
            snapshot[key] = self._earlier[key] + counts.get(key, 0.0)
        self._last = snapshot
        return snapshot


@dataclass
class RunEnds:
    """Where a run stops: whichever comes first."""

    max_steps: int
    max_minutes: float = 0.0
    """0: no wall-time limit."""
    started: float = 0.0
    """Wall-clock time (``time.time()``) this invocation of ``up`` started."""


def _stall_line(shares: dict[str, float]) -> str:
    if not shares:
        return "no episode-slot time yet"
    return (", ".join(f"{reason} {100 * share:.1f} %" for reason, share in shares.items())
            + " of episode-slot time")


def _number(value: float | None, form: str = ".0f", missing: str = "no data") -> str:
    return missing if value is None else format(value, form)


#: The live view's rates (tokens/s, each actor's rollouts and stall, the
#: bottleneck) are over at least this long: the replay counts an actor's
#: rollouts and tokens when a batch is confirmed, so the 2 s between two
#: snapshots often hold none, and read as an idle fleet.
LIVE_WINDOW_S = 30.0


def window_start(snapshots: list[Snapshot]) -> Snapshot | None:
    """The snapshot the live view's rates count from: the newest one at
    least :data:`LIVE_WINDOW_S` before the last (else the first); None
    with fewer than two."""
    if len(snapshots) < 2:
        return None
    end = snapshots[-1]["time"] - LIVE_WINDOW_S  # type: ignore[operator]
    return next((s for s in reversed(snapshots[:-1]) if s["time"] <= end),  # type: ignore[operator]
                snapshots[0])


def pace_start(snapshots: list[Snapshot]) -> Snapshot | None:
    """The snapshot a pace is counted from: the first of ``snapshots`` with a
    learner step (the learner reports none until it is up, and the first
    snapshots of a run come before that)."""
    return next((s for s in snapshots if s.get("learner_step") is not None), None)


def eta(now: Snapshot, first: Snapshot | None, ends: RunEnds) -> str:
    """Seconds to the first end: ``max_steps`` at the pace since ``first`` (the
    first snapshot of this invocation), or ``max_minutes`` of wall time."""
    candidates: list[tuple[float, str]] = []
    step, start = now.get("learner_step"), (first or {}).get("learner_step")
    if step is not None and start is not None and step > start:
        pace = (now["time"] - first["time"]) / (step - start)  # type: ignore[index,operator]
        candidates.append((max(0.0, ends.max_steps - step) * pace, "max_steps"))
    if ends.max_minutes:
        candidates.append((max(0.0, ends.started + ends.max_minutes * 60 - now["time"]),
                           "max_minutes"))
    if not candidates:
        return "no pace yet"
    seconds, which = min(candidates)
    return f"{seconds:.0f} s ({which})"


def _rate(now: Snapshot, start: Snapshot, key: str) -> float:
    """``key``'s increase per second from ``start`` to ``now``."""
    return max(0.0, ((now[key] or 0.0) - (start.get(key) or 0.0))
               / (now["time"] - start["time"]))  # type: ignore[operator]


def _actor_lines(now: Snapshot, window: Snapshot | None) -> dict[str, str]:
    """A line per actor the replay registered: its figures over the whole
    run (its counts add up to the run's, and one that left keeps them), then
    over the window from ``window`` to ``now`` where there is one."""
    recent = actor_rows(now, window) if window is not None else {}
    return {f"actor {actor}": row.text() + (
        f"; {recent[actor].window_text(window_label(now, window))}" if window is not None else "")
        for actor, row in actor_rows(now).items()}


def summarise(now: Snapshot, before: Snapshot | None, first: Snapshot | None, ends: RunEnds,
              ended: str | None = None) -> dict[str, str]:
    """Human-readable lines of the live view, ``summary.txt`` and ``compactionrl
    status``: counts over the whole run; rates and stall since ``before``,
    labelled with that window; the ETA from the pace since ``first``.
    ``ended``: how the run ended (then no ETA, rates or liveness: they would
    describe processes that are gone, and stall is the whole run's)."""
    window = (before if not ended and before is not None
              and now["time"] > before["time"] else None)  # type: ignore[operator]
    label = window_label(now, window) if window is not None else ""
    generated = now["actor_generated_tokens"] or 0.0
    share = (now["actor_summary_tokens"] or 0.0) / generated if generated else None
    rollouts = now["actor_rollouts"] or 0.0
    version = now.get("learner_version")
    learner = (f"step {_number(now.get('learner_step'), missing='-')}/{ends.max_steps}, "
               + (f"version {version:.0f}" if version is not None else "no version yet")
               + f" (published {_number(now.get('published_version'), missing='none')})")
    p50, p95 = staleness_quantile(now, 0.5), staleness_quantile(now, 0.95)
    lines = {
        "learner": learner if ended else f"{learner}, ETA {eta(now, first, ends)}",
        "reward": f"{_number(now.get('reward'), '.3f')}; success compacted "
                  f"{_number(now.get('success_compacted'), '.2f')}, uncompacted "
                  f"{_number(now.get('success_uncompacted'), '.2f')}",
        "compaction": (f"{(now['actor_compactions'] or 0.0) / rollouts:.2f} per rollout"
                       if rollouts else "no rollouts yet")
                      + f" ({rollouts:.0f} rollouts); summary-token share "
                        f"{_number(share, '.3f')}",
        "stall": _stall_line(stall_shares(now, window)) + (f", {label}" if label else ""),
        "staleness": f"p50 {_number(p50, missing='-')}, p95 {_number(p95, missing='-')}; "
                     f"expired rollouts {now['expired_rollouts'] or 0.0:.0f}, "
                     f"stale {now['stale_rollouts'] or 0.0:.0f}" + stale_bias(now),
        "credit": "cross-trajectory factor (applied with advantage = cross): " + (", ".join(
            f"{kind} {mean:.3f}" for kind, mean in cross_factors(now).items()) or "-"),
        "restarts": f"actors {now.get('actor_restarts') or 0:.0f}, replay "
                    f"{now.get('replay_restarts') or 0:.0f}, learner "
                    f"{now.get('learner_restarts') or 0:.0f}",
    }
    lines.update(_actor_lines(now, window))
    if not ended and (holding_back := bottleneck(now, window)) is not None:
        lines["bottleneck"] = holding_back
    if ended:
        invocations = now.get("up_invocations") or 1
        lines["ended"] = (f"{ended}; wall time {now.get('run_seconds') or 0:.0f} s"
                          + (f" over {invocations:.0f} invocations of up"
                             if invocations > 1 else ""))
        lines["ended at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z",
                                          time.localtime(now.get("time") or time.time()))
    else:
        lines["throughput"] = (
            f"actors {_rate(now, window, 'actor_generated_tokens'):.0f} tokens/s, learner "
            f"{_rate(now, window, 'learner_tokens'):.0f} tokens/s, {label}"
            if window is not None else "no window yet")
        lines["processes"] = (f"replay {'up' if now['replay_up'] else 'DOWN'}, learner "
                              f"{'up' if now['learner_up'] else 'DOWN'}, "
                              f"actors {now.get('actors_up') or 0:.0f} registered")
    return lines
