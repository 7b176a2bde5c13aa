"""The ``gloo`` / ``nccl`` weight transport: each bucket is one process-group
broadcast from rank 0 (gloo on the CPU, NCCL between GPUs, any hosts). Rank 0
keeps one broadcast in flight while it converts and packs the next bucket;
members receive one at a time (the engine's loader may draw ahead:
:func:`protocol.weights.received_ahead`).

Every broadcast is waited for explicitly with a deadline counted from when
it was enqueued (:func:`wait_within`): an NCCL work's ``wait()`` only orders
streams, it neither blocks the host nor times out, so the same polling wait
serves both backends. Past the deadline the communicator is aborted
(``ncclCommAbort`` on NCCL) and :class:`TransferFailed` raised; the process
stays healthy.

NCCL's own watchdog must never act first, and no other group may end the
process for the weight group's failure (docs/weights.md "NCCL error
handling"). Torch reads both from the environment as each group is built,
so every process that may join a weight group starts with what
:func:`start_environments` says for the run's deadline (the learner's
ranks through ``compactionrl learner``, each engine through
``actors/engine.py``), and an NCCL weight group refuses to form in a
process where torch would read anything else
(:func:`nccl_environment_problem`, asked where the group is built, after
vLLM's GPU worker removed what it removes). Its timeout is far above the
project's deadline (:func:`nccl_watchdog_timeout_s`). Every member joins
through the store first (``WeightChannel._join``), with our deadline; the
NCCL communicator is then created without blocking, and the first
broadcast waits for it at most the process's init timeout: rank 0's
deadline on the learner, the longest a member may be announced on an
engine (:func:`member_timeout_s` at :data:`MAX_LANES`). An aborted NCCL
group is never destroyed, an aborted gloo group not before its pending
operation timed out (:func:`retire`): either destructor joins a thread that
may still be waiting.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from protocol.messages import TensorSpec
from protocol.weights import (
    ABANDONED_POLL_S,
    GROUP_TIMEOUT_S,
    WIRE_FLOAT_DTYPES,
    JoinCancelled,
    TransferFailed,
    WeightChannel,
    dtype_of,
)
from protocol.weights_store import StoreClient

#: The names torch reads a ProcessGroupNCCL setting under, in its order
#: of precedence (``ProcessGroupNCCL.hpp``): ``getCvarInt`` / ``getCvarBool``
#: (``Utils.hpp``) walk the list backwards and keep the last value found, so
#: the first name set wins and a later one is read only where it is the
#: only one set (torch then warns that the name is deprecated).
NCCL_ERROR_HANDLING_VARIABLES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
#: ``CleanUpOnly`` in ProcessGroupNCCL.hpp: abort the failed group's
#: communicators and leave the process running (3, ``SkipCleanUp``, and 1,
#: ``TearDown``, torchrun's default for its ranks, end the process).
NCCL_CLEAN_UP_ONLY = "2"
#: Whether a group's watchdog, on a failed or timed-out collective, dumps:
#: every group's watchdog raises a process-wide dump flag when one of its
#: collectives fails, and the monitor of the process's first group, where
#: this is on, acts on it (or on a dump key in its store): it dumps, waits
#: ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (480 s) and ends the process. Off
#: from the start, the first group never acts on another group's failure.
NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
#: A failing group's watchdog sleeps 4 times this many milliseconds (60 s
#: by default) before it aborts the group's communicators, and a group's
#: destructor waits for that sleep: at 250, one second.
NCCL_DUMP_WAIT_MS = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
#: How long, in whole seconds, torch waits for a non-blocking communicator
#: to become ready before it raises (read once per process; 1800 by default).
NCCL_INIT_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
#: What torch must read in a process that builds an NCCL weight group: each
#: setting's names (in torch's order of precedence) and its value.
NCCL_MEMBER_REQUIRED: dict[tuple[str, ...], str] = {
    NCCL_ERROR_HANDLING_VARIABLES: NCCL_CLEAN_UP_ONLY, (NCCL_DUMP_ON_TIMEOUT,): "0"}
#: What vLLM's GPU worker removes from its own environment in
#: ``Worker.init_device`` (``vllm/v1/worker/gpu_worker.py``), after the
#: engine started and before any weight group is built: nothing a weight
#: group relies on may be set under these names alone
#: (tests/unit/test_vllm_environment.py reads the installed worker).
VLLM_GPU_WORKER_REMOVES = ("NCCL_ASYNC_ERROR_HANDLING",)
#: The weight group's NCCL timeout, in multiples of the project's deadline:
#: the watchdog acts only long after :func:`wait_within` has aborted.
NCCL_WATCHDOG_FACTOR = 10
#: The most lanes a publication has (learner/publisher.py ``plan_lanes``):
#: one per floating-point dtype weights travel in.
MAX_LANES = len(WIRE_FLOAT_DTYPES)


def nccl_watchdog_timeout_s(deadline_s: float) -> float:
    """The NCCL weight group's own timeout for a project deadline of ``deadline_s``."""
    return NCCL_WATCHDOG_FACTOR * deadline_s


