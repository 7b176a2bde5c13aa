"""The learner's metric names (docs/design.md §4) and what a step records."""

from __future__ import annotations

from learner.metrics import STEP_GAUGES, LearnerMetrics


def test_a_step_is_recorded_under_the_design_names() -> None:
    metrics = LearnerMetrics()
    step = {"tokens": 120.0, **{key: 0.5 for key in STEP_GAUGES.values()},
            "advantages/summary_factor_sum": 1.5, "advantages/summary_segments": 3.0,
            "advantages/execution_factor_sum": 4.0, "advantages/execution_segments": 5.0,
            "loss_weight/0": 0.25, "loss_weight/1": 0.25, "loss_weight/2": 0.5}
    metrics.record(step, rewards=[1.0, 0.0, 1.0], successes=[True, False, True],
                   compactions=[2, 0, 1], seconds=1.5, version=7, step=5)
    value = metrics.registry.get_sample_value
    assert value("crl_learner_policy_version") == 7
    assert value("crl_learner_step") == 5
    assert value("crl_learner_tokens_total") == 120
    assert value("crl_learner_reward") == 2 / 3
    assert value("crl_learner_success_rate", {"compacted": "true"}) == 1.0
    assert value("crl_learner_success_rate", {"compacted": "false"}) == 0.0
    assert value("crl_learner_step_seconds_count") == 1
    assert value("crl_learner_rollout_reward_count") == 3
    assert value("crl_learner_rollout_reward_bucket", {"le": "0.0"}) == 1
    assert value("crl_learner_rollout_compactions_bucket", {"le": "1.0"}) == 2
    assert value("crl_learner_idle_seconds_total") == 0
    assert value("crl_learner_cross_factor_sum_total", {"segment_type": "summary"}) == 1.5
    assert value("crl_learner_trained_segments_total", {"segment_type": "execution"}) == 5
    for name in STEP_GAUGES:
        assert value(name) == 0.5
    assert value("crl_learner_loss_weight_total", {"compactions": "2"}) == 0.5
    assert value("crl_learner_loss_weight_total", {"compactions": "8+"}) == 0.0
    assert value("crl_learner_trained_rollouts_total", {"compactions": "0"}) == 1


def test_rollouts_past_the_last_bucket_are_counted_in_it() -> None:
    metrics = LearnerMetrics()
    metrics.record({}, rewards=[0.0, 1.0], successes=[False, True], compactions=[8, 12],
                   seconds=1.0, version=1, step=1)
    value = metrics.registry.get_sample_value
    assert value("crl_learner_trained_rollouts_total", {"compactions": "8+"}) == 2
    assert value("crl_learner_trained_rollouts_total", {"compactions": "7"}) == 0


def test_a_learner_serves_no_version_or_step_until_it_has_resumed() -> None:
    """A restarted learner answering /metrics before it has loaded its
    checkpoint must not report version 0 (the run's history would read
    74 -> 0 -> 78)."""
    metrics = LearnerMetrics()
    value = metrics.registry.get_sample_value
    assert value("crl_learner_policy_version") is None
    assert value("crl_learner_step") is None
    metrics.resumed(version=78, step=72)
    metrics.resumed(version=78, step=72)  # idempotent
    assert value("crl_learner_policy_version") == 78
    assert value("crl_learner_step") == 72


def test_success_is_given_by_task_tag_and_a_tag_absent_from_a_batch_reads_nan() -> None:
    import math

    metrics = LearnerMetrics()
    value = metrics.registry.get_sample_value
    metrics.record({"tokens": 1.0}, rewards=[1.0, 0.0, 1.0], successes=[True, False, True],
                   compactions=[1, 1, 0], seconds=1.0, version=1, step=1,
                   tags=[{"family": "arith"}, {"family": "arith"}, {"family": "words"}])
    assert value("crl_learner_tagged_success_rate", {"tag": "family", "value": "arith"}) == 0.5
    assert value("crl_learner_tagged_success_rate", {"tag": "family", "value": "words"}) == 1.0
    metrics.record({"tokens": 1.0}, rewards=[1.0], successes=[True], compactions=[0],
                   seconds=1.0, version=2, step=2, tags=[{"family": "arith"}])
    assert value("crl_learner_tagged_success_rate", {"tag": "family", "value": "arith"}) == 1.0
    assert math.isnan(value("crl_learner_tagged_success_rate",
                            {"tag": "family", "value": "words"}))
