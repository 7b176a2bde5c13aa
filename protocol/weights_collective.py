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

NCCL's own watchdog must never act first: by default (torchrun sets
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) it tears the process down when a
collective outlives the group's timeout, which would kill learner rank 0
whenever an actor dies mid-publication. The weight group alone is built with
error handling that only cleans up (:func:`nccl_error_handling`; the
variable is read when a group is built) and a timeout far above the
project's deadline (:func:`nccl_watchdog_timeout_s`). Every member joins
through the store first (``WeightChannel._join``), with our deadline: NCCL
creates its communicator inside the first collective, which has none. An
aborted NCCL group is never destroyed, an aborted gloo group not before its
pending operation timed out (:func:`retire`): either destructor joins a
thread that may still be waiting.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from protocol.environment import environment
from protocol.messages import TensorSpec
from protocol.weights import (
    ABANDONED_POLL_S,
    GROUP_TIMEOUT_S,
    JoinCancelled,
    TransferFailed,
    WeightChannel,
    dtype_of,
)
from protocol.weights_store import StoreClient

#: The environment variables (current and legacy name) that choose what
#: ProcessGroupNCCL does when a collective fails or times out.
NCCL_ERROR_HANDLING_VARIABLES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
#: ``CleanUpOnly`` in ProcessGroupNCCL.hpp: abort the failed group's
#: communicators and leave the process running (3, ``SkipCleanUp``, and 1,
#: ``TearDown``, end the process).
NCCL_CLEAN_UP_ONLY = "2"
#: The weight group's NCCL timeout, in multiples of the project's deadline:
#: the watchdog acts only long after :func:`wait_within` has aborted.
NCCL_WATCHDOG_FACTOR = 10


def nccl_watchdog_timeout_s(deadline_s: float) -> float:
    """The NCCL weight group's own timeout for a project deadline of ``deadline_s``."""
    return NCCL_WATCHDOG_FACTOR * deadline_s


@contextlib.contextmanager
def nccl_error_handling(mode: str = NCCL_CLEAN_UP_ONLY) -> Iterator[None]:
    """Build a ProcessGroupNCCL inside: the error-handling variables (both
    names, so that neither overrides the other) say ``mode`` meanwhile, and
    are restored after. Only that group is affected: the learner's own
    training group keeps what torchrun set."""
    with environment(dict.fromkeys(NCCL_ERROR_HANDLING_VARIABLES, mode)):
        yield


#: Aborted groups kept referenced (:func:`retire`), each with when it may go:
#: NCCL ones never, gloo ones once the operation they had pending timed out.
RETIRED_GROUPS: list[tuple[object, float]] = []
#: A retired gloo group goes this long after its own timeout.
GLOO_RELEASE_GRACE_S = 5.0


def retire(group: object, backend: str, timeout_s: float) -> None:
    """After ``group`` (built with ``timeout_s``) was aborted: keep it
    referenced while destroying it could block. Either backend's destructor
    joins a thread of the group's:

    - NCCL: its watchdog, which after a peer's death may log its clean-up a
      minute after its flight-recorder dump signal (measured on an H200,
      docs/weights.md "Run on an H200", where such a member did not join the
      next generation in time). Kept for the process's life: one group
      object a failure, its communicators aborted. Not yet run on a GPU.
    - gloo: the worker thread of the broadcast pending at the abort, which
      ``abort()`` does not end (gloo's abort is a no-op here); it ends at
      the group's own timeout. Dropped at once, the group blocked whoever
      collected it, in the fault run the survivor's load of the next
      generation, for the rest of that timeout (15 s of 30). Kept until
      then, and a few seconds more.

    Groups whose time has come are released here, by the next failure."""
    now = time.monotonic()
    RETIRED_GROUPS[:] = [(kept, until) for kept, until in RETIRED_GROUPS if until > now]
    if not any(kept is group for kept, _ in RETIRED_GROUPS):
        until = math.inf if backend == "nccl" else now + timeout_s + GLOO_RELEASE_GRACE_S
        RETIRED_GROUPS.append((group, until))


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
        self._join(backend)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=nccl_watchdog_timeout_s(timeout_s))
            with nccl_error_handling():
                self._group = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
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
        self._pending = None  # the tensor may be freed once the work has completed
        try:
            wait_within(work, deadline, self.given_up)
        except (RuntimeError, TimeoutError) as exc:  # torch's DistError is a RuntimeError
            self.abort()
            raise TransferFailed(f"generation {self.generation}: {exc}") from exc

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
        try:
            self._group.abort()
        except RuntimeError:
            pass
        retire(self._group, self.backend, self.timeout_s)
