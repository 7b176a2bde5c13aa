"""``torchrun ... -m learner --settings FILE``: one learner rank."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from learner.models import placement
from learner.process import Learner
from learner.settings import read_settings
from ops.lifetime import die_with_parent


def main() -> int:
    # torchrun starts each rank in a session of its own, so stopping torchrun's
    # process group misses the ranks; a torchrun killed outright takes them along
    die_with_parent()
    parser = argparse.ArgumentParser(prog="python -m learner")
    parser.add_argument("--settings", required=True, type=Path,
                        help="JSON written by `compactionrl learner`")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = read_settings(args.settings)
    backend, device = placement(settings.learner.device, settings.learner.gpu_memory_fraction)
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        return Learner(settings, device).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
