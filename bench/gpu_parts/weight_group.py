"""Part 3 of the GPU check: the project's weight group
(protocol/weights_collective.py) between member processes, each loading as
actors/weight_transfer.py does. Each process starts as the one it stands
for: rank 0 as a learner rank (``start_environments(deadline).learner``),
the others as engines' workers (``start_environments(deadline).engine``,
and then, on CUDA, without what vLLM's GPU worker removes from its
environment in ``Worker.init_device``, ``VLLM_GPU_WORKER_REMOVES``, before
it builds any group). Four trials:

- ``receiver_killed``: a sender and two receivers; in the second
  publication one receiver SIGKILLs itself after its first tensor. The
  sender (as learner/publisher.py) abandons the failed generation and
  publishes again to the survivor alone in a new one. Every member first
  builds a training-like group of its own (one rank, one all-reduce, never
  aborted): the process's first group, whose monitor acts on any group's
  dump signal, as the learner's training group and vLLM's world group do.
  ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` is lowered to ``HEARTBEAT_TIMEOUT_S``
  and every live member is asked whether it lives ``window_s`` after the
  death, past it. Run with the fix and as before issue 62's
  (``before_fix``: the weight group's error handling alone, torch's dump on
  timeout kept).
- ``failed_publications``: ``rounds`` publications of the whole 0.5B
  manifest in buckets of ``memory_bucket_bytes`` that fail on both sides
  with a broadcast in flight (the receiver, drawing ahead as an engine
  does, stops after its first tensor, so the sender's next broadcast times
  out; then it asks for the rest, which the abandoned generation never
  sends), between a warm-up and a
  final publication, in processes that never collect garbage
  (``gc.disable()`` at their start): what a failure keeps in a reference
  cycle, they keep for good. Per process, before and after the failures:
  the buffers its weight groups broadcast or received that are still
  alive, held by anything (weak references to their storage), and on a GPU
  its allocated memory; after them at most one bucket more.
- ``killed_after_join``: a receiver joins its first generation and dies
  before the first broadcast; the sender's first broadcast must fail within
  the deadline (its communicator, created right after the join, never
  becomes ready).
- ``unequal_deadlines``: a run whose ``weight_timeout_s`` is above the 30 s
  every engine started with before ``start_environments``; rank 0 serves
  ``UNEQUAL_LANES`` lanes and reaches this member's lane ``late_s`` after
  the join (as after an earlier lane's member stalled for rank 0's whole
  deadline), within the member's announced deadline. On NCCL the member's
  first broadcast waits that long for the communicator and its connections,
  under the init timeout its process started with: the publication must
  arrive intact. Three variants at once, each a generation of its own:
  ``fixed``; ``init_timeout_before`` (the engine with the 30 s init timeout
  it had, all else as now: expected to fail after 30 s); and
  ``environment_before`` (both error-handling names set and the check that
  required both, as before commit f0952a3: the GPU worker removes one, so
  the member is refused at its join).

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
detected", part 5), so each member gets a host id of its own
(``NCCL_HOSTID``) and the bytes go through NCCL's socket transport over
loopback, as between hosts. On the CPU (the dry run) gloo stands in: no
heartbeat monitor (``before_fix`` is skipped), no NCCL init timeout or
environment check (``unequal_deadlines``' variants before the fixes
deliver as well), no GPU worker removing a name, and no GPU memory (the
live buffers are counted all the same).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from gpu_parts.common import (
    MODELS,
    RECEIVE_AHEAD,
    STARTUP_S,
    TRANSFER_MODEL,
    answer,
    checksums,
    collect,
    kill_tree,
    manifest,
    member_process,
    numel,
    publication,
    receive_and_load,
    synchronize,
    tail,
    weight_manifest,
)

#: The killed receiver dies after its first tensor of the second
#: publication (the first forms the group, NCCL's communicator included, so
#: that the death is not mistaken for a slow start).
KILLED_IN_PUBLICATION = 2
MAX_PUBLICATIONS = 4
#: The first group's monitor ends a process this long after any group's
#: dump signal (torch's default: 480 s), lowered so that the trial sees it.
HEARTBEAT_TIMEOUT_S = 30
#: The init timeout (``TORCH_NCCL_NONBLOCKING_TIMEOUT``) every engine
#: started with before ``start_environments``, whatever the run's deadline:
#: ``weight_member_environment``'s default then (``GROUP_TIMEOUT_S``).
ENGINE_INIT_TIMEOUT_BEFORE_S = 30.0
#: The lanes of ``unequal_deadlines``' publication: an earlier one, whose
#: member stalled, and the member's own. Its announced deadline is
#: ``member_timeout_s(weight_timeout_s, UNEQUAL_LANES)``.
UNEQUAL_LANES = 2


@dataclass(frozen=True)
class WeightGroupPlan:
    divisor: int  # the 0.5B manifest's hidden, intermediate and vocabulary sizes divided by this
    bucket_bytes: int  # learner.weight_bucket_bytes
    deadline_s: float  # learner.weight_timeout_s
    window_s: float  # after a death, when the live members are asked whether they live
    rounds: int  # failed publications of ``failed_publications``
    memory_divisor: int  # ``failed_publications``' manifest: the 0.5B one's sizes divided by this
    memory_bucket_bytes: int  # and its buckets
    unequal_deadline_s: float  # learner.weight_timeout_s of ``unequal_deadlines``
    late_s: float  # how long after its join rank 0 starts to broadcast to that lane


#: 62 MB publications in 4 MiB buckets: enough buckets for a death in the
#: middle, few bytes for many publications. The failed publications: the
#: whole 0.5B manifest (988 MB) in 256 MiB buckets, each failure leaving
#: one in flight on both sides. The unequal deadlines: 36 s, rank 0 late by
#: as much (it waited its whole deadline on the stalled lane), 6 s past the
#: engines' init timeout before, 36 s within the member's deadline (72 s).
#: The dry run: sizes divided by 32, 64 KiB and 256 KiB buckets, no monitor
#: to wait for, two failed publications (a bucket kept per failure shows as
#: two), a 2 s run deadline and rank 0 as late.
GPU_PLAN = WeightGroupPlan(divisor=4, bucket_bytes=4 << 20, deadline_s=10.0,
                           window_s=HEARTBEAT_TIMEOUT_S + 15.0, rounds=5, memory_divisor=1,
                           memory_bucket_bytes=256 << 20, unequal_deadline_s=36.0, late_s=36.0)
DRY_RUN_PLAN = WeightGroupPlan(divisor=32, bucket_bytes=64 << 10, deadline_s=3.0, window_s=1.0,
                               rounds=2, memory_divisor=32, memory_bucket_bytes=256 << 10,
                               unequal_deadline_s=2.0, late_s=2.0)

#: The environment check a member's weight group applies (a name, so that a
#: start travels to the member's process): ``project``, protocol's own
#: (``nccl_environment_problem``); ``both_names``, the one before commit
#: f0952a3 (``problem_before_f0952a3``); ``none``, no check (a group forms
#: whatever the environment, as before issue 62's fix, whose failure is the
#: point).
Check = Literal["project", "both_names", "none"]


@dataclass(frozen=True)
class MemberStart:
    """How a member process starts, as the process it stands for does."""

    environment: dict[str, str]
    """Set over the parent's first thing, as a learner rank's or an engine's
    process starts with it."""
    engine: bool
    """An engine's worker: on CUDA, ``VLLM_GPU_WORKER_REMOVES`` is then
    removed, as vLLM's GPU worker does before it builds any group."""
    check: Check = "project"
    collector: bool = True
    """False: ``gc.disable()`` at the start, and nothing collects after."""


