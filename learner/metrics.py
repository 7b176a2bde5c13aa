"""The learner's Prometheus metrics (docs/design.md §4, learner part), served by rank 0."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from learner.replay_client import ReplayClientCounters
from ops.metrics import WaitSeconds
from ops.summary import COMPACTION_BUCKETS, compaction_bucket

#: PPO statistics exported as gauges: metric name -> key in the step's metrics.
STEP_GAUGES = {
    "crl_learner_policy_loss": "losses/policy_loss",
    "crl_learner_value_loss": "losses/value_loss",
    "crl_learner_clip_fraction": "losses/clipfrac",
    "crl_learner_approx_kl": "losses/approx_kl",
    "crl_learner_is_weight_mean": "losses/is_weight_mean",
    "crl_learner_is_truncated_fraction": "losses/is_affected_frac",
    "crl_learner_explained_variance": "losses/value_explained_variance",
    "crl_learner_grad_norm": "losses/policy_grad_norm",
}


class LearnerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.step_seconds = Histogram("crl_learner_step_seconds", "Time of one learner step",
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
                                      registry=r)
        self.tokens = Counter("crl_learner_tokens", "Trainable tokens trained on", registry=r)
        # Served from when the learner knows them (after resuming): a learner
        # that has not resumed yet serves no version, not version 0.
        self.policy_version = Gauge("crl_learner_policy_version", "Policy version",
                                    registry=None)
        self._position_served = False
        self.step = Gauge("crl_learner_step",
                          "Learner steps taken in the run (continues across restarts)",
                          registry=None)
        self.reward = Gauge("crl_learner_reward", "Mean final reward of the last batch",
                            registry=r)
        self.success_rate = Gauge("crl_learner_success_rate",
                                  "Success rate of the last batch, by compaction",
                                  ["compacted"], registry=r)
        self.rollout_reward = Histogram(
            "crl_learner_rollout_reward", "Final reward of each rollout trained on (the "
            "distribution behind crl_learner_reward, the batch mean)",
            buckets=(-1.0, -0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0), registry=r)
        self.rollout_compactions = Histogram(
            "crl_learner_rollout_compactions", "Compactions of each rollout trained on",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.tagged_success_rate = Gauge(
            "crl_learner_tagged_success_rate",
            "Success rate of the last batch's rollouts whose task has this tag value "
            "(Task.tags); NaN when the batch had none", ["tag", "value"], registry=r)
        self._tags_seen: set[tuple[str, str]] = set()
        self.compactions = Gauge("crl_learner_compactions_per_rollout",
                                 "Mean compactions per rollout of the last batch", registry=r)
        self.idle_seconds = WaitSeconds("crl_learner_idle_seconds",
                                        "Time waiting for batches from the replay")
        r.register(self.idle_seconds)
        self.rejected_batches = Counter("crl_learner_rejected_batches",
                                        "Batches refused before any update", registry=r)
        self.duplicate_batches = Counter(
            "crl_learner_duplicate_batches",
            "Batches received again after a reconnect and dropped (trained once)", registry=r)
        self.duplicate_rollouts = Counter(
            "crl_learner_duplicate_rollouts",
            "Rollouts served again that this learner took before (the replay restarted "
            "before it asked again), dropped (trained once)", registry=r)
        self.weight_sync_seconds = Histogram(
            "crl_learner_weight_sync_seconds",
            "Weight publication by phase: gather (from FSDP shards), broadcast "
            "(rank 0 to actors), load (reported by each actor)", ["phase"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120), registry=r)
        self.publications = Counter("crl_learner_weight_publications",
                                    "Weight publications by result", ["result"], registry=r)
        for result in ("ok", "failed"):  # from 0: a rate over the first failure sees it
            self.publications.labels(result)
        self.published_version = Gauge("crl_learner_published_version",
                                       "Version of the last successful publication", registry=r)
        self.member_exclusions = Counter(
            "crl_learner_member_exclusions",
            "Times a member was left out of publications after a generation it made fail "
            "(it never joined, or its lane's broadcast failed)", registry=r)
        self.members_excluded = Gauge(
            "crl_learner_members_excluded",
            "Members that publications leave out now after failed generations", registry=r)
        self.retired_weight_groups = Gauge(
            "crl_learner_weight_groups_retired",
            "Aborted weight groups rank 0 still holds (an NCCL one for the process's life)",
            registry=r)
        self.members = Gauge("crl_learner_weight_members",
                             "Actors registered for weight broadcasts", registry=r)
        self.disk_free = Gauge("crl_learner_disk_free_bytes",
                               "Free bytes on the filesystem of the run folder (checkpoints)",
                               registry=r)
        self.disk_size = Gauge("crl_learner_disk_size_bytes",
                               "Size of the filesystem of the run folder", registry=r)
        self.rejected_frames = Counter("crl_learner_rejected_frames",
                                       "Frames refused on the control socket, or dropped "
                                       "from the replay, by reason", ["reason"], registry=r)
        self.cross_factor_sum = Counter(
            "crl_learner_cross_factor_sum",
            "Sum over trained segments of the cross-trajectory factor "
            "(gamma*lambda)^N_>s under the run's lambda (applied with advantage = cross), "
            "by segment type; over crl_learner_trained_segments_total, its mean",
            ["segment_type"], registry=r)
        self.loss_weight = Counter(
            "crl_learner_loss_weight",
            "Sum of the loss weights c_t over the trained tokens of rollouts that "
            "compacted this many times (the last bucket open), over every minibatch: "
            "each minibatch's weights sum to 1, so a bucket's share of the total is the "
            "share of the loss its rollouts had", ["compactions"], registry=r)
        self.trained_rollouts = Counter(
            "crl_learner_trained_rollouts", "Rollouts trained on, by how many times they "
            "compacted (the last bucket open)", ["compactions"], registry=r)
        for bucket in COMPACTION_BUCKETS:  # from 0: a share over buckets sees every one
            self.loss_weight.labels(bucket)
            self.trained_rollouts.labels(bucket)
        self.group_rollouts = Counter(
            "crl_learner_group_rollouts", "Rollouts trained on that belong to a group "
            "(Segment.group), by whether all G of their group were in the same batch: "
            "group-relative advantages assume they were", ["complete"], registry=r)
        for complete in ("true", "false"):
            self.group_rollouts.labels(complete)
        self.trained_segments = Counter(
            "crl_learner_trained_segments", "Segments with trainable tokens trained on, by type",
            ["segment_type"], registry=r)
        self.gauges = {name: Gauge(name, f"PPO statistic {key}", registry=r)
                       for name, key in STEP_GAUGES.items()}

    def replay_client(self) -> ReplayClientCounters:
        """The counters rank 0's replay client keeps."""
        return ReplayClientCounters(self.duplicate_batches, self.duplicate_rollouts,
                                    self.idle_seconds, self.rejected_frames)

    def resumed(self, version: int, step: int) -> None:
        """The learner's position is known (a fresh start or a resumed
        checkpoint): serve it from now on."""
        self.policy_version.set(version)
        self.step.set(step)
        if not self._position_served:
            self._position_served = True
            self.registry.register(self.policy_version)
            self.registry.register(self.step)

    def record(self, metrics: dict[str, float], rewards: list[float], successes: list[bool],
               compactions: list[int], seconds: float, version: int, step: int,
               tags: list[dict[str, str]] | None = None,
               grouped: dict[bool, int] | None = None) -> None:
        """One step's figures; ``grouped``: its rollouts with a group, by
        whether their whole group was in the batch (``TrainBatch.grouped_rollouts``)."""
        self.step_seconds.observe(seconds)
        self.tokens.inc(metrics.get("tokens", 0.0))
        self.resumed(version, step)
        for kind in ("summary", "execution"):
            self.cross_factor_sum.labels(kind).inc(metrics.get(f"advantages/{kind}_factor_sum", 0))
            self.trained_segments.labels(kind).inc(metrics.get(f"advantages/{kind}_segments", 0))
        for name, key in STEP_GAUGES.items():
            if key in metrics:
                self.gauges[name].set(metrics[key])
        if rewards:
            self.reward.set(sum(rewards) / len(rewards))
            self.compactions.set(sum(compactions) / len(compactions))
        for reward, count in zip(rewards, compactions, strict=True):
            self.rollout_reward.observe(reward)
            self.rollout_compactions.observe(count)
            self.trained_rollouts.labels(compaction_bucket(count)).inc()
        for complete, count in (grouped or {}).items():
            self.group_rollouts.labels(str(complete).lower()).inc(count)
        for bucket in COMPACTION_BUCKETS:
            self.loss_weight.labels(bucket).inc(metrics.get(f"loss_weight/{bucket}", 0.0))
        for label, chosen in (("true", [s for s, c in zip(successes, compactions, strict=True)
                                        if c > 0]),
                              ("false", [s for s, c in zip(successes, compactions, strict=True)
                                         if c == 0])):
            # NaN, not a stale value, when the batch had no rollout of this kind
            self.success_rate.labels(label).set(sum(chosen) / len(chosen) if chosen
                                                else float("nan"))
        by_tag: dict[tuple[str, str], list[bool]] = defaultdict(list)
        for success, labels in zip(successes, tags or [{}] * len(successes), strict=True):
            for tag, value in labels.items():
                by_tag[tag, value].append(success)
        self._tags_seen |= set(by_tag)
        for tag, value in self._tags_seen:
            chosen = by_tag.get((tag, value), [])
            self.tagged_success_rate.labels(tag, value).set(
                sum(chosen) / len(chosen) if chosen else float("nan"))
