"""The weight group's deadlines and failure handling, as plain decisions
(protocol/weights_collective.py, protocol/weights_store.py): NCCL's watchdog
can never act before the project's deadline, the weight group alone is built
with error handling that leaves the process running, a broadcast's deadline
counts from when it was enqueued, a member's poll of the store is bounded by
what is left of that deadline, and a generation whose member never comes
fails its join within the deadline (gloo here: the CPU twin of NCCL's lazily
created communicator, which the join now precedes)."""

from __future__ import annotations

import gc
import math
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from actors.weight_transfer import GenerationMember, GroupInitInfo
from protocol.transport import TransportConfig
from protocol.weights import JOIN_POLL_S, WeightChannel, connect_store, host_store
from protocol.weights_backends import join_channel
from protocol.weights_collective import (
    ABORT_WAIT_S,
    GLOO_RELEASE_GRACE_S,
    MAX_LANES,
    NCCL_CLEAN_UP_ONLY,
    NCCL_DUMP_ON_TIMEOUT,
    NCCL_ERROR_HANDLING_VARIABLES,
    NCCL_INIT_TIMEOUT,
    NCCL_MEMBER_REQUIRED,
    VLLM_GPU_WORKER_REMOVES,
    WeightGroup,
    member_timeout_s,
    nccl_environment_problem,
    nccl_watchdog_timeout_s,
    release,
    releases_on_abort,
    retire,
    retired_groups,
    start_environments,
    torch_reads,
    wait_within,
    weight_member_environment,
)
from protocol.weights_store import REPLY_GRACE_S, StoreClient
from tests.ports import free_ports


class NeverCompletes:
    """A collective whose peer died: it never completes, and its own wait
    would not bound the host (NCCL's does not)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("waited on a work that never completes")


def test_nccl_s_watchdog_acts_only_long_after_the_project_s_deadline() -> None:
    for deadline_s in (0.5, 30.0, 600.0):
        assert nccl_watchdog_timeout_s(deadline_s) >= 2 * deadline_s


def test_a_weight_member_starts_with_clean_up_only_error_handling_and_no_dump_on_timeout() -> None:
    started = weight_member_environment(30.0)
    assert torch_reads(started, NCCL_ERROR_HANDLING_VARIABLES) == NCCL_CLEAN_UP_ONLY
    assert started[NCCL_DUMP_ON_TIMEOUT] == "0"
    assert nccl_environment_problem({**os.environ, **started}) is None


def test_torch_takes_a_setting_from_the_first_of_its_names_that_is_set() -> None:
    names = NCCL_ERROR_HANDLING_VARIABLES
    assert torch_reads({names[1]: "1"}, names) == "1"  # the legacy name, alone
    assert torch_reads({names[1]: "1", names[0]: "2"}, names) == "2"
    assert torch_reads({}, names) is None


@pytest.mark.parametrize("parent", [
    {},
    {"NCCL_ASYNC_ERROR_HANDLING": "1"},  # set by Ray; torch reads the current name first
    {"NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
])
def test_an_engine_may_build_the_group_after_vllm_s_gpu_worker_removed_what_it_removes(
        parent: dict[str, str]) -> None:
    """vLLM's GPU worker removes ``NCCL_ASYNC_ERROR_HANDLING`` as it starts
    (tests/unit/test_vllm_environment.py pins the name to its source): what
    an engine started with must hold without it."""
    environ = {**parent, **start_environments(30.0).engine}
    for name in VLLM_GPU_WORKER_REMOVES:
        environ.pop(name, None)
    assert nccl_environment_problem(environ) is None


@pytest.mark.parametrize("changed", [
    # torch's defaults: a timeout arms the process-wide dump, and the first group's abort
    dict.fromkeys(weight_member_environment(30.0)),
    {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},  # torchrun's default for its ranks
    {"TORCH_NCCL_ASYNC_ERROR_HANDLING": None, "NCCL_ASYNC_ERROR_HANDLING": "3"},
    {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"},
])
def test_an_nccl_weight_group_refuses_to_form_in_a_process_a_member_s_death_could_end(
        changed: dict[str, str | None]) -> None:
    started = {name: value for name, value in {**weight_member_environment(30.0),
                                                **changed}.items()
               if value is not None}
    problem = nccl_environment_problem(started)
    assert problem is not None and "compactionrl learner" in problem


def test_each_process_starts_with_the_run_s_weight_deadline() -> None:
    """The learner's ranks wait their own deadline for a communicator; an
    engine waits what it may be announced, rank 0 reaching its lane after
    every other lane failed (120 s: the k8s run)."""
    started = start_environments(120.0)
    assert started.learner[NCCL_INIT_TIMEOUT] == "120"
    assert int(started.engine[NCCL_INIT_TIMEOUT]) >= member_timeout_s(120.0, MAX_LANES)
    assert int(start_environments(0.2).learner[NCCL_INIT_TIMEOUT]) >= 1  # whole seconds


def _torch_c10d_header(name: str) -> str:
    return (Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d" / name).read_text()


@pytest.mark.parametrize("names", list(NCCL_MEMBER_REQUIRED))
def test_the_names_torch_reads_each_setting_under_are_torch_s_own(names: tuple[str, ...]) -> None:
    """The installed torch's list for the setting, in its order."""
    declared = re.search(rf"std::vector<std::string> {names[0]} = \{{([^}}]*)\}}",
                         _torch_c10d_header("ProcessGroupNCCL.hpp"))
    assert declared is not None, f"ProcessGroupNCCL.hpp no longer declares {names[0]}"
    assert tuple(re.findall(r'"(\w+)"', declared.group(1))) == names