def problem_before_f0952a3(environ: Mapping[str, str]) -> str | None:
    """The weight group's environment check before commit f0952a3: every
    name of each setting set to its value (both error-handling names),
    whatever torch reads. It refuses an engine whose GPU worker removed the
    legacy name, though torch reads clean-up-only there all the same."""
    from protocol.weights_collective import NCCL_MEMBER_REQUIRED

    wrong = {name: environ.get(name) for names, value in NCCL_MEMBER_REQUIRED.items()
             for name in names if environ.get(name) != value}
    return f"this process started with {wrong} (as before f0952a3)" if wrong else None


def accepts_any(environ: Mapping[str, str]) -> str | None:
    """No check at all."""
    return None


CHECKS: dict[str, Callable[[Mapping[str, str]], str | None]] = {
    "both_names": problem_before_f0952a3, "none": accepts_any}


def starts(variant: str, deadline_s: float) -> tuple[MemberStart, MemberStart]:
    """How rank 0 (a learner rank) and the members (engines' workers) start
    in a run whose ``learner.weight_timeout_s`` is ``deadline_s``, each with
    the first group's heartbeat timeout lowered:

    - ``fixed``: as the project starts them (``start_environments``);
    - ``before_fix``: as before issue 62's fix, the weight group's
      clean-up-only error handling alone (under both names, so that torch
      reads it on an engine too), torch's dump on timeout kept, no check;
    - ``init_timeout_before``: the engines' init timeout as before
      ``start_environments`` (``ENGINE_INIT_TIMEOUT_BEFORE_S``, whatever the
      run's deadline), all else as now;
    - ``environment_before``: as before commit f0952a3, both error-handling
      names set (the engines' init timeout as before, too) and the check
      that required both (``problem_before_f0952a3``)."""
    from protocol.weights_collective import (
        NCCL_CLEAN_UP_ONLY,
        NCCL_ERROR_HANDLING_VARIABLES,
        start_environments,
        weight_member_environment,
    )

    both_names = dict.fromkeys(NCCL_ERROR_HANDLING_VARIABLES, NCCL_CLEAN_UP_ONLY)
    now = start_environments(deadline_s)
    engine_before = weight_member_environment(ENGINE_INIT_TIMEOUT_BEFORE_S)
    learner, engine, check = {
        "fixed": (now.learner, now.engine, "project"),
        "before_fix": (both_names, both_names, "none"),
        "init_timeout_before": (now.learner, engine_before, "project"),
        "environment_before": ({**now.learner, **both_names}, {**engine_before, **both_names},
                               "both_names"),
    }[variant]
    heartbeat = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(HEARTBEAT_TIMEOUT_S)}
    return (MemberStart({**learner, **heartbeat}, engine=False, check=check),
            MemberStart({**engine, **heartbeat}, engine=True, check=check))


