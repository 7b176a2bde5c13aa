"""``torchrun ... -m learner --settings FILE``: one learner rank."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from learner.process import Learner, read_settings


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m learner")
    parser.add_argument("--settings", required=True, type=Path,
                        help="JSON written by `compactionrl learner`")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # gloo: the learner keeps its models on the CPU for now (GPU placement,
    # NCCL and bf16 mixed precision are not wired yet).
    dist.init_process_group("gloo")
    try:
        return Learner(read_settings(args.settings)).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
