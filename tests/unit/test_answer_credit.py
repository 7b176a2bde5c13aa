"""deploy/answer_credit.py: the advantage a run's training gave the wrong
answers of rollouts that ended right, read from its kept samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from deploy.answer_credit import graded_answers, measure
from learner.samples import SAMPLES_FOLDER


def kept_sequence(tokenizer, turns: list[tuple[str, str]], advantages: list[float]) -> dict:
    """A kept sequence of (action, reply) turns, each action's tokens trained
    with the next of ``advantages``."""
    tokens, trainable, advantage = tokenizer.encode("room 1 : note : alpha two ."), [], []
    for (action, reply), value in zip(turns, advantages, strict=True):
        action_tokens = tokenizer.encode(f" {action}")
        trainable += range(len(tokens), len(tokens) + len(action_tokens))
        advantage += [value] * len(action_tokens)
        tokens += action_tokens + tokenizer.encode(f" {reply}")
    return {"tokens": tokens, "trainable": trainable, "advantage": advantage}


WRONG_THEN_RIGHT = [("next", "room 2 : cat ."), ("answer alpha three", "answer wrong . 0 of 1 "
                    "digits right . try again : say next ."), ("next", "room 1 : dog ."),
                    ("answer alpha two", "answer correct . 1 of 1 digits right .")]


def test_each_answer_is_found_with_its_verdict_and_advantages(tokenizer) -> None:
    sequence = kept_sequence(tokenizer, WRONG_THEN_RIGHT, [0.1, 0.9, 0.2, 0.5])
    answers = list(graded_answers(sequence, tokenizer.decode))
    assert [correct for correct, _ in answers] == [False, True]
    assert set(answers[0][1]) == {0.9} and set(answers[1][1]) == {0.5}
    unanswered = kept_sequence(tokenizer, WRONG_THEN_RIGHT[:1], [0.1])
    assert list(graded_answers(unanswered, tokenizer.decode)) == []


def test_a_run_compares_the_wrong_and_right_answers_of_the_same_rollouts(
        tokenizer, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The right answers of rollouts right at the first try are reported
    apart: they are easier tasks' and would compare other rollouts."""
    run = tmp_path / "run"
    (run / SAMPLES_FOLDER).mkdir(parents=True)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(run / "export")
    retried = {"success": True,
               "sequences": [kept_sequence(tokenizer, WRONG_THEN_RIGHT, [0.1, 0.9, 0.2, 0.3])]}
    failed = {"success": False,
              "sequences": [kept_sequence(tokenizer, WRONG_THEN_RIGHT[:2], [0.0, -2.0])]}
    first_try = {"success": True,
                 "sequences": [kept_sequence(tokenizer, WRONG_THEN_RIGHT[3:], [1.5])]}
    (run / SAMPLES_FOLDER / "step-0000002.json").write_text(
        json.dumps({"step": 2, "version": 2, "rollouts": [retried, failed, first_try]}))
    result = measure(run)
    assert result["retried_right_rollouts"] == 1
    assert result["wrong_answer_advantage"] == pytest.approx(0.9)
    assert result["right_answer_advantage"] == pytest.approx(0.3)
    assert result["ratio"] == pytest.approx(3.0)
    assert result["first_try_right_advantage"] == pytest.approx(1.5)
    assert result["paired_difference"] == pytest.approx(0.6)


def test_one_advantage_per_rollout_pairs_to_zero_where_pooled_tokens_do_not_give_one(
        tokenizer, tiny_model_dir: Path, tmp_path: Path) -> None:
    """GRPO's case: every token of a rollout has its advantage. Two rollouts
    with their wrong and right answers in other proportions pool to a ratio
    other than 1; each rollout's own difference is 0."""
    run = tmp_path / "run"
    (run / SAMPLES_FOLDER).mkdir(parents=True)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(run / "export")
    twice_wrong = WRONG_THEN_RIGHT[:2] + WRONG_THEN_RIGHT[:2] + WRONG_THEN_RIGHT[2:]
    rollouts = [{"success": True, "sequences": [kept_sequence(tokenizer, twice_wrong,
                                                              [0.2] * len(twice_wrong))]},
                {"success": True, "sequences": [kept_sequence(
                    tokenizer, WRONG_THEN_RIGHT, [1.0] * len(WRONG_THEN_RIGHT))]}]
    (run / SAMPLES_FOLDER / "step-0000002.json").write_text(
        json.dumps({"step": 2, "version": 2, "rollouts": rollouts}))
    result = measure(run)
    assert result["retried_right_rollouts"] == 2
    assert result["ratio"] != pytest.approx(1.0, abs=0.05)
    assert result["paired_difference"] == pytest.approx(0.0, abs=1e-12)