def role_starts(ranks: dict[str, int], variant: str, deadline_s: float,
                **changes: Any) -> dict[str, MemberStart]:
    """Each role's start: rank 0 as a learner rank, the others as engines'
    workers (``changes`` to both)."""
    learner, engine = starts(variant, deadline_s)
    return {role: replace(learner if rank == 0 else engine, **changes)
            for role, rank in ranks.items()}


def first_group(backend: str, device: str) -> Any:
    """A training-like group of this process's own, its first (PG0), never
    aborted: one rank, one all-reduce."""
    store = dist.HashStore()
    group = (dist.ProcessGroupNCCL(store, 0, 1, dist.ProcessGroupNCCL.Options())
             if backend == "nccl" else dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=60)))
    group.allreduce([torch.ones(1, device=device)]).wait()
    synchronize(device)
    return group


def allocated(device: str) -> int | None:
    """Bytes of GPU memory torch has allocated (None on the CPU)."""
    return torch.cuda.memory_allocated() if device == "cuda" else None


def watch_broadcast_buffers() -> Callable[[], dict[str, int]]:
    """From now on, a weak reference to the storage of every tensor a weight
    group of this process broadcasts: rank 0's buckets (and tensors
    travelling alone), a member's receive buffers; each passes through
    ``WeightGroup._start`` on either side. Returns how many of them, and how
    many bytes, are still alive, whatever holds them (a frame, a traceback,
    an aborted group's pending work): on the CPU as on a GPU, what a failed
    publication kept."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from protocol.weights_collective import WeightGroup

    watched: list[tuple[StorageWeakRef, int]] = []
    start = WeightGroup._start

    def watched_start(group: WeightGroup, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        watched.append((StorageWeakRef(storage), storage.nbytes()))
        start(group, tensor)

    def alive() -> dict[str, int]:
        watched[:] = [(ref, nbytes) for ref, nbytes in watched if not ref.expired()]
        return {"count": len(watched), "bytes": sum(nbytes for _, nbytes in watched)}

    WeightGroup._start = watched_start
    return alive


def collector_runs() -> int:
    """How many times this process's garbage collector has run, any generation."""
    return sum(generation["collections"] for generation in gc.get_stats())


def send_publication(channel: Any, order: dict[str, Any], device: str) -> dict[str, Any]:
    """Rank 0: publication ``order["number"]``, its first broadcast
    ``order["late_s"]`` late if given (another lane held rank 0); its
    checksums, and when it failed if it did (the channel is aborted then)."""
    specs = order["specs"]
    tensors = publication(specs, order["number"], device)
    synchronize(device)
    sent = checksums(tensors)
    time.sleep(order.get("late_s", 0.0))
    started = time.monotonic()
    try:
        channel.send(weight_manifest(specs, order["bucket_bytes"]), tensors)
    except RuntimeError as error:  # TransferFailed
        return {"error": f"{type(error).__name__}: {error}", "failed_at": time.monotonic(),
                "started_at": started, "checksums": sent, "memory": allocated(device)}
    return {"error": None, "push_s": time.monotonic() - started, "started_at": started,
            "checksums": sent, "memory": allocated(device)}


