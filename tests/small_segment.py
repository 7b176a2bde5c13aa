"""A four-token ``Segment`` built field by field, for the checks of its
contents: two context tokens, then two trainable ones of versions 3 and 4."""

from __future__ import annotations

import numpy as np

from protocol import Array, Segment


def small_segment(tokens: tuple = (1, 2, 3, 4), mask: tuple = (0, 0, 1, 1),
                  logprobs: tuple = (0, 0, -0.5, -1.5), versions: tuple = (-1, -1, 3, 4)
                  ) -> Segment:
    def array(values: tuple, dtype: str) -> Array:
        return Array.from_numpy(np.array(values, dtype=dtype))

    return Segment(sender_id="a", incarnation=0, seq=0, sent_at=0.0, rollout_id="r",
                   task_id="t", index=0, segment_type="execution",
                   tokens=array(tokens, "int32"), loss_mask=array(mask, "uint8"),
                   logprobs=array(logprobs, "float32"), versions=array(versions, "int32"),
                   final=False)
