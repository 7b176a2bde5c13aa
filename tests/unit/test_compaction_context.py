"""The compaction context: room rules, triggers, rebuilding and segments."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from actors.config import CompactionConfig
from actors.context import (
    MIN_ACTION_TOKENS,
    ClosedSegment,
    CompactionContext,
    CompactionFailed,
    Generation,
    TurnTokens,
)

HEADER, FOOTER, OPEN, CLOSE, MARKER, RESUME_OPEN, RESUME_CLOSE, END = 1, 2, 3, 4, 5, 6, 7, 8
SYSTEM, TASK, REQUEST = 10, 11, 12
OBSERVATION = 20  # observation content tokens
SAMPLED_FROM = 1000  # every sampled token gets a unique id from here up


def turns(system: int = 3, task: int = 5, request: int = 6) -> TurnTokens:
    return TurnTokens(
        system=[SYSTEM] * system, task=[TASK] * task, summary_request=[REQUEST] * request,
        assistant_header=[HEADER], assistant_end=[END], assistant_footer=[FOOTER],
        observation_open=[OPEN],
        observation_close=[CLOSE], truncation_marker=[MARKER],
        resume=lambda ids: [RESUME_OPEN] + [TASK] * task + ids + [RESUME_CLOSE])


class Sampler:
    """Hands out generations whose every token id is unique, except the
    end-of-turn token that closes some of them."""

    def __init__(self, end_every: int = 3) -> None:
        self._ids = itertools.count(SAMPLED_FROM)
        self._calls = itertools.count()
        self._end_every = end_every
        self.sampled: list[int] = []

    def __call__(self, n: int, version: int = 0) -> Generation:
        ids = [next(self._ids) for _ in range(n)]
        if next(self._calls) % self._end_every == 0:
            ids[-1] = END
        self.sampled += ids
        return Generation(ids, [-0.5] * n, [version] * n)


def run_episode(data: st.DataObject, context: CompactionContext, max_turn: int,
                max_steps: int = 40) -> tuple[list[ClosedSegment], str, Sampler]:
    sample = Sampler()
    segments: list[ClosedSegment] = []
    for _ in range(max_steps):
        if context.is_full():
            return segments + [context.finish()], "context_full", sample
        budget = context.action_budget(max_turn)
        action = sample(data.draw(st.integers(1, budget)))
        context.add_step(action, [OBSERVATION] * data.draw(st.integers(0, 200)))
        if context.needs_compaction():
            if not context.compaction_allowed():
                return segments + [context.finish()], "compaction_limit", sample
            summary = sample(data.draw(st.integers(1, context.summary_budget())))
            try:
                segments += context.compact(summary, summary.token_ids)
            except CompactionFailed as failed:
                return segments + failed.args[0], "compaction_failed", sample
    return segments + [context.finish()], "step_limit", sample


@st.composite
def configs(draw) -> CompactionConfig:
    context_tokens = draw(st.integers(64, 700))
    max_summary = draw(st.integers(1, 80))
    return CompactionConfig(
        enabled=draw(st.booleans()), context_tokens=context_tokens,
        reserve_tokens=draw(st.integers(max_summary + 16, max(max_summary + 16, context_tokens))),
        keep_steps=draw(st.integers(0, 3)), max_summary_tokens=max_summary,
        max_compactions=draw(st.integers(0, 4)))


@settings(max_examples=400, deadline=None)
@given(configs(), st.integers(1, 120), st.data())
def test_episode_invariants(config: CompactionConfig, max_turn: int, data: st.DataObject) -> None:
    try:
        context = CompactionContext(turns(), config)
    except ValueError:
        assume(False)
    segments, outcome, sample = run_episode(data, context, max_turn)

    for segment in segments:
        n = len(segment.tokens)
        # arrays have the tokens' length; no context ever exceeds C
        assert len(segment.loss_mask) == len(segment.logprobs) == len(segment.versions) == n
        assert n <= config.context_tokens
        for token, mask, version in zip(segment.tokens, segment.loss_mask, segment.versions,
                                        strict=True):
            # sampled tokens reappear as context (kept steps, the summary in
            # the resume turn); only the policy's own tokens are ever trainable
            assert not mask or token >= SAMPLED_FROM or token == END
            assert (version >= 0) == bool(mask)

    # every sampled token is trainable in exactly one segment, in order
    trainable = [t for s in segments for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
    assert trainable == sample.sampled
    assert len(set(trainable) - {END}) == len([t for t in trainable if t != END])

    # execution and summary segments alternate, starting and ending with execution
    # unless compaction failed right after a summary
    kinds = [s.segment_type for s in segments]
    assert kinds[0] == "execution"
    assert all(a != b for a, b in itertools.pairwise(kinds))
    assert (kinds[-1] == "summary") == (outcome == "compaction_failed")

    for before, segment in zip([None, *segments], segments, strict=False):
        if segment.segment_type == "execution":
            _assert_steps_are_whole(segment.tokens)
        else:
            # a summary's context is the window it summarises, then the request
            assert segment.tokens[:len(before.tokens)] == before.tokens
            n_summary = segment.num_trainable
            assert 1 <= n_summary <= config.max_summary_tokens
            assert segment.tokens[-n_summary - 1] == HEADER
    if not config.enabled:
        assert outcome in ("context_full", "step_limit") and len(segments) == 1


def _assert_steps_are_whole(tokens: list[int]) -> None:
    """After the prefix, the segment is a sequence of whole steps:
    HEADER action+ END FOOTER OPEN content* CLOSE, never an action alone (END
    sampled as the action's last token, or added when the turn hit its limit)."""
    i = 0
    while i < len(tokens) and tokens[i] != HEADER:
        i += 1
    while i < len(tokens):
        assert tokens[i] == HEADER, tokens[i:]
        i += 1
        start = i
        while tokens[i] >= SAMPLED_FROM:
            i += 1
        assert i > start or tokens[i] == END
        assert tokens[i:i + 3] == [END, FOOTER, OPEN]
        i += 3
        while tokens[i] in (OBSERVATION, MARKER):
            i += 1
        assert tokens[i] == CLOSE
        i += 1


def _config(**changes) -> CompactionConfig:
    values = dict(enabled=True, context_tokens=200, reserve_tokens=60, keep_steps=2,
                  max_summary_tokens=20, max_compactions=3)
    values.update(changes)
    return CompactionConfig(**values)


def test_compaction_triggers_when_less_than_the_reserve_is_free() -> None:
    context = CompactionContext(turns(), _config())
    sample = Sampler(end_every=1)
    prefix = len(context)  # 8
    # one step of 1 + 10 + 1 + 1 + content + 1 tokens (the action ends with END)
    context.add_step(sample(10), [OBSERVATION] * (200 - 60 - prefix - 14))
    assert 200 - len(context) == 60 and not context.needs_compaction()
    context.add_step(sample(1), [])
    assert context.needs_compaction()


def test_rebuild_keeps_the_last_steps_as_context_only() -> None:
    context = CompactionContext(turns(), _config(keep_steps=2, context_tokens=300,
                                                 reserve_tokens=100))
    sample = Sampler(end_every=1)
    for _ in range(3):
        context.add_step(sample(5), [OBSERVATION] * 60)
    assert context.needs_compaction()
    summary = sample(7)
    execution, summary_segment = context.compact(summary, summary.token_ids)
    assert execution.num_trainable == 15 and summary_segment.num_trainable == 7
    rebuilt = context.finish()
    assert rebuilt.num_trainable == 0
    # system, resume(task + summary), then the last two steps verbatim
    resume = [RESUME_OPEN] + [TASK] * 5 + summary.token_ids + [RESUME_CLOSE]
    assert rebuilt.tokens[:3 + len(resume)] == [SYSTEM] * 3 + resume
    assert rebuilt.tokens[3 + len(resume):] == execution.tokens[-2 * 69:]


def test_k_is_lowered_until_the_reserve_fits() -> None:
    context = CompactionContext(turns(), _config(keep_steps=2, context_tokens=300,
                                                 reserve_tokens=100))
    sample = Sampler(end_every=1)
    context.add_step(sample(5), [OBSERVATION] * 100)
    context.add_step(sample(5), [OBSERVATION] * 80)
    assert context.needs_compaction()
    summary = sample(10)
    context.compact(summary, summary.token_ids)
    # two kept steps (109 + 89) would leave < 100 free; one (89) fits
    assert 300 - len(context) >= 100
    # system 3, resume 1 + task 5 + summary 10 + 1, one kept step of 89
    assert len(context) == 3 + 17 + 89


def test_compaction_fails_cleanly_when_even_k0_does_not_fit() -> None:
    # a long task makes the resume turn alone overflow the reserve
    config = _config(context_tokens=200, reserve_tokens=60, max_summary_tokens=20)
    context = CompactionContext(turns(task=120), config)
    sample = Sampler(end_every=1)
    context.add_step(sample(4), [OBSERVATION] * 30)
    assert context.needs_compaction()
    summary = sample(20)
    with pytest.raises(CompactionFailed) as info:
        context.compact(summary, summary.token_ids)
    assert [s.segment_type for s in info.value.args[0]] == ["execution", "summary"]


def test_long_observation_is_cut_with_a_marker_and_the_window_holds() -> None:
    context = CompactionContext(turns(), _config())
    cut = context.add_step(Sampler(end_every=1)(3), [OBSERVATION] * 10_000)
    assert cut
    tokens = context.finish().tokens
    assert tokens[-2:] == [MARKER, CLOSE]
    # the summary prompt and the longest summary still fit
    assert len(context.summary_prompt()) + context.summary_budget() <= 200


def test_action_budget_respects_turn_cap_and_room() -> None:
    context = CompactionContext(turns(), _config())
    assert context.action_budget(16) == 16
    room = 200 - len(context) - (6 + 1 + 20) - 5 - 1
    assert context.action_budget(10_000) == room


def test_without_compaction_the_window_fills_then_ends() -> None:
    context = CompactionContext(turns(), _config(enabled=False))
    sample = Sampler(end_every=1)
    while not context.is_full():
        context.add_step(sample(context.action_budget(30)), [OBSERVATION] * 30)
        assert not context.needs_compaction()
    assert len(context) <= 200
    assert 200 - len(context) < 5 + 1 + MIN_ACTION_TOKENS


def test_reserve_too_small_for_the_summary_is_rejected() -> None:
    with pytest.raises(ValueError, match="reserve_tokens"):
        CompactionContext(turns(request=40), _config(reserve_tokens=50))
