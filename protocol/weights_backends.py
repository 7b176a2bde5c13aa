"""The choice of weight transport: one function that gives a member its end
of a generation on the backend the run chose.

The interface every backend implements (:class:`protocol.weights.WeightChannel`)
is in ``protocol/weights.py``; each backend is a file of its own
(``weights_collective.py``: gloo and NCCL; ``weights_ipc.py``: shared staging
files, the CPU twin of CUDA IPC). They import the interface, and only this
module imports them: no cycle (tests/unit/test_package_layers.py).
"""

from __future__ import annotations

from protocol.weights import GROUP_TIMEOUT_S, JoinCancelled, WeightChannel
from protocol.weights_collective import WeightGroup
from protocol.weights_ipc import IpcChannel
from protocol.weights_store import StoreClient


def join_channel(store: StoreClient, generation: int, world_size: int, rank: int,
                 backend: str, timeout_s: float = GROUP_TIMEOUT_S,
                 cancelled: JoinCancelled | None = None) -> WeightChannel:
    """This member's end of ``generation`` on ``backend`` (``gloo``, ``nccl``
    or ``ipc``); returns once every member has joined, or raises after
    ``timeout_s``, or as soon as ``cancelled()`` gives a reason to stop waiting."""
    if backend == "ipc":
        return IpcChannel(store, generation, world_size, rank, timeout_s, cancelled)
    if backend in ("gloo", "nccl"):
        return WeightGroup(store, generation, world_size, rank, backend, timeout_s, cancelled)
    raise ValueError(f"unknown weight transport {backend!r} (gloo, nccl or ipc)")
