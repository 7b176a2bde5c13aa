"""The run report (ops/report.py) from a run folder: every chart has labelled
axes and its legend beside the plot, the held-out evaluation when one ran,
summary length and stall over time, and how and when the run ended."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ops.report import LEFT, PLOT_W, write_report


def snapshot(t: float, step: int) -> dict:
    return {"time": 1000.0 + t, "learner_step": step, "reward": 0.1 * step,
            "success_compacted": 0.05 * step, "success_uncompacted": 0.5,
            "compactions_per_rollout": 2.0, "actor_compactions": 10 * step,
            "actor_summary_tokens": 240 * step, "actor_generated_tokens": 1000 * step,
            "learner_tokens": 900 * step, "stall_weights_s": 1.0 * step,
            "stall_credits_s": 2.0 * step, "stall_summary_s": 0.5 * step,
            "actor_slot_s": 40.0 * step,
            "staleness_le_0": 3 * step, "staleness_le_1": 5 * step, "staleness_le_2": 6 * step,
            # the replay's per-actor figures: one actor started by up, one added by hand
            **{f"actor/{actor}/{figure}": value * step for actor, share in (
                ("actor-0", 3), ("extra-1", 1)) for figure, value in (
                ("trained", 2 * share), ("credits", 2 * share), ("slot_s", 20.0),
                ("stall_credits_s", share), ("staleness_sum", share))},
            "actor/actor-0/registered": 1, "actor/extra-1/registered": 0}


def run_folder(tmp_path: Path, evaluation: bool) -> Path:
    run = tmp_path / "demo"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(snapshot(10.0 * i, i)) + "\n"
                                               for i in range(1, 6)))
    (run / "summary.txt").write_text("learner: step 5 of 5\nended: max_steps reached; wall "
                                     "time 50 s\nended at: 2026-12-01 19:00:00 UTC\n")
    if evaluation:
        report = {"model": "runs/demo/export", "episodes": 200, "success": 0.7,
                  "success_ci95": [0.63, 0.76], "mean_reward": 0.7,
                  "compactions_per_episode": 2.0, "summary_tokens_per_compaction": 24.0}
        (run / "evaluation.json").write_text(json.dumps(
            {"trained": report, "baseline": {**report, "model": "base", "success": 0.12}}))
    return run


def test_every_chart_has_labelled_axes_and_its_legend_beside_the_plot(tmp_path: Path) -> None:
    page = write_report(run_folder(tmp_path, evaluation=False), "demo").read_text()
    charts = page.split("<svg")[1:]
    assert len(charts) == 7
    for chart in charts:
        labels = re.findall(r'transform="rotate\(-90[^"]*"[^>]*>([^<]+)<', chart)
        assert labels, "a y-axis label"
    assert "share of episode-slot time" in page and "learner step" in page
    assert "summary tokens per compaction" in page and "tokens per second" in page
    for x in re.findall(r'<line x1="(\d+)" y1="\d+" x2="\d+" y2="\d+" stroke="#[0-9a-f]{6}" '
                        r'stroke-width="3"/>', page):
        assert int(x) > LEFT + PLOT_W, "a legend sits right of the plot area"
    assert "Held-out evaluation" not in page
    assert "max_steps reached" in page and "ended at" in page


def test_a_held_out_evaluation_goes_into_the_report(tmp_path: Path) -> None:
    page = write_report(run_folder(tmp_path, evaluation=True), "demo").read_text()
    assert "Held-out evaluation" in page
    assert "<th>trained</th><th>baseline</th>" in page and "0.63 - 0.76" in page


def test_the_report_lists_every_actor_and_what_it_contributed(tmp_path: Path) -> None:
    """The actors the replay registered, whoever started them: their
    trained rollouts add up to the run's, stall as a share of slot time."""
    page = write_report(run_folder(tmp_path, evaluation=False), "demo").read_text()
    table = page[page.index("<h2>Actors</h2>"):page.index("</table>", page.index("<h2>Actors"))]
    assert "actor-0</th><td>30</td><td>75 %</td>" in table
    assert "extra-1 (gone)</th><td>10</td><td>25 %</td>" in table
    assert "<th align='left'>all</th><td>40</td>" in table
    assert "<td>15 %</td>" in table  # actor-0's credit stall: 15 of 100 slot seconds
