"""What a run's summary says (live view, ``summary.txt``, ``status``, report):
the run's own figures across process restarts and ``up --resume``, never a
number that is not one."""

from __future__ import annotations

import math

import pytest

from ops.summary import (
    RunEnds,
    RunScraper,
    Samples,
    cross_factors,
    pace_start,
    summarise,
    training_window,
    weight_by_compactions,
    window_start,
)


def _samples(**metrics: float | dict[tuple[tuple[str, str], ...], float]) -> Samples:
    """``name=value`` or ``name={(("label", "x"),): value, ...}``."""
    out: Samples = {}
    for name, value in metrics.items():
        if isinstance(value, dict):
            out[name] = [(dict(labels), v) for labels, v in value.items()]
        else:
            out[name] = [({}, value)]
    return out


def _replay(expired: float, stale: float) -> Samples:
    return _samples(crl_replay_dropped_total={(("reason", "expired"),): expired,
                                              (("reason", "stale"),): stale})


def _learner(step: float, version: float, **extra: float) -> Samples:
    return _samples(crl_learner_step=step, crl_learner_policy_version=version, **extra)


def test_replay_totals_add_up_over_its_restarts() -> None:
    """The issue's run: 1 expired and 380 stale rollouts over two replay
    processes read 'expired 0, stale 201' from the last one alone."""
    scraper = RunScraper({})
    scraper.fold({"replay": _replay(expired=1, stale=150)}, {})
    scraper.fold({"replay": _replay(expired=1, stale=179)}, {})
    scraper.fold({"replay": None}, {})  # restarting: the totals stand
    scraper.fold({"replay": _replay(expired=0, stale=120)}, {})  # a new process
    last = scraper.fold({"replay": _replay(expired=0, stale=201)}, {})
    assert (last["expired_rollouts"], last["stale_rollouts"]) == (1, 380)


def _fleet(trained: dict[str, float], registered: dict[str, float],
           stall_credits: dict[str, float], slot_s: dict[str, float]) -> Samples:
    """The replay's per-actor series for these actors."""
    return _samples(
        crl_replay_actor_rollouts_total={(("actor", a), ("fate", "trained")): n
                                         for a, n in trained.items()},
        crl_replay_finished_rollouts_total={(("fate", "trained"), ("success", "true")):
                                            sum(trained.values())},
        crl_replay_actor_registered={(("actor", a),): n for a, n in registered.items()},
        crl_replay_actor_stall_seconds_total={(("actor", a), ("reason", "credits")): n
                                              for a, n in stall_credits.items()},
        crl_replay_actor_slot_seconds_total={(("actor", a),): n for a, n in slot_s.items()})


def test_each_actor_s_figures_add_up_over_replay_restarts() -> None:
    """The replay counts every actor (up's, or one added by hand); a replay
    restart starts its counters afresh and the run's totals go on."""
    scraper = RunScraper({})
    scraper.fold({"replay": _fleet({"actor-0": 10, "extra-1": 4}, {"actor-0": 1, "extra-1": 1},
                                   {}, {})}, {})
    last = scraper.fold({"replay": _fleet({"actor-0": 3, "extra-1": 2},
                                          {"actor-0": 1, "extra-1": 1}, {}, {})}, {})
    assert (last["actor/actor-0/trained"], last["actor/extra-1/trained"]) == (13, 6)
    assert last["trained_rollouts"] == 19 and last["actors_up"] == 2


def test_the_summary_lists_every_actor_with_stall_as_a_share_of_slot_time() -> None:
    """'actors 1' while a hand-added actor trained a third of the rollouts,
    and stall in summed seconds (1,981 -> 3,836 s in one line): now each
    actor has its line, the shares of trained rollouts add to the run's,
    and stall is a share of episode-slot time."""
    scraper = RunScraper({})
    before = scraper.fold({"replay": _fleet({"actor-0": 0, "extra-1": 0},
                                            {"actor-0": 1, "extra-1": 1}, {}, {}),
                           "learner": _learner(1, 1)}, {})
    now = scraper.fold({"replay": _fleet({"actor-0": 20, "extra-1": 10},
                                         {"actor-0": 1, "extra-1": 0},
                                         {"actor-0": 20, "extra-1": 2}, {"actor-0": 40,
                                                                        "extra-1": 40}),
                        "learner": _learner(5, 5)}, {})
    now["time"] = before["time"] + 10
    lines = summarise(now, before, before, RunEnds(max_steps=10))
    assert lines["actor actor-0"].startswith("20 rollouts trained (67 %)")
    assert lines["actor extra-1"].startswith("(gone) 10 rollouts trained (33 %)")
    assert "credits 50 %" in lines["actor actor-0"]
    assert lines["stall"] == ("weights 0.0 %, credits 27.5 %, summary 0.0 % of episode-slot "
                              "time, last 10 s")
    assert lines["processes"].endswith("actors 1 registered")
    assert "bottleneck" in lines and lines["bottleneck"].startswith("the learner")


