"""Where a KeyVault episode loses its facts: in reading, in summarising or in
answering.

A KeyVault fact is one digit of one code, read from a note ("note : alpha
seven ."). An episode succeeds only if every fact is read, survives every
compaction (the window is rebuilt around the summary, so a fact leaves the
context only there) and is then answered right. This module reads an
episode's segments, as the actor emitted them, and says which of those
failed:

- a fact is *read* when its note was in an observation;
- before compaction k, the facts *in the window* are the read facts the
  window mentions (a note, or the code's name followed by the digit's word in
  the policy's own text: an earlier summary, an action); after it, those the
  rebuilt window (the summary and the kept steps) mentions;
- the episode's *cause* is the first of: ``success``; ``no answer`` (it
  ended otherwise: the compaction limit, a full window, the step limit);
  ``never read`` (a note was not read: the answer came too early);
  ``lost in compaction`` (a read fact was not in the window the answer was
  written from); ``wrong answer`` (every fact was there, the answer was
  wrong).

A mention is attributed to the nearest code name before it; number words
before any code name (the system prompt's "one action") are not facts. With
``ordered`` notes, a mention is a position's ordinal followed by the digit.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from actors.context import ClosedSegment
from actors.envs.keyvault import CODE_NAMES, NUMBER_WORDS, ORDINALS, KeyVault
from actors.episode import EpisodeResult
from protocol import sampled_runs

Cause = Literal["success", "no answer", "never read", "lost in compaction", "wrong answer"]
#: In the order an episode's cause is decided (the first that applies).
CAUSES: tuple[Cause, ...] = ("success", "no answer", "never read", "lost in compaction",
                             "wrong answer")
DIGIT_WORDS = NUMBER_WORDS[:10]
NOTE = re.compile(r"note : ([a-z]+) (?:([a-z]+) )?([a-z]+) \.")


@dataclass(frozen=True)
class Fact:
    """A digit of a code; ``position`` None where notes do not give it."""

    code: str
    position: int | None
    digit: int


@dataclass(frozen=True)
class Layout:
    """What an episode's facts are: how many, of which codes, with positions or not."""

    facts: int
    codes: tuple[str, ...]
    ordered: bool


async def layout_of(options: dict[str, Any], seed: int) -> Layout:
    """The layout of the KeyVault task ``seed`` with these options (its sizes
    may be drawn per episode)."""
    vault = KeyVault(**options)
    await vault.reset(seed)
    return Layout(vault.codes * vault.digits, CODE_NAMES[:vault.codes], vault.ordered)


def notes_in(text: str) -> set[Fact]:
    """The facts of the notes in an observation's text."""
    found = set()
    for code, ordinal, word in NOTE.findall(text):
        if word in DIGIT_WORDS and (not ordinal or ordinal in ORDINALS):
            found.add(Fact(code, ORDINALS.index(ordinal) if ordinal else None,
                           DIGIT_WORDS.index(word)))
    return found


def mentions_in(text: str, codes: Iterable[str], ordered: bool) -> set[Fact]:
    """The facts ``text`` states, in any words (see the module docstring)."""
    names = set(codes)
    found: set[Fact] = set()
    code = previous = None
    for word in re.findall(r"[a-z]+|\d", text.lower()):
        if word in names:
            code = word
        elif code is not None and word in DIGIT_WORDS:
            if not ordered:
                found.add(Fact(code, None, DIGIT_WORDS.index(word)))
            elif previous in ORDINALS:
                found.add(Fact(code, ORDINALS.index(previous), DIGIT_WORDS.index(word)))
        previous = word
    return found


@dataclass(frozen=True)
class FactAccount:
    """One episode's facts, from reading to the answer."""

    facts: int
    """The task's facts (codes x digits)."""
    read: frozenset[Fact]
    compactions: tuple[tuple[int, int], ...]
    """Per compaction: read facts in the window before it, and of them in the window after."""
    at_answer: int | None
    """Read facts in the window the answer was written from; None without an answer."""
    success: bool
    steps_since_compaction: int | None = None
    """Actions between the last compaction and the answer; None without
    either. Where the last summary falls before the end is the window's
    layout at the answer."""

    @property
    def cause(self) -> Cause:
        if self.success:
            return "success"
        if self.at_answer is None:
            return "no answer"
        if len(self.read) < self.facts:
            return "never read"
        if self.at_answer < len(self.read):
            return "lost in compaction"
        return "wrong answer"


