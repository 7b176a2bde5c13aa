"""The actor's Prometheus metrics (docs/design.md §4, actor part)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ops.metrics import WaitSeconds
from ops.timeline import add_span
from protocol import STALL_REASONS, EngineInfo, Error, RolloutStats

log = logging.getLogger("compactionrl.actor")


class EngineMetrics(Collector):
    """vLLM's own engine metrics (KV-cache usage, running and waiting
    requests, time to first token, ...), which vLLM registers in the
    process's default registry, served beside ours under names that pass
    ``promtool check metrics``: ``vllm:x`` becomes ``vllm_x`` (``:`` is for
    recording rules), and a histogram or gauge named ``..._total``
    (``vllm:iteration_tokens_total``) loses the suffix, which counters own."""

    def __init__(self, source: CollectorRegistry = REGISTRY) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if not family.name.startswith("vllm:"):
                continue
            name = family.name.replace(":", "_")
            clean = (name.removesuffix("_total") if family.type != "counter" else name)
            renamed = Metric(clean, family.documentation, family.type, family.unit)
            for sample in family.samples:
                sample_name = clean + sample.name.replace(":", "_")[len(name):]
                renamed.add_sample(sample_name, sample.labels, sample.value, sample.timestamp,
                                   sample.exemplar)
            yield renamed


#: A wait shorter than this is no span of the run timeline (most episodes
#: start at once: a span each would be most of the file).
MIN_WAIT_SPAN_S = 0.001


class StallSeconds(WaitSeconds):
    """``crl_actor_stall_seconds_total`` by reason, each wait counted from its
    start (:class:`ops.metrics.WaitSeconds`): a scrape or a heartbeat in the
    middle of a wait sees the part already waited. Counted only when a wait
    ended, the stall of a slot that never got a credit would read 0, and a
    share of slot time made of it would read low; an episode's summaries,
    counted when it ended, landed in one window and read over 100 % of it."""

    def __init__(self) -> None:
        super().__init__("crl_actor_stall_seconds", "Time episodes waited, by reason",
                         STALL_REASONS)

    @contextmanager
    def waiting(self, reason: str = "", marked: bool = True) -> Iterator[None]:
        """Count the time spent inside as stall of ``reason``, from now on;
        a span of the run timeline unless ``marked`` is False (an episode
        marks its summaries itself, with their tokens)."""
        began = time.monotonic()
        try:
            with super().waiting(reason):
                yield
        finally:
            ended = time.monotonic()
            if marked and ended - began >= MIN_WAIT_SPAN_S:
                add_span(reason, began, ended)


class ActorMetrics:
    """One registry per actor, served on its metrics port (with vLLM's
    engine metrics: :class:`EngineMetrics`)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        r.register(EngineMetrics())
        self.rollouts = Counter("crl_actor_rollouts", "Finished rollouts by outcome",
                                ["outcome"], registry=r)
        self.compactions = Counter("crl_actor_compactions", "Compactions performed", registry=r)
        # compactions per rollout is a ratio of rates in PromQL: rate of
        # crl_actor_compactions_total over rate of crl_actor_rollouts_total
        self.compaction_tokens = Counter(
            "crl_actor_compaction_tokens",
            "Tokens generated as summaries at compactions (a metric name may not say "
            "'summary', a Prometheus type)", registry=r)
        self.generated_tokens = Counter("crl_actor_generated_tokens",
                                        "Tokens generated (actions and summaries)", registry=r)
        self.stall_seconds = StallSeconds()
        r.register(self.stall_seconds)
        self.policy_version = Gauge("crl_actor_policy_version",
                                    "Policy version the engine generates with", registry=r)
        self.engine_info = Gauge("crl_actor_engine_info", "Engine of this actor (value 1)",
                                 ["device", "dtype", "tp", "model"], registry=r)
        self.reward = Counter("crl_actor_reward_sum", "Sum of final rewards", registry=r)
        self.successes = Counter("crl_actor_successes", "Rollouts that solved the task",
                                 ["compacted"], registry=r)
        self.segments_sent = Counter("crl_actor_segments_sent", "Segments sent (first time)",
                                     registry=r)
        self.segments_resent = Counter("crl_actor_segments_resent",
                                       "Segments sent again after no ack", registry=r)
        self.unacked_segments = Gauge("crl_actor_unacked_segments",
                                      "Segments sent and not yet acknowledged", registry=r)
        self.episode_slots = Gauge("crl_actor_episode_slots",
                                   "Episodes this actor runs at once (stall share = stall "
                                   "seconds per second / slots)", registry=r)
        self.active_rollouts = Gauge("crl_actor_active_rollouts", "Episodes in progress",
                                     registry=r)
        self.rollouts_in_progress = 0
        """What ``active_rollouts`` shows, as a number a weight load's pause reads."""
        self.credits_held = Gauge("crl_actor_credits_held",
                                  "Credits granted and not yet spent on an episode", registry=r)
        self.learner_registered = Gauge(
            "crl_actor_learner_registered",
            "1 while the learner's control plane knows this actor (no episode starts "
            "without it: weights freshness is the learner's word)", registry=r)
        self.rejected_frames = Counter("crl_actor_rejected_frames",
                                       "Frames from peers that failed to decode", ["reason"],
                                       registry=r)
        self.errors_received = Counter("crl_actor_errors_received",
                                       "Error replies received, by code", ["code"], registry=r)
        self.weight_failures = Counter("crl_actor_weight_load_failures",
                                       "Weight publications not loaded (a broadcast failed)",
                                       registry=r)
        self.disconnects = Counter("crl_actor_disconnects",
                                   "Connections to a peer that dropped (ZeroMQ reconnects)",
                                   ["peer"], registry=r)
        self.credits_recovered = Counter(
            "crl_actor_credits_recovered",
            "Credits whose reply was lost (a dropped connection), made up by a later one",
            registry=r)
        self.reincarnations = Counter("crl_actor_reincarnations",
                                      "Times this process registered as a new incarnation "
                                      "after the replay declared the old one dead", registry=r)
        self.abandoned_rollouts = Counter("crl_actor_abandoned_rollouts",
                                          "Episodes cancelled unfinished (declared dead, or "
                                          "stopped with on_shutdown = abandon)", registry=r)
        self.segments_abandoned = Counter("crl_actor_segments_abandoned",
                                          "Unacknowledged segments given up with a dead "
                                          "incarnation (the replay expired their rollouts)",
                                          registry=r)
        self.observations_cut = Counter("crl_actor_observations_cut",
                                        "Observations cut to fit budget or window", registry=r)
        self.tool_call_errors = Counter(
            "crl_actor_tool_call_errors", "Tool calls answered with an error observation "
            "instead of being run, by reason (malformed, unknown_tool, invalid_arguments)",
            ["reason"], registry=r)
        self.endpoint_calls = Counter(
            "crl_actor_endpoint_calls", "Chat completions the recording endpoint served, by "
            "segment type (summary: marked as the harness's summarisation)",
            ["segment_type"], registry=r)
        self.endpoint_errors = Counter(
            "crl_actor_endpoint_errors", "Requests the recording endpoint refused, by reason "
            "(no_credit is the 429 a harness retries)", ["reason"], registry=r)
        self.endpoint_rebuilds = Counter(
            "crl_actor_endpoint_rebuilds", "Calls whose prompt did not extend the session's "
            "context (a new execution segment: the harness rewrote its history)", registry=r)
        self.endpoint_sessions = Counter(
            "crl_actor_endpoint_sessions", "Harness sessions ended, by how (rewarded, "
            "abandoned: no call or reward within session_timeout_s, or the actor stopping)",
            ["end"], registry=r)

    def refused(self, peer: str, error: Error) -> None:
        """A peer refused one of the actor's messages: counted by code, logged."""
        self.errors_received.labels(error.code).inc()
        log.warning("%s rejected seq %s: %s %s", peer, error.ref_seq, error.code, error.text)

    def set_engine(self, engine: EngineInfo) -> None:
        self.engine_info.labels(engine.device, engine.dtype, str(engine.tensor_parallel),
                                engine.model).set(1)

    def episode_finished(self, reward: float, stats: RolloutStats, observations_cut: int,
                         tool_call_errors: Mapping[str, int]) -> None:
        """An episode is over (its summaries counted as stall while written)."""
        self.rollouts.labels(stats.outcome).inc()
        self.compactions.inc(stats.compactions)
        self.compaction_tokens.inc(stats.summary_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        self.reward.inc(reward)
        if stats.success:
            self.successes.labels("true" if stats.compactions else "false").inc()
        self.observations_cut.inc(observations_cut)
        for reason, count in tool_call_errors.items():
            self.tool_call_errors.labels(reason).inc(count)

    def rollout_begun(self) -> None:
        self.rollouts_in_progress += 1
        self.active_rollouts.set(self.rollouts_in_progress)

    def rollout_landed(self) -> None:
        self.rollouts_in_progress -= 1
        self.active_rollouts.set(self.rollouts_in_progress)

    def generation_paused(self, seconds: float) -> None:
        """A weight load paused generation ``seconds``: a stall of every
        rollout in progress, each in its own slot. A slot that waits for the
        weights counts its own wait already (and one that waits for a credit
        has no episode to pause), so a share of slot time stays at most 1."""
        self.stall_seconds.add("weights", seconds * self.rollouts_in_progress)

    def stall_totals(self) -> dict[str, float]:
        """Cumulative stall by reason, waits under way included, as sent in heartbeats."""
        return self.stall_seconds.totals()
