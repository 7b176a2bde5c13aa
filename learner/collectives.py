"""The few values the learner's ranks agree on besides the training
collectives of FSDP2: flags (any rank stopping), rank 0's integers (the batch
size, the starting version) and rank 0's batch frame, as raw bytes (never
pickled). Every rank calls each at the same point of the loop."""

from __future__ import annotations

import torch
import torch.distributed as dist


class RankCollectives:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rank = dist.get_rank()

    def true_on_any_rank(self, *flags: bool) -> list[bool]:
        """Each flag, true if it is true on any rank."""
        tensor = torch.tensor([int(f) for f in flags], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [bool(v) for v in tensor.tolist()]

    def broadcast_int(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.broadcast(tensor, 0)
        return int(tensor.item())

    def broadcast_bytes(self, data: bytes) -> bytes:
        """Rank 0's bytes on every rank, as a uint8 tensor: never pickled."""
        size = self.broadcast_int(len(data))
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 and size
                  else torch.empty(size, dtype=torch.uint8)).to(self.device)
        if size:
            dist.broadcast(buffer, 0)
        return buffer.cpu().numpy().tobytes()
