"""The few values the learner's ranks agree on besides the training
collectives of FSDP2: flags (any rank stopping), rank 0's integers (the batch
size, the starting version) and rank 0's batch frame, as raw bytes (never
pickled); and the sums a PPO step reduces (:func:`all_reduce_floats`). Every
rank calls each at the same point of the loop."""

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


def world() -> tuple[int, int]:
    """(this rank, the number of ranks); (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def collective_device() -> torch.device:
    """NCCL reduces only tensors on the GPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_floats(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    """``values`` reduced over every rank in one collective, in float64."""
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    if world()[1] > 1:
        dist.all_reduce(tensor, op)
    return tensor.tolist()
