"""Error codes, the one table of why a peer refuses a message, and the one
error type the decoder raises."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """The ``code`` of an ``Error`` reply. Values are stable: they label
    counters (``crl_replay_rejected_messages_total{reason}``, the actors'
    ``rejected_frames_total``) and peers act on some of them. An ``Error``
    carries the refused message's ``seq`` as ``ref_seq`` whenever its header
    (``protocol_version``, ``kind``, ``seq``) read (``protocol.codec.header_seq``)."""

    OVERSIZED = "oversized"
    """The frame is longer than the configured ``max_message_bytes``."""
    MALFORMED = "malformed"
    """Not MessagePack, truncated, more than one frame, or a field of the
    wrong type or missing."""
    PROTOCOL_VERSION = "protocol_version"
    """The header's ``protocol_version`` is not the one this build speaks."""
    UNKNOWN_KIND = "unknown_kind"
    """The header's ``kind`` names no message type."""
    ARRAY = "array"
    """An array's dtype is not allowed, its shape is invalid, or its byte
    length is not shape x itemsize."""
    LENGTH_MISMATCH = "length_mismatch"
    """Per-token arrays of one segment disagree in length."""
    INVALID = "invalid"
    """Well-formed but semantically impossible (NaN log-probability on a
    trainable token, a final segment without a reward, a token version
    outside the window, ...)."""
    IDENTITY = "identity"
    """The sender may not speak for ``sender_id`` here: the connection speaks for another
    actor, another client key owns the id, the incarnation is registered on another live
    connection and this ``hello`` lacks its token, or ``learner`` on the learner socket. Also
    told, unasked, to a connection whose incarnation moved to another (displaced). Final."""
    OWNER = "owner"
    """A segment or abandon of a rollout that another actor incarnation owns
    (the one that sent its first segment): only the owner may add to,
    finish or abandon it."""
    UNEXPECTED = "unexpected"
    """A message kind this socket does not take."""
    FULL = "full"
    """The replay is at its memory bound: the segment's rollout is dropped."""
    STALE_INCARNATION = "stale_incarnation"
    """A newer incarnation of the same actor id registered: this one is over."""
    DEAD_INCARNATION = "dead_incarnation"
    """The replay declared this incarnation dead (silent past the liveness)
    and expired its rollouts: the process, if it lives, must register as a
    new one."""
    UNREGISTERED = "unregistered"
    """This connection is not registered for the sender's incarnation (the service restarted,
    the connection is new after a reconnect, or the sender never said ``Hello``): say
    ``Hello`` on it, then send the message again. Not final."""


class ProtocolError(Exception):
    """A message that cannot be accepted. ``code`` says why, ``str()`` says
    what exactly, ``ref_seq`` is the message's ``seq`` if its header decoded;
    the receiver replies with an ``Error`` and counts it."""

    def __init__(self, code: ErrorCode, detail: str, ref_seq: int | None = None) -> None:
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail
        self.ref_seq = ref_seq