@pytest.mark.parametrize("reader", ["getCvarInt", "getCvarBool"])
def test_torch_keeps_the_first_name_set_of_a_setting(reader: str) -> None:
    """``torch_reads``'s rule, in the installed torch's ``Utils.hpp``: the
    names are walked from the last to the first, each one set overwriting
    the value, so the first name set is the one that stays."""
    utils = _torch_c10d_header("Utils.hpp")
    body = utils[utils.index(f"inline {'int' if reader == 'getCvarInt' else 'bool'} {reader}("):]
    body = body[:body.index("\n}\n")]
    assert re.search(r"for \(ssize_t i = static_cast<ssize_t>\(env\.size\(\)\) - 1; i >= 0; i--\)",
                     body), f"{reader} no longer walks the names from the last to the first"
    assert "ret = " in body and "return ret;" in body and "break" not in body


def test_a_broadcast_s_deadline_counts_from_when_it_was_enqueued() -> None:
    """Rank 0 enqueues a bucket, packs the next, then waits: a deadline that
    passed while it packed ends the wait at once."""
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="deadline"):
        wait_within(NeverCompletes(), deadline=began - 1.0)
    assert time.monotonic() - began < 1.0


def test_a_member_asks_the_store_with_what_is_left_of_its_deadline() -> None:
    asked: list[float] = []

    def abandoned(within_s: float) -> bool:
        asked.append(within_s)
        return len(asked) == 2

    deadline = time.monotonic() + 30.0
    with pytest.raises(TimeoutError, match="abandoned"):
        wait_within(NeverCompletes(), deadline, abandoned)
    assert len(asked) == 2 and all(0 < s <= 30.0 for s in asked) and asked[1] < asked[0]


def test_the_sender_gives_a_broadcast_up_once_a_member_has_left() -> None:
    """Rank 0 asks its join's ``cancelled()`` while a bucket travels: a member
    that said goodbye (or a learner that stops) fails the publication at
    once, and the survivors get the next, instead of at the bucket's deadline."""
    reasons: list[str | None] = [None, None, "actor-1 left"]
    sender = SimpleNamespace(rank=0, _cancelled=lambda: reasons.pop(0))
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="given up"):
        wait_within(NeverCompletes(), began + 30.0,
                    lambda within_s: WeightChannel.given_up(sender, within_s))
    assert reasons == [] and time.monotonic() - began < 5.0
    assert not WeightChannel.given_up(SimpleNamespace(rank=0, _cancelled=None))


