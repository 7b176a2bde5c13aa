"""What ``compactionrl eval`` reports, from episode results."""

from __future__ import annotations

import pytest

from actors.config import ActorConfig
from actors.episode import EpisodeResult
from deploy.evaluate import format_report, summarise, wilson_interval
from protocol import RolloutStats


def result(success: bool, compactions: int, summary_tokens: int,
           tags: dict[str, str] | None = None) -> EpisodeResult:
    stats = RolloutStats(outcome="done", success=success, steps=12, compactions=compactions,
                         generated_tokens=40, summary_tokens=summary_tokens, duration_s=1.0,
                         tags=tags or {})
    return EpisodeResult(task_id="t", reward=float(success), stats=stats, summary_seconds=0.1,
                         observations_cut=0)


def test_wilson_interval_matches_known_values_and_stays_inside_0_1() -> None:
    low, high = wilson_interval(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    assert wilson_interval(0, 20)[0] == 0.0 and 0 < wilson_interval(0, 20)[1] < 0.2
    assert wilson_interval(20, 20)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_report_splits_success_by_number_of_compactions() -> None:
    results = [result(True, 2, 20), result(False, 2, 10), result(True, 1, 6),
               result(False, 0, 0)]
    report = summarise("m", ActorConfig(), results, seconds=3.0)
    assert report.success == 0.5 and report.mean_reward == 0.5
    assert report.compactions_per_episode == pytest.approx(5 / 4)
    assert report.summary_tokens_per_compaction == pytest.approx(36 / 5)
    assert report.success_by_compactions == {0: {"episodes": 1, "success": 0.0},
                                             1: {"episodes": 1, "success": 1.0},
                                             2: {"episodes": 2, "success": 0.5}}


def test_report_gives_success_by_each_tag_value() -> None:
    results = [result(True, 1, 5, {"family": "arith", "difficulty": "1"}),
               result(False, 1, 5, {"family": "arith", "difficulty": "3"}),
               result(True, 0, 0, {"family": "words"}), result(True, 0, 0)]
    report = summarise("m", ActorConfig(), results, seconds=1.0)
    assert report.success_by_tag == {
        "difficulty": {"1": {"episodes": 1, "success": 1.0},
                       "3": {"episodes": 1, "success": 0.0}},
        "family": {"arith": {"episodes": 2, "success": 0.5},
                   "words": {"episodes": 1, "success": 1.0}}}
    assert "success by family: arith: 50.0% of 2, words: 100.0% of 1" in format_report(report)


def test_groups_report_how_unequally_a_task_s_episodes_compacted() -> None:
    results = [result(True, 2, 5), result(False, 6, 5), result(True, 2, 5), result(False, 4, 5),
               result(True, 2, 5), result(True, 2, 5), result(True, 3, 5), result(True, 2, 5),
               result(False, 4, 5)]  # a group cut short (the last) is left out
    report = summarise("m", ActorConfig(), results, seconds=1.0, group_size=4)
    assert report.group_size == 4 and report.compaction_spread == {1: 1, 4: 1}
    assert "compaction spread within groups of 4 (most - fewest: groups): 1: 1, 4: 1" in (
        format_report(report))
    assert summarise("m", ActorConfig(), results, seconds=1.0).compaction_spread == {}
    # successes per held-out task, what intervals clustered by task resample
    assert report.successes_by_task == [2, 4, 0]


def test_a_group_size_below_one_is_refused_by_the_command_line() -> None:
    from deploy.cli import build_parser

    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["eval", "--group-size", bad])
    assert build_parser().parse_args(["eval", "--group-size", "4"]).group_size == 4
