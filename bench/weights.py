"""Pushing weights into running vLLM engines, against a raw broadcast.

For the tiny model (float32) and a larger one (``--big-params``, bf16, 100M by
default), into one and into two running engines: the end-to-end push (pause,
receive, load, repack, resume, as the actors do it) against a broadcast of the
same tensors, cut the same way, between plain processes that only receive
(the same ``WeightGroup`` code, nothing loaded) — in the same run. Also the
generation stall per push against the load time, and where a push's time
goes (phases of ``Engine.load_weights``).

    python bench/weights.py [--json] [--quick] [--big-params 1e8] [--engines 1 2] [--pushes 3]

``--quick``: ``--big-params 2e6`` (the fewest layers: ~10M parameters), one
engine, one timed push: a smoke test of the same code, whose ``big_*`` and
``*_100m`` keys then describe that model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from actors.config import EngineConfig, SamplingConfig
from actors.engine import Engine, LoadTimes, quiet_vllm_logging
from deploy.tiny_model import TinyModelConfig, build_tiny_model
from protocol import GroupInfo, WeightManifest
from protocol.weights import WeightGroup, connect_store, host_store, manifest_of

#: Shape of the larger model: Qwen2 layers 768 wide; the layer count is
#: chosen to reach the requested parameter count.
BIG_HIDDEN, BIG_INTERMEDIATE, BIG_HEADS = 768, 3072, 12


def build_models(folder: Path, big_params: float) -> dict[str, tuple[Path, str]]:
    per_layer = 4 * BIG_HIDDEN ** 2 + 3 * BIG_HIDDEN * BIG_INTERMEDIATE
    layers = max(1, round(big_params / per_layer))
    big = build_tiny_model(folder / "big", TinyModelConfig(
        hidden_size=BIG_HIDDEN, intermediate_size=BIG_INTERMEDIATE, num_layers=layers,
        num_heads=BIG_HEADS, num_kv_heads=BIG_HEADS, init_std=0.02))
    return {"tiny": (build_tiny_model(folder / "tiny"), "float32"), "big": (big, "bfloat16")}


def load_tensors(model: Path, dtype: str) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    return [(name, p.detach().contiguous()) for name, p in loaded.named_parameters()]


def _plain_receiver(port: int, generation: int, world: int, rank: int,
                    manifest: bytes, rounds: int) -> None:
    import msgspec

    group = WeightGroup(connect_store("127.0.0.1", port), generation, world, rank)
    spec = msgspec.msgpack.decode(manifest, type=WeightManifest)
    for _ in range(rounds):
        for _ in group.receive(spec):
            pass


def raw_broadcast(tensors: list[tuple[str, torch.Tensor]], receivers: int, rounds: int,
                  store, port: int, generation: int) -> float:
    """Median seconds to broadcast the tensors to plain receiving processes."""
    import msgspec

    manifest = manifest_of(tensors, 0)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_plain_receiver, args=(
        port, generation, receivers + 1, rank, msgspec.msgpack.encode(manifest), rounds + 1))
        for rank in range(1, receivers + 1)]
    for process in processes:
        process.start()
    group = WeightGroup(store, generation, receivers + 1, 0)
    group.send(manifest, (t for _, t in tensors))  # warm-up (connections, buffers)
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        group.send(manifest, (t for _, t in tensors))
        times.append(time.perf_counter() - began)
    for process in processes:
        process.join(timeout=120)
    return statistics.median(times)


async def push_into_engines(engines: list[Engine], tensors: list[tuple[str, torch.Tensor]],
                            rounds: int, store, port: int, generation: int
                            ) -> tuple[float, list[LoadTimes]]:
    """Median end-to-end push seconds, and every engine's load times."""
    world = len(engines) + 1
    joined: list[WeightGroup] = []
    learner = threading.Thread(target=lambda: joined.append(
        WeightGroup(store, generation, world, 0)))
    learner.start()
    await asyncio.gather(*(engine.join_weight_group(GroupInfo(
        generation=generation, master_addr="127.0.0.1", master_port=port, world_size=world,
        rank=rank, backend="gloo")) for rank, engine in enumerate(engines, start=1)))
    learner.join()
    manifest = manifest_of(tensors, 0)
    times, loads = [], []
    for round_ in range(rounds + 1):  # the first is a warm-up
        began = time.perf_counter()
        sender = threading.Thread(target=lambda: joined[0].send(manifest,
                                                                (t for _, t in tensors)))
        sender.start()
        results = await asyncio.gather(*(engine.load_weights(round_ + 1, manifest)
                                         for engine in engines))
        sender.join()
        if round_:
            times.append(time.perf_counter() - began)
            loads += results
    return statistics.median(times), loads


