"""Hypothesis strategies: a valid instance of every message kind."""

from __future__ import annotations

from typing import get_args

import numpy as np
from hypothesis import strategies as st

from protocol import (
    Abandon,
    Ack,
    Array,
    Batch,
    BatchRequest,
    EngineInfo,
    Error,
    Goodbye,
    GroupInfo,
    Heartbeat,
    Hello,
    LearnerHello,
    LearnerWelcome,
    MemberWelcome,
    Rollout,
    RolloutStats,
    Segment,
    StalenessStats,
    TensorSpec,
    WeightManifest,
    WeightsAnnounce,
    WeightsLoaded,
    Welcome,
)
from protocol.messages import (
    LEARNER_ID,
    MAX_CAPACITY,
    MAX_TENSOR_PARALLEL,
    MAX_TOKEN_BYTES,
    MIN_TOKEN_BYTES,
    WireDtype,
)

#: Identifiers hold no control character nor line or paragraph separator
#: (``protocol.messages.PRINTABLE``).
ids = st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp")), min_size=1, max_size=24)
counts = st.integers(min_value=0, max_value=2**31 - 1)
positives = st.integers(min_value=1, max_value=2**31 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
non_negative = st.floats(min_value=0, allow_infinity=False, width=64)
intervals = st.floats(min_value=1e-3, max_value=1e6)
header = st.fixed_dictionaries({
    "sender_id": ids, "incarnation": counts, "seq": st.integers(0, 2**63 - 1),
    "sent_at": st.floats(0, 4e9),
})


def _array(values: list, dtype: str) -> Array:
    return Array.from_numpy(np.asarray(values, dtype=dtype))


@st.composite
def segments(draw, rollout_id: str | None = None, index: int | None = None,
             final: bool | None = None) -> Segment:
    n = draw(st.integers(1, 64))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    is_final = draw(st.booleans()) if final is None else final
    at = draw(st.integers(0, 100)) if index is None else index
    return Segment(
        **draw(header),
        rollout_id=draw(ids) if rollout_id is None else rollout_id,
        task_id=draw(ids),
        index=at,
        # a rollout begins with an execution segment (a summary summarises one)
        segment_type=draw(st.sampled_from(["execution", "summary"] if at else ["execution"])),
        tokens=_array(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), "int32"),
        loss_mask=_array(mask, "uint8"),
        logprobs=_array(draw(st.lists(st.floats(-50, 0, width=32), min_size=n, max_size=n)),
                        "float32"),
        versions=_array([draw(st.integers(0, 1000)) if m else -1 for m in mask], "int32"),
        final=is_final,
        reward=draw(finite) if is_final else None,
        stats=draw(st.none() | rollout_stats) if is_final else None,
    )


@st.composite
def _stats(draw) -> RolloutStats:
    generated = draw(counts)
    return RolloutStats(
        outcome=draw(st.sampled_from(["done", "step_limit", "compaction_limit", "context_full",
                                      "error"])),
        success=draw(st.booleans()), steps=draw(counts), compactions=draw(counts),
        generated_tokens=generated, summary_tokens=draw(st.integers(0, generated)),
        duration_s=draw(st.floats(0, 1e6)))


rollout_stats = _stats()


@st.composite
def rollouts(draw) -> Rollout:
    rollout_id = draw(ids)
    k = draw(st.integers(1, 4))
    return Rollout(
        rollout_id=rollout_id, staleness=draw(st.integers(0, 10)),
        segments=[draw(segments(rollout_id, i, final=i == k - 1)) for i in range(k)])


KINDS = ("hello", "welcome", "member_welcome", "segment", "abandon", "goodbye", "ack",
         "heartbeat",
         "learner_hello", "learner_welcome", "batch_request", "batch", "weights_announce",
         "weights_loaded", "error")


