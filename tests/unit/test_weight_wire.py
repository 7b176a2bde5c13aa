"""What travels in a weight publication and to whom: the engines' dtype on
the wire (never fp32 master weights to a bf16 engine), one group per dtype of
a mixed fleet, one rank per tensor-parallel worker, and a publication that
cannot outlive its timeout, on the gloo and ipc transports. Real gloo groups
and shared files between processes."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
import time
import weakref
from collections.abc import Iterator
from typing import get_args

import pytest
import torch

from learner.members import Member
from learner.publisher import (
    gather_dtype,
    plan_lanes,
    reason_to_give_up,
    weight_backend,
    wire_dtype,
)
from protocol import EngineInfo, WeightManifest
from protocol.messages import WireDtype
from protocol.weights import (
    WIRE_FLOAT_DTYPES,
    TransferFailed,
    WeightChannel,
    abandon_generation,
    connect_store,
    dtype_name,
    host_store,
    manifest_of,
    member_ranks,
    nbytes_of,
    received_ahead,
    worker_rank,
)
from protocol.weights_backends import join_channel
from protocol.weights_collective import MAX_LANES, member_timeout_s
from tests.collector import collector_disabled, python_holders
from tests.ports import free_ports

#: The tests whose members are processes joining groups (~25 s in all) are
#: slow, so that this module starts early on its xdist worker
#: (tests/conftest.py); the rest are plain unit tests.

TENSORS = [("embed.weight", torch.randn(64, 8)), ("layer.weight", torch.randn(8, 8)),
           ("layer.bias", torch.randn(8)), ("steps", torch.arange(3))]


def _member(name: str, dtype: str, tensor_parallel: int = 1) -> Member:
    return Member(name, 1, name.encode(), b"t" * 16, EngineInfo(device="cpu", dtype=dtype,
                                                     tensor_parallel=tensor_parallel,
                                                     model="m"), version=0)


def test_each_tensor_parallel_worker_holds_a_rank_of_its_own() -> None:
    """Every worker of a TP engine joined with the engine's rank before."""
    bases, world_size = member_ranks([1, 2, 4])
    assert (bases, world_size) == ([1, 2, 4], 8)
    ranks = [worker_rank(base, w) for base, workers in zip(bases, [1, 2, 4], strict=True)
             for w in range(workers)]
    assert ranks == list(range(1, 8))  # each once, none the sender's 0
    with pytest.raises(ValueError):
        member_ranks([1, 0])


def test_an_engine_may_declare_exactly_the_dtypes_weights_travel_in() -> None:
    """``EngineInfo.dtype``'s set is the wire dtypes' names (the protocol
    module imports no torch, so they are written twice and compared here)."""
    assert get_args(WireDtype) == tuple(dtype_name(d) for d in WIRE_FLOAT_DTYPES)


def test_engines_get_weights_in_their_own_dtype() -> None:
    assert wire_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert wire_dtype("float16", torch.float32) == torch.float16
    # an engine that names no dtype gets the learner's, unconverted
    assert wire_dtype("auto", torch.float32) == torch.float32
    assert wire_dtype("int8", torch.float32) == torch.float32
    manifest = manifest_of(TENSORS, 0, torch.bfloat16)
    assert [s.dtype for s in manifest.tensors] == ["bfloat16"] * 3 + ["int64"]
    fp32 = manifest_of(TENSORS, 0)
    wire = sum(nbytes_of(s) for s in manifest.tensors[:3])
    assert wire * 2 == sum(nbytes_of(s) for s in fp32.tensors[:3])


def test_a_mixed_fleet_is_split_into_one_lane_per_dtype() -> None:
    members = [_member("a", "bfloat16", 2), _member("b", "float16"), _member("c", "bfloat16")]
    lanes = plan_lanes(members, torch.float32)
    assert [(lane.dtype, [m.actor_id for m in lane.members], lane.bases, lane.world_size)
            for lane in lanes] == [(torch.bfloat16, ["a", "c"], [1, 3], 4),
                                   (torch.float16, ["b"], [1], 2)]