def member_timeout_s(weight_timeout_s: float, lanes: int) -> float:
    """A member's bound on joining its lane's generation and on each of its
    broadcasts, when rank 0's is ``weight_timeout_s``. Rank 0 serves every
    lane from one thread, one bucket at a time across them: a lane whose
    member stalls holds the others back for up to ``weight_timeout_s``
    (rank 0's own bound, then the lane is failed and skipped), and so on for
    each such lane. A member of a healthy lane waits through all of them
    without failing itself."""
    return weight_timeout_s * max(1, lanes)


def torch_reads(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The value torch takes for a setting read under ``names`` (in its
    order of precedence) from ``environ``: the first name set (None: none is)."""
    return next((environ[name] for name in names if name in environ), None)


def weight_member_environment(deadline_s: float) -> dict[str, str]:
    """What a process that may join an NCCL weight group with a deadline of
    ``deadline_s`` starts with, on top of its parent's (and over any setting
    of the same names). Torch reads these as each group is built (the init
    timeout once per process), so they hold for the process's other groups
    too (the learner's training group, vLLM's world group):

    - error handling ``CleanUpOnly``, under torch's own name, which wins over
      the legacy one whatever that says (vLLM's GPU worker removes the legacy
      one, :data:`VLLM_GPU_WORKER_REMOVES`): a failed collective aborts its
      own group's communicators and the process goes on. In the training
      group a failure then surfaces as an error of the next collective the
      step waits for, and the learner exits with it, instead of the watchdog
      ending the process;
    - no dump on timeout: the first group's monitor never ends the process
      for another group's failure (it still ends a process whose own
      watchdog hangs);
    - a failing group's watchdog waits 1 s, not 60, before its clean-up, so
      a process that stops soon after a failure is not held by it;
    - a communicator that does not become ready within ``deadline_s`` (a
      member died between the join and the first broadcast) raises, where
      the weight group creates it (:class:`WeightGroup`)."""
    return {NCCL_ERROR_HANDLING_VARIABLES[0]: NCCL_CLEAN_UP_ONLY, NCCL_DUMP_ON_TIMEOUT: "0",
            NCCL_DUMP_WAIT_MS: "250", NCCL_INIT_TIMEOUT: str(max(1, math.ceil(deadline_s)))}


@dataclass(frozen=True)
class StartEnvironments:
    """What each process of a run that may join a weight group starts with,
    on top of its parent's: the one place a run's weight deadline becomes
    the environment torch reads once per process."""

    learner: dict[str, str]
    """Every learner rank's (``compactionrl learner`` execs torchrun with it):
    rank 0's communicators wait ``learner.weight_timeout_s``, its own bound."""
    engine: dict[str, str]
    """Every actor engine's (``actors/engine.py engine_environment``): a
    member's communicator waits what a member may be announced
    (:func:`member_timeout_s` at :data:`MAX_LANES`), since rank 0 may reach
    its lane only after the other lanes failed."""


def start_environments(weight_timeout_s: float) -> StartEnvironments:
    """The environments a run whose ``learner.weight_timeout_s`` is
    ``weight_timeout_s`` starts its processes with."""
    return StartEnvironments(
        learner=weight_member_environment(weight_timeout_s),
        engine=weight_member_environment(member_timeout_s(weight_timeout_s, MAX_LANES)))


def nccl_environment_problem(environ: Mapping[str, str]) -> str | None:
    """Why a process whose environment is now ``environ`` must not build an
    NCCL weight group (None: it may): torch would read a setting under
    which a member's death ends the process, now or minutes later. Asked
    where the group is built, after the engine's own start-up changed what
    it started with."""
    wrong = {names[0]: torch_reads(environ, names) for names, value in NCCL_MEMBER_REQUIRED.items()
             if torch_reads(environ, names) != value}
    if not wrong:
        return None
    wanted = {names[0]: value for names, value in NCCL_MEMBER_REQUIRED.items()}
    return (f"torch reads {wrong} here, not {wanted}: a weight group's failure could end this "
            "process (docs/weights.md \"NCCL error handling\"); start it through "
            "`compactionrl learner` / `compactionrl actor`")


