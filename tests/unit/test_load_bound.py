"""How long an actor lets its engine join a weight group or load a
publication before it counts as hung (actors/learner_link.py
``load_bound_s``): a few of the group's deadlines, plus the publication's
bytes at a rate far below any transport's."""

from __future__ import annotations

from actors.learner_link import LOAD_DEADLINES, SLOWEST_LOAD_BYTES_PER_S, load_bound_s
from protocol import TensorSpec, WeightManifest


def manifest(*shapes: list[int], dtype: str = "bfloat16") -> WeightManifest:
    return WeightManifest(tensors=[TensorSpec(name=f"t{i}", dtype=dtype, shape=shape)
                                   for i, shape in enumerate(shapes)], bucket_bytes=0)


def test_a_load_may_take_a_few_deadlines_plus_its_bytes_at_the_slowest_rate() -> None:
    small = manifest([4])
    assert load_bound_s(small, 30.0) == LOAD_DEADLINES * 30.0 + 8 / SLOWEST_LOAD_BYTES_PER_S
    # a 7B policy in bf16 (15.2 GB): about five minutes beyond the deadlines
    seven_b = manifest([7_615_616_512])
    assert 300 < load_bound_s(seven_b, 30.0) - LOAD_DEADLINES * 30.0 < 310


def test_the_bound_grows_with_the_deadline_and_the_bytes() -> None:
    assert load_bound_s(manifest([4]), 1.0) < load_bound_s(manifest([4]), 2.0)
    assert load_bound_s(manifest([4]), 1.0) < load_bound_s(manifest([4], dtype="float32"), 1.0)
    assert load_bound_s(manifest([4]), 1.0) > 1.0  # always past the group's own deadline