@st.composite
def messages(draw, kind: str | None = None):
    """One valid message of ``kind``, or of a kind drawn uniformly."""
    h = draw(header)
    kind = kind or draw(st.sampled_from(KINDS))
    if kind == "segment":
        return draw(segments())
    if kind == "hello":
        engine = draw(st.builds(EngineInfo, device=ids, dtype=st.sampled_from(get_args(WireDtype)),
                                tensor_parallel=st.integers(1, MAX_TENSOR_PARALLEL),
                                model=ids))
        h["sender_id"] = draw(ids.filter(lambda i: i != LEARNER_ID))
        return Hello(**h, engine=engine, capacity=draw(st.integers(1, MAX_CAPACITY)),
                     token=draw(st.binary(min_size=MIN_TOKEN_BYTES, max_size=MAX_TOKEN_BYTES)),
                     metrics_address=draw(st.sampled_from(
                         ["", "10.0.0.5:9111", "[::1]:9110", "actor-3.pods.local:65535"])))
    if kind == "welcome":
        return Welcome(**h, run_id=draw(ids), policy_version=draw(counts),
                       heartbeat_interval_s=draw(intervals), heartbeat_liveness=draw(positives),
                       max_staleness=draw(counts), rollouts_per_batch=draw(positives),
                       credits=draw(counts), credit_ledger=draw(counts),
                       credits_total=draw(counts), max_message_bytes=draw(positives),
                       vocab_size=draw(positives), stale_grace=draw(counts))
    if kind == "member_welcome":
        return MemberWelcome(**h, run_id=draw(ids), policy_version=draw(counts),
                             heartbeat_interval_s=draw(intervals),
                             heartbeat_liveness=draw(positives))
    if kind == "learner_hello":
        return LearnerHello(**h)
    if kind == "learner_welcome":
        return LearnerWelcome(**h, run_id=draw(ids), policy_version=draw(counts),
                              rollouts_per_batch=draw(positives), max_staleness=draw(counts))
    if kind == "abandon":
        return Abandon(**h, rollout_id=draw(ids))
    if kind == "goodbye":
        return Goodbye(**h)
    if kind == "ack":
        return Ack(**h, stored_seqs=draw(st.lists(counts, max_size=20)), credits=draw(counts),
                   policy_version=draw(counts), credit_ledger=draw(counts),
                   credits_total=draw(counts))
    if kind == "heartbeat":
        return Heartbeat(**h, active_rollouts=draw(st.integers(0, MAX_CAPACITY)),
                         stall_seconds=draw(st.dictionaries(ids, non_negative, max_size=3)),
                         credit_ledger=draw(counts), credits_seen=draw(counts))
    if kind == "batch_request":
        return BatchRequest(**h, size=draw(counts), policy_version=draw(counts))
    if kind == "batch":
        stats = StalenessStats(min=draw(counts), max=draw(counts), mean=draw(non_negative),
                               p50=draw(non_negative), p95=draw(non_negative))
        return Batch(**h, policy_version=draw(counts),
                     rollouts=draw(st.lists(rollouts(), max_size=3)), staleness=stats)
    if kind == "weights_announce":
        spec = st.builds(TensorSpec, name=ids, dtype=ids,
                         shape=st.lists(st.integers(0, 4096), max_size=4).map(tuple))
        manifest = WeightManifest(tensors=draw(st.lists(spec, max_size=5)),
                                  bucket_bytes=draw(counts))
        group = draw(st.builds(GroupInfo, generation=counts, master_addr=ids,
                               master_port=st.integers(1, 65535),
                               world_size=st.integers(2, 2**31 - 1), rank=st.integers(1, 2**31 - 2),
                               backend=st.sampled_from(["gloo", "nccl"])))
        return WeightsAnnounce(**h, version=draw(counts), manifest=manifest, group=group)
    if kind == "weights_loaded":
        return WeightsLoaded(**h, version=draw(counts), seconds=draw(non_negative))
    return Error(**h, code=draw(ids), text=draw(st.text(max_size=200)),
                 ref_seq=draw(st.none() | counts))
