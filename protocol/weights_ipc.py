"""The ``ipc`` weight transport: rank 0 packs each bucket into a staging
buffer the receivers map into their own address space, and each receiver
copies it out; nothing goes through a socket but the buffer's handle.

- On a GPU (co-location: an engine on learner rank 0's GPU), a staging buffer
  is a CUDA allocation and its handle a CUDA IPC handle, as vLLM's ``ipc``
  weight-transfer engine exports them (device to device, no host copy).
- On the CPU (its twin, every process on one host), a staging buffer is a
  shared file under ``/dev/shm`` and its handle the file's path.

The rendezvous store carries the rest, as JSON, never pickle: under
``weights/<generation>``, rank 0 posts bucket ``b`` of publication ``p`` as
``p<p>/b<b>`` (handle and size) and every receiver acknowledges with
``p<p>/a<b>/<rank>`` once it has copied it. Two staging buffers alternate,
so rank 0 packs bucket ``b + 1`` while the receivers copy bucket ``b``;
before reusing a buffer it waits for the acknowledgements of the bucket it
held. Every wait has the channel's deadline: a receiver that dies fails the
publication within ``timeout_s`` (rank 0 waits on its acknowledgement), a
sender that dies fails the receivers (they wait on its post).

Why the project's own and not vLLM's ``ipc`` engine as it is: vLLM's takes a
whole publication's handles in one engine RPC (the trainer holds a copy of
every tensor, or packed chunks, until the engines finish) and has no deadline;
this one keeps two buckets and the project's generations, deadlines and
acknowledgements (docs/weights.md).
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from protocol.weights import GROUP_TIMEOUT_S, JoinCancelled, TransferFailed, WeightChannel
from protocol.weights_store import StoreClient

#: Shared files (the CPU twin) are named so; a receiver maps no other file.
SHARED_FILE_PREFIX = "compactionrl-weights-"


def shared_file_dir() -> Path:
    """Where staging files live: ``/dev/shm`` (memory) where it exists."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def cuda_handle(storage_share: tuple, nbytes: int, device_uuid: str) -> dict[str, Any]:
    """The JSON handle of a CUDA staging buffer, from its storage's
    ``_share_cuda_()`` (device index, IPC handle, storage size and offset,
    ref-counter handle and offset, event handle, event sync)."""
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = storage_share
    return {"kind": "cuda", "nbytes": nbytes, "device_uuid": device_uuid, "device": device,
            "handle": _b64(handle), "storage_size_bytes": size_bytes,
            "storage_offset_bytes": offset_bytes, "ref_counter_handle": _b64(ref_handle),
            "ref_counter_offset": ref_offset, "event_handle": _b64(event_handle),
            "event_sync_required": bool(event_sync)}


def cuda_rebuild_args(handle: dict[str, Any], device: int) -> tuple:
    """``torch.multiprocessing.reductions.rebuild_cuda_tensor``'s arguments
    for ``handle`` (from :func:`cuda_handle`), mapped onto local ``device``:
    a flat ``uint8`` tensor of ``nbytes``."""
    nbytes = handle["nbytes"]
    return (torch.Tensor, (nbytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8, device,
            _unb64(handle["handle"]), handle["storage_size_bytes"],
            handle["storage_offset_bytes"], False, _unb64(handle["ref_counter_handle"]),
            handle["ref_counter_offset"], _unb64(handle["event_handle"]),
            handle["event_sync_required"])


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class StagingBuffer:
    """Rank 0: ``nbytes`` the receivers can map, and its JSON handle."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.path: Path | None = None
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            storage = self.tensor.untyped_storage()
            self.handle = cuda_handle(storage._share_cuda_(), nbytes,
                                      _device_uuid(device.index))
            return
        self.path = shared_file_dir() / f"{SHARED_FILE_PREFIX}{uuid.uuid4().hex}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.from_file(str(self.path), shared=True, size=nbytes,
                                      dtype=torch.uint8)
        self.handle = {"kind": "file", "nbytes": nbytes, "path": str(self.path)}

    def unlink(self) -> None:
        """Remove the file's name (mappings stay valid): once every receiver
        has mapped it, or when the buffer is dropped."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


def map_staging(handle: dict[str, Any], device: torch.device) -> torch.Tensor:
    """Receivers: the staging buffer ``handle`` names, as a flat ``uint8``
    tensor; raises :class:`ValueError` for a handle this process cannot map."""
    kind, nbytes = handle.get("kind"), handle.get("nbytes")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"staging handle without a size: {handle!r}")
    if kind == "file":
        path = Path(str(handle.get("path")))
        # the store is not authenticated: map nothing but a staging file
        if path.parent != shared_file_dir() or not path.name.startswith(SHARED_FILE_PREFIX):
            raise ValueError(f"not a staging file: {path}")
        if not path.is_file():
            raise ValueError(f"staging file {path} is not on this host: ipc needs the "
                             "learner and the engine on one machine")
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    if kind == "cuda":
        if device.type != "cuda" or _device_uuid(device.index) != handle.get("device_uuid"):
            raise ValueError("the staging buffer is on GPU "
                             f"{handle.get('device_uuid')}, not this engine's ({device}): "
                             "ipc needs the engine on learner rank 0's GPU")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(*cuda_rebuild_args(handle, device.index))
    raise ValueError(f"unknown staging handle kind {kind!r}")


