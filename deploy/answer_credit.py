"""What a run's training credited to the wrong answers of rollouts that ended
right: the segment-level credit group-relative advantages lose.

In KeyVault with ``retries`` a rollout may answer wrong, walk the rooms again
and then answer right. Group-relative advantages (GRPO) give every token of
that rollout its outcome's advantage, the wrong answer's included; a critic
can give the wrong answer its own. This reads the rollouts a run kept as
trained (``RUN/samples``, :mod:`learner.samples`), finds each answer among
their sampled tokens (an action that begins with ``answer``) and the verdict
the environment replied to it (``answer correct`` / ``answer wrong``), and
reports, over the rollouts that answered wrong and then right, the mean
advantage the loss gave the tokens of their wrong answers and of their
right ones, both from the same rollouts: a ratio near 0 leaves the wrong
answers alone, 1 reinforces them as much as the answer that was right (what
one advantage per rollout, GRPO's, gives by construction). Apart, the right
answers of the rollouts that were right at the first try.

Pooled over tokens, the two means weigh each rollout by how many answer
tokens it has of each kind, so even one advantage per rollout does not give
a ratio of exactly 1 over many rollouts. The paired difference does not mix
rollouts: per rollout, its wrong answers' mean advantage less its right
answers', averaged over the rollouts; exactly 0 under one advantage per
rollout, below 0 where training told the wrong answer from the right one.

    python -m deploy.answer_credit RUN [RUN ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

from transformers import AutoTokenizer

from learner.samples import read_samples
from protocol import sampled_runs

#: KeyVault's reply to an answer (actors/envs/keyvault.py, ``_grade``).
VERDICT = re.compile(r"answer (correct|wrong)")
#: Tokens after an answer within which its verdict is looked for: the
#: turn's end, the tool's turn and the verdict.
VERDICT_WITHIN = 16


def graded_answers(sequence: dict, decode: Callable[[list[int]], str]
                   ) -> Iterator[tuple[bool, list[float]]]:
    """Each answer among a kept sequence's trained tokens whose verdict its
    tokens hold: whether it was right, and the advantages of its tokens."""
    tokens = sequence["tokens"]
    advantage = dict(zip(sequence["trainable"], sequence["advantage"], strict=True))
    for start, end in sampled_runs([position in advantage for position in range(len(tokens))]):
        if not decode(tokens[start:end]).lstrip().lower().startswith("answer"):
            continue
        verdict = VERDICT.search(decode(tokens[end:end + VERDICT_WITHIN]).lower())
        if verdict is not None:
            yield verdict.group(1) == "correct", [advantage[p] for p in range(start, end)]


def measure(run: Path) -> dict:
    """The mean advantage of the wrong and of the right answers' tokens in
    the kept rollouts of ``run`` that answered wrong, then right, and of the
    right answers' tokens in those right at the first try (None where it
    kept none)."""
    tokenizer = AutoTokenizer.from_pretrained(run / "export")
    wrong: list[float] = []
    right: list[float] = []
    first_try: list[float] = []
    paired: list[float] = []
    retried = 0
    for step in read_samples(run):
        for rollout in step["rollouts"]:
            if not rollout["success"]:
                continue
            answers = [answer for sequence in rollout["sequences"]
                       for answer in graded_answers(sequence, tokenizer.decode)]
            if all(correct for correct, _ in answers):
                first_try.extend(a for _, advantages in answers for a in advantages)
                continue
            retried += 1
            mine: dict[bool, list[float]] = {True: [], False: []}
            for correct, advantages in answers:
                mine[correct].extend(advantages)
            wrong.extend(mine[False])
            right.extend(mine[True])
            if mine[False] and mine[True]:
                paired.append(statistics.fmean(mine[False]) - statistics.fmean(mine[True]))

    def mean(values: list[float]) -> float | None:
        return round(statistics.fmean(values), 4) if values else None

    wrong_mean, right_mean = mean(wrong), mean(right)
    return {"run": str(run), "retried_right_rollouts": retried,
            "wrong_answer_advantage": wrong_mean, "right_answer_advantage": right_mean,
            "first_try_right_advantage": mean(first_try),
            "paired_difference": mean(paired),
            "ratio": (round(wrong_mean / right_mean, 3)
                      if wrong_mean is not None and right_mean else None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path,
                        help="run folders (RUN/samples, RUN/export)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    results = [measure(run) for run in args.runs]
    for result in results:
        print(f"{result['run']}: {result['retried_right_rollouts']} kept rollouts answered "
              f"wrong, then right; advantage of their wrong answers "
              f"{result['wrong_answer_advantage']}, of right answers "
              f"{result['right_answer_advantage']} (ratio {result['ratio']}; per rollout, "
              f"wrong less right {result['paired_difference']}); right answers "
              f"at the first try {result['first_try_right_advantage']}")
    if args.json:
        print(json.dumps({"runs": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
