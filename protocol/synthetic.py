"""Synthetic segments of a given size, for tests and benchmarks.

Every other token is trainable, token ids cycle below 100, log-probabilities
are -1 on trainable tokens: valid against any vocabulary of 100 or more.
"""

from __future__ import annotations

import numpy as np

from protocol.arrays import Array
from protocol.messages import Segment, Stamp


def synthetic_segment(stamp: Stamp, rollout_id: str, index: int, final: bool,
                      version: int = 0, tokens: int = 64) -> Segment:
    mask = (np.arange(tokens) % 2).astype(np.uint8)
    return Segment(
        **stamp.next(), rollout_id=rollout_id, task_id="task", index=index,
        segment_type="execution" if index % 2 == 0 else "summary",
        tokens=Array.from_numpy(np.arange(tokens, dtype=np.int32) % 100),
        loss_mask=Array.from_numpy(mask),
        logprobs=Array.from_numpy(np.where(mask, -1.0, 0.0).astype(np.float32)),
        versions=Array.from_numpy(np.where(mask, version, -1).astype(np.int32)),
        final=final, reward=1.0 if final else None)
