"""``keyvault``: a long-horizon memory task that needs compaction.

The agent walks through numbered rooms by saying ``next``. Each room is
described with distractor text; some rooms hold a note revealing one digit of
one code ("note : bravo second seven": the second digit of code bravo is 7). After the last room the
agent must ``answer`` with every code: ``answer alpha 4 0 7 1 bravo 9 9 2 5``
(digits as numerals or words). With the local default context the notes of
early rooms have scrolled out of the window by the end, so an episode
succeeds only if the summaries kept the digits found.

With ``ordered = false`` a code's digits are distinct and a note gives a digit
without its position ("note : bravo seven"); the answer may list them in any
order. That removes *binding* (which value goes with which position) from
the task, which a tiny model cannot learn in minutes (docs/running.md), and
leaves what compaction is about: keeping every fact.

Sizes: ``codes``, ``digits``, ``rooms`` and ``distractor_words`` each take a
number, or a ``[low, high]`` range from which each episode draws its own
(inclusive, from the episode's seed): training on a distribution of horizons
(more rooms and distractors, more windows, more compactions; more facts to
keep) instead of one. Each task's tags name its sizes, so an evaluation
reports success by size.

``retries``: after a wrong answer the agent may search again that many times:
the observation says how many digits were right, the walk starts again at
room 1 (the same notes, other distractor text), and the last answer is
graded. How long an episode runs, and so how many times it compacts,
then depends on what the agent kept: rollouts of one task that kept every
fact answer after one walk, those that lost one walk again (and compact
again), the regime in which segment counts differ within a task's group
(docs/results.md, "Unequal compaction").

Reward: 1 for an exact answer (all codes, all digits), else 0; with
``partial_credit`` the fraction of digits right, each code's counted over
the digits given for it where more were given than it has (an answer padded
with every digit scores as a guess, not as right). Deterministic in the seed.
All text uses :mod:`actors.envs.vocabulary` words, one token each in the
tiny model.
"""

from __future__ import annotations

import asyncio
import random
import re

from actors.envs.base import StepResult, Task
from actors.envs.vocabulary import DISTRACTOR_WORDS

CODE_NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten")
#: Digit positions are ordinals, never number words: a note reads "code,
#: position, value" with no word that every note repeats between position
#: and value, so matching the one word before a value finds it (an induction
#: head; the tiny model does not learn one in minutes, hence ``ordered``).
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
            "ninth", "tenth")

# Short texts: they open every window, so their length is paid in every
# segment the learner trains on.
SYSTEM = "you are an agent . each reply is one action : next , or answer with every code ."


Size = int | list[int] | tuple[int, int]
"""A number, or an inclusive ``[low, high]`` range drawn from per episode."""


