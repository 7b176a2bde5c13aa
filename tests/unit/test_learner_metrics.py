"""The learner's metric names (DESIGN §4) and what a step records."""

from __future__ import annotations

from learner.metrics import STEP_GAUGES, LearnerMetrics


def test_a_step_is_recorded_under_the_design_names() -> None:
    metrics = LearnerMetrics()
    step = {"tokens": 120.0, **{key: 0.5 for key in STEP_GAUGES.values()}}
    metrics.record(step, rewards=[1.0, 0.0, 1.0], successes=[True, False, True],
                   compactions=[2, 0, 1], seconds=1.5, version=7)
    value = metrics.registry.get_sample_value
    assert value("crl_learner_policy_version") == 7
    assert value("crl_learner_tokens_total") == 120
    assert value("crl_learner_reward") == 2 / 3
    assert value("crl_learner_success_rate", {"compacted": "true"}) == 1.0
    assert value("crl_learner_success_rate", {"compacted": "false"}) == 0.0
    assert value("crl_learner_step_seconds_count") == 1
    assert value("crl_learner_idle_seconds_total") == 0
    for name in STEP_GAUGES:
        assert value(name) == 0.5
