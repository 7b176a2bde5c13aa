"""Content checks of a segment against the run it claims to belong to.

The codec checks structure in O(1); this module reads the data (a few
vectorised passes) and needs the run's facts (vocabulary size, the window of
policy versions that may still be trained). The replay calls it on ingest, so
nothing that fails it ever reaches the learner.
"""

from __future__ import annotations

import math

import numpy as np

from protocol.errors import ProtocolError, Reason
from protocol.messages import Segment


def check_segment_content(
    segment: Segment, *, vocab_size: int, oldest_version: int, newest_version: int
) -> None:
    """Raise :class:`ProtocolError` (reason ``invalid``) unless every token id
    is in ``[0, vocab_size)``, the loss mask is 0/1, every log-probability is
    finite and not positive, and every trainable token's version lies in
    ``[oldest_version, newest_version]``."""
    tokens = segment.tokens.numpy()
    if tokens.size == 0:
        return
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ProtocolError(Reason.INVALID, f"token id outside the vocabulary [0, {vocab_size})")
    mask = segment.loss_mask.numpy()
    if mask.max() > 1:
        raise ProtocolError(Reason.INVALID, "loss_mask holds values other than 0 and 1")
    logprobs = segment.logprobs.numpy()
    # One reduction: NaN and +-inf propagate into the sum.
    if not math.isfinite(float(logprobs.sum(dtype=np.float64))) or logprobs.max() > 0:
        raise ProtocolError(Reason.INVALID, "log-probabilities must be finite and <= 0")
    trainable = mask.view(np.bool_)
    if trainable.any():
        versions = segment.versions.numpy()
        low = np.where(trainable, versions, newest_version).min()
        high = np.where(trainable, versions, oldest_version).max()
        if low < oldest_version or high > newest_version:
            raise ProtocolError(
                Reason.INVALID,
                f"trainable token versions [{low}, {high}] outside the window "
                f"[{oldest_version}, {newest_version}]",
            )