def test_each_actor_s_line_counts_the_whole_run_and_labels_its_window() -> None:
    """The live view read '112 rollouts trained (50 %)' for each of two
    actors of a run that had trained 1,008 (their last 30 s), and '(gone) 0
    rollouts trained (0 %)' once one had left: an actor's counts are the
    whole run's, adding up to the run's and kept when it leaves, and its
    figures of the window say they are."""
    scraper = RunScraper({})
    both = {"actor-0": 1, "actor-1": 1}
    snapshots = [scraper.fold({"replay": _fleet(trained, registered, {}, {}),
                               "learner": _learner(1, 1)}, {})
                 for trained, registered in (({"actor-0": 392, "actor-1": 392}, both),
                                             ({"actor-0": 504, "actor-1": 504}, both),
                                             ({"actor-0": 560, "actor-1": 504},
                                              {"actor-0": 1, "actor-1": 0}))]
    for seconds, snapshot in zip((0, 30, 60), snapshots, strict=True):
        snapshot["time"] = seconds
    first, running, left = snapshots
    lines = summarise(running, first, first, RunEnds(max_steps=10))
    for actor in ("actor-0", "actor-1"):
        assert lines[f"actor {actor}"].startswith("504 rollouts trained (50 %)")
        assert lines[f"actor {actor}"].endswith("; last 30 s: 112 trained, 0 tokens/s, stall -")
    assert 504 + 504 == running["trained_rollouts"]
    lines = summarise(left, running, first, RunEnds(max_steps=10))
    assert lines["actor actor-0"].startswith("560 rollouts trained (53 %)")
    assert lines["actor actor-1"].startswith("(gone) 504 rollouts trained (47 %)")
    assert "; last 30 s: 0 trained" in lines["actor actor-1"]
    assert lines["throughput"].endswith(", last 30 s")


def test_the_learner_s_idle_share_is_judged_only_over_a_window_it_answered_at_both_ends(
        ) -> None:
    """'the learner waits for rollouts 120 % of the time': a learner that
    did not answer the scrape at the window's start left an earlier count
    standing, and the increase to the window's end covered more time than
    the window. A share of time is judged only where the learner answered at
    both ends, and never exceeds one there."""
    scraper = RunScraper({})
    earlier = scraper.fold({"learner": _learner(1, 1, crl_learner_idle_seconds_total=0.0)}, {})
    unanswered = scraper.fold({"learner": None}, {})
    answered = scraper.fold({"learner": _learner(1, 1, crl_learner_idle_seconds_total=6.0)}, {})
    end = scraper.fold({"learner": _learner(1, 1, crl_learner_idle_seconds_total=36.0)}, {})
    for seconds, snapshot in zip((0, 6, 6, 36), (earlier, unanswered, answered, end),
                                 strict=True):
        snapshot["time"] = seconds
    assert "bottleneck" not in summarise(end, unanswered, earlier, RunEnds(max_steps=10))
    assert summarise(end, answered, earlier, RunEnds(max_steps=10))["bottleneck"] == (
        "the actors: the learner waits for rollouts 100 % of the time (last 30 s); more actors "
        "(or faster ones) would train faster")


def test_a_learner_that_has_not_resumed_leaves_step_and_version_where_they_were() -> None:
    """74 -> 0 -> 78 in the history, and 'step 2/500' beside version 78,
    came from a restarted learner's per-process counts."""
    scraper = RunScraper({})
    versions, steps = [], []
    for learner in (_learner(70, 74), None, _samples(crl_learner_tokens_total=0.0),
                    _learner(72, 78)):
        snapshot = scraper.fold({"learner": learner}, {})
        versions.append(snapshot["learner_version"])
        steps.append(snapshot["learner_step"])
    assert versions == [74, 74, 74, 78]
    assert steps == [70, 70, 70, 72]


def test_before_any_learner_figure_the_summary_says_so_in_words() -> None:
    snapshot = RunScraper({}).fold({"learner": _samples(crl_learner_reward=math.nan)}, {})
    lines = summarise(snapshot, None, snapshot, RunEnds(max_steps=500))
    text = "\n".join(lines.values())
    assert "nan" not in text.lower()
    assert "no version yet" in lines["learner"]
    assert "no pace yet" in lines["learner"]
    assert lines["reward"].startswith("no data;")


