"""Part 3 of the GPU check: the project's weight group
(protocol/weights_collective.py) between member processes, each loading as
actors/weight_transfer.py does, in three trials:

- ``receiver_killed``: a sender and two receivers; in the second
  publication one receiver SIGKILLs itself after its first tensor. The
  sender (as learner/publisher.py) abandons the failed generation and
  publishes again to the survivor alone in a new one. Every member first
  builds a training-like group of its own (one rank, one all-reduce, never
  aborted): the process's first group, whose monitor acts on any group's
  dump signal, as the learner's training group and vLLM's world group do.
  ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` is lowered to ``HEARTBEAT_TIMEOUT_S``
  and every live member is asked whether it lives ``window_s`` after the
  death, past it. Run with the fix (every member started with
  ``weight_member_environment``) and as before it (``before_fix``: the
  weight group's error handling alone, torch's dump on timeout kept).
- ``failed_publications``: ``rounds`` publications that fail on both sides
  with a broadcast in flight (the receiver stops after its first tensor, so
  the sender's next broadcast times out; then it asks for its next one,
  which the abandoned generation never sends), between a warm-up and a
  final publication; each process's allocated GPU memory before and after,
  which must differ by at most one bucket.
- ``killed_after_join``: a receiver joins its first generation and dies
  before the first broadcast; the sender's first broadcast must fail within
  the deadline (its communicator, created right after the join, never
  becomes ready).

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
detected", part 5), so each member gets a host id of its own
(``NCCL_HOSTID``) and the bytes go through NCCL's socket transport over
loopback, as between hosts. On the CPU (the dry run) gloo stands in and
there is no heartbeat monitor, so ``before_fix`` is skipped and no memory
is measured.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class WeightGroupPlan:
    divisor: int  # the 0.5B manifest's hidden, intermediate and vocabulary sizes divided by this
    bucket_bytes: int  # learner.weight_bucket_bytes
    deadline_s: float  # learner.weight_timeout_s
    window_s: float  # after a death, when the live members are asked whether they live
    rounds: int  # failed publications of ``failed_publications``


#: 62 MB publications in 4 MiB buckets: enough buckets for a death in the
#: middle, few bytes for many publications. The dry run: sizes divided by 32,
#: 64 KiB buckets, no monitor to wait for.
GPU_PLAN = WeightGroupPlan(4, 4 << 20, 10.0, HEARTBEAT_TIMEOUT_S + 15.0, 5)
DRY_RUN_PLAN = WeightGroupPlan(32, 64 << 10, 3.0, 1.0, 2)


def member_environment(fixed: bool, deadline_s: float) -> dict[str, str]:
    """What a member process starts with: with the fix, what every process
    that may join a weight group starts with; before it, the weight group's
    clean-up-only error handling alone (torch's dump on timeout kept). Both
    with the first group's heartbeat timeout lowered."""
    from protocol.weights_collective import (
        NCCL_CLEAN_UP_ONLY,
        NCCL_ERROR_HANDLING_VARIABLES,
        weight_member_environment,
    )

    started = (weight_member_environment(deadline_s) if fixed
               else dict.fromkeys(NCCL_ERROR_HANDLING_VARIABLES, NCCL_CLEAN_UP_ONLY))
    return {**started, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(HEARTBEAT_TIMEOUT_S)}


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


def send_publication(channel: Any, order: dict[str, Any], device: str) -> dict[str, Any]:
    """Rank 0: publication ``order["number"]``; its checksums, and when it
    failed if it did (the channel is aborted then)."""
    specs = order["specs"]
    tensors = publication(specs, order["number"], device)
    synchronize(device)
    sent = checksums(tensors)
    started = time.monotonic()
    try:
        channel.send(weight_manifest(specs, order["bucket_bytes"]), tensors)
    except RuntimeError as error:  # TransferFailed
        return {"error": f"{type(error).__name__}: {error}", "failed_at": time.monotonic(),
                "checksums": sent, "memory": allocated(device)}
    return {"error": None, "push_s": time.monotonic() - started, "checksums": sent,
            "memory": allocated(device)}


def stall_then_resume(channel: Any, order: dict[str, Any], device: str,
                      conn: Connection) -> dict[str, Any]:
    """A receiver that takes the first tensor, stops (the sender's next
    broadcast times out), and once told to resume asks for the next one,
    which the abandoned generation never sends."""
    received = channel.receive(weight_manifest(order["specs"], order["bucket_bytes"]), 0)
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
                 deadline_s: float, environment: dict[str, str], refused: bool) -> None:
    """One member of a weight group in a process of its own, started with
    ``environment``; with ``refused`` False, a group forms whatever the
    environment (as before the fix, whose refusal it is). ``sender`` is
    rank 0: it publishes what each order says and abandons a generation
    that failed; the others receive and load. An order may ask whether the
    process lives (``ping``), kill it after its join (``die_after_join``) or
    in the middle (``die_after``), or stall it (``stall``). None ends it."""
    os.environ.update(environment)  # this process's start: nothing of torch's has read it
    if backend == "nccl":
        # each process a host to NCCL: the bytes go through its socket
        # transport over loopback, as between the learner's host and an actor's
        os.environ.update(NCCL_HOSTID=f"gpu-check-{role}", NCCL_SOCKET_IFNAME="lo",
                          NCCL_IB_DISABLE="1")
        os.environ.setdefault("NCCL_DEBUG", "WARN")  # its reasons, in the stderr tails
        torch.cuda.set_device(0)
    from protocol import weights_collective
    from protocol.weights import abandon_generation, connect_store
    from protocol.weights_backends import join_channel

    if not refused:
        weights_collective.nccl_environment_problem = lambda environ: None
    training = first_group(backend, device)
    store = connect_store("127.0.0.1", port, deadline_s)
    conn.send({"error": None})
    channel = None
    while (order := conn.recv()) is not None:
        if order.get("ping"):
            conn.send({"error": None, "alive_at": time.monotonic(),
                       "memory": allocated(device)})
            continue
        try:
            if channel is None or channel.generation != order["generation"]:
                channel = None  # leave the previous generation first
                channel = join_channel(store, order["generation"], order["world_size"],
                                       order["rank"], backend, deadline_s)
                if order.get("die_after_join"):
                    conn.send({"dying_at": time.monotonic()})
                    os.kill(os.getpid(), signal.SIGKILL)
            if role == "sender":
                report = send_publication(channel, order, device)
            elif order.get("stall"):
                report = stall_then_resume(channel, order, device, conn)
            else:
                report = receive_and_load(channel, order, device, conn)
        except RuntimeError as error:  # a generation that did not form
            report = {"error": f"{type(error).__name__}: {error}", "failed_at": time.monotonic()}
        if report["error"] and role == "sender":
            abandon_generation(store, order["generation"])
        conn.send(report)
    del training
    os._exit(0)  # no teardown: it can hang on a group whose peer died