class IpcChannel(WeightChannel):
    """One generation of the ``ipc`` transport, as seen by one member."""

    #: Staging buffers rank 0 alternates between.
    SLOTS = 2

    def __init__(self, store: StoreClient, generation: int, world_size: int, rank: int,
                 timeout_s: float = GROUP_TIMEOUT_S,
                 cancelled: JoinCancelled | None = None) -> None:
        """Join; returns when every member has joined (or raises after
        ``timeout_s``, or once ``cancelled()`` gives a reason)."""
        super().__init__(store, generation, world_size, rank, timeout_s, cancelled)
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        self._aborted = False
        self._publication = 0
        self._bucket = 0
        self._slots: list[StagingBuffer | None] = [None] * self.SLOTS
        self._held: dict[int, int] = {}  # slot -> the bucket posted from it, unacknowledged
        self._mapped: dict[int, tuple[str, torch.Tensor]] = {}  # receivers: slot -> mapping
        self._join("ipc")

    def _failed(self, why: str, cause: BaseException | None = None) -> TransferFailed:
        self.abort()
        failure = TransferFailed(f"ipc generation {self.generation}: {why}")
        failure.__cause__ = cause
        return failure

    def _begin(self) -> None:
        if self._aborted:
            raise self._failed("the channel was aborted")
        self._publication += 1
        self._bucket = 0

    def _key(self, bucket: int) -> str:
        return f"p{self._publication}/b{bucket}"

    def _ack_key(self, bucket: int, rank: int) -> str:
        return f"p{self._publication}/a{bucket}/{rank}"

    # ------------------------------------------------------------ rank 0
    def _bucket_buffer(self, nbytes: int) -> torch.Tensor:
        slot = self._bucket % self.SLOTS
        self._await(slot)
        buffer = self._slots[slot]
        if buffer is None or buffer.tensor.numel() < nbytes:
            self._slots[slot] = buffer = StagingBuffer(nbytes, self.device)
        return buffer.tensor[:nbytes]

    def _send_bucket(self, flat: torch.Tensor) -> None:
        if self._aborted:
            raise self._failed("the channel was aborted")
        slot = self._bucket % self.SLOTS
        buffer = self._slots[slot]
        if buffer is None:
            raise ValueError("a bucket must be packed into _bucket_buffer first")
        if flat.is_cuda:  # the receivers read on streams of their own
            torch.cuda.current_stream(flat.device).synchronize()
        self._store.set(self._key(self._bucket), json.dumps(
            {"nbytes": flat.numel(), "slot": slot, "handle": buffer.handle}))
        self._held[slot] = self._bucket
        self._bucket += 1

    def _await(self, slot: int) -> None:
        """Until every receiver has copied the bucket ``slot`` holds."""
        bucket = self._held.pop(slot, None)
        if bucket is None:
            return
        acks = [self._ack_key(bucket, r) for r in range(1, self.world_size)]
        try:
            self._store.wait(acks, timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # DistStoreError: a receiver died or stalled
            raise self._failed(f"bucket {bucket} was not acknowledged: {exc}", exc) from exc
        for key in (self._key(bucket), *acks):
            self._store.delete_key(key)
        buffer = self._slots[slot]
        if buffer is not None:
            buffer.unlink()  # every receiver has it mapped now

    def _finish_send(self) -> None:
        for slot in range(self.SLOTS):
            self._await(slot)

    # ------------------------------------------------------------ receivers
    def _receive_bucket(self, nbytes: int) -> torch.Tensor:
        if self._aborted:
            raise self._failed("the channel was aborted")
        bucket = self._bucket
        try:
            raw = self._store.get(self._key(bucket))
        except RuntimeError as exc:  # DistStoreError: the sender died or stalled
            raise self._failed(f"bucket {bucket} was not posted: {exc}", exc) from exc
        try:
            posted = json.loads(raw)
            if posted.get("nbytes") != nbytes:
                raise ValueError(f"it holds {posted.get('nbytes')} bytes, the manifest says "
                                 f"{nbytes}")
            handle, slot = posted["handle"], int(posted["slot"]) % self.SLOTS
            key = json.dumps(handle, sort_keys=True)
            if self._mapped.get(slot, ("", None))[0] != key:  # new, or the sender replaced it
                self._mapped[slot] = (key, map_staging(handle, self.device))
            # a copy of our own: the sender reuses the buffer once we acknowledge
            received = self._mapped[slot][1][:nbytes].to(self.device, copy=True)
            if received.is_cuda:
                torch.cuda.current_stream(received.device).synchronize()
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            raise self._failed(f"bucket {bucket}: {exc}", exc) from exc
        self._store.set(self._ack_key(bucket, self.rank), "1")
        self._bucket += 1
        return received

    def abort(self) -> None:
        self._aborted = True
        for buffer in self._slots:
            if buffer is not None:
                buffer.unlink()
        self._slots = [None] * self.SLOTS
        self._held.clear()
        self._mapped.clear()

    def __del__(self) -> None:
        if hasattr(self, "_slots"):  # not when __init__ failed before it
            self.abort()