def test_a_batch_without_uncompacted_rollouts_reads_no_data_not_nan() -> None:
    learner = _learner(3, 3, crl_learner_success_rate=math.nan)
    learner["crl_learner_success_rate"] = [({"compacted": "true"}, 0.5),
                                           ({"compacted": "false"}, math.nan)]
    snapshot = RunScraper({}).fold({"learner": learner}, {})
    assert snapshot["success_uncompacted"] is None
    lines = summarise(snapshot, None, snapshot, RunEnds(max_steps=10))
    assert "compacted 0.50, uncompacted no data" in lines["reward"]


def test_up_resume_continues_the_totals_restarts_and_wall_time_of_the_history() -> None:
    first = RunScraper({})
    first.fold({"replay": _replay(1, 10), "learner": _learner(40, 40)},
               {"actor_restarts": 2, "up_invocations": 1, "run_seconds": 300})
    earlier = [first.fold({"replay": _replay(1, 12), "learner": _learner(50, 50)},
                          {"actor_restarts": 3, "up_invocations": 1, "run_seconds": 310})]
    resumed = RunScraper({}, earlier)
    snapshot = resumed.fold({"replay": _replay(0, 5), "learner": _learner(50, 51)},
                            {"actor_restarts": 1, "up_invocations": 1, "run_seconds": 20})
    assert snapshot["stale_rollouts"] == 17 and snapshot["expired_rollouts"] == 1
    assert snapshot["actor_restarts"] == 4
    assert snapshot["up_invocations"] == 2
    assert snapshot["run_seconds"] == 330
    assert snapshot["learner_step"] == 50 and snapshot["learner_version"] == 51
    lines = summarise(snapshot, None, snapshot, RunEnds(max_steps=500),
                      ended="interrupted (SIGINT): stopped cleanly")
    assert lines["restarts"] == "actors 4, replay 0, learner 0"
    assert lines["ended"] == ("interrupted (SIGINT): stopped cleanly; wall time 330 s "
                              "over 2 invocations of up")


def test_the_eta_is_to_whichever_end_comes_first() -> None:
    scraper = RunScraper({})
    first = scraper.fold({"learner": _learner(10, 10)}, {})
    now = scraper.fold({"learner": _learner(20, 20)}, {})
    now["time"] = first["time"] + 100  # 10 s a step: 480 steps to go
    by_steps = summarise(now, first, first, RunEnds(max_steps=500))
    assert by_steps["learner"].endswith("ETA 4800 s (max_steps)")
    by_time = summarise(now, first, first, RunEnds(max_steps=500, max_minutes=5,
                                                   started=first["time"]))
    assert by_time["learner"].endswith("ETA 200 s (max_minutes)")


def test_the_pace_is_counted_from_the_learner_s_first_step_not_the_run_s_first_snapshot(
        ) -> None:
    """The first snapshots of a run come before the learner is up: a pace
    counted from them never existed, and the ETA fell back to max_minutes."""
    scraper = RunScraper({})
    before_learner = scraper.fold({}, {})
    first = scraper.fold({"learner": _learner(10, 10)}, {})
    now = scraper.fold({"learner": _learner(20, 20)}, {})
    now["time"] = first["time"] + 100  # 10 s a step: 80 steps to go
    assert before_learner["learner_step"] is None
    assert pace_start([before_learner, first, now]) is first
    lines = summarise(now, first, pace_start([before_learner, first, now]),
                      RunEnds(max_steps=100, max_minutes=60, started=first["time"]))
    assert lines["learner"].endswith("ETA 800 s (max_steps)")


def test_a_finished_run_shows_how_it_ended_not_liveness_or_an_eta() -> None:
    """'learner DOWN' and 'ETA 400 s' described processes that had stopped."""
    scraper = RunScraper({})
    first = scraper.fold({"learner": _learner(1, 1)}, {"run_seconds": 1})
    last = scraper.fold({"learner": None}, {"run_seconds": 301, "up_invocations": 1})
    lines = summarise(last, first, first, RunEnds(max_steps=500, max_minutes=5),
                      ended="wall time of 5 min reached")
    assert "ETA" not in lines["learner"]
    assert "processes" not in lines and "throughput" not in lines
    assert lines["ended"] == "wall time of 5 min reached; wall time 301 s"