Members = dict[str, tuple[BaseProcess, Connection]]


@contextlib.contextmanager
def members_of(context: Any, roles: list[str], backend: str, device: str, deadline_s: float,
               environment: dict[str, str], refused: bool = True
               ) -> Any:
    """The member processes of ``roles`` with the rendezvous store in this
    process, started and ready, and their stderr files; all killed after."""
    from protocol.weights import host_store

    store = host_store(0, timeout_s=deadline_s)
    members: Members = {}
    with tempfile.TemporaryDirectory() as folder:
        logs = {role: Path(folder) / f"{role}.log" for role in roles}
        try:
            for role, log in logs.items():
                members[role] = member_process(context, log, group_member, role, store.port,
                                               backend, device, deadline_s, environment,
                                               refused)
            started = collect(members, roles, STARTUP_S)
            failed = {role: r["error"] for role, r in started.items() if r["error"]}
            yield members, logs, failed
        finally:
            for _, conn in members.values():
                with contextlib.suppress(OSError):  # a member that died closed its end
                    conn.send(None)
            for process, _ in members.values():
                kill_tree(process)
            store.close()


def order(members: Members, role: str, **fields: Any) -> None:
    with contextlib.suppress(OSError):  # a member torn down: collect reports its exit
        members[role][1].send(fields)