def test_a_poll_of_a_store_that_does_not_answer_returns_within_its_bound() -> None:
    """The store's host is gone: the poll fails within the bound it is
    given, not the client's reply grace (5 s), so a member's deadline holds."""
    [port] = free_ports(1)
    client = StoreClient(f"tcp://127.0.0.1:{port}", TransportConfig(), timeout_s=60)
    try:
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="did not answer"):
            client.abandoned(within_s=0.2)
        assert time.monotonic() - began < REPLY_GRACE_S / 2
    finally:
        client.close()


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_generation_whose_member_never_comes_fails_its_join_within_the_deadline(
        backend: str) -> None:
    store = host_store(0, timeout_s=60)
    try:
        began = time.monotonic()
        with pytest.raises(RuntimeError, match=f"{backend} generation 1 did not form in 1 s"):
            join_channel(store, 1, 2, 0, backend, 1.0)
        assert time.monotonic() - began < 30  # the store's own timeout is 60 s
    finally:
        store.close()


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_join_stops_waiting_as_soon_as_it_is_given_a_reason(backend: str) -> None:
    """Asked every JOIN_POLL_S: a member that left, or a learner that stops,
    ends the join then, not at its deadline."""
    store = host_store(0, timeout_s=60)
    asked: list[float] = []

    def cancelled() -> str | None:
        asked.append(time.monotonic())
        return "actor-1 left" if len(asked) == 3 else None

    try:
        began = time.monotonic()
        with pytest.raises(RuntimeError,
                           match=f"{backend} generation 1 given up while forming: actor-1 left"):
            join_channel(store, 1, 2, 0, backend, 60.0, cancelled)
        assert len(asked) == 3
        assert asked[0] - began >= JOIN_POLL_S * 0.9  # it waited between the questions
        assert time.monotonic() - began < 30  # not the join's deadline (60 s)
    finally:
        store.close()


