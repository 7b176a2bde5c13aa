"""How a weight-broadcast group is formed, shared by the learner and the actors.

Learner rank 0 hosts a ``TCPStore``; every member joins a gloo process group
under the store prefix ``weights/<generation>`` (a new generation whenever
membership changes), separate from the learner's default group. Rank 0 sends
each tensor of the manifest, in manifest order, with one broadcast per tensor
(on gloo, packing into flat buckets only adds copies).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

#: Joining waits this long for the other members before giving up.
JOIN_TIMEOUT_S = 120.0


class WeightGroup:
    """One generation of the broadcast group, as seen by one member."""

    def __init__(self, master_addr: str, master_port: int, generation: int, world_size: int,
                 rank: int, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Join (rank 0 hosts the store); returns when every member has joined."""
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                                    timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(f"weights/{generation}", self._store)
        self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        self.rank = rank

    def broadcast(self, tensor: torch.Tensor) -> None:
        """One tensor from rank 0 to every member, in place."""
        self._group.broadcast(tensor, 0).wait()