def size_range(name: str, size: Size) -> tuple[int, int]:
    """``(low, high)`` of a size option; ValueError unless it is an integer or
    a pair of integers with low <= high."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    if (isinstance(size, list | tuple) and len(size) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in size)
            and size[0] <= size[1]):
        return size[0], size[1]
    raise ValueError(f"{name} must be an integer or [low, high] with low <= high, not {size!r}")


class KeyVault:
    """One keyvault episode at a time (see the module docstring)."""

    def __init__(self, codes: Size = 2, digits: Size = 4, rooms: Size = 24,
                 distractor_words: Size = 30, partial_credit: bool = False,
                 ordered: bool = True, step_latency_s: float = 0.0, retries: int = 0) -> None:
        self.sizes = {name: size_range(name, size) for name, size in (
            ("codes", codes), ("digits", digits), ("rooms", rooms),
            ("distractor_words", distractor_words))}
        if not 1 <= self.sizes["codes"][0] <= self.sizes["codes"][1] <= len(CODE_NAMES):
            raise ValueError(f"codes must be in [1, {len(CODE_NAMES)}]")
        if not 1 <= self.sizes["digits"][0] <= self.sizes["digits"][1] <= 10:
            raise ValueError("digits must be in [1, 10]")
        most_notes = self.sizes["codes"][1] * self.sizes["digits"][1]
        if self.sizes["rooms"][0] < most_notes:
            raise ValueError(f"rooms = {self.sizes['rooms'][0]} cannot hold codes x digits = "
                             f"{most_notes} notes")
        if self.sizes["distractor_words"][0] < 0 or step_latency_s < 0 or retries < 0:
            raise ValueError("distractor_words, step_latency_s and retries must be >= 0")
        self.codes = self.digits = self.rooms = self.distractor_words = 0
        """This episode's sizes (drawn at reset)."""
        self.partial_credit = partial_credit
        self.ordered = ordered
        self.step_latency_s = step_latency_s
        self.retries = retries
        self.attempts = 0
        """Answers given in this episode."""
        self._rng = random.Random()
        self._answer: dict[str, list[int]] = {}
        self._notes: dict[int, tuple[str, int, int]] = {}
        self._room = 0

    async def reset(self, seed: int) -> Task:
        self._rng = random.Random(seed)
        self.codes, self.digits, self.rooms, self.distractor_words = (
            self._rng.randint(*self.sizes[name])
            for name in ("codes", "digits", "rooms", "distractor_words"))
        names = CODE_NAMES[: self.codes]
        self._answer = {name: ([self._rng.randrange(10) for _ in range(self.digits)]
                               if self.ordered else self._rng.sample(range(10), self.digits))
                        for name in names}
        facts = [(name, position, digit) for name, digits in self._answer.items()
                 for position, digit in enumerate(digits)]
        rooms = self._rng.sample(range(1, self.rooms + 1), len(facts))
        self._notes = dict(zip(rooms, facts, strict=True))
        self._room = 0
        self.attempts = 0
        which = " . " if self.ordered else " , not its position . "
        instruction = (
            f"{self.rooms} rooms . say next to enter a room . notes hold one digit of a code"
            f"{which}codes : " + " , ".join(names) + f" , {self.digits} digits each . after the "
            "last room say answer " + " ".join(f"{n} " + " ".join("0" * self.digits)
                                               for n in names) + " .")
        tags = {name: str(getattr(self, name)) for name, (low, high) in self.sizes.items()
                if low < high}  # the sizes that vary
        return Task(task_id=f"keyvault-{seed}", system=SYSTEM, instruction=instruction, tags=tags)

    async def step(self, action: str) -> StepResult:
        if self.step_latency_s:
            await asyncio.sleep(self.step_latency_s)
        words = re.findall(r"[a-z]+|\d", action.lower())
        if "answer" in words:
            self.attempts += 1
            graded = self._grade(words[words.index("answer") + 1:])
            if graded.success or self.attempts > self.retries:
                return graded
            self._room = 0  # the same notes again, from the first room
            return StepResult(f"{graded.observation} try again : say next .")
        if words[:1] == ["next"]:
            self._room += 1
            if self._room > self.rooms:
                return StepResult("no more rooms . say answer now with every code .")
            return StepResult(self._describe(self._room))
        return StepResult("unknown command . say next , or answer with every code .")

    async def close(self) -> None:
        return None

    def _describe(self, room: int) -> str:
        distractor = " ".join(self._rng.choice(DISTRACTOR_WORDS)
                              for _ in range(self.distractor_words))
        text = f"room {room} : {distractor} ."
        if room in self._notes:
            name, position, digit = self._notes[room]
            where = f" {ORDINALS[position]}" if self.ordered else ""
            text += f" note : {name}{where} {NUMBER_WORDS[digit]} ."
        return text

    def _grade(self, words: list[str]) -> StepResult:
        given: dict[str, list[int]] = {}
        current: list[int] | None = None
        for word in words:
            if word in self._answer:
                current = given.setdefault(word, [])
            elif current is not None and (word.isdigit() or word in NUMBER_WORDS[:10]):
                current.append(int(word) if word.isdigit() else NUMBER_WORDS.index(word))
        if self.ordered:
            rights = {name: sum(a == b for a, b in zip(digits, given.get(name, []), strict=False))
                      for name, digits in self._answer.items()}
            exact = all(given.get(name) == digits for name, digits in self._answer.items())
        else:
            rights = {name: len(set(digits) & set(given.get(name, [])))
                      for name, digits in self._answer.items()}
            exact = all(sorted(given.get(name, [])) == sorted(digits)
                        for name, digits in self._answer.items())
        right, total = sum(rights.values()), self.codes * self.digits
        # a code's credit is over the digits given where more were given than
        # it has: padding an answer with every digit must not earn full credit
        credit = sum(count / max(self.digits, len(given.get(name, [])))
                     for name, count in rights.items()) / self.codes
        reward = 1.0 if exact else (credit if self.partial_credit else 0.0)
        verdict = "correct" if exact else "wrong"
        return StepResult(f"answer {verdict} . {right} of {total} digits right .", done=True,
                          reward=reward, success=exact,
                          info={"digits_right": right, "attempts": self.attempts})
