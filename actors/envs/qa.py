"""``qa``: questions with known answers, from task rows (a JSONL file or a
``datasets`` folder: actors/envs/tasks.py), the shape of most reasoning
datasets users bring.

A row has ``question`` and ``answer``, and optionally ``id``, ``system``,
``split`` and any of ``family`` and ``difficulty`` (the task's tags). The
agent answers; an exact match of the answer (after trimming, case-folding
and collapsing spaces, and taking the text after a final ``answer:`` if the
reply has one) ends the episode with reward 1. A wrong answer is told so,
and the agent may try again until ``attempts`` are spent (reward 0).
"""

from __future__ import annotations

from typing import Any

from actors.envs.base import StepResult, Task
from actors.envs.tasks import TaskRows, row_id

DEFAULT_SYSTEM = "Answer the question. End your reply with 'answer: ' and the answer."


def normalise(text: str) -> str:
    """The comparable form of an answer."""
    text = text.lower().rsplit("answer:", 1)[-1]
    return " ".join(text.split()).strip(" .")


class QuestionAnswer:
    def __init__(self, rows: str, attempts: int = 1, eval_fraction: float = 0.1,
                 system: str = DEFAULT_SYSTEM) -> None:
        if attempts < 1:
            raise ValueError(f"attempts = {attempts}: at least 1")
        self.rows = TaskRows(rows, eval_fraction)
        self.attempts = attempts
        self.system = system
        self._row: dict[str, Any] = {}
        self._left = 0

    async def reset(self, seed: int) -> Task:
        self._row = self.rows.for_seed(seed)
        for column in ("question", "answer"):
            if column not in self._row:
                raise ValueError(f"{self.rows.source}: a row without {column!r}: {self._row}")
        self._left = self.attempts
        tags = {key: str(self._row[key]) for key in ("family", "difficulty") if key in self._row}
        return Task(task_id=f"qa-{row_id(self._row)}",
                    system=str(self._row.get("system") or self.system),
                    instruction=str(self._row["question"]), tags=tags)

    async def step(self, action: str) -> StepResult:
        self._left -= 1
        if normalise(action) == normalise(str(self._row["answer"])):
            return StepResult("correct", done=True, reward=1.0, success=True)
        if self._left <= 0:
            return StepResult("wrong", done=True, reward=0.0)
        return StepResult(f"wrong; {self._left} attempt{'s' if self._left > 1 else ''} left")

    async def close(self) -> None:
        return None
