"""The ``gloo`` / ``nccl`` weight transport: each bucket is one process-group
broadcast from rank 0 (gloo on the CPU, NCCL between GPUs, any hosts).

Every broadcast is waited for explicitly with a deadline (:func:`wait_within`):
an NCCL work's ``wait()`` only orders streams, it neither blocks the host nor
times out, so the same polling wait serves both backends. Past the deadline
the communicator is aborted (``ncclCommAbort`` on NCCL) and
:class:`TransferFailed` raised; the process stays healthy.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from protocol.messages import TensorSpec
from protocol.weights import GROUP_TIMEOUT_S, TransferFailed, WeightChannel, dtype_of


def wait_within(work: dist.Work, timeout_s: float) -> None:
    """Until ``work`` completes; raises :class:`TimeoutError` after
    ``timeout_s`` (and the op's own error if it failed)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"a broadcast did not complete in {timeout_s:g} s")
        time.sleep(pause)
        pause = min(0.001, pause + 0.0001)
    work.wait()


class WeightGroup(WeightChannel):
    """One generation of the broadcast group, as seen by one member."""

    def __init__(self, store: dist.Store, generation: int, world_size: int, rank: int,
                 backend: str = "gloo", timeout_s: float = GROUP_TIMEOUT_S) -> None:
        """Join; returns when every member has joined (or raises after ``timeout_s``)."""
        super().__init__(generation, world_size, rank, timeout_s)
        timeout = timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(f"weights/{generation}", store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            self.device = torch.device("cpu")

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            wait_within(self._group.broadcast(tensor, 0), self.timeout_s)
        except (RuntimeError, TimeoutError) as exc:  # torch's DistError is a RuntimeError
            self.abort()
            raise TransferFailed(f"generation {self.generation}: {exc}") from exc

    # a tensor travelling alone is broadcast as it is: packing would only add a copy
    def _send_tensor(self, tensor: torch.Tensor) -> None:
        self._broadcast(tensor)

    def _receive_tensor(self, spec: TensorSpec) -> torch.Tensor:
        tensor = torch.empty(spec.shape, dtype=dtype_of(spec), device=self.device)
        self._broadcast(tensor)
        return tensor

    def _send_bucket(self, flat: torch.Tensor) -> None:
        self._broadcast(flat)

    def _receive_bucket(self, nbytes: int) -> torch.Tensor:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._broadcast(flat)
        return flat

    def abort(self) -> None:
        try:
            self._group.abort()
        except RuntimeError:
            pass
