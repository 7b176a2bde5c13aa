"""``torchrun ... -m learner --settings FILE``: one learner rank."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from learner.models import placement
from learner.process import Learner, read_settings

#: prctl option: the signal the kernel sends this process when its parent dies.
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """torchrun starts each rank in a session of its own, so killing
    torchrun's process group misses the ranks; if torchrun dies without
    stopping them (SIGKILL), the kernel kills them too (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl took effect
            sys.exit(1)


def main() -> int:
    die_with_parent()
    parser = argparse.ArgumentParser(prog="python -m learner")
    parser.add_argument("--settings", required=True, type=Path,
                        help="JSON written by `compactionrl learner`")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = read_settings(args.settings)
    backend, device = placement(settings.learner.device)
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        return Learner(settings, device).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
