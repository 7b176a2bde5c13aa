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
live records to a new file in a background thread while appends go on, then
copies the records appended meanwhile after them, fsyncs it and renames it
over the old one, so the log is always either the old or the new file, never
a mix, and both replay to the same state.

Usage::

    log = DurableLog(path, fsync="batch")
    for kind, payload in log.recover(): ...
    log.append_segment(frame); log.sync()      # then acknowledge
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal

SEGMENT = 1
RELEASED = 2
VERSION = 3
_HEADER = struct.Struct("<IIB")
_VERSION = struct.Struct("<Q")
#: A record claiming more than this is corruption, not data (frames are capped far lower).
MAX_RECORD_BYTES = 1 << 31
WRITE_BUFFER_BYTES = 1 << 20
#: A compaction's thread copies new records until at most this many bytes are left.
CATCH_UP_BYTES = 1 << 20


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
        self._file = self._open_for_append()
        self._dirty = False
        self._last_sync = time.monotonic()
        self.bytes_written = self._file.tell()
        self.released_bytes = 0
        """Bytes of records that compaction would drop (released rollouts)."""
        self._compaction: _Compaction | None = None
        self._flushed = self.bytes_written
        """The file's length as the OS has it: a compaction thread may read up to here."""
        self.path.with_suffix(".retired").unlink(missing_ok=True)  # a crash mid-retirement
        self._retire_thread: threading.Thread | None = None

    def _open_for_append(self) -> BinaryIO:
        # held open for the service's life; a buffer larger than a segment
        # frame turns a record's two writes into a share of one syscall
        return open(self.path, "ab", buffering=WRITE_BUFFER_BYTES)  # noqa: SIM115

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
        self._flushed = self.bytes_written
        now = time.monotonic()
        if force or self.fsync == "batch" or now - self._last_sync >= self.fsync_interval_s:
            os.fsync(self._file.fileno())
            self._last_sync = now
            self._dirty = False

    def compact(self, live_frames: Iterable[bytes | memoryview], version: int) -> None:
        """Rewrite the log with only ``live_frames`` (the segments still
        needed) after the learner's newest ``version``, atomically; returns
        when done."""
        self.start_compaction(live_frames, version)
        self.finish_compaction(wait=True)

    @property
    def compacting(self) -> bool:
        return self._compaction is not None

    def start_compaction(self, live_frames: Iterable[bytes | memoryview], version: int) -> None:
        """Begin :meth:`compact` in a background thread. ``live_frames`` are
        the live segments *now*; records appended from now on are copied after
        them when :meth:`finish_compaction` swaps the files, so the new log
        replays to the same state as the old one. Rewriting tens of MB in the
        service's loop would hold every acknowledgement for as long."""
        if self._compaction is not None:
            return
        self._file.flush()
        self._flushed = self.bytes_written
        compaction = _Compaction(self.path, self.bytes_written, lambda: self._flushed,
                                 [(VERSION, _VERSION.pack(version)),
                                  *((SEGMENT, frame) for frame in live_frames)])
        self.released_bytes = 0  # what is released from now on is compactable next time
        self._compaction = compaction
        compaction.thread.start()

    def finish_compaction(self, wait: bool = False) -> bool:
        """Once the background rewrite is done (or after waiting for it):
        append the records written since it began, make it durable and put it
        in the log's place. Returns whether a compaction ended. A rewrite that
        failed (a full disk) leaves the old log in place, whole."""
        compaction = self._compaction
        if compaction is None or (compaction.thread.is_alive() and not wait):
            return False
        compaction.thread.join()
        self._compaction = None
        if compaction.error is not None:
            with contextlib.suppress(OSError):  # what was written of it, if anything
                compaction.path.unlink()
            raise OSError(f"log compaction failed; the log is unchanged: {compaction.error}")
        self._file.flush()
        with open(self.path, "rb") as old, open(compaction.path, "ab") as new:
            old.seek(compaction.copied)  # the thread copied what came before, mostly
            tail = old.read()
            new.write(tail)
            new.flush()
            os.fsync(new.fileno())
        # freeing the old log's blocks takes tens of ms per hundred MB here:
        # a second link keeps them, and a thread drops it off the loop
        retired: Path | None = self.path.with_suffix(".retired")
        self._join_retirement()
        try:
            os.link(self.path, retired)
        except OSError:  # no hard links here: the rename frees them, in the loop
            retired = None
        self._file.close()
        try:
            os.replace(compaction.path, self.path)
        except OSError:
            self._file = self._open_for_append()  # the old log is whole: go on with it
            if retired is not None:
                retired.unlink(missing_ok=True)
            raise
        if retired is not None:
            self._retire_thread = threading.Thread(target=os.unlink, args=(retired,),
                                                   name="log-retire", daemon=True)
            self._retire_thread.start()
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._file = self._open_for_append()
        self.bytes_written = self._flushed = compaction.size + len(tail)
        self._dirty = False
        return True

    def close(self) -> None:
        if self._compaction is not None:
            self.finish_compaction(wait=True)
        self.sync(force=True)
        self._file.close()
        self._join_retirement()

    def _join_retirement(self) -> None:
        if self._retire_thread is not None:
            self._retire_thread.join()


class _Compaction:
    """A rewrite of the live records to ``<log>.compacting`` in a thread of
    its own. ``mark``: the old log's length when it began. Once the live
    records are written, the thread copies what the log gained meanwhile
    (up to ``flushed()``, its length as the OS has it) until
    at most :data:`CATCH_UP_BYTES` is left, so the swap copies only that much."""

    def __init__(self, log_path: Path, mark: int, flushed: Callable[[], int],
                 records: list[tuple[int, bytes | memoryview]]) -> None:
        self.log_path = log_path
        self.path = log_path.with_suffix(".compacting")
        self.copied = mark
        """The old log's bytes copied so far (its records from ``mark`` on are whole)."""
        self.size = 0
        """Bytes written to the new file."""
        self.error: OSError | None = None
        self._flushed = flushed
        self.thread = threading.Thread(target=self._write, args=(records,),
                                       name="log-compaction", daemon=True)

    def _write(self, records: list[tuple[int, bytes | memoryview]]) -> None:
        try:
            with open(self.path, "wb", buffering=WRITE_BUFFER_BYTES) as file:
                for kind, payload in records:
                    file.write(_header(kind, payload))
                    file.write(payload)
                    self.size += _HEADER.size + len(payload)
                with open(self.log_path, "rb") as old:
                    while (end := self._flushed()) - self.copied > CATCH_UP_BYTES:
                        old.seek(self.copied)
                        file.write(old.read(end - self.copied))
                        self.size += end - self.copied
                        self.copied = end
                file.flush()
                os.fsync(file.fileno())
        except OSError as exc:
            self.error = exc


def decode_version(payload: bytes) -> int:
    """The policy version of a :data:`VERSION` record's payload."""
    return _VERSION.unpack(payload)[0]