def test_rank_0_gives_a_forming_generation_up_when_a_member_left_or_the_learner_stops() -> None:
    [lane] = plan_lanes([_member("a", "bfloat16"), _member("b", "bfloat16")], torch.float32)
    assert reason_to_give_up(lane, lane.members, stopping=False) is None
    assert reason_to_give_up(lane, lane.members, stopping=True) == "the learner is stopping"
    assert reason_to_give_up(lane, lane.members[:1], stopping=False) == "b left"
    replaced = dataclasses.replace(lane.members[0], incarnation=2)  # killed and back
    assert reason_to_give_up(lane, [replaced, lane.members[1]], stopping=False) == "a left"


def _member_process(port: int, backend: str, manifest: WeightManifest | None,
                    timeout_s: float, results: multiprocessing.Queue) -> None:
    """Rank 1 in a process of its own (two gloo groups forming in one process
    hold each other up): what it received, or the error it ended with; with
    no manifest it joins and then stalls."""
    try:
        group = join_channel(connect_store("127.0.0.1", port, timeout_s), 1, 2, 1, backend,
                             timeout_s)
        if manifest is None:
            time.sleep(3600)
        began = time.monotonic()
        try:
            # as bytes: a shared tensor would need this process alive to be read
            results.put([(name, str(tensor.dtype), tuple(tensor.shape),
                          tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                         for name, tensor in group.receive(manifest)])
        except TransferFailed as exc:
            results.put((type(exc).__name__, time.monotonic() - began))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put(repr(exc))


def _start_member(port: int, backend: str, manifest: WeightManifest | None, timeout_s: float
                  ) -> tuple[multiprocessing.Process, multiprocessing.Queue]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_member_process,
                              args=(port, backend, manifest, timeout_s, results))
    process.start()
    return process, results


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
@pytest.mark.parametrize("bucket_bytes", [0, 256])
def test_a_receiver_gets_exactly_the_sender_tensors_in_the_wire_dtype(bucket_bytes: int,
                                                                      backend: str) -> None:
    [port] = free_ports(1)
    store = host_store(port, timeout_s=60)
    manifest = manifest_of(TENSORS, bucket_bytes, torch.bfloat16)
    process, results = _start_member(port, backend, manifest, 60)
    try:
        join_channel(store, 1, 2, 0, backend, 60).send(manifest, (t for _, t in TENSORS))
        received = [(name, torch.frombuffer(bytearray(data), dtype=torch.uint8)
                     .view(getattr(torch, dtype.removeprefix("torch."))).reshape(shape))
                    for name, dtype, shape, data in results.get(timeout=60)]
    finally:
        process.join(timeout=30)
        process.kill()
    assert [name for name, _ in received] == [name for name, _ in TENSORS], received
    for (_, got), (_, sent) in zip(received, TENSORS, strict=True):
        expected = sent.to(torch.bfloat16) if sent.is_floating_point() else sent
        assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_bucket_never_sent_fails_the_receiver_within_its_timeout(backend: str) -> None:
    """A member waits for a bucket the sender never sends (the sender froze,
    or its NCCL work never finishes): it gives up after the timeout instead
    of hanging, having aborted the channel."""
    [port] = free_ports(1)
    store = host_store(port, timeout_s=60)
    manifest = manifest_of(TENSORS, 0)
    process, results = _start_member(port, backend, manifest, 1.0)
    try:
        sender = join_channel(store, 1, 2, 0, backend, 60)  # joins, then sends nothing
        outcome = results.get(timeout=60)
    finally:
        process.join(timeout=30)
        process.kill()
    assert outcome[0] == "TransferFailed", outcome
    assert outcome[1] < 10
    sender.abort()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_member_stops_waiting_on_a_bucket_once_the_sender_abandons_the_generation(
        backend: str) -> None:
    """Rank 0 gave the generation up (another member died mid-broadcast): the
    member waiting on its next bucket fails at once, not at its deadline, and
    is free to join the next generation."""
    [port] = free_ports(1)
    store = host_store(port, timeout_s=60)
    manifest = manifest_of(TENSORS, 0)
    process, results = _start_member(port, backend, manifest, 60.0)
    try:
        sender = join_channel(store, 1, 2, 0, backend, 60)
        time.sleep(0.5)  # the member is waiting on the first bucket
        abandon_generation(store, 1)
        outcome = results.get(timeout=60)
    finally:
        # the member's exit after a gloo failure is not what is tested, and it
        # is slow (the join's whole 30 s in the suite)
        process.kill()
        process.join(timeout=30)
    assert outcome[0] == "TransferFailed", outcome
    assert outcome[1] < 30  # its deadline is 60 s
    sender.abort()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_member_stops_joining_once_the_sender_abandons_the_generation(backend: str) -> None:
    """The generation did not form (another member never came): rank 0
    abandons it, and a member still joining fails at once; so does one that
    comes to it later."""
    [port] = free_ports(1)
    store = host_store(port, timeout_s=60)
    began = time.monotonic()
    threading.Timer(0.5, abandon_generation, (store, 1)).start()
    with pytest.raises(RuntimeError, match="abandoned"):
        join_channel(connect_store("127.0.0.1", port, 60), 1, 3, 1, backend, 60)
    with pytest.raises(RuntimeError, match="abandoned"):
        join_channel(connect_store("127.0.0.1", port, 60), 1, 3, 2, backend, 60)
    assert time.monotonic() - began < 30  # the deadlines are 60 s
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_member_that_stalls_fails_the_sender_within_its_timeout(backend: str) -> None:
    """The member joins, then never takes a bucket: the sender's publication
    raises TransferFailed after its timeout instead of hanging, and (on
    gloo, whose buckets are the sender's own: ipc stages them in buffers it
    reuses) nothing of Python's keeps the failed bucket alive: gloo's
    pending operation holds it until the retired group's own timeout
    (protocol/weights_collective.py ``retire``), NCCL's not past the abort."""
    [port] = free_ports(1)
    store = host_store(port, timeout_s=60)
    # 16 MB: more than any socket buffer holds, in one bucket of two tensors
    big = [("w", torch.zeros(2 << 20)), ("v", torch.zeros(2 << 20))]
    process, _ = _start_member(port, backend, None, 60)
    try:
        # the join waits for the member's process to start (seconds of imports
        # on a busy machine); the deadline under test is the publication's
        sender = join_channel(store, 1, 2, 0, backend, 60)
        sender.timeout_s = 2.0
        buckets = _recording_buckets(sender)
        began = time.monotonic()
        with collector_disabled(), pytest.raises(TransferFailed):
            sender.send(manifest_of(big, 32 << 20), (t for _, t in big))
        assert time.monotonic() - began < 10
        assert len(buckets) == 1
        if backend == "gloo" and (bucket := buckets[0]()) is not None:
            assert not python_holders(bucket), "a failed publication still holds its bucket"
    finally:
        process.kill()
        process.join(timeout=30)


