"""``RolloutStats.info``: an environment's last ``info`` as the wire carries
it (protocol.wire_info), and on to the learner's batch and kept samples."""

from __future__ import annotations

import msgspec

from learner.batch import to_train_batch
from protocol import Batch, decode, encode, wire_info
from protocol.messages import MAX_TAG_CHARS, MAX_TAGS
from protocol.synthetic import synthetic_batch


def test_info_is_flattened_to_text_truth_values_and_finite_numbers() -> None:
    info = {"digits_right": 3, "attempts": 2, "solved": False, "stop": None,
            "metrics": {"accuracy": 0.5, "format": {"ok": True}}, "trace": [1, 2],
            "nan": float("nan"), "huge": 10**400, "long": "x" * 1000, "k" * 300: 1}
    flat = wire_info(info)
    assert flat["digits_right"] == 3.0 and isinstance(flat["digits_right"], float)
    assert flat["solved"] is False and flat["stop"] == "None"
    assert flat["metrics.accuracy"] == 0.5 and flat["metrics.format.ok"] is True
    assert flat["trace"] == "[1, 2]" and flat["nan"] == "nan"
    assert flat["huge"] == str(10**400)[:MAX_TAG_CHARS]
    assert len(flat["long"]) == MAX_TAG_CHARS and "k" * MAX_TAG_CHARS in flat
    assert len(wire_info({f"key{i}": i for i in range(MAX_TAGS + 10)})) == MAX_TAGS


def test_the_info_crosses_the_wire_into_the_learner_s_batch() -> None:
    batch = synthetic_batch(rollouts=3)
    rollouts = []
    for n, rollout in enumerate(batch.rollouts):
        final = rollout.segments[-1]
        stats = msgspec.structs.replace(final.stats, info=wire_info({"digits_right": n,
                                                                     "rubric": {"ok": n > 0}}))
        segments = [*rollout.segments[:-1], msgspec.structs.replace(final, stats=stats)]
        rollouts.append(msgspec.structs.replace(rollout, segments=segments))
    sent = msgspec.structs.replace(batch, rollouts=rollouts)
    received = decode(encode(sent))
    assert isinstance(received, Batch)
    assert to_train_batch(received, train_summary=True).infos == [
        {"digits_right": float(n), "rubric.ok": n > 0} for n in range(3)]
