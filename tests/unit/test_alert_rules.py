"""The alert rules, rendered from a run's thresholds, run by Prometheus' own
rule tester (`promtool test rules`): each alert fires on the series that
should fire it, at its threshold and after its `for`, stays quiet on the
series of the like healthy event (an actor leaving, a publication failing
with it), and none fires over the series of a healthy default run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ops.observability import AlertThresholds, alert_rules, alerts

#: The local default's (replay.max_staleness 2, stale_grace 1: the replay
#: serves rollouts up to 3 versions stale).
THRESHOLDS = AlertThresholds(max_staleness=2, stale_grace=1, stall_share=0.5,
                             no_step_minutes=10, disk_free_fraction=0.1)
SUMMARIES = {a.name: a.summary for a in alerts(THRESHOLDS)}


def expect(name: str, severity: str = "warning", **labels: str) -> dict:
    return {"exp_labels": {"severity": severity, **labels},
            "exp_annotations": {"summary": SUMMARIES[name]}}


def staleness(per_minute: dict[str, int]) -> dict[str, str]:
    """The staleness histogram of ``per_minute`` trained rollouts a minute at
    each staleness (0 to 3; none is served older), as cumulative buckets."""
    series, total = {}, 0
    for bound in ("0", "1", "2", "3", "4", "+Inf"):
        total += per_minute.get(bound, 0)
        series[f'crl_replay_staleness_bucket{{le="{bound}"}}'] = f"0+{total}x40"
    return series


#: A healthy default run, minute by minute, as measured: 82 % of trained
#: rollouts within max_staleness and 18 % one version past it (docs/replay.md,
#: "Stale"); actors waiting for credits 45 % of their slot time, the
#: learner's pace (issue 59), for summaries 20 % (docs/results.md) and for
#: weights 5 %; a step a minute; an actor leaving cleanly at minute 20 (its
#: target gone from the file, its publication in flight failed).
HEALTHY = {
    'up{job="replay", instance="r:9100"}': "1x40",
    'up{job="learner", instance="l:9102"}': "1x40",
    'up{job="actors", instance="a:9110"}': "1x40",
    'up{job="actors", instance="b:9111"}': "1x19 0 stale",
    'crl_actor_stall_seconds_total{reason="credits"}': "0+432x40",
    'crl_actor_stall_seconds_total{reason="summary"}': "0+192x40",
    'crl_actor_stall_seconds_total{reason="weights"}': "0+48x40",
    "crl_actor_episode_slots": "16x40",
    **staleness({"1": 2, "2": 80, "3": 18}),
    "crl_learner_policy_version": "0+1x40",
    "crl_learner_policy_loss": "0.5x40",
    "crl_learner_value_loss": "0.1x40",
    'crl_learner_weight_publications_total{result="ok"}': "0+1x40",
    'crl_learner_weight_publications_total{result="failed"}': "0x20 1x19",
    'crl_replay_dropped_total{reason="expired"}': "0x40",
    "crl_learner_members_excluded": "0x40",
    'crl_replay_dropped_total{reason="abandoned"}': "0x20 3x19",
    'crl_learner_disk_free_bytes{job="learner", instance="l:9102"}': "50x40",
    'crl_learner_disk_size_bytes{job="learner", instance="l:9102"}': "100x40",
    'crl_replay_disk_free_bytes{job="replay", instance="r:9100"}': "50x40",
    'crl_replay_disk_size_bytes{job="replay", instance="r:9100"}': "100x40",
}

#: (alert, input series, evaluation time, expected alerts)
CASES = [
    ("CompactionRLActorDown", {'up{job="actors", instance="a:9110"}': "1 1 0 0 0 0"}, "5m",
     [expect("CompactionRLActorDown", job="actors", instance="a:9110")]),
    # the replay took it off the targets' file as it left: no series to judge
    ("CompactionRLActorDown", {'up{job="actors", instance="a:9110"}': "1 1 0 stale"}, "5m",
     []),
    ("CompactionRLLearnerDown", {'up{job="learner", instance="l:9102"}': "0x10"}, "5m",
     [expect("CompactionRLLearnerDown", "critical", job="learner", instance="l:9102")]),
    ("CompactionRLReplayDown", {'up{job="replay", instance="r:9100"}': "0x10"}, "5m",
     [expect("CompactionRLReplayDown", "critical", job="replay", instance="r:9100")]),
    ("CompactionRLStallShareHigh", {'crl_actor_stall_seconds_total{reason="weights"}':
                                    "0+45x30", "crl_actor_episode_slots": "1x30"}, "15m",
     [expect("CompactionRLStallShareHigh")]),
    ("CompactionRLStallShareHigh", {'crl_actor_stall_seconds_total{reason="weights"}':
                                    "0+15x30", "crl_actor_episode_slots": "1x30"}, "15m", []),
    # waiting for credits is the learner's pace, however long
    ("CompactionRLStallShareHigh", {'crl_actor_stall_seconds_total{reason="credits"}':
                                    "0+55x30", "crl_actor_episode_slots": "1x30"}, "15m", []),
    # most trained rollouts as stale as the replay serves
    ("CompactionRLStalenessAtBound", staleness({"2": 30, "3": 70}), "15m",
     [expect("CompactionRLStalenessAtBound")]),
    ("CompactionRLStalenessAtBound", staleness({"1": 10, "2": 60, "3": 30}), "15m", []),
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
        'crl_learner_weight_publications_total{result="failed"}': "0+2x40",
        'crl_learner_weight_publications_total{result="ok"}': "0+1x40"}, "30m",
     [expect("CompactionRLWeightPublicationsFailing")]),
    ("CompactionRLWeightPublicationsFailing", {
        'crl_learner_weight_publications_total{result="ok"}': "0+1x40"}, "30m", []),
    # actors leaving now and then: each fails the publication in flight
    ("CompactionRLWeightPublicationsFailing", {
        'crl_learner_weight_publications_total{result="failed"}': "0x5 1x5 2x5 3x5 4x20",
        'crl_learner_weight_publications_total{result="ok"}': "0+1x40"}, "30m", []),
    ("CompactionRLMembersExcluded", {"crl_learner_members_excluded": "0 1x20"}, "15m",
     [expect("CompactionRLMembersExcluded")]),
    # left out for its backoff, then back: a failure now and then
    ("CompactionRLMembersExcluded", {"crl_learner_members_excluded": "0 1 1 0 0 1 0x20"},
     "15m", []),
    ("CompactionRLRolloutsExpiring", {'crl_replay_dropped_total{reason="expired"}': "0+1x40"},
     "30m", [expect("CompactionRLRolloutsExpiring")]),
    ("CompactionRLDiskFilling", {
        'crl_learner_disk_free_bytes{job="learner", instance="l:9102"}': "5x20",
        'crl_learner_disk_size_bytes{job="learner", instance="l:9102"}': "100x20",
        'crl_replay_disk_free_bytes{job="replay", instance="r:9100"}': "50x20",
        'crl_replay_disk_size_bytes{job="replay", instance="r:9100"}': "100x20"}, "10m",
     [expect("CompactionRLDiskFilling", "critical", job="learner", instance="l:9102")]),
    *[(name, HEALTHY, at, []) for name in SUMMARIES for at in ("15m", "25m", "40m")],
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


def test_the_staleness_alert_takes_the_run_s_bound_and_its_grace() -> None:
    """The replay serves up to max_staleness + stale_grace versions stale:
    the alert judges against that bound, not max_staleness alone."""
    [rule] = [r for r in alert_rules(AlertThresholds(max_staleness=4, stale_grace=1))["groups"][0]
              ["rules"] if r["alert"] == "CompactionRLStalenessAtBound"]
    assert rule["expr"].endswith("> 4") and "are 5 versions stale" in (
        rule["annotations"]["summary"])
    [on_policy] = [r for r in alert_rules(AlertThresholds(max_staleness=0))["groups"][0]["rules"]
                   if r["alert"] == "CompactionRLStalenessAtBound"]
    assert on_policy["expr"].endswith("> 0")  # every rollout at 0: never fires
