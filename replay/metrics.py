"""The replay's Prometheus metrics (DESIGN §4, replay part)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DROP_REASONS = ("stale", "expired", "full", "invalid", "abandoned")
SEGMENT_RESULTS = ("accepted", "duplicate", "rejected")
#: What becomes of a complete rollout: trained (its batch arrived), or dropped.
FINISHED_FATES = ("trained", "stale")


class ReplayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.disk_free = Gauge("crl_replay_disk_free_bytes",
                               "Free bytes on the filesystem of the segment log", registry=r)
        self.disk_size = Gauge("crl_replay_disk_size_bytes",
                               "Size of the filesystem of the segment log", registry=r)
        self.segments = Counter("crl_replay_segments", "Segments received, by result",
                                ["result"], registry=r)
        self.rejected = Counter("crl_replay_rejected_messages",
                                "Messages rejected, by reason", ["reason"], registry=r)
        self.rollouts = Gauge("crl_replay_rollouts", "Rollouts held, by state", ["state"],
                              registry=r)
        self.dropped = Counter("crl_replay_dropped", "Rollouts dropped, by reason", ["reason"],
                               registry=r)
        self.finished = Counter(
            "crl_replay_finished_rollouts",
            "Complete rollouts by fate (trained, or dropped: stale) and success: against "
            "every finished one, whether dropping biases what is trained", ["fate", "success"],
            registry=r)
        self.finished_tokens = Counter(
            "crl_replay_finished_rollout_tokens",
            "Sampled (trainable) tokens of complete rollouts, by fate", ["fate"], registry=r)
        self.staleness = Histogram("crl_replay_staleness",
                                   "Staleness of served rollouts (learner versions)",
                                   buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.credits_outstanding = Gauge("crl_replay_credits_outstanding",
                                         "Credits granted and not yet returned", registry=r)
        self.credits_granted = Counter("crl_replay_credits_granted", "Credits granted",
                                       registry=r)
        self.replies_undelivered = Counter(
            "crl_replay_replies_undelivered",
            "Replies not sent: the peer's connection was gone or its queue full", registry=r)
        self.buffer_bytes = Gauge("crl_replay_buffer_bytes", "Bytes of stored segments",
                                  registry=r)
        self.log_bytes = Gauge("crl_replay_log_bytes", "Size of the durable log", registry=r)
        self.batches = Counter("crl_replay_batches", "Batches served", registry=r)
        self.batches_resent = Counter(
            "crl_replay_batches_resent",
            "Batches served again: the learner asked again after a reconnect", registry=r)
        self.batches_returned = Counter(
            "crl_replay_batches_returned",
            "Batches whose learner died before asking again: their rollouts are served "
            "again", registry=r)
        self.learner_version = Gauge("crl_replay_learner_version",
                                     "Learner version last reported", registry=r)
        self.actors_alive = Gauge("crl_replay_actors_alive", "Actors heard from recently",
                                  registry=r)
        self.recovered_segments = Counter("crl_replay_recovered_segments",
                                          "Segments recovered from the log at start",
                                          registry=r)
        self.unrecoverable_segments = Counter(
            "crl_replay_unrecoverable_segments",
            "Segments in the log at start that failed to decode or validate, skipped",
            registry=r)
        for result in SEGMENT_RESULTS:
            self.segments.labels(result)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        for fate in FINISHED_FATES:
            self.finished_tokens.labels(fate)
            for success in ("true", "false"):
                self.finished.labels(fate, success)
        for state in ("pending", "ready"):
            self.rollouts.labels(state)
