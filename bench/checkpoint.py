"""How long a checkpoint stalls training: a synchronous save (DCP writes,
training waits) against the background save the learner uses by default
(``learner.async_checkpoint``: training waits only while the state is
copied to CPU memory; a thread writes the copy).

One process, a Qwen2-shaped model of ~30M parameters (~10M with
``--quick``) with its critic and both AdamW states after one PPO step, the
same trainer saved both ways into a temporary folder, ``--repeats`` times
each (median). Absolute times depend on this machine's disk; the ratio
``async_stall_vs_sync`` is what to quote.

    python bench/checkpoint.py [--json] [--quick] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _options import BenchmarkParser  # bench/_options.py

from learner.batch import to_train_batch
from learner.checkpoint import CheckpointWriter
from learner.config import LearnerConfig
from learner.models import load_critic, load_policy
from learner.ppo import PPOTrainer
from protocol.synthetic import synthetic_batch
from starting_points.tiny_model import TinyModelConfig, build_tiny_model


def trainer_on(folder: Path, quick: bool) -> tuple[PPOTrainer, int]:
    shape = (TinyModelConfig(hidden_size=256, intermediate_size=768, num_layers=4)
             if quick else TinyModelConfig(hidden_size=512, intermediate_size=1536,
                                           num_layers=8, num_heads=8, num_kv_heads=4))
    model = str(build_tiny_model(folder / "model", shape))
    torch.manual_seed(0)
    trainer = PPOTrainer(load_policy(model), load_critic(model), LearnerConfig())
    trainer.step(to_train_batch(synthetic_batch(rollouts=2, seed=0), True))  # AdamW state
    return trainer, sum(p.numel() for p in trainer.policy.parameters())


def timed_saves(trainer: PPOTrainer, folder: Path, asynchronous: bool, repeats: int
                ) -> tuple[list[float], list[float]]:
    """(stall, total) seconds of each save: the stall is until save returns."""
    writer = CheckpointWriter(folder, asynchronous, keep_last=1, keep_every=0)
    stalls, totals = [], []
    for step in range(1, repeats + 1):
        began = time.perf_counter()
        writer.save(trainer, version=step, step=step)
        stalls.append(time.perf_counter() - began)
        writer.finish()
        totals.append(time.perf_counter() - began)
    return stalls, totals


def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch:
        folder = Path(scratch)
        trainer, params = trainer_on(folder, args.quick)
        sync_stalls, _ = timed_saves(trainer, folder / "sync", False, args.repeats)
        async_stalls, async_totals = timed_saves(trainer, folder / "async", True, args.repeats)
    sync_s, stall_s = statistics.median(sync_stalls), statistics.median(async_stalls)
    return {"params": params, "repeats": args.repeats, "sync_save_s": round(sync_s, 4),
            "async_stall_s": round(stall_s, 4),
            "async_write_s": round(statistics.median(async_totals), 4),
            "async_stall_vs_sync": round(stall_s / sync_s, 3)}


if __name__ == "__main__":
    parser = BenchmarkParser(__doc__.split("\n\n")[0], quick="~10M parameters, one repeat")
    parser.add_size("--repeats", 3, 1, "saves each way", type=int)
    arguments = parser.parse_args()
    report = main(arguments)
    print(f"{report['params'] / 1e6:.1f}M-parameter policy with critic and AdamW: synchronous "
          f"save {report['sync_save_s']} s; background save stalls {report['async_stall_s']} s "
          f"(ratio {report['async_stall_vs_sync']}), written in {report['async_write_s']} s")
    if arguments.json:
        print(json.dumps(report))