def account(segments: list[ClosedSegment], result: EpisodeResult, layout: Layout,
            decode: Callable[[list[int]], str]) -> FactAccount:
    """What happened to the facts of one episode, from its segments in the
    order they were emitted (execution, then summary and execution after
    each compaction). ``decode`` turns token ids into text without special
    tokens."""
    codes, ordered = layout.codes, layout.ordered
    read: set[Fact] = set()
    compactions: list[tuple[int, int]] = []
    before: set[Fact] | None = None
    for segment in segments:
        runs = sampled_runs(segment.loss_mask)
        if segment.segment_type == "summary":
            context = [t for t, m in zip(segment.tokens, segment.loss_mask, strict=True) if not m]
            before = mentions_in(decode(context), codes, ordered) & read
            continue
        first = runs[0][0] if runs else len(segment.tokens)
        if before is not None:  # this window was rebuilt around the last summary
            kept = mentions_in(decode(segment.tokens[:first]), codes, ordered) & before
            compactions.append((len(before), len(kept)))
            before = None
        for (_, end), (following, _) in zip(runs, [*runs[1:], (len(segment.tokens), 0)],
                                            strict=True):
            read |= notes_in(decode(segment.tokens[end:following]))
    at_answer = steps = None
    runs = sampled_runs(segments[-1].loss_mask) if segments else []
    if result.stats.outcome == "done" and runs:
        window = mentions_in(decode(segments[-1].tokens[:runs[-1][0]]), codes, ordered)
        at_answer = len(window & read)
        steps = len(runs) - 1 if compactions else None
    return FactAccount(layout.facts, frozenset(read), tuple(compactions), at_answer,
                       result.stats.success, steps)


def summarise_facts(accounts: list[FactAccount]) -> dict[str, Any]:
    """Over episodes: the fraction of each cause; the fraction of the facts
    read; of the facts read by episodes that answered, the fraction in the
    window the answer was written from; per compaction k (1, 2, ...), the
    fraction of the read facts in the window before it that are in the
    window after it; and, of the answers written with every fact in the
    window, the fraction wrong, and that by the actions between the last
    compaction and the answer."""
    n = len(accounts)
    causes = {cause: sum(a.cause == cause for a in accounts) / n if n else 0.0
              for cause in CAUSES}
    before: dict[int, int] = defaultdict(int)
    after: dict[int, int] = defaultdict(int)
    for a in accounts:
        for k, (held, kept) in enumerate(a.compactions, start=1):
            before[k] += held
            after[k] += kept
    answered = [a for a in accounts if a.at_answer is not None]
    complete = [a for a in answered if a.at_answer == a.facts]
    read_when_answering = sum(len(a.read) for a in answered)
    return {
        "episodes": n, "causes": causes,
        "read": sum(len(a.read) for a in accounts) / sum(a.facts for a in accounts) if n else 0.0,
        "in_answer_window": (sum(a.at_answer or 0 for a in answered) / read_when_answering
                             if read_when_answering else None),
        "kept_by_compaction": {k: after[k] / before[k] for k in sorted(before) if before[k]},
        "facts_by_compaction": dict(sorted(before.items())),
        "answers_with_every_fact": len(complete),
        "wrong_with_every_fact": (sum(not a.success for a in complete) / len(complete)
                                  if complete else None),
        "wrong_with_every_fact_by_steps_since_compaction": {
            k: {"answers": len(group), "wrong": sum(not a.success for a in group) / len(group)}
            for k in sorted({a.steps_since_compaction for a in complete} - {None})
            for group in [[a for a in complete if a.steps_since_compaction == k]]}}