def stall_then_resume(channel: Any, order: dict[str, Any], device: str,
                      conn: Connection) -> dict[str, Any]:
    """A receiver that, as an engine receives (``order["ahead"]`` tensors
    drawn ahead by a thread), takes the first tensor, stops (the sender's
    next broadcast times out), and once told to resume asks for the rest,
    which the abandoned generation never sends."""
    received = channel.receive(weight_manifest(order["specs"], order["bucket_bytes"]),
                               order["ahead"])
    next(received)
    conn.send({"stalled": True})
    conn.recv()
    try:
        for _ in received:
            pass
    except RuntimeError as error:  # TransferFailed: the generation was abandoned
        return {"error": f"{type(error).__name__}: {error}", "memory": allocated(device)}
    return {"error": "an abandoned publication arrived whole", "memory": allocated(device)}


def group_member(conn: Connection, role: str, port: int, backend: str, device: str,
                 deadline_s: float, start: MemberStart) -> None:
    """One member of a weight group in a process of its own (``role``: its
    name, to NCCL a host of its own), started as ``start`` says; it answers
    first with the settings torch will read and what the weight group's
    environment check says of them, both as they are once the process has
    started. Each order names a generation, the member's rank in it and its
    deadline (``deadline_s``: the store's); rank 0 publishes what the order
    says and abandons a generation that failed, the others receive and
    load; it may also kill the process after its join (``die_after_join``)
    or in the middle (``die_after``), or stall it (``stall``). An order may
    instead ask whether the process lives (``ping``: with the buffers of its
    weight groups still alive, its allocated GPU memory and its garbage
    collections). None ends it."""
    if not start.collector:
        gc.disable()  # first thing: whatever a failure leaves in a reference cycle stays
    os.environ.update(start.environment)  # this process's start: nothing of torch's has read it
    from protocol import weights_collective

    if start.engine and device == "cuda":
        # what vLLM's GPU worker does in Worker.init_device, once the
        # engine's process has started and before it builds any group
        for name in weights_collective.VLLM_GPU_WORKER_REMOVES:
            os.environ.pop(name, None)
    if backend == "nccl":
        # each process a host to NCCL: the bytes go through its socket
        # transport over loopback, as between the learner's host and an actor's
        os.environ.update(NCCL_HOSTID=f"gpu-check-{role}", NCCL_SOCKET_IFNAME="lo",
                          NCCL_IB_DISABLE="1")
        os.environ.setdefault("NCCL_DEBUG", "WARN")  # its reasons, in the stderr tails
        torch.cuda.set_device(0)
    from protocol.weights import connect_store

    if start.check != "project":
        weights_collective.nccl_environment_problem = CHECKS[start.check]
    live_buffers = watch_broadcast_buffers()
    training = first_group(backend, device)
    store = connect_store("127.0.0.1", port, deadline_s)
    read = (*weights_collective.NCCL_ERROR_HANDLING_VARIABLES,
            weights_collective.NCCL_DUMP_ON_TIMEOUT, weights_collective.NCCL_INIT_TIMEOUT)
    conn.send({"error": None, "environment": {name: os.environ.get(name) for name in read},
               "nccl_check": weights_collective.nccl_environment_problem(os.environ)})
    serve_orders(conn, store, backend, device, live_buffers)
    del training
    os._exit(0)  # no teardown: it can hang on a group whose peer died


def serve_orders(conn: Connection, store: Any, backend: str, device: str,
                 live_buffers: Callable[[], dict[str, int]]) -> None:
    """A member's orders (:func:`group_member`), until the one that is None."""
    from protocol.weights import abandon_generation
    from protocol.weights_backends import join_channel

    channel, joined_at = None, None
    while (order := conn.recv()) is not None:
        if order.get("ping"):
            conn.send({"error": None, "alive_at": time.monotonic(),
                       "memory": allocated(device), "buffers": live_buffers(),
                       "collections": collector_runs()})
            continue
        try:
            if channel is None or channel.generation != order["generation"]:
                channel = joined_at = None  # leave the previous generation first
                channel = join_channel(store, order["generation"], order["world_size"],
                                       order["rank"], backend, order["deadline_s"])
                joined_at = time.monotonic()
                if order.get("die_after_join"):
                    conn.send({"dying_at": time.monotonic()})
                    os.kill(os.getpid(), signal.SIGKILL)
            if order["rank"] == 0:
                report = send_publication(channel, order, device)
            elif order.get("stall"):
                report = stall_then_resume(channel, order, device, conn)
            else:
                report = receive_and_load(channel, order, device, conn)
        except RuntimeError as error:  # a generation that did not form
            report = {"error": f"{type(error).__name__}: {error}", "failed_at": time.monotonic()}
        if report["error"] and order["rank"] == 0:
            abandon_generation(store, order["generation"])
        conn.send({**report, "joined_at": joined_at, "ended_at": time.monotonic()})


