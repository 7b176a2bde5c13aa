"""The ``gloo`` / ``nccl`` weight transport: each bucket is one process-group
broadcast from rank 0 (gloo on the CPU, NCCL between GPUs, any hosts). Rank 0
keeps one broadcast in flight while it converts and packs the next bucket;
members receive one at a time (the engine's loader may draw ahead:
:func:`protocol.weights.received_ahead`).

Every broadcast is waited for explicitly with a deadline (:func:`wait_within`):
an NCCL work's ``wait()`` only orders streams, it neither blocks the host nor
times out, so the same polling wait serves both backends. Past the deadline
the communicator is aborted (``ncclCommAbort`` on NCCL) and
:class:`TransferFailed` raised; the process stays healthy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from protocol.messages import TensorSpec
from protocol.weights import (
    ABANDONED_POLL_S,
    GROUP_TIMEOUT_S,
    TransferFailed,
    WeightChannel,
    dtype_of,
)
from protocol.weights_store import StoreClient


def wait_within(work: dist.Work, timeout_s: float,
                abandoned: Callable[[], bool] = lambda: False) -> None:
    """Until ``work`` completes; raises :class:`TimeoutError` after
    ``timeout_s``, or as soon as ``abandoned()`` (asked every
    ``ABANDONED_POLL_S``) says the sender gave the generation up (and the
    op's own error if it failed)."""
    now = time.monotonic()
    deadline, ask_at = now + timeout_s, now + ABANDONED_POLL_S
    pause = 0.0
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"a broadcast did not complete in {timeout_s:g} s")
        if now > ask_at:
            if abandoned():
                raise TimeoutError("the sender abandoned the generation")
            ask_at = now + ABANDONED_POLL_S
        time.sleep(pause)
        pause = min(0.001, pause + 0.0001)
    work.wait()


class WeightGroup(WeightChannel):
    """One generation of the broadcast group, as seen by one member."""

    def __init__(self, store: StoreClient, generation: int, world_size: int, rank: int,
                 backend: str = "gloo", timeout_s: float = GROUP_TIMEOUT_S) -> None:
        """Join; returns when every member has joined (or raises after ``timeout_s``)."""
        # the generation's store view is kept: the group's C++ side calls into it
        super().__init__(store, generation, world_size, rank, timeout_s)
        timeout = timedelta(seconds=timeout_s)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._group = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
            self.device = torch.device("cpu")
        # rank 0: the broadcast in flight, and its tensor (kept alive until it completes)
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast and wait for completion (members: the tensor is filled)."""
        self._start(tensor)
        self._wait()

    def _start(self, tensor: torch.Tensor) -> None:
        """Start a broadcast of ``tensor`` after the previous one completes;
        returns while it travels (rank 0 converts and packs the next)."""
        self._wait()
        try:
            self._pending = (self._group.broadcast(tensor, 0), tensor)
        except RuntimeError as exc:
            self.abort()
            raise TransferFailed(f"generation {self.generation}: {exc}") from exc

    def _wait(self) -> None:
        if self._pending is None:
            return
        work, _ = self._pending
        self._pending = None  # the tensor may be freed once the work has completed
        try:
            # rank 0 knows when it gave up; members are told through the store
            wait_within(work, self.timeout_s, self.abandoned if self.rank else lambda: False)
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
