"""The replay's Prometheus metrics (docs/design.md §4, replay part)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DROP_REASONS = ("stale", "expired", "full", "invalid", "abandoned", "late_member")
SEGMENT_RESULTS = ("accepted", "duplicate", "rejected")
#: What becomes of a complete rollout: trained (its batch arrived), or dropped.
FINISHED_FATES = ("trained", "stale")
#: Actor ids labelled one by one in the per-actor series; later ones share
#: :data:`OTHER_ACTORS`, so that a fleet that churns through ids (or a peer
#: that makes them up) cannot grow the replay's metrics without bound.
ACTOR_SERIES_LIMIT = 1024
OTHER_ACTORS = "(others)"


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
        self.groups_served = Counter(
            "crl_replay_groups_served",
            "Groups of rollouts (Segment.group) served, by whether all G of the group were: "
            "an incomplete one lost members (abandoned, expired, its actor gone)",
            ["complete"], registry=r)
        self.group_rollouts_served = Counter(
            "crl_replay_group_rollouts_served",
            "Rollouts of groups served, by whether their group was complete", ["complete"],
            registry=r)
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
        self.by_actor = ActorSeries(r)
        self.recovered_segments = Counter("crl_replay_recovered_segments",
                                          "Segments recovered from the log at start",
                                          registry=r)
        self.unrecoverable_segments = Counter(
            "crl_replay_unrecoverable_segments",
            "Segments in the log at start that failed to decode or validate, skipped",
            registry=r)
        for result in SEGMENT_RESULTS:
            self.segments.labels(result)
        for complete in ("true", "false"):
            self.groups_served.labels(complete)
            self.group_rollouts_served.labels(complete)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        for fate in FINISHED_FATES:
            self.finished_tokens.labels(fate)
            for success in ("true", "false"):
                self.finished.labels(fate, success)
        for state in ("pending", "ready"):
            self.rollouts.labels(state)


class ActorSeries:
    """Per actor (label ``actor``): what the views show of each one, kept
    by the replay, which registers every actor, whoever started it."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.registered = Gauge("crl_replay_actor_registered",
                                "1 while the actor's incarnation is registered", ["actor"],
                                registry=r)
        self.capacity = Gauge("crl_replay_actor_capacity", "Episodes it runs at once (Hello)",
                              ["actor"], registry=r)
        self.slot_seconds = Counter(
            "crl_replay_actor_slot_seconds",
            "Episode-slot time between its heartbeats (capacity x seconds), counted with the "
            "stall they report: what stall shares divide by",
            ["actor"], registry=r)
        self.stall_seconds = Counter(
            "crl_replay_actor_stall_seconds", "Stall its heartbeats reported, by reason",
            ["actor", "reason"], registry=r)
        self.credits_granted = Counter("crl_replay_actor_credits_granted", "Credits granted",
                                       ["actor"], registry=r)
        self.credits_held = Gauge("crl_replay_actor_credits_held",
                                  "Credits granted and not yet returned", ["actor"], registry=r)
        self.rollouts = Counter("crl_replay_actor_rollouts",
                                "Complete rollouts by fate (trained, stale)", ["actor", "fate"],
                                registry=r)
        self.tokens = Counter(
            "crl_replay_actor_tokens",
            "Tokens its complete rollouts generated, by kind (all: actions and summaries; "
            "summary)", ["actor", "kind"], registry=r)
        self.compactions = Counter("crl_replay_actor_compactions",
                                   "Compactions in its complete rollouts", ["actor"], registry=r)
        self.staleness = Counter(
            "crl_replay_actor_staleness",
            "Sum of its trained rollouts' staleness (versions): over its trained rollouts, "
            "the mean version lag", ["actor"], registry=r)
        self._labelled: set[str] = set()

    def label(self, actor_id: str) -> str:
        """The ``actor`` label of ``actor_id`` (:data:`ACTOR_SERIES_LIMIT`)."""
        if actor_id in self._labelled or len(self._labelled) < ACTOR_SERIES_LIMIT:
            self._labelled.add(actor_id)
            return actor_id
        return OTHER_ACTORS
