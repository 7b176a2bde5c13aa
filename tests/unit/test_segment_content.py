"""Content checks against the run: vocabulary, log-probabilities, version window."""

from __future__ import annotations

import numpy as np
import pytest

from protocol import Array, ErrorCode, ProtocolError, Segment
from protocol.validation import check_segment_content


def _segment(tokens=(1, 2, 3, 4), mask=(0, 0, 1, 1), logprobs=(0, 0, -0.5, -1.5),
             versions=(-1, -1, 3, 4)) -> Segment:
    def array(values, dtype):
        return Array.from_numpy(np.array(values, dtype=dtype))

    return Segment(sender_id="a", incarnation=0, seq=0, sent_at=0.0, rollout_id="r",
                   task_id="t", index=0, segment_type="execution",
                   tokens=array(tokens, "int32"), loss_mask=array(mask, "uint8"),
                   logprobs=array(logprobs, "float32"), versions=array(versions, "int32"),
                   final=False)


def check(segment: Segment) -> None:
    check_segment_content(segment, vocab_size=10, oldest_version=2, newest_version=5)


def test_a_valid_segment_passes_and_reports_its_oldest_version() -> None:
    assert check_segment_content(_segment(), vocab_size=10, oldest_version=2,
                                 newest_version=5) == 3
    assert check_segment_content(_segment((), (), (), ()), vocab_size=10, oldest_version=2,
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
        check(_segment(**changes))
    assert info.value.code is ErrorCode.INVALID


def test_versions_of_context_tokens_are_not_checked() -> None:
    check(_segment(versions=(-1, 99, 3, 4)))
