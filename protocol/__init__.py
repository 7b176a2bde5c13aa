"""The contract between CompactionRL's processes: message types, their
MessagePack codec, socket helpers and the configuration they share.

Depends on nothing else of the project; everything else depends on it.
"""

from protocol.arrays import ALLOWED_DTYPES, Array
from protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, decode, encode
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import (
    LEARNER_ID,
    MESSAGE_TYPES,
    NO_COMPLETE_VERSION,
    PROTOCOL_VERSION,
    STALL_REASONS,
    Abandon,
    Ack,
    Batch,
    BatchRequest,
    EngineInfo,
    Error,
    FramedBatch,
    FramedRollout,
    Goodbye,
    GroupInfo,
    GroupTag,
    Heartbeat,
    Hello,
    LearnerHello,
    LearnerWelcome,
    MemberWelcome,
    Message,
    Rollout,
    RolloutStats,
    Segment,
    StalenessStats,
    Stamp,
    TensorSpec,
    WeightManifest,
    WeightsAnnounce,
    WeightsLoaded,
    Welcome,
    sampled_runs,
    wire_info,
)

__all__ = [
    "ALLOWED_DTYPES", "Array", "DEFAULT_MAX_MESSAGE_BYTES", "decode", "encode",
    "ErrorCode", "ProtocolError", "LEARNER_ID", "MESSAGE_TYPES", "NO_COMPLETE_VERSION",
    "PROTOCOL_VERSION", "STALL_REASONS", "Abandon", "Ack", "Batch",
    "BatchRequest", "EngineInfo", "Error", "Goodbye", "GroupInfo", "GroupTag", "Heartbeat", "Hello",
    "LearnerHello", "LearnerWelcome", "MemberWelcome", "Message",
    "Rollout", "RolloutStats", "Segment", "FramedBatch", "FramedRollout", "StalenessStats",
    "Stamp", "TensorSpec",
    "WeightManifest", "WeightsAnnounce", "WeightsLoaded", "Welcome", "sampled_runs",
    "wire_info",
]