async def main(args: argparse.Namespace) -> dict:
    store = host_store(0)  # any free port
    port = store.port
    generations = iter(range(1, 1000))
    report: dict = {"pushes": args.pushes, "engines": args.engines}
    with tempfile.TemporaryDirectory() as folder:
        models = build_models(Path(folder), args.big_params)
        for label, (model, dtype) in models.items():
            tensors = load_tensors(model, dtype)
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
            report[f"{label}_params"] = sum(t.numel() for _, t in tensors)
            report[f"{label}_megabytes"] = round(nbytes / 1e6, 1)
            engines = [await Engine.start(str(model), EngineConfig(dtype=dtype),
                                          SamplingConfig(), seed_offset=i, weight_transfer=True)
                       for i in range(max(args.engines))]
            try:
                for n in args.engines:
                    raw_s = raw_broadcast(tensors, n, args.pushes, store, port,
                                          next(generations))
                    push_s, loads = await push_into_engines(engines[:n], tensors, args.pushes,
                                                            store, port, next(generations))
                    key = f"{label}_{n}"
                    report[f"{key}_push_s"] = round(push_s, 4)
                    report[f"{key}_raw_s"] = round(raw_s, 4)
                    report[f"{key}_push_vs_raw"] = round(push_s / raw_s, 2)
                    report[f"{key}_stall_s"] = round(statistics.mean(
                        t.stall_seconds for t in loads), 4)
                    report[f"{key}_load_s"] = round(statistics.mean(
                        t.load_seconds for t in loads), 4)
                    report[f"{key}_phases_s"] = {name: round(statistics.mean(
                        t.phases[name] for t in loads), 4) for name in loads[0].phases}
            finally:
                for engine in engines:
                    await engine.shutdown()
    first = min(args.engines)
    report["push_vs_raw_100m"] = report[f"big_{first}_push_vs_raw"]
    report["stall_vs_load"] = round(report[f"big_{first}_stall_s"]
                                    / report[f"big_{first}_load_s"], 3)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("--quick", action="store_true",
                        help="--big-params 2e6 --engines 1 --pushes 1 unless given (smoke test)")
    parser.add_argument("--big-params", type=float, default=None,
                        help="parameters of the larger model (its JSON keys say big_*): "
                        "1e8 (--quick: 2e6)")
    parser.add_argument("--engines", type=int, nargs="+", default=None,
                        help="engine counts to push into: 1 2 (--quick: 1)")
    parser.add_argument("--pushes", type=int, default=None,
                        help="timed pushes per case: 3 (--quick: 1)")
    arguments = parser.parse_args()
    if arguments.big_params is None:
        arguments.big_params = 2e6 if arguments.quick else 1e8
    if arguments.engines is None:
        arguments.engines = [1] if arguments.quick else [1, 2]
    if arguments.pushes is None:
        arguments.pushes = 1 if arguments.quick else 3
    quiet_vllm_logging()
    result = asyncio.run(main(arguments))
    for label in ("tiny", "big"):
        for n in arguments.engines:
            key = f"{label}_{n}"
            print(f"{label} ({result[f'{label}_megabytes']} MB) into {n} engine(s): push "
                  f"{result[f'{key}_push_s']} s vs raw broadcast {result[f'{key}_raw_s']} s "
                  f"= {result[f'{key}_push_vs_raw']}x; stall {result[f'{key}_stall_s']} s, "
                  f"load {result[f'{key}_load_s']} s; phases {result[f'{key}_phases_s']}")
    if arguments.json:
        print(json.dumps(result))
