"""One snapshot of a run from its processes' ``/metrics``: what the live view,
the metrics history, ``compactionrl status`` and the report all show.

A snapshot is a flat dict of numbers (JSON-serialisable), named after what
it shows; rates (tokens per second) come from two consecutive snapshots.

Usage::

    snapshot = scrape_run({"replay": url, "learner": url, "actor-0": url})
    summary = summarise(snapshot, previous)
"""

from __future__ import annotations

import time
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

#: A scrape slower than this counts as a process not answering (a busy
#: learner answers late: its HTTP thread waits for the GIL).
SCRAPE_TIMEOUT_S = 2.5

Samples = dict[str, list[tuple[dict[str, str], float]]]


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


def _value(samples: Samples | None, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    if not samples:
        return 0.0
    return sum(value for found, value in samples.get(name, [])
               if all(found.get(k) == x for k, x in labels.items()))


def _quantile(samples: Samples | None, name: str, q: float) -> float | None:
    """Quantile of a histogram from its cumulative buckets (upper bound of the bucket)."""
    buckets = sorted((float(found["le"]), value)
                     for found, value in (samples or {}).get(f"{name}_bucket", []))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= q * total)


def scrape_run(urls: dict[str, str], previous: dict | None = None) -> dict[str, float | None]:
    """One snapshot: learner, replay and the sum over the actors that answer."""
    scraped = {name: scrape(url) for name, url in urls.items()}
    learner, replay = scraped.get("learner"), scraped.get("replay")
    actors = [s for n, s in scraped.items() if n.startswith("actor") and s]
    total = lambda name, **labels: sum(_value(a, name, **labels) for a in actors)  # noqa: E731
    finished = total("crl_actor_rollouts_total")
    generated = total("crl_actor_generated_tokens_total")
    snapshot: dict[str, float | None] = {
        "time": time.time(),
        "learner_up": float(learner is not None),
        "replay_up": float(replay is not None),
        "actors_up": float(len(actors)),
        "learner_step_count": _value(learner, "crl_learner_step_seconds_count"),
        "learner_step_seconds_sum": _value(learner, "crl_learner_step_seconds_sum"),
        "learner_version": _value(learner, "crl_learner_policy_version"),
        "learner_tokens": _value(learner, "crl_learner_tokens_total"),
        "learner_idle_s": _value(learner, "crl_learner_idle_seconds_total"),
        "reward": _value(learner, "crl_learner_reward"),
        "success_compacted": _value(learner, "crl_learner_success_rate", compacted="true"),
        "success_uncompacted": _value(learner, "crl_learner_success_rate", compacted="false"),
        "compactions_per_rollout": _value(learner, "crl_learner_compactions_per_rollout"),
        "policy_loss": _value(learner, "crl_learner_policy_loss"),
        "published_version": _value(learner, "crl_learner_published_version"),
        "actor_rollouts": finished,
        "actor_compactions": total("crl_actor_compactions_total"),
        "actor_generated_tokens": generated,
        "actor_summary_tokens": total("crl_actor_summary_tokens_total"),
        "stall_weights_s": total("crl_actor_stall_seconds_total", reason="weights"),
        "stall_credits_s": total("crl_actor_stall_seconds_total", reason="credits"),
        "stall_summary_s": total("crl_actor_stall_seconds_total", reason="summary"),
        "staleness_p50": _quantile(replay, "crl_replay_staleness", 0.5),
        "staleness_p95": _quantile(replay, "crl_replay_staleness", 0.95),
        "expired_rollouts": _value(replay, "crl_replay_dropped_total", reason="expired"),
        "stale_rollouts": _value(replay, "crl_replay_dropped_total", reason="stale"),
        "batches": _value(replay, "crl_replay_batches_total"),
    }
    for labels, count in (replay or {}).get("crl_replay_staleness_bucket", []):
        if labels["le"] != "+Inf":
            snapshot[f"staleness_le_{float(labels['le']):g}"] = count
    if previous:
        learner_keys = ("learner_step", "learner_version", "learner_tokens", "reward",
                        "success_", "compactions_per_rollout", "policy_loss",
                        "published_version")
        silent = {"learner": learner is None, "replay": replay is None, "actors": not actors}
        prefixes = {"learner": learner_keys,
                    "replay": ("staleness_", "expired_", "stale_", "batches"),
                    "actors": ("actor_", "stall_")}
        for source, quiet in silent.items():
            if quiet:
                for key, value in previous.items():
                    if key.startswith(prefixes[source]):
                        snapshot[key] = value
    return snapshot


def summarise(now: dict, before: dict | None, first: dict | None, max_steps: int
              ) -> dict[str, str]:
    """Human-readable lines of the live view and of ``compactionrl status``:
    rates since ``before``, the ETA from the pace since ``first``."""
    def rate(key: str) -> float:
        if not before or now["time"] <= before["time"]:
            return 0.0
        # a counter that went down is a process that restarted or did not
        # answer this time: no rate, rather than a negative one
        return max(0.0, (now[key] - before[key]) / (now["time"] - before["time"]))

    steps = now["learner_step_count"]
    generated = now["actor_generated_tokens"]
    share = now["actor_summary_tokens"] / generated if generated else 0.0
    rollouts = now["actor_rollouts"]
    done = steps - (first["learner_step_count"] if first else 0)
    eta = "-" if not first or done <= 0 else (
        f"{(max_steps - steps) * (now['time'] - first['time']) / done:.0f} s")
    p50, p95 = now["staleness_p50"], now["staleness_p95"]
    return {
        "learner": f"step {steps:.0f}/{max_steps}, version {now['learner_version']:.0f} "
                   f"(published {now['published_version']:.0f}), ETA {eta}",
        "reward": f"{now['reward']:.3f}; success compacted {now['success_compacted']:.2f}, "
                  f"uncompacted {now['success_uncompacted']:.2f}",
        "compaction": f"{now['actor_compactions'] / rollouts if rollouts else 0:.2f} per "
                      f"rollout ({rollouts:.0f} rollouts); summary-token share {share:.3f}",
        "stall": f"weights {now['stall_weights_s']:.1f} s, credits "
                 f"{now['stall_credits_s']:.1f} s, summary {now['stall_summary_s']:.1f} s",
        "staleness": f"p50 {'-' if p50 is None else f'{p50:.0f}'}, "
                     f"p95 {'-' if p95 is None else f'{p95:.0f}'}; expired rollouts "
                     f"{now['expired_rollouts']:.0f}, stale {now['stale_rollouts']:.0f}",
        "throughput": f"actors {rate('actor_generated_tokens'):.0f} tokens/s, learner "
                      f"{rate('learner_tokens'):.0f} tokens/s",
        "processes": f"replay {'up' if now['replay_up'] else 'DOWN'}, learner "
                     f"{'up' if now['learner_up'] else 'DOWN'}, actors {now['actors_up']:.0f}",
    }
