"""The alert rules, rendered from a run's thresholds, run by Prometheus' own
rule tester (`promtool test rules`): each alert fires on the series that
should fire it, at its threshold and after its `for`, and stays quiet on a
healthy run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ops.observability import AlertThresholds, alert_rules, alerts

THRESHOLDS = AlertThresholds(max_staleness=4, stall_share=0.5, no_step_minutes=10,
                             disk_free_fraction=0.1)
SUMMARIES = {a.name: a.summary for a in alerts(THRESHOLDS)}


def expect(name: str, severity: str = "warning", **labels: str) -> dict:
    return {"exp_labels": {"severity": severity, **labels},
            "exp_annotations": {"summary": SUMMARIES[name]}}


#: (alert, input series, evaluation time, expected alerts)
CASES = [
    ("CompactionRLActorDown", {'up{job="actors", instance="a:9110"}': "1 1 0 0 0 0"}, "5m",
     [expect("CompactionRLActorDown", job="actors", instance="a:9110")]),
    ("CompactionRLLearnerDown", {'up{job="learner", instance="l:9102"}': "0x10"}, "5m",
     [expect("CompactionRLLearnerDown", "critical", job="learner", instance="l:9102")]),
    ("CompactionRLReplayDown", {'up{job="replay", instance="r:9100"}': "0x10"}, "5m",
     [expect("CompactionRLReplayDown", "critical", job="replay", instance="r:9100")]),
    ("CompactionRLStallShareHigh", {'crl_actor_stall_seconds_total{reason="credits"}':
                                    "0+45x30", "crl_actor_episode_slots": "1x30"}, "15m",
     [expect("CompactionRLStallShareHigh")]),
    ("CompactionRLStallShareHigh", {'crl_actor_stall_seconds_total{reason="credits"}':
                                    "0+15x30", "crl_actor_episode_slots": "1x30"}, "15m", []),
    ("CompactionRLStalenessAtBound", {
        'crl_replay_staleness_bucket{le="2"}': "0x30", 'crl_replay_staleness_bucket{le="4"}':
        "0x30", 'crl_replay_staleness_bucket{le="8"}': "0+10x30",
        'crl_replay_staleness_bucket{le="+Inf"}': "0+10x30"}, "15m",
     [expect("CompactionRLStalenessAtBound")]),
    ("CompactionRLStalenessAtBound", {
        'crl_replay_staleness_bucket{le="2"}': "0+10x30", 'crl_replay_staleness_bucket{le="4"}':
        "0+10x30", 'crl_replay_staleness_bucket{le="8"}': "0+10x30",
        'crl_replay_staleness_bucket{le="+Inf"}': "0+10x30"}, "15m", []),
    ("CompactionRLLearnerStuck", {"crl_learner_policy_version": "5x30"}, "20m",
     [expect("CompactionRLLearnerStuck", "critical")]),
    ("CompactionRLLearnerStuck", {"crl_learner_policy_version": "0+1x30"}, "20m", []),
    ("CompactionRLLossNotFinite", {"crl_learner_policy_loss": "0.5 NaN NaN",
                                   "crl_learner_value_loss": "0.1 0.1 0.1"}, "2m",
     [expect("CompactionRLLossNotFinite", "critical")]),
    ("CompactionRLLossNotFinite", {"crl_learner_policy_loss": "0.5 Inf Inf",
                                   "crl_learner_value_loss": "0.1 0.1 0.1"}, "2m",
     [expect("CompactionRLLossNotFinite", "critical")]),
    ("CompactionRLLossNotFinite", {"crl_learner_policy_loss": "0.5 0.4 0.3",
                                   "crl_learner_value_loss": "0.1 0.1 0.1"}, "2m", []),
    ("CompactionRLWeightPublicationsFailing", {
        'crl_learner_weight_publications_total{result="failed"}': "0+1x40"}, "30m",
     [expect("CompactionRLWeightPublicationsFailing")]),
    ("CompactionRLWeightPublicationsFailing", {
        'crl_learner_weight_publications_total{result="ok"}': "0+1x40"}, "30m", []),
    ("CompactionRLRolloutsExpiring", {'crl_replay_dropped_total{reason="expired"}': "0+1x40"},
     "30m", [expect("CompactionRLRolloutsExpiring")]),
    ("CompactionRLDiskFilling", {
        'crl_learner_disk_free_bytes{job="learner", instance="l:9102"}': "5x20",
        'crl_learner_disk_size_bytes{job="learner", instance="l:9102"}': "100x20",
        'crl_replay_disk_free_bytes{job="replay", instance="r:9100"}': "50x20",
        'crl_replay_disk_size_bytes{job="replay", instance="r:9100"}': "100x20"}, "10m",
     [expect("CompactionRLDiskFilling", "critical", job="learner", instance="l:9102")]),
]


def test_every_alert_has_a_case_that_fires_it() -> None:
    fired = {name for name, _, _, expected in CASES if expected}
    assert fired == set(SUMMARIES)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_runs_the_rules_against_each_case(tmp_path: Path) -> None:
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(alert_rules(THRESHOLDS)))
    tests = [{"interval": "1m",
              "input_series": [{"series": series, "values": values}
                               for series, values in inputs.items()],
              "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": expected}]}
             for name, inputs, at, expected in CASES]
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(
        {"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run(["promtool", "test", "rules", "tests.yml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_the_staleness_alert_takes_the_run_s_bound() -> None:
    [rule] = [r for r in alert_rules(AlertThresholds(max_staleness=4))["groups"][0]["rules"]
              if r["alert"] == "CompactionRLStalenessAtBound"]
    assert rule["expr"].endswith(">= 4") and "(4, replay.max_staleness)" in (
        rule["annotations"]["summary"])