Members = dict[str, tuple[BaseProcess, Connection]]


@contextlib.contextmanager
def members_of(context: Any, started_as: dict[str, MemberStart], backend: str, device: str,
               deadline_s: float
               ) -> Iterator[tuple[Members, dict[str, Path], dict[str, dict[str, Any]]]]:
    """A member process for each role of ``started_as``, started as it says,
    with the rendezvous store in this process (``deadline_s``: its timeout
    and its clients'); their stderr files and their first answers (the
    settings they started with). All killed after."""
    from protocol.weights import host_store

    store = host_store(0, timeout_s=deadline_s)
    members: Members = {}
    with tempfile.TemporaryDirectory() as folder:
        logs = {role: Path(folder) / f"{role}.log" for role in started_as}
        try:
            for role, log in logs.items():
                members[role] = member_process(context, log, group_member, role, store.port,
                                               backend, device, deadline_s, started_as[role])
            yield members, logs, collect(members, list(started_as), STARTUP_S)
        finally:
            for _, conn in members.values():
                with contextlib.suppress(OSError):  # a member that died closed its end
                    conn.send(None)
            for process, _ in members.values():
                kill_tree(process)
            store.close()


def not_started(started: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Why each member that did not start did not."""
    return {role: report["error"] for role, report in started.items() if report["error"]}


def order(members: Members, role: str, **fields: Any) -> None:
    with contextlib.suppress(OSError):  # a member torn down: collect reports its exit
        members[role][1].send(fields)


def publication_order(number: int, generation: int, ranks: dict[str, int], role: str,
                      plan: WeightGroupPlan, **extra: Any) -> dict[str, Any]:
    return {"number": number, "generation": generation, "world_size": len(ranks),
            "rank": ranks[role], "deadline_s": plan.deadline_s,
            "specs": manifest(MODELS[TRANSFER_MODEL], plan.divisor),
            "bucket_bytes": plan.bucket_bytes, "ahead": RECEIVE_AHEAD, "side_stream": True,
            **extra}


def publish_through_a_death(members: Members, plan: WeightGroupPlan) -> list[dict[str, Any]]:
    """Publications until the sender has published again after a failure,
    to the survivor alone in a new generation, or is gone: the doomed member
    dies in publication ``KILLED_IN_PUBLICATION``. Each publication: its
    number, generation, size and every member's report."""
    ranks = {"sender": 0, "survivor": 1, "doomed": 2}
    alive, generation, history = set(ranks), 1, []
    for number in range(1, MAX_PUBLICATIONS + 1):
        roles = [role for role in ranks if role in alive]
        for role in roles:
            doomed = role == "doomed" and number == KILLED_IN_PUBLICATION
            order(members, role, **publication_order(number, generation, ranks, role, plan,
                                                     die_after=1 if doomed else None))
        # a join and a broadcast each fail within the deadline
        reports = collect(members, roles, 2 * plan.deadline_s + 10)
        history.append({"number": number, "generation": generation,
                        "world_size": len(ranks), "reports": reports})
        alive -= {role for role, report in reports.items()
                  if "dying_at" in report or "exitcode" in report}
        sender_failed = reports["sender"]["error"] is not None
        if "sender" not in alive or generation > 1 and not sender_failed:
            break  # the sender is gone, or it reached the survivor again
        if sender_failed:
            if number < KILLED_IN_PUBLICATION:
                break  # it failed before any death: the report says so
            generation += 1  # as the learner forms the next one without the dead member
            ranks = {"sender": 0, "survivor": 1}
    return history


def killed_receiver_summary(history: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``publish_through_a_death`` saw: whether the sender survived, how
    long after the death it failed, whether the publication before the death
    and the one after reached their receivers intact."""
    by_role = {role: [(h["number"], h["reports"][role]) for h in history
                      if role in h["reports"]] for role in ("sender", "survivor", "doomed")}
    died_at = next((r["dying_at"] for _, r in by_role["doomed"] if "dying_at" in r), None)
    failure = next(((n, r) for n, r in by_role["sender"] if r["error"]), None)
    ended_at = failure and (failure[1].get("failed_at") or failure[1].get("exited_at"))
    first, last = history[0]["reports"], history[-1]
    republished = last["generation"] > 1 and last["reports"]["sender"]["error"] is None
    intact = [first[role].get("checksums") == first["sender"].get("checksums")
              for role in ("survivor", "doomed")]
    return {
        "sender_survived": all("exitcode" not in r for _, r in by_role["sender"]),
        "sender_exitcode": next((r["exitcode"] for _, r in by_role["sender"]
                                 if "exitcode" in r), None),
        "receiver_died": died_at is not None, "killed_in_publication": KILLED_IN_PUBLICATION,
        "died_at": died_at,
        "failed_in_publication": failure and failure[0],
        "failure": failure and failure[1]["error"],
        "failed_within_s": ended_at - died_at if ended_at and died_at else None,
        "survivor_failure": next((r["error"] for _, r in by_role["survivor"] if r["error"]),
                                 None),
        "first_publication_checksums_match": first["sender"]["error"] is None and all(intact),
        "republished": republished,
        "republish_generation": last["generation"] if republished else None,
        "republish_checksums_match": republished and last["reports"].get(
            "survivor", {}).get("checksums") == last["reports"]["sender"]["checksums"],
        "publications": [{"number": h["number"], "generation": h["generation"],
                          "world_size": h["world_size"],
                          **{role: "died" if "dying_at" in r else r["error"] or "ok"
                             for role, r in h["reports"].items()}} for h in history]}


def ping(members: Members, roles: list[str]) -> dict[str, dict[str, Any]]:
    """Each of ``roles``' answer to whether it lives, with the buffers of its
    weight groups still alive, its allocated GPU memory and how many garbage
    collections it has run."""
    for role in roles:
        order(members, role, ping=True)
    return {role: answer(members[role][1], members[role][0], 30) for role in roles}


def alive_after(members: Members, roles: list[str], since: float | None,
                window_s: float) -> dict[str, bool]:
    """Whether each of ``roles`` answers once ``window_s`` has passed since
    ``since`` (the death): the first group's monitor would have ended it by then."""
    if since is not None:
        time.sleep(max(0.0, since + window_s - time.monotonic()))
    return {role: "alive_at" in report for role, report in ping(members, roles).items()}


def receiver_killed(context: Any, backend: str, device: str, plan: WeightGroupPlan,
                    variant: str) -> dict[str, Any]:
    """The first trial, with the fix (``fixed``) or as before issue 62's
    (``before_fix``)."""
    ranks = {"sender": 0, "survivor": 1, "doomed": 2}
    with members_of(context, role_starts(ranks, variant, plan.deadline_s), backend, device,
                    plan.deadline_s) as (members, logs, started):
        if failed := not_started(started):
            summary: dict[str, Any] = {"error": f"members did not start: {failed}"}
        else:
            summary = {"error": None, **killed_receiver_summary(
                publish_through_a_death(members, plan))}
            summary["alive_after_window"] = alive_after(
                members, ["sender", "survivor"], summary["died_at"], plan.window_s)
        tails = {role: tail(log) for role, log in logs.items()}
    return {**summary, "window_s": plan.window_s, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "stderr_tails": tails}


def retained(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int | None]:
    """What a process holds after that it did not before (two pings'
    answers): broadcast buffers still alive, their bytes, and GPU memory."""
    return {"buffers": after["buffers"]["count"] - before["buffers"]["count"],
            "buffer_bytes": after["buffers"]["bytes"] - before["buffers"]["bytes"],
            "allocated_bytes": None if before["memory"] is None
            else after["memory"] - before["memory"]}


def failed_publications(context: Any, backend: str, device: str,
                        plan: WeightGroupPlan) -> dict[str, Any]:
    """The second trial: what ``plan.rounds`` failed publications keep, in
    processes that never collect garbage."""
    ranks = {"sender": 0, "receiver": 1}
    roles = list(ranks)
    specs = manifest(MODELS[TRANSFER_MODEL], plan.memory_divisor)
    with members_of(context, role_starts(ranks, "fixed", plan.deadline_s, collector=False),
                    backend, device, plan.deadline_s) as (members, logs, started):
        if failed := not_started(started):
            return {"error": f"members did not start: {failed}"}

        def publish(number: int, generation: int, stall: bool) -> dict[str, dict[str, Any]]:
            for role in roles:
                order(members, role, **publication_order(
                    number, generation, ranks, role, plan, specs=specs,
                    bucket_bytes=plan.memory_bucket_bytes, stall=stall))
            if stall:  # the sender times out on the receiver, then the receiver resumes
                stalled = answer(members["receiver"][1], members["receiver"][0],
                                 plan.deadline_s + 10)
                sender = answer(members["sender"][1], members["sender"][0],
                                plan.deadline_s + 10)
                order(members, "receiver", resume=True)
                receiver = answer(members["receiver"][1], members["receiver"][0],
                                  plan.deadline_s + 10)
                return {"sender": sender, "receiver": receiver, "stalled": stalled}
            return collect(members, roles, 2 * plan.deadline_s + 10)

        warm = publish(1, 1, stall=False)
        before = ping(members, roles)
        rounds = [publish(2 + i, 2 + i, stall=True) for i in range(plan.rounds)]
        final = publish(2 + plan.rounds, 2 + plan.rounds, stall=False)
        after = ping(members, roles)
        tails = {role: tail(log) for role, log in logs.items()}
    failed_both = all(r["sender"]["error"] and r["receiver"]["error"] for r in rounds)
    kept = {role: retained(before[role], after[role]) for role in roles}
    bucket = plan.memory_bucket_bytes
    return {"error": None, "rounds": plan.rounds, "every_round_failed_on_both": failed_both,
            "first_failures": {role: rounds[0][role]["error"] for role in roles},
            "warm_and_final_intact": all(
                r[role]["error"] is None for r in (warm, final) for role in roles),
            "final_checksums_match": final["receiver"].get("checksums") ==
            final["sender"].get("checksums"),
            "publication_bytes": 2 * sum(numel(shape) for _, shape in specs),
            "bucket_bytes": bucket, "retained": kept,
            "within_one_bucket": all(
                r["buffers"] <= 1 and r["buffer_bytes"] <= bucket
                and (r["allocated_bytes"] is None or r["allocated_bytes"] <= bucket)
                for r in kept.values()),
            "collections": {role: after[role]["collections"] - before[role]["collections"]
                            for role in roles},
            "stderr_tails": tails}


def killed_after_join(context: Any, backend: str, device: str,
                      plan: WeightGroupPlan) -> dict[str, Any]:
    """The third trial: a receiver dies between its join and the first
    broadcast; the sender's publication fails within its deadline."""
    ranks = {"sender": 0, "doomed": 1}
    roles = list(ranks)
    with members_of(context, role_starts(ranks, "fixed", plan.deadline_s), backend, device,
                    plan.deadline_s) as (members, logs, started):
        if failed := not_started(started):
            return {"error": f"members did not start: {failed}"}
        for role in roles:
            order(members, role, **publication_order(1, 1, ranks, role, plan,
                                                     die_after_join=role == "doomed"))
        reports = collect(members, roles, 2 * plan.deadline_s + 10)
        alive = alive_after(members, ["sender"], None, 0.0)
        tails = {role: tail(log) for role, log in logs.items()}
    died_at, sender = reports["doomed"].get("dying_at"), reports["sender"]
    ended_at = sender.get("failed_at") or sender.get("exited_at")
    return {"error": None, "receiver_died": died_at is not None,
            "sender_failure": sender["error"],
            "failed_within_s": ended_at - died_at if ended_at and died_at else None,
            "deadline_s": plan.deadline_s, "sender_alive": alive["sender"],
            "stderr_tails": tails}


#: ``unequal_deadlines``' variants (``starts``), run at once.
UNEQUAL_VARIANTS = ("fixed", "init_timeout_before", "environment_before")


def lane_outcome(variant: str, started: dict[str, dict[str, Any]],
                 reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What one variant's member started with (as it holds the settings once
    started, and what the weight group's check says of them) and how long
    it waited in the generation, from its join to its end; with rank 0's
    report, how late rank 0 started to broadcast and whether the
    publication arrived intact."""
    member, sender = reports[f"{variant}.member"], reports.get(f"{variant}.sender")
    ended_at = member.get("failed_at") or member.get("ended_at")
    outcome: dict[str, Any] = {
        "member_environment": started[f"{variant}.member"]["environment"],
        "nccl_check": started[f"{variant}.member"]["nccl_check"],
        "member": member["error"] or "ok",
        "member_waited_s": ended_at - member["joined_at"]
        if ended_at and member.get("joined_at") else None}
    if sender is not None:
        outcome.update(
            sender=sender["error"] or "ok",
            rank0_late_s=sender["started_at"] - sender["joined_at"]
            if sender.get("started_at") and sender.get("joined_at") else None,
            publication_intact=sender["error"] is None and member["error"] is None
            and member.get("checksums") == sender.get("checksums"))
    return outcome


def unequal_deadlines(context: Any, backend: str, device: str,
                      plan: WeightGroupPlan) -> dict[str, Any]:
    """The fourth trial: in a run whose deadline is
    ``plan.unequal_deadline_s``, rank 0 starts to broadcast to the member's
    lane ``plan.late_s`` after the join, the member announced
    ``member_timeout_s(deadline, UNEQUAL_LANES)``; every variant at once, in
    a generation of its own. Rank 0's outcome is waited for with the fix
    only: before it, the member's failure fails the publication (rank 0
    would learn it at its own deadline, after ``late_s``)."""
    from protocol.weights_collective import member_timeout_s

    member_deadline_s = member_timeout_s(plan.unequal_deadline_s, UNEQUAL_LANES)
    ranks = {"sender": 0, "member": 1}
    started_as = {f"{variant}.{role}": start for variant in UNEQUAL_VARIANTS
                  for role, start in role_starts(ranks, variant,
                                                 plan.unequal_deadline_s).items()}
    with members_of(context, started_as, backend, device, member_deadline_s
                    ) as (members, logs, started):
        if failed := not_started(started):
            return {"error": f"members did not start: {failed}"}
        for generation, variant in enumerate(UNEQUAL_VARIANTS, 1):
            order(members, f"{variant}.sender", **publication_order(
                1, generation, ranks, "sender", plan, deadline_s=plan.unequal_deadline_s,
                late_s=plan.late_s))
            order(members, f"{variant}.member", **publication_order(
                1, generation, ranks, "member", plan, deadline_s=member_deadline_s))
        reports = collect(members, ["fixed.sender",
                                    *(f"{variant}.member" for variant in UNEQUAL_VARIANTS)],
                          member_deadline_s + 10)
        tails = {role: tail(log) for role, log in logs.items()}
    return {"error": None, "weight_timeout_s": plan.unequal_deadline_s,
            "lanes": UNEQUAL_LANES, "member_deadline_s": member_deadline_s,
            "late_s": plan.late_s, "init_timeout_before_s": ENGINE_INIT_TIMEOUT_BEFORE_S,
            **{variant: lane_outcome(variant, started, reports)
               for variant in UNEQUAL_VARIANTS},
            "stderr_tails": tails}


def weight_group_trials(context: Any, device: str, plan: WeightGroupPlan) -> dict[str, Any]:
    """The four trials, each on its own (one that fails keeps the others'
    figures) and timed."""
    backend = "nccl" if device == "cuda" else "gloo"

    def trial(run: Any, *args: Any) -> dict[str, Any]:
        started = time.monotonic()
        try:
            report = run(context, backend, device, plan, *args)
        except Exception as error:  # one lent run: keep the other trials' figures
            report = {"error": f"{type(error).__name__}: {error}"}
        return {**report, "seconds": time.monotonic() - started}

    return {"backend": backend, "deadline_s": plan.deadline_s,
            "receiver_killed": trial(receiver_killed, "fixed"),
            "before_fix": (trial(receiver_killed, "before_fix") if backend == "nccl" else
                           {"skipped": "gloo: no heartbeat monitor to end a process"}),
            "failed_publications": trial(failed_publications),
            "killed_after_join": trial(killed_after_join),
            "unequal_deadlines": trial(unequal_deadlines)}


def trials_hold(report: dict[str, Any]) -> bool:
    """Whether the fix held in every trial: the sender survived the death
    and reached the survivor again, intact, and both lived past the
    monitor's window; failed publications kept at most a bucket, without a
    garbage collection; a death after the join failed the sender within its
    deadline and it lived; a late rank 0 reached its member intact."""
    killed, failed = report["receiver_killed"], report["failed_publications"]
    joined, unequal = report["killed_after_join"], report["unequal_deadlines"]
    if any(trial.get("error") for trial in (killed, failed, joined, unequal)):
        return False
    return bool(killed["sender_survived"] and killed["republish_checksums_match"]
                and killed["first_publication_checksums_match"]
                and all(killed["alive_after_window"].values())
                and failed["every_round_failed_on_both"] and failed["within_one_bucket"]
                and failed["final_checksums_match"] and not any(failed["collections"].values())
                and joined["sender_alive"] and joined["failed_within_s"] is not None
                and joined["failed_within_s"] <= joined["deadline_s"] + 5
                and unequal["fixed"]["publication_intact"])