def test_an_aborted_group_is_kept_while_destroying_it_could_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Either destructor joins a thread of the group's: an aborted NCCL group
    (its watchdog may sleep a minute after a peer's death) is kept for good,
    an aborted gloo group until the operation it had pending timed out; each
    once, however often it is aborted; released by the next failure."""
    monkeypatch.setattr("protocol.weights_collective.RETIRED_GROUPS",
                        kept := [(object(), time.monotonic() - 1)])
    nccl, gloo = object(), object()
    began = time.monotonic()
    retire(nccl, "nccl", 30.0)
    retire(nccl, "nccl", 30.0)
    retire(gloo, "gloo", 30.0)
    assert [group for group, _ in kept] == [nccl, gloo]  # the expired one released
    # and the NCCL one never destroyed: a reference nobody drops, not even at exit
    assert sys.getrefcount(nccl) == 4  # the local, the list's, the kept one, getrefcount's
    assert kept[0][1] == math.inf
    assert began + 30 + GLOO_RELEASE_GRACE_S <= kept[1][1] <= time.monotonic() + 30 + \
        GLOO_RELEASE_GRACE_S


def test_an_aborted_gloo_group_with_a_broadcast_pending_is_dropped_without_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real path: a member's broadcast is pending when it aborts (its
    sender gave up); gloo's abort does not end it, and the group's
    destructor would wait for it (until the group's timeout). Kept, the
    member's last reference goes at once."""
    monkeypatch.setattr("protocol.weights_collective.RETIRED_GROUPS", kept := [])
    timeout_s = 30.0
    store = host_store(0, timeout_s=60)
    # a client of its own for each rank, as in two processes: a client's calls
    # are serialised, and rank 0's join holds its client while it waits
    clients = [store, connect_store("127.0.0.1", store.port, 60)]
    try:
        with ThreadPoolExecutor(2) as pool:
            sender, member = pool.map(
                lambda rank: join_channel(clients[rank], 1, 2, rank, "gloo", timeout_s), (0, 1))
        member._start(torch.empty(4))  # rank 0 never sends
        member.abort()
        assert [group for group, _ in kept] == [member._group]
        began = time.monotonic()
        del member
        gc.collect()
        assert time.monotonic() - began < timeout_s / 3  # not the broadcast's timeout
        del sender  # its connections close: the pending broadcast fails, and goes at once
        kept.clear()
    finally:
        clients[1].close()
        store.close()


def test_only_an_nccl_abort_releases_the_pending_broadcast_s_tensors_by_waiting() -> None:
    """An NCCL work's wait orders streams and releases what it keeps; a gloo
    work's wait would block until the group's timeout."""
    assert releases_on_abort("nccl") and not releases_on_abort("gloo")
    waited: list[bool] = []
    failed = SimpleNamespace(wait=lambda: (waited.append(True), _raise_aborted())[0])
    release(failed)  # an aborted collective's error is what its wait gives: taken
    assert waited == [True]


def _raise_aborted() -> None:
    raise RuntimeError("NCCL communicator was aborted on rank 1")


def test_an_abort_lets_go_of_the_pending_broadcast_and_releases_it_where_the_backend_can(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The member's last reference to a bucket in flight goes at the abort,
    and on a backend that releases on abort (NCCL: here gloo stands in, its
    wait recorded instead of run) the work is waited for once, so that a
    retired group keeps no bucket (issue 62: a GPU bucket per failure)."""
    monkeypatch.setattr("protocol.weights_collective.RETIRED_GROUPS", kept := [])
    released: list[object] = []
    monkeypatch.setattr("protocol.weights_collective.releases_on_abort", lambda backend: True)
    monkeypatch.setattr("protocol.weights_collective.release", released.append)
    store = host_store(0, timeout_s=60)
    clients = [store, connect_store("127.0.0.1", store.port, 60)]
    try:
        with ThreadPoolExecutor(2) as pool:
            sender, member = pool.map(
                lambda rank: join_channel(clients[rank], 1, 2, rank, "gloo", 30.0), (0, 1))
        member._start(torch.empty(1 << 20))  # rank 0 never sends
        [(work, _, _)] = [member._pending]
        member.abort()
        assert released == [work] and member._pending is None
        kept.clear()
        del sender, member
    finally:
        clients[1].close()
        store.close()


class StalledAbort:
    """A group whose abort stalls, as ``ncclCommAbort`` may, up to the
    group's own timeout (ten times the deadline)."""

    def __init__(self) -> None:
        self.unstalled = threading.Event()

    def abort(self) -> None:
        self.unstalled.wait(60.0)


def test_an_abort_that_stalls_holds_its_caller_up_for_at_most_the_abort_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 aborts a failed lane between two optimiser steps: the abort
    goes on alone after ``ABORT_WAIT_S``, the group kept meanwhile."""
    monkeypatch.setattr("protocol.weights_collective.RETIRED_GROUPS", kept := [])
    stalled = StalledAbort()
    channel = WeightGroup.__new__(WeightGroup)
    channel._group, channel.backend, channel.timeout_s, channel._pending = (
        stalled, "gloo", 1.0, None)
    began = time.monotonic()
    channel.abort()
    assert time.monotonic() - began < ABORT_WAIT_S + 1.0
    assert [group for group, _ in kept] == [stalled] and retired_groups() == 1
    assert any(t.name == "weights-abort" for t in threading.enumerate())  # still stalled
    stalled.unstalled.set()


def test_retired_groups_are_counted_until_released(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("protocol.weights_collective.RETIRED_GROUPS", kept := [])
    retire(object(), "gloo", -GLOO_RELEASE_GRACE_S)  # its pending operation already timed out
    assert len(kept) == 1 and retired_groups() == 0 and not kept


def test_a_closed_store_client_fails_each_call_as_a_store_that_does_not_answer() -> None:
    """A retired NCCL group keeps its member's store client, closed when the
    member leaves the generation: anything that still calls it gets the
    error a store raises, not a socket's."""
    store = host_store(0, timeout_s=5)
    client = connect_store("127.0.0.1", store.port, 5)
    try:
        view = client.prefixed("weights/1")
        view.set("join/1", "1")
        client.close()
        with pytest.raises(dist.DistStoreError, match="closed"):
            view.set("join/1", "1")
        with pytest.raises(dist.DistStoreError, match="closed"):
            client.check(["join/1"])
    finally:
        store.close()


def test_an_engine_s_worker_closes_the_store_of_each_generation_it_leaves() -> None:
    """A failed NCCL generation's group keeps the store it was built on for
    the process's life; the connection under it goes when the worker joins
    the next generation (or shuts down), not with the group."""
    store = host_store(0, timeout_s=10)
    worker = GenerationMember()
    worker.parallel_config = SimpleNamespace(rank=0)
    joined: list[StoreClient] = []
    try:
        for generation in (1, 2):
            info = GroupInitInfo(master_addr="127.0.0.1", master_port=store.port, world_size=2,
                                 rank=1, generation=generation, timeout_s=10.0)
            with ThreadPoolExecutor(1) as pool:
                sender = pool.submit(join_channel, store, generation, 2, 0, "gloo", 10.0)
                worker.init_transfer_engine(info)
                sender.result()
            joined.append(worker.store)
        assert [client._socket.closed for client in joined] == [True, False]
        worker.leave()
        assert joined[1]._socket.closed and worker.group is None
    finally:
        store.close()