def publication_order(number: int, generation: int, ranks: dict[str, int], role: str,
                      plan: WeightGroupPlan, **extra: Any) -> dict[str, Any]:
    return {"number": number, "generation": generation, "world_size": len(ranks),
            "rank": ranks[role], "specs": manifest(MODELS[TRANSFER_MODEL], plan.divisor),
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
    """Each of ``roles``' answer to whether it lives, with its allocated GPU memory."""
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
                    fixed: bool) -> dict[str, Any]:
    """The first trial, with the fix or as before it."""
    roles = ["sender", "survivor", "doomed"]
    with members_of(context, roles, backend, device, plan.deadline_s,
                    member_environment(fixed, plan.deadline_s), refused=fixed
                    ) as (members, logs, failed):
        if failed:
            summary: dict[str, Any] = {"error": f"members did not start: {failed}"}
        else:
            summary = {"error": None, **killed_receiver_summary(
                publish_through_a_death(members, plan))}
            summary["alive_after_window"] = alive_after(
                members, ["sender", "survivor"], summary["died_at"], plan.window_s)
        tails = {role: tail(log) for role, log in logs.items()}
    return {**summary, "window_s": plan.window_s, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "stderr_tails": tails}


def failed_publications(context: Any, backend: str, device: str,
                        plan: WeightGroupPlan) -> dict[str, Any]:
    """The second trial: memory after ``plan.rounds`` failed publications."""
    ranks = {"sender": 0, "receiver": 1}
    roles = list(ranks)
    with members_of(context, roles, backend, device, plan.deadline_s,
                    member_environment(True, plan.deadline_s)) as (members, logs, failed):
        if failed:
            return {"error": f"members did not start: {failed}"}

        def publish(number: int, generation: int, stall: bool) -> dict[str, dict[str, Any]]:
            for role in roles:
                order(members, role, **publication_order(number, generation, ranks, role, plan,
                                                         stall=stall))
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
    retained = {role: after[role]["memory"] - before[role]["memory"]
                if device == "cuda" else None for role in roles}
    return {"error": None, "rounds": plan.rounds, "every_round_failed_on_both": failed_both,
            "first_failures": {role: rounds[0][role]["error"] for role in roles},
            "warm_and_final_intact": all(
                r[role]["error"] is None for r in (warm, final) for role in roles),
            "final_checksums_match": final["receiver"].get("checksums") ==
            final["sender"].get("checksums"),
            "retained_bytes": retained, "bucket_bytes": plan.bucket_bytes,
            "within_one_bucket": device != "cuda" or all(
                bytes_ is not None and bytes_ <= plan.bucket_bytes
                for bytes_ in retained.values()),
            "stderr_tails": tails}


def killed_after_join(context: Any, backend: str, device: str,
                      plan: WeightGroupPlan) -> dict[str, Any]:
    """The third trial: a receiver dies between its join and the first
    broadcast; the sender's publication fails within its deadline."""
    ranks = {"sender": 0, "doomed": 1}
    roles = list(ranks)
    with members_of(context, roles, backend, device, plan.deadline_s,
                    member_environment(True, plan.deadline_s)) as (members, logs, failed):
        if failed:
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


def weight_group_trials(context: Any, device: str, plan: WeightGroupPlan) -> dict[str, Any]:
    """The three trials, each on its own (one that fails keeps the others' figures)."""
    backend = "nccl" if device == "cuda" else "gloo"

    def trial(run: Any, *args: Any) -> dict[str, Any]:
        try:
            return run(context, backend, device, plan, *args)
        except Exception as error:  # one lent run: keep the other trials' figures
            return {"error": f"{type(error).__name__}: {error}"}

    return {"backend": backend, "deadline_s": plan.deadline_s,
            "receiver_killed": trial(receiver_killed, True),
            "before_fix": (trial(receiver_killed, False) if backend == "nccl" else
                           {"skipped": "gloo: no heartbeat monitor to end a process"}),
            "failed_publications": trial(failed_publications),
            "killed_after_join": trial(killed_after_join)}


def trials_hold(report: dict[str, Any]) -> bool:
    """Whether the fix held in every trial: the sender survived the death
    and reached the survivor again, intact, and both lived past the
    monitor's window; failed publications kept at most a bucket; a death
    after the join failed the sender within its deadline and it lived."""
    killed, failed = report["receiver_killed"], report["failed_publications"]
    joined = report["killed_after_join"]
    if any(trial.get("error") for trial in (killed, failed, joined)):
        return False
    return bool(killed["sender_survived"] and killed["republish_checksums_match"]
                and killed["first_publication_checksums_match"]
                and all(killed["alive_after_window"].values())
                and failed["every_round_failed_on_both"] and failed["within_one_bucket"]
                and failed["final_checksums_match"]
                and joined["sender_alive"] and joined["failed_within_s"] is not None
                and joined["failed_within_s"] <= joined["deadline_s"] + 5)
