"""The keyvault environment: deterministic tasks, grading, and a size that needs compaction."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import Generation
from actors.envs.base import Environment
from actors.envs.keyvault import KeyVault
from actors.envs.vocabulary import WORDS
from actors.episode import run_episode


def walk(env: KeyVault, seed: int) -> list[str]:
    async def go() -> list[str]:
        await env.reset(seed)
        return [(await env.step("next")).observation for _ in range(env.rooms + 1)]
    return asyncio.run(go())


def answer(env: KeyVault, text: str):
    return asyncio.run(env.step(text))


def test_is_an_environment() -> None:
    assert isinstance(KeyVault(), Environment)


def test_same_seed_same_episode_other_seed_other_codes() -> None:
    env = KeyVault()
    assert walk(env, 3) == walk(env, 3)
    first = dict(env._answer)
    walk(env, 4)
    assert env._answer != first


def test_every_digit_is_revealed_exactly_once() -> None:
    env = KeyVault(codes=3, digits=3, rooms=12)
    notes = [o for o in walk(env, 1) if "note :" in o]
    assert len(notes) == 9
    assert "no more rooms" in walk(env, 1)[-1]


def test_exact_answer_scores_one_and_partial_credit_is_optional() -> None:
    env = KeyVault(codes=2, digits=4)
    walk(env, 9)
    codes = env._answer
    right = "answer " + " ".join(f"{n} " + " ".join(map(str, d)) for n, d in codes.items())
    result = answer(env, right)
    assert result.done and result.success and result.reward == 1.0
    words = right.replace(str(codes["alpha"][0]), "zero one two three four five six seven eight "
                          "nine".split()[codes["alpha"][0]], 1)
    assert answer(env, words).success  # digits as words count too
    wrong = "answer alpha " + " ".join(str((d + 1) % 10) for d in codes["alpha"])
    assert answer(env, wrong).reward == 0.0
    partial = KeyVault(codes=2, digits=4, partial_credit=True)
    walk(partial, 9)
    only_alpha = "answer alpha " + " ".join(map(str, partial._answer["alpha"]))
    result = answer(partial, only_alpha)
    assert result.reward == 0.5 and not result.success


def test_unordered_notes_hide_positions_and_any_order_is_exact() -> None:
    env = KeyVault(codes=2, digits=4, ordered=False)
    notes = [o.split("note : ")[1] for o in walk(env, 9) if "note :" in o]
    assert all(len(note.split()) == 3 for note in notes)  # "alpha seven ."
    codes = env._answer
    assert all(len(set(digits)) == 4 for digits in codes.values())  # distinct
    backwards = "answer " + " ".join(f"{n} " + " ".join(map(str, d[::-1]))
                                     for n, d in codes.items())
    assert answer(env, backwards).success
    partial = KeyVault(codes=1, digits=4, ordered=False, partial_credit=True)
    walk(partial, 9)
    first, second = partial._answer["alpha"][:2]
    twice = answer(partial, f"answer alpha {first} {first} {second}")
    assert twice.reward == 0.5 and not twice.success  # a digit given twice counts once


@pytest.mark.parametrize("ordered", [True, False])
def test_padding_an_answer_with_extra_digits_earns_no_credit(ordered: bool) -> None:
    env = KeyVault(codes=2, digits=3, ordered=ordered, partial_credit=True)
    walk(env, 9)
    codes = env._answer
    every_digit = "answer " + " ".join(f"{n} " + " ".join(map(str, range(10))) for n in codes)
    result = answer(env, every_digit)
    assert not result.success and result.reward <= 0.3  # 3 right of the 10 given, per code
    padded = "answer " + " ".join(f"{n} " + " ".join(map(str, [*d, *d])) for n, d in codes.items())
    assert answer(env, padded).reward == 0.5  # every digit right, given twice over


@pytest.mark.parametrize("ordered", [True, False])
def test_text_stays_inside_the_vocabulary(ordered: bool) -> None:
    env = KeyVault(ordered=ordered)
    task = asyncio.run(env.reset(5))
    known = set(WORDS) | {".", ",", ":"}
    text = " ".join([task.system, task.instruction, *walk(env, 5)[:-1]])
    assert {w for w in text.split() if w not in known and not w.isdigit()} == set()


def test_a_wrong_answer_with_retries_left_walks_the_same_rooms_again() -> None:
    """With ``retries`` a wrong answer is not the end: the agent is told how
    many digits were right and walks the same notes from room 1 again; the
    last answer is graded, with the attempts it took."""
    env = KeyVault(codes=1, digits=3, rooms=5, ordered=False, partial_credit=True, retries=2)
    first = walk(env, 7)
    digits = env._answer["alpha"]
    wrong = "answer alpha " + " ".join(str(d) for d in range(10) if d not in digits)[:5]
    retry = answer(env, wrong)
    assert not retry.done and retry.observation.endswith("try again : say next .")
    assert set(retry.observation.split()) <= set(WORDS) | {".", ",", ":", "right"} | set("0123")
    again = [asyncio.run(env.step("next")).observation for _ in range(env.rooms + 1)]
    notes = [o.split(" . note : ")[1:] for o in first]
    assert [o.split(" . note : ")[1:] for o in again] == notes  # the same notes, room by room
    right = answer(env, "answer alpha " + " ".join(map(str, digits)))
    assert right.done and right.success and right.reward == 1.0
    assert right.info["attempts"] == 2


def test_the_last_attempt_is_graded_when_the_retries_run_out() -> None:
    env = KeyVault(codes=1, digits=3, rooms=5, ordered=False, partial_credit=True, retries=1)
    walk(env, 7)
    digits = env._answer["alpha"]
    wrong = "answer alpha " + " ".join(str(d) for d in range(10) if d not in digits)[:5]
    assert not answer(env, wrong).done
    one_right = f"answer alpha {digits[0]} " + wrong.split()[-1] + " " + wrong.split()[-2]
    last = answer(env, one_right)
    assert last.done and not last.success and last.reward == pytest.approx(1 / 3)
    assert last.info["attempts"] == 2
    asyncio.run(env.reset(7))  # a new episode has its retries again
    assert not answer(env, wrong).done
    with pytest.raises(ValueError, match="retries"):
        KeyVault(retries=-1)


def test_sizes_given_as_ranges_are_drawn_per_episode_and_tagged() -> None:
    env = KeyVault(codes=1, digits=3, rooms=[6, 20], distractor_words=[2, 9])
    drawn = set()
    for seed in range(40):
        task = asyncio.run(env.reset(seed))
        assert 6 <= env.rooms <= 20 and 2 <= env.distractor_words <= 9
        assert task.tags == {"rooms": str(env.rooms), "distractor_words": str(env.distractor_words)}
        assert f"{env.rooms} rooms" in task.instruction
        drawn.add(env.rooms)
        again = asyncio.run(env.reset(seed))  # the seed decides
        assert again == task
    assert len(drawn) > 5
    fixed = asyncio.run(KeyVault(rooms=12).reset(0))
    assert fixed.tags == {}  # nothing varies: nothing to tell apart


@pytest.mark.parametrize("options", [{"codes": 0}, {"digits": 11}, {"rooms": 3},
                                     {"distractor_words": -1}, {"rooms": [20, 10]},
                                     {"rooms": [3, 30]}, {"codes": [1, 9]},
                                     {"rooms": "many"}, {"digits": [1, 2, 3]}])
def test_impossible_sizes_are_rejected(options: dict) -> None:
    with pytest.raises(ValueError):
        KeyVault(**options)


class Oracle:
    """Walks every room, then answers from the environment's own solution;
    its summaries are one word (the kept steps carry nothing it needs)."""

    def __init__(self, chat: ChatFormat, env: KeyVault) -> None:
        self.chat, self.env = chat, env
        self.summary_tail = chat.summary_request + chat.assistant_header

    async def generate(self, prompt, max_tokens, seed=None, temperature=None) -> Generation:
        if prompt[-len(self.summary_tail):] == self.summary_tail:
            text = "summary"
        elif self.env._room < self.env.rooms:
            text = "next"
        else:
            text = "answer " + " ".join(f"{n} " + " ".join(map(str, d))
                                        for n, d in self.env._answer.items())
        ids, _ = self.chat.content(text, max_tokens)
        return Generation(ids, [-0.1] * len(ids), [0] * len(ids))


def test_a_perfect_episode_needs_one_to_three_compactions_by_default(tiny_model_dir: Path
                                                                    ) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = ActorConfig()
    env = KeyVault(**{"codes": 2, "digits": 4, "rooms": 24, "distractor_words": 30})
    chat = ChatFormat(tokenizer, config.compaction, config.environment)
    oracle = Oracle(chat, env)

    async def ignore(task_id, segment, result) -> None:
        return None

    result = asyncio.run(run_episode(oracle, env, chat, config, seed=2, emit=ignore))
    assert result.stats.success
    assert 1 <= result.stats.compactions <= 3