def test_the_summary_compares_the_trained_rollouts_with_every_finished_one() -> None:
    """Dropping the long episodes as stale would show as trained rollouts
    shorter (and here also more successful) than all finished ones."""
    replay = _replay(expired=0, stale=25)
    replay |= _samples(
        crl_replay_finished_rollouts_total={(("fate", "trained"), ("success", "true")): 60,
                                            (("fate", "trained"), ("success", "false")): 15,
                                            (("fate", "stale"), ("success", "true")): 5,
                                            (("fate", "stale"), ("success", "false")): 20},
        crl_replay_finished_rollout_tokens_total={(("fate", "trained"),): 75 * 100,
                                                  (("fate", "stale"),): 25 * 300})
    snapshot = RunScraper({}).fold({"replay": replay}, {})
    lines = summarise(snapshot, None, snapshot, RunEnds(max_steps=10))
    assert lines["staleness"].endswith(
        "stale 25 (25.0 % of finished); trained vs all finished: 100 vs 150 sampled tokens, "
        "success 0.80 vs 0.65")


def test_the_summary_gives_the_mean_cross_trajectory_factor_by_segment_type() -> None:
    learner = _learner(3, 3) | _samples(
        crl_learner_cross_factor_sum_total={(("segment_type", "summary"),): 12.0,
                                            (("segment_type", "execution"),): 45.0},
        crl_learner_trained_segments_total={(("segment_type", "summary"),): 40,
                                            (("segment_type", "execution"),): 50})
    snapshot = RunScraper({}).fold({"learner": learner}, {})
    assert cross_factors(snapshot) == {"summary": 0.3, "execution": 0.9}
    lines = summarise(snapshot, None, snapshot, RunEnds(max_steps=10))
    assert lines["credit"] == ("cross-trajectory factor (applied with advantage = cross): "
                               "summary 0.300, execution 0.900")
    empty = RunScraper({}).fold({"learner": _learner(0, 0)}, {})
    assert cross_factors(empty) == {}
    assert summarise(empty, None, empty, RunEnds(max_steps=10))["credit"].endswith(": -")


def test_the_loss_weight_by_compaction_count_is_folded_into_shares_of_the_run() -> None:
    learner = _learner(3, 3) | _samples(
        crl_learner_loss_weight_total={(("compactions", "2"),): 1.0,
                                       (("compactions", "4"),): 2.0,
                                       (("compactions", "8+"),): 1.0},
        crl_learner_trained_rollouts_total={(("compactions", "2"),): 30,
                                            (("compactions", "4"),): 10,
                                            (("compactions", "8+"),): 0})
    snapshot = RunScraper({}).fold({"learner": learner}, {})
    assert weight_by_compactions(snapshot) == {"2": {"rollouts": 0.75, "weight": 0.25},
                                               "4": {"rollouts": 0.25, "weight": 0.5}}
    empty = RunScraper({}).fold({"learner": _learner(0, 0)}, {})
    assert weight_by_compactions(empty) == {}


def test_the_training_window_spans_the_snapshots_with_the_learner_training() -> None:
    """From the first completed step to the last (or the first at the given
    step); snapshots before the first step, or while the learner was down
    (no step of its own), are outside it."""
    history = [{"learner_up": 1, "learner_step": 0, "time": 0},
               {"learner_up": 1, "learner_step": 1, "time": 1},
               {"learner_up": 0, "learner_step": None, "time": 2},
               {"learner_up": 1, "learner_step": 3, "time": 3},
               {"learner_up": 1, "learner_step": 5, "time": 4}]
    assert [s["time"] for s in training_window(history)] == [1, 4]
    assert [s["time"] for s in training_window(history, steps=2)] == [1, 3]
    assert [s["time"] for s in training_window(history, steps=9)] == [1, 4]
    with pytest.raises(ValueError, match="fewer than two"):
        training_window(history[:3])


def test_the_views_know_the_stall_reasons_the_heartbeats_carry() -> None:
    """ops imports nothing of ours: its copy of the reasons must stay the protocol's."""
    from ops.fleet import STALL_REASONS as shown
    from protocol import STALL_REASONS as sent

    assert shown == sent


def test_the_live_view_counts_its_rates_over_half_a_minute_not_two_seconds() -> None:
    """The replay counts rollouts when a batch is confirmed: the 2 s between
    two snapshots often held none, and the live view read '0 tokens/s' for a
    busy fleet. Rates count from the newest snapshot LIVE_WINDOW_S old."""
    history = [{"time": t} for t in (0.0, 10.0, 20.0, 30.0, 32.0, 34.0, 62.0)]
    assert window_start(history) is history[4]  # the newest at or before 62 - 30 = 32 s
    assert window_start(history[:4]) is history[0]  # under 30 s of history: from its start
    assert window_start(history[:1]) is None
