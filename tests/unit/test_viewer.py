"""The rollout viewer's page (deploy/viewer.py) from a run folder's samples:
what it holds, and that it needs nothing from outside the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from deploy.cli import main
from deploy.evaluate import SHOWN_EPISODES
from deploy.viewer import (
    HELD_OUT_FILE,
    held_out_sequences,
    viewer_data,
    write_held_out,
    write_viewer,
)
from deploy.viewer_pair import before_and_after, comparison_pair
from learner.batch import to_train_batch
from ops.report import write_report
from protocol import Batch, Rollout, Segment, StalenessStats
from protocol.arrays import Array
from tests.viewer_runs import SUMMARY, WINDOW, kept_run, played_held_out


def test_the_page_holds_each_kept_rollout_with_its_segments_facts_and_lags(
        tmp_path: Path, tokenizer) -> None:
    data = viewer_data(kept_run(tmp_path, tokenizer), tokenizer)
    assert [(r["step"], r["task_id"]) for r in data["rollouts"]] == [
        (1, "keyvault-1"), (2, "keyvault-2"), (2, "keyvault-1")]
    (sequence,) = data["rollouts"][0]["sequences"]
    assert "".join(sequence["texts"]) == WINDOW + SUMMARY
    execution, summary = sequence["segments"]
    assert (execution["type"], execution["factor"], summary["type"]) == ("execution", 0.5,
                                                                         "summary")
    assert "".join(sequence["texts"][summary["start"]:]) == SUMMARY
    # the window held alpha 7 and alpha 2; the summary wrote alpha 7
    assert summary["facts"] == {"kept": ["alpha 7"], "dropped": ["alpha 2"]}
    assert sequence["values"]["lag"][:2] == [2, 1]  # version 5 less 3 and 4
    assert data["pair"] == ["1-0", "2-1"]  # the same task, early and late
    assert data["rollouts"][0]["info"] == {"digits_right": 0.0, "attempts": 1.0}


def test_each_rollout_names_the_actor_that_played_it_and_the_versions_that_sampled_it(
        tmp_path: Path, tokenizer) -> None:
    run_dir = kept_run(tmp_path, tokenizer)
    write_held_out(run_dir, {"baseline": ("runs/base-model", played_held_out(tokenizer, "next"))})
    # a step recorded before the actor was kept, and a rollout nothing of which was trained
    (run_dir / "samples" / "step-0000003.json").write_text(json.dumps(
        {"step": 3, "version": 7, "rollouts": [{"task_id": "t", "reward": 0.0, "success": False,
                                                "compactions": 0, "tags": {}, "sequences": []}]}))
    data = viewer_data(run_dir, tokenizer)
    assert [(r["id"], r["actor"], r["policy"]) for r in data["rollouts"]] == [
        *((f"baseline-{n}", "compactionrl eval", "model runs/base-model")
          for n in range(SHOWN_EPISODES)),
        ("1-0", "a", "versions 3–4"), ("2-0", "b", "version 5"), ("2-1", "a", "versions 4–5"),
        ("3-0", "unknown", "version unknown")]


def test_the_pair_falls_back_to_alike_tasks_then_to_the_first_and_last() -> None:
    def rollout(id_: str, step: int, task: str, compactions: int) -> dict:
        return {"id": id_, "step": step, "task_id": task, "tags": {}, "compactions": compactions}

    alike = [rollout("a", 1, "t1", 2), rollout("b", 5, "t2", 3), rollout("c", 9, "t3", 2)]
    assert comparison_pair(alike) == ["a", "c"]
    unlike = [rollout("a", 1, "t1", 1), rollout("b", 5, "t2", 2), rollout("c", 9, "t3", 3)]
    assert comparison_pair(unlike) == ["a", "c"]
    assert comparison_pair(unlike[:1]) == ["a"]


def test_the_page_opens_offline_with_its_data_inside(tmp_path: Path, tokenizer) -> None:
    run_dir = kept_run(tmp_path, tokenizer)
    page = write_viewer(run_dir, tokenizer).read_text()
    # nothing fetched: no script, style or image from elsewhere, no request
    assert not re.search(r"\b(src|href)\s*=|@import|url\(|fetch\(|XMLHttpRequest|import\(",
                         page)
    embedded = re.search(r'<script id="data" type="application/json">(.*?)</script>', page,
                         re.S).group(1)
    assert json.loads(embedded)["run"] == "my-run"
    assert page.count("</script>") == 2  # the data cannot close its element early


def test_view_writes_the_page_of_a_run_and_refuses_a_folder_without_samples(
        tmp_path: Path, tokenizer, tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = kept_run(tmp_path, tokenizer)
    tokenizer.save_pretrained(run_dir / "export")
    assert main(["view", "--run", str(run_dir)]) == 0
    assert (run_dir / "viewer.html").is_file()
    assert main(["view", "--run", str(tmp_path)]) == 2
    assert "holds no samples/" in capsys.readouterr().err
    assert "<a href='viewer.html'>Rollout viewer</a>" in write_report(run_dir, "x").read_text()
    assert "Rollout viewer" not in write_report(tmp_path, "y").read_text()


def test_a_held_out_task_before_and_after_training_is_the_pair_when_the_run_was_evaluated(
        tmp_path: Path, tokenizer) -> None:
    run_dir = kept_run(tmp_path, tokenizer)
    before, after = played_held_out(tokenizer, "next"), played_held_out(tokenizer, "back")
    assert [e["episode"] for e in before] == list(range(SHOWN_EPISODES))
    write_held_out(run_dir, {"trained": ("export", after), "baseline": ("base", before)})
    data = viewer_data(run_dir, tokenizer)
    assert data["pair"] == ["baseline-0", "trained-0"]  # both failed: the first
    walked = next(r for r in data["rollouts"] if r["id"] == "baseline-0")
    assert walked["step"] == 0 and walked["label"] == "held-out episode 0, before training"
    assert walked["task_id"] == before[0]["task_id"] and walked["compactions"] >= 1
    # each summary extends the execution segment it summarises, as the
    # learner cuts sequences: one sequence per window, the summary's facts
    segments = before[0]["segments"]
    sequences = walked["sequences"]
    assert len(sequences) == sum(s["type"] == "execution" for s in segments)
    first = sequences[0]
    assert [s["type"] for s in first["segments"]] == ["execution", "summary"]
    assert "".join(first["texts"]) == tokenizer.decode(segments[1]["tokens"])
    assert set(first["segments"][1]["facts"]) == {"kept", "dropped"}
    sampled = sum(segments[0]["loss_mask"]) + sum(segments[1]["loss_mask"][
        len(segments[0]["tokens"]):])
    assert len(first["trainable"]) == sampled
    # nothing trained them: only the behaviour log-probability is shown
    assert set(first["values"]["behaviour_logprob"]) == {-0.1}
    assert set(first["values"]["advantage"]) == {None} and first["segments"][0]["factor"] is None
    # the learner's kept rollouts follow them
    assert [r["id"] for r in data["rollouts"]][-3:] == ["1-0", "2-0", "2-1"]


def test_the_held_out_pair_is_the_task_whose_outcome_then_reward_training_changed() -> None:
    def played(role: str, n: int, success: bool, reward: float) -> dict:
        return {"id": f"{role}-{n}", "success": success, "reward": reward}

    before = [played("baseline", 0, False, 0.3), played("baseline", 1, False, 0.3),
              played("baseline", 2, False, 0.3)]
    after = [played("trained", 0, False, 0.6), played("trained", 1, True, 1.0),
             played("trained", 2, False, 0.9)]
    assert before_and_after(before + after) == ["baseline-1", "trained-1"]
    # no outcome changed: the reward that changed most, the first of equals
    assert before_and_after(before + after[:1] + after[2:]) == ["baseline-2", "trained-2"]
    assert before_and_after(before[:1] + after[:1]) == ["baseline-0", "trained-0"]
    assert before_and_after(before) == []


def test_a_held_out_file_that_is_not_evaluations_is_left_out(tmp_path: Path, tokenizer) -> None:
    run_dir = kept_run(tmp_path, tokenizer)
    unnamed = json.dumps({"trained": {"episodes": played_held_out(tokenizer, "next")}})
    for text in ("not json", "[1, 2]", '{"trained": 7}', '{"trained": {}}', unnamed):
        (run_dir / HELD_OUT_FILE).write_text(text)
        assert viewer_data(run_dir, tokenizer)["pair"] == ["1-0", "2-1"]


def test_held_out_episodes_are_cut_into_sequences_as_the_learner_cuts_them() -> None:
    # (type, tokens, sampled positions): a summary that only repeats its
    # window, one whose window holds a sampled token, and one that extends
    # its window cleanly; the first two stay apart in the learner, as they
    # now do in the viewer.
    window = list(range(3, 13))
    played = [("execution", window, [8, 9]), ("summary", window, []),
              ("execution", window, [7, 8]), ("summary", window + [40, 41], [5, 10, 11]),
              ("execution", window, [9]), ("summary", window + [50, 51], [10, 11]),
              ("execution", window, [6])]
    shown = [{"type": kind, "tokens": tokens,
              "loss_mask": [p in sampled for p in range(len(tokens))],
              "logprobs": [-0.5] * len(tokens)} for kind, tokens, sampled in played]
    segments = [Segment(
        sender_id="a", incarnation=0, seq=n, sent_at=0.0, rollout_id="r", task_id="t", index=n,
        segment_type=e["type"], tokens=Array.from_numpy(np.array(e["tokens"], np.int32)),
        loss_mask=Array.from_numpy(np.array(e["loss_mask"], np.uint8)),
        logprobs=Array.from_numpy(np.array(e["logprobs"], np.float32)),
        versions=Array.from_numpy(np.zeros(len(e["tokens"]), np.int32)),
        final=n == len(shown) - 1, reward=1.0 if n == len(shown) - 1 else None)
        for n, e in enumerate(shown)]
    wire = Batch(sender_id="replay", incarnation=0, seq=0, sent_at=0.0, policy_version=0,
                 rollouts=[Rollout(rollout_id="r", staleness=0, segments=segments)],
                 staleness=StalenessStats(min=0, max=0, mean=0, p50=0, p95=0))
    for share_prefixes, count in ((True, 6), (False, 7)):
        learner = [(s.tokens.tolist(), s.trainable.nonzero().flatten().tolist(),
                    s.segment_lengths)
                   for s in to_train_batch(wire, True, share_prefixes).sequences]
        viewer = [(s["tokens"], s["trainable"], s["segment_lengths"])
                  for s in held_out_sequences(shown, share_prefixes)]
        assert viewer == learner and len(viewer) == count