def _recording_buckets(channel: WeightChannel) -> list[weakref.ref]:
    """Weak references to each bucket ``channel`` packs from now on."""
    made: list[weakref.ref] = []
    allocate = channel._bucket_buffer

    def recorded(nbytes: int) -> torch.Tensor:
        flat = allocate(nbytes)
        made.append(weakref.ref(flat))
        return flat

    channel._bucket_buffer = recorded
    return made


class FailingChannel(WeightChannel):
    """A channel whose second bucket fails the way a broadcast does: the
    failure is raised, with a cause, from a frame that holds the bucket."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.sent = 0

    def _send_bucket(self, flat: torch.Tensor) -> None:
        self.sent += 1
        if self.sent == 2:
            in_flight = flat  # noqa: F841 - the frame holds it, as a pending broadcast's does
            try:
                raise RuntimeError("connection reset by peer")
            except RuntimeError as exc:
                raise TransferFailed("generation 1: connection reset by peer") from exc

    def _receive_bucket(self, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def abort(self) -> None:
        pass


def test_a_failed_publication_holds_no_bucket_without_the_collector() -> None:
    """Rank 0 may fail publications again and again under churn: once a
    lane failed, its sender keeps neither the bucket nor a traceback whose
    frames hold one (a cycle through the sender only a full collection
    frees), while the publication goes on to the other lanes."""
    tensors = [(f"t{i}", torch.full((1 << 16,), float(i))) for i in range(6)]
    manifest = manifest_of(tensors, 2 * (1 << 18))  # two tensors a bucket
    channel = FailingChannel()
    buckets = _recording_buckets(channel)
    with collector_disabled():
        sender = channel.sender(manifest)
        for index, (_, tensor) in enumerate(tensors):
            sender.add(index, tensor)
        assert sender.error is not None and channel.sent == 2
        assert len(buckets) == 2 and all(bucket() is None for bucket in buckets)
        with pytest.raises(TransferFailed, match="connection reset") as raised:
            sender.finish()
        assert raised.value.__cause__ is sender.error
        del raised
        assert all(bucket() is None for bucket in buckets)


def test_a_receiving_failure_holds_no_bucket_once_the_consumer_drops_it() -> None:
    """The engine's loader catches the failure of a tensor received ahead
    and goes on to the next generation: nothing but the exception it
    dropped held the bucket the receiving frames had."""
    received: list[weakref.ref] = []

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        flat = torch.zeros(1 << 20, dtype=torch.uint8)
        received.append(weakref.ref(flat))
        yield "t0", flat[:16]
        raise TransferFailed("member died")

    def load() -> None:  # as vLLM's loader, the tensors it loaded going with its frame
        for _name, _tensor in received_ahead(tensors(), 2):
            pass

    with collector_disabled():
        with pytest.raises(TransferFailed, match="member died"):
            load()
        assert received and received[0]() is None


def test_received_ahead_keeps_order_and_raises_where_the_consumer_reaches_it() -> None:
    def tensors(fail_at: int | None):
        for i in range(10):
            if i == fail_at:
                raise TransferFailed("member died")
            yield f"t{i}", torch.full((2,), i)

    assert [n for n, _ in received_ahead(tensors(None), 3)] == [f"t{i}" for i in range(10)]
    got = []
    with pytest.raises(TransferFailed, match="member died"):
        for name, _ in received_ahead(tensors(6), 2):
            got.append(name)
    assert got == [f"t{i}" for i in range(6)]


def test_a_consumer_that_stops_early_stops_the_receiving_thread() -> None:
    drawn = []

    def tensors():
        for i in range(1000):
            drawn.append(i)
            yield f"t{i}", torch.zeros(1)

    ahead = received_ahead(tensors(), 2)
    assert next(ahead)[0] == "t0"
    ahead.close()  # joins the thread
    assert len(drawn) <= 5
    assert not any(t.name == "weights-receive" for t in threading.enumerate())


def test_the_weight_backend_follows_the_config_or_the_learner() -> None:
    assert weight_backend("auto", "gloo") == "gloo"
    assert weight_backend("auto", "nccl") == "nccl"
    assert weight_backend("gloo", "nccl") == "gloo"  # allowed: through the host
    with pytest.raises(ValueError, match="needs a learner on GPUs"):
        weight_backend("nccl", "gloo")
    assert weight_backend("ipc", "nccl") == "ipc"  # CUDA IPC on the learner's GPU
    assert weight_backend("ipc", "gloo") == "ipc"  # shared memory on its host


def test_a_publication_has_at_most_max_lanes_lanes_whatever_its_engines_run() -> None:
    """An engine's communicator deadline is fixed at its start from
    ``MAX_LANES`` (protocol/weights_collective.py ``start_environments``):
    no fleet may plan more lanes than that."""
    dtypes = ["float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "int8", "auto", "x"]
    lanes = plan_lanes([_member(f"a{i}", dtype) for i, dtype in enumerate(dtypes)],
                       torch.float32)
    assert len(lanes) == MAX_LANES


def test_a_lane_s_member_waits_through_every_other_lane_s_failure() -> None:
    """Rank 0 serves lanes in turn; each stalled lane holds the rest back by
    up to its own deadline, then is skipped."""
    assert member_timeout_s(30.0, 1) == 30.0
    for lanes in (2, 3):
        assert member_timeout_s(30.0, lanes) >= 30.0 * lanes


def test_shards_are_cast_to_the_one_wire_dtype_before_they_are_gathered() -> None:
    assert gather_dtype([torch.bfloat16], torch.float32) == torch.bfloat16
    assert gather_dtype([torch.bfloat16, torch.bfloat16], torch.float32) == torch.bfloat16
    # two wire dtypes: each lane converts from what was trained
    assert gather_dtype([torch.bfloat16, torch.float16], torch.float32) == torch.float32
    assert gather_dtype([torch.float8_e4m3fn], torch.float32) == torch.float32
    assert gather_dtype([], torch.bfloat16) == torch.bfloat16