#: Aborted groups kept referenced (:func:`retire`), each with when it may go:
#: NCCL ones never, gloo ones once the operation they had pending timed out.
RETIRED_GROUPS: list[tuple[object, float]] = []
#: A retired gloo group goes this long after its own timeout.
GLOO_RELEASE_GRACE_S = 5.0
#: The most an abort holds its caller up (:func:`abort_in_background`).
ABORT_WAIT_S = 1.0


def retire(group: object, backend: str, timeout_s: float) -> None:
    """After ``group`` (built with ``timeout_s``) was aborted: keep it
    referenced while destroying it could block. Either backend's destructor
    joins a thread of the group's:

    - NCCL: its watchdog, which after a peer's death sleeps before its
      clean-up (60 s by default: a member that did not join the next
      generation in time on an H200, docs/weights.md "Run on an H200"; 1 s
      with :func:`weight_member_environment`), and which never ends if an
      operation never completes. Never destroyed, not even at the
      interpreter's exit (a reference nobody drops): stopping never waits on
      it. What it keeps is small: its tensors were released at the abort
      (:func:`releases_on_abort`), its communicators aborted, its threads
      ended with them. Not yet run on a GPU.
    - gloo: the worker thread of the broadcast pending at the abort, which
      ``abort()`` does not end (gloo's abort is a no-op here); it ends at
      the group's own timeout. Dropped at once, the group blocked whoever
      collected it, in the fault run the survivor's load of the next
      generation, for the rest of that timeout (15 s of 30). Kept until
      then, and a few seconds more.

    Groups whose time has come are released here, by the next failure, or
    when they are counted (:func:`retired_groups`)."""
    retired_groups()  # releases those whose time has come
    now = time.monotonic()
    if not any(kept is group for kept, _ in RETIRED_GROUPS):
        if backend == "nccl":
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
        until = math.inf if backend == "nccl" else now + timeout_s + GLOO_RELEASE_GRACE_S
        RETIRED_GROUPS.append((group, until))


def retired_groups() -> int:
    """How many aborted groups this process holds (:func:`retire`), once
    those whose time has come are released: every NCCL group that ever
    failed here, for the process's life (docs/weights.md "What a failure
    leaves behind")."""
    now = time.monotonic()
    RETIRED_GROUPS[:] = [(kept, until) for kept, until in RETIRED_GROUPS if until > now]
    return len(RETIRED_GROUPS)


def abort_in_background(group: dist.ProcessGroup, backend: str, pending: dist.Work | None,
                        wait_s: float = ABORT_WAIT_S) -> None:
    """Abort ``group`` and release what the broadcast ``pending`` at the
    abort keeps (:func:`releases_on_abort`), in a thread of its own that the
    caller waits on for ``wait_s`` at most: ``ncclCommAbort`` may stall, up
    to the group's own timeout (:func:`nccl_watchdog_timeout_s`), and the
    caller is learner rank 0 between two optimiser steps, or an engine's
    worker whose loader must fail its load. A stalled abort goes on alone;
    the group is kept either way (:func:`retire`)."""

    def abort() -> None:
        try:
            group.abort()
        except RuntimeError:
            pass
        if pending is not None and releases_on_abort(backend):
            release(pending)

    aborting = threading.Thread(target=abort, name="weights-abort", daemon=True)
    aborting.start()
    aborting.join(wait_s)


def releases_on_abort(backend: str) -> bool:
    """Whether the tensors of a broadcast pending at an abort are released
    then (:func:`release`), or kept until the operation ends:

    - NCCL: a work keeps its tensors until it is waited for, and one that
      completes unwaited has them moved to its group's list of tensors to
      release, emptied only by that group's next collective: a retired group
      has none, so each failure would keep a bucket on the GPU for the
      process's life. ``wait()`` on the aborted work releases them (it
      orders streams and never blocks the host).
    - gloo: ``wait()`` blocks until the operation ends, which after an abort
      is the group's timeout; its tensors go with the group then (:func:`retire`)."""
    return backend == "nccl"


