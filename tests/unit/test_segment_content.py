"""Content checks against the run: vocabulary, log-probabilities, version window."""

from __future__ import annotations

import pytest

from protocol import ErrorCode, ProtocolError, Segment, sampled_runs
from protocol.validation import check_segment_content
from tests.small_segment import small_segment


def check(segment: Segment) -> None:
    check_segment_content(segment, vocab_size=10, oldest_version=2, newest_version=5)


def test_a_valid_segment_passes_and_reports_its_oldest_version() -> None:
    assert check_segment_content(small_segment(), vocab_size=10, oldest_version=2,
                                 newest_version=5) == 3
    assert check_segment_content(small_segment((), (), (), ()), vocab_size=10, oldest_version=2,
                                 newest_version=5) is None


@pytest.mark.parametrize("changes", [
    {"tokens": (1, 2, 3, 10)},                      # outside the vocabulary
    {"tokens": (1, -2, 3, 4)},                      # negative id
    {"mask": (0, 2, 1, 1)},                         # mask not 0/1
    {"logprobs": (0, 0, float("nan"), -1)},         # NaN on a trainable token
    {"logprobs": (float("-inf"), 0, -1, -1)},       # inf anywhere
    {"logprobs": (0, 0, 0.5, -1)},                  # positive log-probability
    {"versions": (-1, -1, 1, 4)},                   # older than the window
    {"versions": (-1, -1, 3, 6)},                   # newer than the learner
])
def test_invalid_contents_are_rejected(changes: dict) -> None:
    with pytest.raises(ProtocolError) as info:
        check(small_segment(**changes))
    assert info.value.code is ErrorCode.INVALID


def test_versions_of_context_tokens_are_not_checked() -> None:
    check(small_segment(versions=(-1, 99, 3, 4)))


def test_sampled_runs_are_the_maximal_runs_of_a_loss_mask() -> None:
    assert sampled_runs([0, 1, 1, 0, 0, 1, 0, 1, 1]) == [(1, 3), (5, 6), (7, 9)]
    assert sampled_runs([1, 1]) == [(0, 2)]
    assert sampled_runs([0, 0]) == []
