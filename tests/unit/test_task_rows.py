"""Task rows from a dataset (actors/envs/tasks.py): training and evaluation
rows never mix, whatever seed is asked, and the split is the same in every
process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.envs.base import EVALUATION_SEEDS_FROM
from actors.envs.tasks import TaskRows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def drawn(rows: TaskRows, seeds: range) -> set[str]:
    return {rows.for_seed(seed)["id"] for seed in seeds}


def test_a_split_column_decides_and_seeds_never_cross_it(tmp_path: Path) -> None:
    rows = [{"id": f"t{i}", "split": "train"} for i in range(5)]
    rows += [{"id": f"e{i}", "split": "test"} for i in range(3)]
    tasks = TaskRows(write_jsonl(tmp_path / "rows.jsonl", rows))
    assert drawn(tasks, range(1000)) == {f"t{i}" for i in range(5)}
    assert drawn(tasks, range(EVALUATION_SEEDS_FROM, EVALUATION_SEEDS_FROM + 1000)) == {
        f"e{i}" for i in range(3)}


def test_without_a_split_a_hash_of_the_id_holds_out_the_same_rows_everywhere(
        tmp_path: Path) -> None:
    rows = [{"id": f"row-{i}", "question": str(i)} for i in range(2000)]
    first = TaskRows(write_jsonl(tmp_path / "a.jsonl", rows), eval_fraction=0.1)
    shuffled = TaskRows(write_jsonl(tmp_path / "b.jsonl", rows[::-1]), eval_fraction=0.1)
    held_out = {row["id"] for row in first.rows["eval"]}
    assert held_out == {row["id"] for row in shuffled.rows["eval"]}
    assert 150 < len(held_out) < 250  # 10 % of 2000, within binomial spread
    assert not held_out & {row["id"] for row in first.rows["train"]}


def test_a_datasets_folder_keeps_its_named_splits(tmp_path: Path) -> None:
    import datasets
    folder = tmp_path / "dataset"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"id": "a", "q": "1"}, {"id": "b", "q": "2"}]),
        "test": datasets.Dataset.from_list([{"id": "c", "q": "3"}]),
    }).save_to_disk(str(folder))
    tasks = TaskRows(folder)
    assert drawn(tasks, range(10)) == {"a", "b"}
    assert drawn(tasks, range(EVALUATION_SEEDS_FROM, EVALUATION_SEEDS_FROM + 10)) == {"c"}


@pytest.mark.parametrize("text, message", [
    ('{"id": 1}\nnot json\n', "rows.jsonl:2: not JSON"),
    ('[1, 2]\n', "rows.jsonl:1: a row must be a JSON object"),
    ('{"id": 1, "split": "test"}\n', "no training rows"),
])
def test_bad_rows_are_refused_with_their_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        TaskRows(path)


def test_a_question_answer_environment_takes_its_tasks_from_rows(tmp_path: Path) -> None:
    import asyncio

    from actors.envs.qa import QuestionAnswer

    rows = [{"id": "q1", "question": "What is 6 x 7?", "answer": "42", "family": "arith",
             "difficulty": "1", "split": "train"},
            {"id": "q2", "question": "Capital of France?", "answer": "Paris", "split": "test"}]
    environment = QuestionAnswer(str(write_jsonl(tmp_path / "qa.jsonl", rows)), attempts=2)

    async def play(seed: int, replies: list[str]):
        task = await environment.reset(seed)
        return task, [await environment.step(reply) for reply in replies]

    task, results = asyncio.run(play(3, ["I think 41", "so the answer: 42."]))
    assert task.instruction == "What is 6 x 7?" and task.tags == {"family": "arith",
                                                                  "difficulty": "1"}
    assert [(r.done, r.reward) for r in results] == [(False, 0.0), (True, 1.0)]
    assert "1 attempt left" in results[0].observation
    held_out, results = asyncio.run(play(EVALUATION_SEEDS_FROM, ["answer: paris"]))
    assert held_out.task_id == "qa-q2" and results[0].success
