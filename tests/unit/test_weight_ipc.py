"""The ipc weight transport's own parts: its handles travel as JSON and map
back to what torch's CUDA IPC rebuild takes; a receiver maps nothing but a
staging file; staging files do not outlive a publication; two staging
buffers alternate across many buckets and publications without a receiver
ever seeing a buffer the sender has reused. Sender and receivers are threads
here (the channel holds no process group); test_weight_wire.py runs it
across processes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from protocol.weights import TransferFailed, connect_store, host_store, manifest_of
from protocol.weights_ipc import (
    SHARED_FILE_PREFIX,
    IpcChannel,
    StagingBuffer,
    cuda_handle,
    cuda_rebuild_args,
    map_staging,
    shared_file_dir,
)
from tests.ports import free_ports


def _staging_files() -> set[str]:
    return {p.name for p in shared_file_dir().glob(f"{SHARED_FILE_PREFIX}*")}


@pytest.fixture
def own_staging_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Staging files in a folder of this test's own: a test that counts
    what is left sees only its own files, not those of a test running
    beside it on another xdist worker (whose buffers in /dev/shm once made
    such a count fail)."""
    monkeypatch.setattr("protocol.weights_ipc.shared_file_dir", lambda: tmp_path)
    probe = StagingBuffer(8, torch.device("cpu"))  # the channels' buffers go there too
    assert Path(probe.handle["path"]).parent == tmp_path
    probe.unlink()
    return tmp_path


def test_a_cuda_handle_survives_json_as_the_rebuild_arguments() -> None:
    share = (3, b"\x00ipc\xff" * 13, 4096, 512, b"ref\x01", 7, b"\x02event", True)
    handle = json.loads(json.dumps(cuda_handle(share, 1000, "GPU-abc")))
    args = cuda_rebuild_args(handle, device=0)
    assert args[0] is torch.Tensor and args[4] is torch.storage.TypedStorage
    assert args[1:4] == ((1000,), (1,), 0) and args[5] is torch.uint8
    # the local device index, then the storage exactly as _share_cuda_ gave it
    assert args[6] == 0
    assert args[7:] == (share[1], 4096, 512, False, b"ref\x01", 7, b"\x02event", True)
    assert handle["device_uuid"] == "GPU-abc" and handle["device"] == 3


def test_a_cuda_handle_without_an_event_keeps_none() -> None:
    share = (0, b"h", 16, 0, b"r", 0, None, False)
    args = cuda_rebuild_args(json.loads(json.dumps(cuda_handle(share, 16, "u"))), 0)
    assert args[13] is None and args[14] is False


@pytest.mark.parametrize("handle, why", [
    ({"kind": "file", "nbytes": 8, "path": "/etc/passwd"}, "not a staging file"),
    ({"kind": "file", "nbytes": 8, "path": str(shared_file_dir() / "other")},
     "not a staging file"),
    ({"kind": "file", "nbytes": 8,
      "path": str(shared_file_dir() / f"{SHARED_FILE_PREFIX}gone")}, "not on this host"),
    ({"kind": "file", "path": "x"}, "without a size"),
    ({"kind": "cuda", "nbytes": 8, "device_uuid": "GPU-x"}, "learner rank 0's GPU"),
    ({"kind": "pickle", "nbytes": 8}, "unknown staging handle"),
])
def test_a_receiver_maps_only_a_staging_buffer_it_can_reach(handle: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        map_staging(handle, torch.device("cpu"))


def test_a_staging_buffer_is_shared_memory_the_receiver_sees() -> None:
    buffer = StagingBuffer(64, torch.device("cpu"))
    try:
        mapped = map_staging(buffer.handle, torch.device("cpu"))
        buffer.tensor[:] = torch.arange(64, dtype=torch.uint8)
        assert torch.equal(mapped, torch.arange(64, dtype=torch.uint8))
    finally:
        buffer.unlink()
    assert Path(buffer.handle["path"]).name not in _staging_files()


def _channels(world_size: int, timeout_s: float = 30.0) -> list[IpcChannel]:
    [port] = free_ports(1)
    store = host_store(port, timeout_s)
    channels: list[IpcChannel | None] = [None] * world_size

    def join(rank: int) -> None:
        joined = store if rank == 0 else connect_store("127.0.0.1", port, timeout_s)
        channels[rank] = IpcChannel(joined, 1, world_size, rank, timeout_s)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(channels), "a member did not join"
    return channels  # type: ignore[return-value]


def test_many_buckets_and_publications_arrive_exactly_through_two_staging_buffers(
        own_staging_dir: Path) -> None:
    channels = _channels(3)
    received: dict[int, list[list[tuple[str, torch.Tensor]]]] = {1: [], 2: []}
    publications = [[(f"t{i}", torch.full((10 + i,), float(p * 100 + i))) for i in range(12)]
                     for p in range(3)]
    manifest = manifest_of(publications[0], 64)
    # the same shapes every publication: one manifest
    for named in publications[1:]:
        assert manifest_of(named, 64) == manifest

    def receive(rank: int) -> None:
        for _ in publications:
            received[rank].append([(n, t.clone()) for n, t in channels[rank].receive(manifest)])

    threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
    for thread in threads:
        thread.start()
    for named in publications:
        channels[0].send(manifest, (t for _, t in named))
    for thread in threads:
        thread.join(timeout=60)
    for rank in (1, 2):
        assert len(received[rank]) == len(publications)
        for got, sent in zip(received[rank], publications, strict=True):
            assert [n for n, _ in got] == [n for n, _ in sent]
            for (_, a), (_, b) in zip(got, sent, strict=True):
                assert torch.equal(a, b)
    # every staging file is unlinked once mapped by all receivers
    assert list(own_staging_dir.iterdir()) == []


def test_a_bucket_larger_than_its_staging_buffer_replaces_only_that_buffer() -> None:
    """Growing tensors, a bucket each: the sender replaces a slot's buffer
    several times running while the other slot's stays; receivers follow."""
    sender, receiver = _channels(2)
    # slots alternate 0, 1, 0, 1, ...: slot 0 grows twice while slot 1 keeps its first
    sizes = [2, 1024, 16, 1, 128, 1, 512, 3]
    tensors = [(f"t{i}", torch.arange(n, dtype=torch.float32) + i) for i, n in enumerate(sizes)]
    manifest = manifest_of(tensors, 0)
    got: list[tuple[str, torch.Tensor]] = []
    thread = threading.Thread(target=lambda: got.extend(
        (n, t.clone()) for n, t in receiver.receive(manifest)))
    thread.start()
    sender.send(manifest, (t for _, t in tensors))
    thread.join(timeout=60)
    assert [n for n, _ in got] == [n for n, _ in tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, tensors, strict=True))


def test_a_receiver_that_never_acknowledges_fails_the_sender_and_leaves_no_file(
        own_staging_dir: Path) -> None:
    sender, _silent = _channels(2, timeout_s=1.0)
    tensors = [(f"t{i}", torch.ones(100)) for i in range(4)]
    with pytest.raises(TransferFailed, match="not acknowledged"):
        sender.send(manifest_of(tensors, 0), (t for _, t in tensors))
    assert list(own_staging_dir.iterdir()) == []
    with pytest.raises(TransferFailed, match="aborted"):  # the channel is spent
        sender.send(manifest_of(tensors, 0), (t for _, t in tensors))


def test_a_generation_a_member_never_joins_does_not_form() -> None:
    [port] = free_ports(1)
    with pytest.raises(RuntimeError, match="did not form"):
        IpcChannel(host_store(port, 1.0), 1, 2, 0, 1.0)
