"""Content checks of a segment against the run it claims to belong to.

The codec checks structure in O(1); this module reads the data (a few
vectorised passes) and needs the run's facts (vocabulary size, the window of
policy versions that may still be trained). The replay calls it on ingest, so
nothing that fails it ever reaches the learner.
"""

from __future__ import annotations

import math

import numpy as np

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Segment


def check_segment_content(
    segment: Segment, *, vocab_size: int, oldest_version: int, newest_version: int
) -> int | None:
    """Raise :class:`ProtocolError` (reason ``invalid``) unless every token id
    is in ``[0, vocab_size)``, the loss mask is 0/1, every log-probability is
    finite and not positive, and every trainable token's version lies in
    ``[oldest_version, newest_version]``, and per-step rewards (if any) are
    finite and sit on trainable tokens only. Returns the oldest trainable
    token's version (None if no token is trainable), which staleness needs."""
    tokens = segment.tokens.numpy()
    if tokens.size == 0:
        return None
    # one pass: a negative id read as unsigned is larger than any vocabulary
    if int(tokens.view(np.uint32).max()) >= vocab_size:
        raise ProtocolError(ErrorCode.INVALID, f"token id outside the vocabulary [0, {vocab_size})")
    mask = segment.loss_mask.numpy()
    if mask.max() > 1:
        raise ProtocolError(ErrorCode.INVALID, "loss_mask holds values other than 0 and 1")
    logprobs = segment.logprobs.numpy()
    # NaN propagates into both extremes (without a warning, unlike a sum of
    # +inf and -inf); -inf is the minimum, +inf the maximum
    low, high = float(logprobs.min()), float(logprobs.max())
    if not (math.isfinite(low) and high <= 0):
        raise ProtocolError(ErrorCode.INVALID, "log-probabilities must be finite and <= 0")
    if segment.token_rewards is not None:
        rewards = segment.token_rewards.numpy()
        with np.errstate(over="ignore", invalid="ignore"):
            finite = math.isfinite(float(np.abs(rewards).sum()))
        if not finite or bool((rewards[mask == 0] != 0).any()):
            raise ProtocolError(ErrorCode.INVALID,
                                "token_rewards must be finite and 0 on tokens with loss_mask 0")
    versions = np.compress(mask.view(np.bool_), segment.versions.numpy())
    if versions.size == 0:
        return None
    low, high = int(versions.min()), int(versions.max())
    if low < oldest_version or high > newest_version:
        raise ProtocolError(
            ErrorCode.INVALID,
            f"trainable token versions [{low}, {high}] outside the window "
            f"[{oldest_version}, {newest_version}]")
    return low
