"""The one error type the decoder raises, with a machine-readable reason."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a message was rejected. Values are stable: they label counters."""

    OVERSIZED = "oversized"
    """The frame is longer than the configured ``max_message_bytes``."""
    MALFORMED = "malformed"
    """Not MessagePack, truncated, or a field of the wrong type or missing."""
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
    trainable token, a final segment without a reward, ...)."""


#: Error codes of the actor socket beyond :class:`Reason`, about the sender's
#: incarnation (stable: they label counters, and actors act on them).
STALE_INCARNATION = "stale_incarnation"
"""A newer incarnation of the same actor id registered: this one is over."""
DEAD_INCARNATION = "dead_incarnation"
"""The replay declared this incarnation dead (silent past the liveness) and
expired its rollouts: the process, if it lives, must register as a new one."""


class ProtocolError(Exception):
    """A message that cannot be accepted. ``reason`` says why, ``str()`` says
    what exactly; the receiver replies with an ``Error`` and counts it."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