def release(work: dist.Work) -> None:
    """Release what ``work`` keeps of an aborted group (NCCL: its tensors),
    whatever its outcome."""
    try:
        work.wait()
    except RuntimeError:  # the collective failed: it was aborted
        pass


def wait_within(work: dist.Work, deadline: float,
                abandoned: Callable[[float], bool] = lambda within_s: False) -> None:
    """Until ``work`` completes; raises :class:`TimeoutError` once
    ``time.monotonic()`` passes ``deadline``, or as soon as
    ``abandoned(seconds left)`` (asked every ``ABANDONED_POLL_S``, and bound
    to answer within what is left) says the generation was given up (a
    member: the sender abandoned it; the sender: a member left); the op's
    own error if it failed."""
    ask_at = time.monotonic() + ABANDONED_POLL_S
    pause = 0.0
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError("a broadcast did not complete by its deadline")
        if now > ask_at:
            if abandoned(deadline - now):
                raise TimeoutError("the generation was given up (a member left, or the "
                                   "sender abandoned it)")
            ask_at = time.monotonic() + ABANDONED_POLL_S
        time.sleep(pause)
        pause = min(0.001, pause + 0.0001)
    work.wait()


class WeightGroup(WeightChannel):
    """One generation of the broadcast group, as seen by one member."""

    def __init__(self, store: StoreClient, generation: int, world_size: int, rank: int,
                 backend: str = "gloo", timeout_s: float = GROUP_TIMEOUT_S,
                 cancelled: JoinCancelled | None = None) -> None:
        """Join; returns when every member has joined (or raises after
        ``timeout_s``, or once ``cancelled()`` gives a reason)."""
        # the generation's store view is kept: the group's C++ side calls into it
        super().__init__(store, generation, world_size, rank, timeout_s, cancelled)
        self.backend = backend
        if backend == "nccl" and (problem := nccl_environment_problem(os.environ)):
            raise TransferFailed(problem)
        self._join(backend)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=nccl_watchdog_timeout_s(timeout_s))
            # Non-blocking: the communicator is created now, without holding
            # the host; the first broadcast waits for it within the process's
            # init timeout (weight_member_environment), so a member that died
            # after the join fails that broadcast instead of hanging it.
            options.config.blocking = 0
            self._group = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
            self._group.eager_connect_single_device(self.device)
        else:
            self._group = dist.ProcessGroupGloo(self._store, rank, world_size,
                                                timedelta(seconds=timeout_s))
            self.device = torch.device("cpu")
        # the broadcast in flight, its tensor (kept alive until it completes)
        # and its deadline, counted from when it was enqueued
        self._pending: tuple[dist.Work, torch.Tensor, float] | None = None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast and wait for completion (members: the tensor is filled)."""
        self._start(tensor)
        self._wait()

    def _start(self, tensor: torch.Tensor) -> None:
        """Start a broadcast of ``tensor`` after the previous one completes;
        returns while it travels (rank 0 converts and packs the next)."""
        self._wait()
        try:
            deadline = time.monotonic() + self.timeout_s
            self._pending = (self._group.broadcast(tensor, 0), tensor, deadline)
        except RuntimeError as exc:
            self.abort()
            raise TransferFailed(f"generation {self.generation}: {exc}") from exc

    def _wait(self) -> None:
        if self._pending is None:
            return
        work, _, deadline = self._pending
        try:
            wait_within(work, deadline, self.given_up)
        except (RuntimeError, TimeoutError) as exc:  # torch's DistError is a RuntimeError
            self.abort()
            raise TransferFailed(f"generation {self.generation}: {exc}") from exc
        self._pending = None  # the tensor may be freed: the work has completed

    # a tensor travelling alone is broadcast as it is: packing would only add a copy
    def _send_tensor(self, tensor: torch.Tensor) -> None:
        self._start(tensor)

    def _receive_tensor(self, spec: TensorSpec) -> torch.Tensor:
        tensor = torch.empty(spec.shape, dtype=dtype_of(spec), device=self.device)
        self._broadcast(tensor)
        return tensor

    def _send_bucket(self, flat: torch.Tensor) -> None:
        self._start(flat)

    def _finish_send(self) -> None:
        self._wait()

    def _receive_bucket(self, nbytes: int) -> torch.Tensor:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._broadcast(flat)
        return flat

    def abort(self) -> None:
        pending, self._pending = self._pending, None
        retire(self._group, self.backend, self.timeout_s)
        abort_in_background(self._group, self.backend, None if pending is None else pending[0])
