"""The replay's durable log: append-only records, checksummed, compacted.

Record framing (little-endian)::

    u32 payload length | u32 crc32(kind byte + payload) | u8 kind | payload

``kind`` is :data:`SEGMENT` (payload = the segment's wire frame, exactly as
received), :data:`RELEASED` (payload = a rollout id whose segments are no
longer needed: served to the learner, or dropped) or :data:`VERSION`
(payload = u64, the newest policy version the learner has asked with: a
restarted replay holds the version window from its first segment on).
Recovery reads records in
order and stops at the first torn or corrupt one (a crash mid-write leaves at
most one): everything before it was written whole. Compaction rewrites the
live records to a new file, fsyncs it and renames it over the old one, so the
log is always either the old or the new file, never a mix.

Usage::

    log = DurableLog(path, fsync="batch")
    for kind, payload in log.recover(): ...
    log.append_segment(frame); log.sync()      # then acknowledge
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

SEGMENT = 1
RELEASED = 2
VERSION = 3
_HEADER = struct.Struct("<IIB")
_VERSION = struct.Struct("<Q")
#: A record claiming more than this is corruption, not data (frames are capped far lower).
MAX_RECORD_BYTES = 1 << 31


def _header(kind: int, payload: bytes | memoryview) -> bytes:
    return _HEADER.pack(len(payload), zlib.crc32(payload, zlib.crc32(bytes([kind]))), kind)


def read_records(data: bytes) -> Iterator[tuple[int, bytes, int]]:
    """``(kind, payload, end offset)`` of each whole record of a log's bytes,
    up to the first torn or corrupt one. Reads only: a live log can be read
    while the replay appends to it."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, checksum, kind = _HEADER.unpack_from(data, offset)
        end = offset + _HEADER.size + length
        if length > MAX_RECORD_BYTES or end > len(data):
            return
        payload = data[offset + _HEADER.size:end]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) != checksum or kind not in (
                SEGMENT, RELEASED, VERSION):
            return
        yield kind, payload, end
        offset = end


class DurableLog:
    """Append-only segment log with a configurable fsync policy."""

    def __init__(self, path: Path, fsync: Literal["batch", "interval"] = "batch",
                 fsync_interval_s: float = 1.0) -> None:
        self.path = path
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")  # noqa: SIM115  (held open for the service's life)
        self._dirty = False
        self._last_sync = time.monotonic()
        self.bytes_written = self._file.tell()
        self.released_bytes = 0
        """Bytes of records that compaction would drop (released rollouts)."""

    # ------------------------------------------------------------------ reading

    def recover(self) -> Iterator[tuple[int, bytes]]:
        """Yield ``(kind, payload)`` of every whole record; truncate the file
        after the last one, so that a torn tail is never followed by new data."""
        good = 0
        with open(self.path, "rb") as file:
            data = file.read()
        for kind, payload, end in read_records(data):
            yield kind, payload
            good = end
        if good < len(data):
            self._file.truncate(good)
            self._file.flush()
            os.fsync(self._file.fileno())
            self.bytes_written = good

    # ------------------------------------------------------------------ writing

    def _append(self, kind: int, payload: bytes | memoryview) -> int:
        self._file.write(_header(kind, payload))
        self._file.write(payload)
        self._dirty = True
        size = _HEADER.size + len(payload)
        self.bytes_written += size
        return size

    def append_segment(self, frame: bytes | memoryview) -> int:
        """Append a segment frame; returns the record's size in bytes."""
        return self._append(SEGMENT, frame)

    def append_version(self, version: int) -> None:
        """Record the learner's newest policy version."""
        self._append(VERSION, _VERSION.pack(version))

    def append_released(self, rollout_id: str, segment_bytes: int) -> None:
        """Record that a rollout's segments (``segment_bytes`` of records) are dead."""
        size = self._append(RELEASED, rollout_id.encode())
        self.released_bytes += segment_bytes + size

    def sync(self, force: bool = False) -> None:
        """Make what was appended durable according to the policy: with
        ``batch`` always (call before acknowledging), with ``interval`` only
        once the interval has passed (or when ``force``)."""
        if not self._dirty:
            return
        self._file.flush()
        now = time.monotonic()
        if force or self.fsync == "batch" or now - self._last_sync >= self.fsync_interval_s:
            os.fsync(self._file.fileno())
            self._last_sync = now
            self._dirty = False

    def compact(self, live_frames: Iterable[bytes | memoryview], version: int) -> None:
        """Rewrite the log with only ``live_frames`` (the segments still
        needed) after the learner's newest ``version``, atomically."""
        temporary = self.path.with_suffix(".compacting")
        with open(temporary, "wb") as file:
            size = 0
            for kind, payload in [(VERSION, _VERSION.pack(version)),
                                  *((SEGMENT, frame) for frame in live_frames)]:
                file.write(_header(kind, payload))
                file.write(payload)
                size += _HEADER.size + len(payload)
            file.flush()
            os.fsync(file.fileno())
        self._file.close()
        os.replace(temporary, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._file = open(self.path, "ab")  # noqa: SIM115
        self.bytes_written = size
        self.released_bytes = 0
        self._dirty = False

    def close(self) -> None:
        self.sync(force=True)
        self._file.close()


def decode_version(payload: bytes) -> int:
    """The policy version of a :data:`VERSION` record's payload."""
    return _VERSION.unpack(payload)[0]
