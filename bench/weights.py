"""Pushing weights into running vLLM engines, against a raw broadcast.

For the tiny model (float32) and a larger one (``--big-params``, 100M by
default, whose engines run bf16 while the learner holds fp32 master weights),
into one and into two running engines: the end-to-end push (conversion to the
engines' dtype on the sender, pause, receive, load, repack, resume, as the
learner and the actors do it) against a broadcast of the same wire bytes, cut
the same way, between plain processes that only receive (the same
``WeightGroup`` code, nothing converted or loaded), and against one flat
buffer of those bytes (the transport's limit here) — in the same run.
``wire_bytes_vs_fp32`` is the bytes sent over what fp32 master weights would
be; ``ipc_push_vs_raw_100m`` the same push into one engine over the ipc
transport (staging files, the CPU twin of CUDA IPC) against the raw gloo
broadcast. The fan-out: ``push_seconds_by_receivers`` is the sender's push of
the larger model (conversion included) to 1, 2, 4 and 8 plain receiving
processes, one-to-all, with ``push_growth_per_doubling`` (2 to the slope of
log time against log receivers) and a linear fit; ``relay_*`` the same
relayed (rank 0 to one leader per node of ``--node-size`` receivers, each
forwarding to its node as tensors arrive); ``projected_push_s`` the model
projected to 64 and 512 GPU actors (assumptions: ``PROJECTED_BYTES`` and the
bandwidths below; docs/weights.md). Also the
generation stall per push against the load time, and where a push's time
goes (phases of ``Engine.load_weights``). And the generation stall of a
publication into an engine with ``--stall-requests`` requests in flight
(prompts of ``--stall-prompt-tokens``), with ``actors.kv_on_update = "keep"``
against ``"recompute"``: for each request, the time from the start of the
publication to its first token after it (a recomputed request is prefilled
again first); ``stall_keep_vs_recompute`` is the ratio of their means, on the
larger model.

    python bench/weights.py [--json] [--quick] [--big-params 1e8] [--engines 1 2] [--pushes 3]
        [--receivers 1 2 4 8] [--node-size 4] [--fanout-only]
        [--stall-requests 16] [--stall-prompt-tokens 1024]

``--quick``: ``--big-params 2e6`` (the fewest layers: ~10M parameters) and
not the tiny model (one engine start), one engine, one timed push, 4
requests of 256 prompt tokens in flight, and no fan-out curves (``--quick
--fanout-only`` smoke-tests those, with 1 and 2 receivers): a smoke test of
the same code, whose ``big_*`` and ``*_100m`` keys then describe that model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from _options import BenchmarkParser  # bench/_options.py

from actors.config import EngineConfig, SamplingConfig
from actors.engine import Engine, LoadTimes, quiet_vllm_logging
from protocol import GroupInfo, WeightManifest
from protocol.weights import (
    GROUP_TIMEOUT_S,
    WeightChannel,
    connect_store,
    host_store,
    manifest_of,
)
from protocol.weights_backends import join_channel
from protocol.weights_collective import WeightGroup
from starting_points.tiny_model import TinyModelConfig, build_tiny_model

#: Named tensors, in the order they are pushed.
Tensors = list[tuple[str, torch.Tensor]]

#: Shape of the larger model: Qwen2 layers 768 wide; the layer count is
#: chosen to reach the requested parameter count.
BIG_HIDDEN, BIG_INTERMEDIATE, BIG_HEADS = 768, 3072, 12


def build_models(folder: Path, big_params: float, tiny: bool = True) -> dict[str, Path]:
    """The models pushed, by label: the tiny one (unless ``tiny`` is False)
    and the larger one of about ``big_params`` parameters."""
    per_layer = 4 * BIG_HIDDEN ** 2 + 3 * BIG_HIDDEN * BIG_INTERMEDIATE
    layers = max(1, round(big_params / per_layer))
    big = build_tiny_model(folder / "big", TinyModelConfig(
        hidden_size=BIG_HIDDEN, intermediate_size=BIG_INTERMEDIATE, num_layers=layers,
        num_heads=BIG_HEADS, num_kv_heads=BIG_HEADS, init_std=0.02))
    return {**({"tiny": build_tiny_model(folder / "tiny")} if tiny else {}), "big": big}


def load_tensors(model: Path, dtype: str) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    return [(name, p.detach().contiguous()) for name, p in loaded.named_parameters()]


#: Engine dtype of each model: the tiny one's tests run float32.
ENGINE_DTYPES = {"tiny": "float32", "big": "bfloat16"}


def _plain_receiver(port: int, generation: int, world: int, rank: int,
                    manifest: bytes, rounds: int) -> None:
    import msgspec

    group = WeightGroup(connect_store("127.0.0.1", port), generation, world, rank)
    spec = msgspec.msgpack.decode(manifest, type=WeightManifest)
    for _ in range(rounds):
        for _ in group.receive(spec):
            pass


def raw_broadcast(tensors: list[tuple[str, torch.Tensor]], receivers: int, rounds: int,
                  store, port: int, generation: int, wire: torch.dtype | None = None) -> float:
    """Median seconds to broadcast the tensors (in ``wire`` dtype, converted
    by the sender as it goes) to plain receiving processes."""
    import msgspec

    manifest = manifest_of(tensors, 0, wire)
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
    _reap(processes)
    return statistics.median(times)


def _relay_member(port: int, trunk: tuple[int, int, int] | None,
                  node: tuple[int, int, int] | None, manifest: bytes, rounds: int) -> None:
    """A receiver of the relay: a node's leader takes each tensor from the
    trunk group and forwards it at once in its node's group; the others of
    the node receive from their leader. ``trunk`` / ``node``: (generation,
    world, rank) of the groups this process is in."""
    import msgspec

    spec = msgspec.msgpack.decode(manifest, type=WeightManifest)
    up = (WeightGroup(connect_store("127.0.0.1", port), *trunk) if trunk is not None
          else None)
    down = (WeightGroup(connect_store("127.0.0.1", port), *node) if node is not None
            else None)
    for _ in range(rounds):
        if up is None:  # a member of a node
            for _ in down.receive(spec):
                pass
            continue
        sender = down.sender(spec) if down is not None else None
        for index, (_, tensor) in enumerate(up.receive(spec)):
            if sender is not None:
                sender.add(index, tensor)
        if sender is not None:
            sender.finish()
        up._group.barrier().wait()  # rank 0 times the publication to here


def relay_broadcast(tensors: list[tuple[str, torch.Tensor]], receivers: int, node_size: int,
                    rounds: int, store, port: int, generations, wire: torch.dtype | None = None
                    ) -> float:
    """Median seconds until every receiver holds the tensors, relayed: rank 0
    broadcasts to one leader per node of ``node_size`` receivers (the trunk),
    each leader forwards to its node while the next tensor travels."""
    import msgspec

    manifest = manifest_of(tensors, 0, wire)
    encoded = msgspec.msgpack.encode(manifest)
    nodes = [list(range(start, min(start + node_size, receivers)))
             for start in range(0, receivers, node_size)]
    trunk_generation = next(generations)
    context = multiprocessing.get_context("spawn")
    processes = []
    for leader, node in enumerate(nodes, start=1):
        node_generation = next(generations) if len(node) > 1 else None
        for position, _ in enumerate(node):
            trunk = (trunk_generation, len(nodes) + 1, leader) if position == 0 else None
            down = ((node_generation, len(node), position) if node_generation is not None
                    else None)
            processes.append(context.Process(target=_relay_member, args=(
                port, trunk, down, encoded, rounds + 1)))
    for process in processes:
        process.start()
    group = WeightGroup(store, trunk_generation, len(nodes) + 1, 0)
    times = []
    for round_ in range(rounds + 1):  # the first is a warm-up
        began = time.perf_counter()
        group.send(manifest, (t for _, t in tensors))
        group._group.barrier().wait()
        if round_:
            times.append(time.perf_counter() - began)
    _reap(processes)
    return statistics.median(times)


def _reap(processes: list[multiprocessing.Process]) -> None:
    """Wait for the receivers; kill one that hangs (the benchmark must end)."""
    for process in processes:
        process.join(timeout=120)
        if process.is_alive():
            process.kill()
            process.join()


def growth_per_doubling(seconds_by_receivers: dict[int, float]) -> float:
    """The factor push time grows by when the receivers double: the slope of
    log2(time) against log2(receivers), least squares, as 2 ** slope."""
    points = [(math.log2(n), math.log2(t)) for n, t in sorted(seconds_by_receivers.items())]
    mean_x = statistics.mean(x for x, _ in points)
    mean_y = statistics.mean(y for _, y in points)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x, _ in points))
    return 2 ** slope


def linear_fit(seconds_by_receivers: dict[int, float]) -> tuple[float, float]:
    """(fixed seconds, seconds per receiver) of t(n) = a + b n, least squares."""
    xs, ys = list(seconds_by_receivers), list(seconds_by_receivers.values())
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    b = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
         / sum((x - mean_x) ** 2 for x in xs))
    return mean_y - b * mean_x, b


#: Assumptions of the projection (docs/weights.md, "Fan-out"): a 7B policy in
#: bf16, 8 GPUs per actor node, one 400 Gb/s NIC per GPU (rank 0's own NIC
#: is the one that carries a one-to-all broadcast), NVLink 4 within a node.
PROJECTED_BYTES = 15.2e9
GPUS_PER_NODE = 8
NIC_BYTES_PER_S = 50e9
NVLINK_BYTES_PER_S = 450e9


def projected_push_seconds(actors: int) -> dict[str, float]:
    """Seconds to push ``PROJECTED_BYTES`` to ``actors`` GPU engines:
    one-to-all (rank 0 sends every copy over its NIC, what the gloo curve
    measured here grows like), relay (rank 0 sends one copy per node over the
    NIC, pipelined; each node's leader forwards over NVLink) and a pipelined
    broadcast tree (NCCL's: about one transfer at the slowest link)."""
    nodes = -(-actors // GPUS_PER_NODE)
    return {"one_to_all": round(actors * PROJECTED_BYTES / NIC_BYTES_PER_S, 1),
            "relay": round(nodes * PROJECTED_BYTES / NIC_BYTES_PER_S
                           + PROJECTED_BYTES / NVLINK_BYTES_PER_S, 1),
            "pipelined_tree": round(PROJECTED_BYTES / NIC_BYTES_PER_S, 1)}


async def push_into_engines(engines: list[Engine], tensors: list[tuple[str, torch.Tensor]],
                            rounds: int, store, port: int, generation: int,
                            wire: torch.dtype, transport: str = "gloo"
                            ) -> tuple[float, list[LoadTimes]]:
    """Median end-to-end push seconds, and every engine's load times."""
    world = len(engines) + 1
    joined: list[WeightChannel] = []
    learner = threading.Thread(target=lambda: joined.append(
        join_channel(store, generation, world, 0, transport)))
    learner.start()
    await asyncio.gather(*(engine.join_weight_group(GroupInfo(
        generation=generation, master_addr="127.0.0.1", master_port=port, world_size=world,
        rank=rank, backend=transport)) for rank, engine in enumerate(engines, start=1)))
    learner.join()
    manifest = manifest_of(tensors, 0, wire)
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


async def _join(engine: Engine, store, port: int, generation: int) -> WeightGroup:
    """Form a group of learner rank 0 (returned) and ``engine``."""
    joined: list[WeightGroup] = []
    learner = threading.Thread(target=lambda: joined.append(WeightGroup(store, generation, 2, 0)))
    learner.start()
    await engine.join_weight_group(GroupInfo(generation=generation, master_addr="127.0.0.1",
                                             master_port=port, world_size=2, rank=1,
                                             backend="gloo"))
    learner.join()
    return joined[0]


async def _timed_request(engine: Engine, prompt: list[int], params, request_id: str,
                         arrivals: list[float]) -> None:
    """Run one request on the raw engine, noting when each output arrives."""
    async for _ in engine.llm.generate({"prompt_token_ids": prompt}, params,
                                       request_id=request_id):
        arrivals.append(time.perf_counter())


async def stall_in_flight(engine: Engine, tensors: list[tuple[str, torch.Tensor]], store,
                          port: int, generation: int, requests: int, prompt_tokens: int
                          ) -> dict[str, dict[str, float]]:
    """Per kv_on_update mode: the mean and the longest stall of ``requests``
    requests in flight (publication start to each one's first token after it),
    and the engine's own pause (``LoadTimes.stall_seconds``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    group = await _join(engine, store, port, generation)
    manifest = manifest_of(tensors, 0)
    vocabulary = len(engine.tokenizer)
    max_tokens = engine.config.max_model_len - prompt_tokens - 1
    results = {}
    rng = random.Random(0)
    for mode in ("recompute", "keep"):
        arrivals: list[list[float]] = [[] for _ in range(requests)]
        tasks = [asyncio.ensure_future(_timed_request(
            engine, [rng.randrange(vocabulary) for _ in range(prompt_tokens)],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i,
                           output_kind=RequestOutputKind.DELTA),
            f"stall-{mode}-{i}", arrivals[i])) for i in range(requests)]
        while not all(len(a) >= 3 for a in arrivals):  # all prefilled and decoding
            await asyncio.sleep(0.01)
        began = time.perf_counter()
        sender = threading.Thread(target=lambda: group.send(manifest, (t for _, t in tensors)))
        sender.start()
        times = await engine.load_weights(engine.version + 1, manifest, mode)
        loaded = time.perf_counter()
        sender.join()
        while not all(a[-1] > loaded for a in arrivals):
            await asyncio.sleep(0.001)
        stalls = [next(t for t in a if t > loaded) - began for a in arrivals]
        for task in tasks:
            task.cancel()  # aborts the request
        await asyncio.gather(*tasks, return_exceptions=True)
        results[mode] = {"mean": statistics.mean(stalls), "max": max(stalls),
                         "pause": times.stall_seconds}
    return results


def fanout(tensors: list[tuple[str, torch.Tensor]], wire: torch.dtype,
           args: argparse.Namespace, store, port: int, generations) -> dict:
    """Push time against the number of plain receiving processes, one-to-all
    and relayed, with the growth per doubling, a linear fit and the
    projection to GPU fleets."""
    # engines do not fit beside each other here: plain receivers
    one_to_all = {n: raw_broadcast(tensors, n, args.pushes, store, port, next(generations),
                                   wire) for n in args.receivers}
    relay = {n: relay_broadcast(tensors, n, args.node_size, args.pushes, store, port,
                                generations, wire) for n in args.receivers}
    fixed, per_receiver = linear_fit(one_to_all)
    return {
        "push_seconds_by_receivers": {str(n): round(t, 4) for n, t in one_to_all.items()},
        "push_growth_per_doubling": round(growth_per_doubling(one_to_all), 3),
        "push_fit_fixed_s": round(fixed, 4), "push_fit_per_receiver_s": round(per_receiver, 4),
        "relay_node_size": args.node_size,
        "relay_push_seconds_by_receivers": {str(n): round(t, 4) for n, t in relay.items()},
        "relay_push_growth_per_doubling": round(growth_per_doubling(relay), 3),
        "projected_push_s": {str(n): projected_push_seconds(n) for n in (64, 512)},
    }


async def fanout_only(args: argparse.Namespace) -> dict:
    """The fan-out curves alone (no engines): the larger model's tensors."""
    store = host_store(0)
    with tempfile.TemporaryDirectory() as folder:
        model = build_models(Path(folder), args.big_params, tiny=False)["big"]
        tensors = load_tensors(model, "float32")
    report = {"big_params": sum(t.numel() for _, t in tensors), "pushes": args.pushes}
    report.update(fanout(tensors, torch.bfloat16, args, store, store.port, iter(range(1, 1000))))
    return report


async def compare_pushes(key: str, engines: list[Engine], tensors: Tensors, on_wire: Tensors,
                         flat: Tensors, wire: torch.dtype, pushes: int, store: Any, port: int,
                         generations: Iterator[int]) -> dict:
    """One receiver count's figures, under ``key``: the project's push into
    the running ``engines`` against a raw broadcast of the same tensors and
    of one flat buffer of their bytes, to as many plain receivers."""
    n = len(engines)
    raw_s = raw_broadcast(on_wire, n, pushes, store, port, next(generations))
    flat_s = raw_broadcast(flat, n, pushes, store, port, next(generations))
    push_s, loads = await push_into_engines(engines, tensors, pushes, store, port,
                                            next(generations), wire)
    return {f"{key}_push_s": round(push_s, 4), f"{key}_raw_s": round(raw_s, 4),
            f"{key}_flat_s": round(flat_s, 4), f"{key}_push_vs_raw": round(push_s / raw_s, 2),
            f"{key}_push_vs_flat": round(push_s / flat_s, 2),
            f"{key}_stall_s": round(statistics.mean(t.stall_seconds for t in loads), 4),
            f"{key}_load_s": round(statistics.mean(t.load_seconds for t in loads), 4),
            f"{key}_phases_s": {name: round(statistics.mean(t.phases[name] for t in loads), 4)
                                for name in loads[0].phases}}


async def main(args: argparse.Namespace) -> dict:
    store = host_store(0)  # any free port
    port = store.port
    generations = iter(range(1, 1000))
    report: dict = {"pushes": args.pushes, "engines": args.engines}
    with tempfile.TemporaryDirectory() as folder:
        models = build_models(Path(folder), args.big_params, tiny=not args.quick)
        for label, model in models.items():
            tensors = load_tensors(model, "float32")  # the learner's master weights
            wire = getattr(torch, ENGINE_DTYPES[label])
            on_wire = [(name, t.to(wire) if t.is_floating_point() else t) for name, t in tensors]
            nbytes = sum(t.numel() * t.element_size() for _, t in on_wire)
            report[f"{label}_params"] = sum(t.numel() for _, t in tensors)
            report[f"{label}_megabytes"] = round(nbytes / 1e6, 1)
            report[f"{label}_wire_bytes_vs_fp32"] = round(
                nbytes / sum(t.numel() * t.element_size() for _, t in tensors), 3)
            flat = [("flat", torch.zeros(nbytes, dtype=torch.uint8))]
            engines = [await Engine.start(str(model), EngineConfig(dtype=ENGINE_DTYPES[label]),
                                          SamplingConfig(), seed_offset=i,
                                          weight_timeout_s=GROUP_TIMEOUT_S)
                       for i in range(max(args.engines))]
            try:
                for n in args.engines:
                    report.update(await compare_pushes(
                        f"{label}_{n}", engines[:n], tensors, on_wire, flat, wire, args.pushes,
                        store, port, generations))
                if 1 in args.engines:  # the same push over ipc (staging files, this host)
                    ipc_s, _ = await push_into_engines(engines[:1], tensors, args.pushes,
                                                       store, port, next(generations), wire,
                                                       "ipc")
                    report[f"{label}_1_ipc_push_s"] = round(ipc_s, 4)
                    report[f"{label}_1_ipc_push_vs_raw"] = round(
                        ipc_s / report[f"{label}_1_raw_s"], 2)
                stalls = await stall_in_flight(engines[0], tensors, store, port,
                                               next(generations), args.stall_requests,
                                               args.stall_prompt_tokens)
                for mode, figures in stalls.items():
                    for name, seconds in figures.items():
                        report[f"{label}_in_flight_{mode}_{name}_s"] = round(seconds, 4)
            finally:
                for engine in engines:
                    await engine.shutdown()
            if label == "big" and not args.quick:
                report.update(fanout(tensors, wire, args, store, port, generations))
    first = min(args.engines)
    report["push_vs_raw_100m"] = report[f"big_{first}_push_vs_raw"]
    report["push_vs_flat_100m"] = report[f"big_{first}_push_vs_flat"]
    if 1 in args.engines:
        report["ipc_push_vs_raw_100m"] = report["big_1_ipc_push_vs_raw"]
    report["wire_bytes_vs_fp32"] = report["big_wire_bytes_vs_fp32"]
    report["stall_vs_load"] = round(report[f"big_{first}_stall_s"]
                                    / report[f"big_{first}_load_s"], 3)
    report["stall_requests"] = args.stall_requests
    report["stall_prompt_tokens"] = args.stall_prompt_tokens
    report["stall_keep_vs_recompute"] = round(report["big_in_flight_keep_mean_s"]
                                              / report["big_in_flight_recompute_mean_s"], 3)
    return report


if __name__ == "__main__":
    parser = BenchmarkParser(
        __doc__.splitlines()[0], quick="no tiny model; --big-params 2e6 --engines 1 --pushes 1 "
        "--receivers 1 2 --stall-requests 4 --stall-prompt-tokens 256 unless given, and no "
        "fan-out unless --fanout-only (smoke test)")
    parser.add_size("--big-params", 1e8, 2e6,
                    "parameters of the larger model (its JSON keys say big_*)", type=float)
    parser.add_size("--engines", [1, 2], [1], "engine counts to push into", type=int, nargs="+")
    parser.add_size("--pushes", 3, 1, "timed pushes per case", type=int)
    parser.add_size("--receivers", [1, 2, 4, 8], [1, 2],
                    "plain receiver counts of the push curve", type=int, nargs="+")
    parser.add_argument("--node-size", type=int, default=4,
                        help="receivers per node of the relayed curve: 4")
    parser.add_argument("--fanout-only", action="store_true",
                        help="only the fan-out curves (no engines)")
    parser.add_size("--stall-requests", 16, 4,
                    "requests in flight for the keep-vs-recompute stall", type=int)
    parser.add_size("--stall-prompt-tokens", 1024, 256, "prompt length of each of them",
                    type=int)
    arguments = parser.parse_args()
    quiet_vllm_logging()
    if arguments.fanout_only:
        result = asyncio.run(fanout_only(arguments))
        print(f"push to 1..N receivers: {result['push_seconds_by_receivers']} s "
              f"(x{result['push_growth_per_doubling']} per doubling); relayed through nodes "
              f"of {arguments.node_size}: {result['relay_push_seconds_by_receivers']} s "
              f"(x{result['relay_push_growth_per_doubling']}); projected for a 7B policy: "
              f"{result['projected_push_s']}")
        if arguments.json:
            print(json.dumps(result))
        raise SystemExit(0)
    result = asyncio.run(main(arguments))
    for label in ("tiny", "big") if not arguments.quick else ("big",):
        for n in arguments.engines:
            key = f"{label}_{n}"
            print(f"{label} ({result[f'{label}_megabytes']} MB) into {n} engine(s): push "
                  f"{result[f'{key}_push_s']} s vs raw broadcast {result[f'{key}_raw_s']} s "
                  f"= {result[f'{key}_push_vs_raw']}x; stall {result[f'{key}_stall_s']} s, "
                  f"load {result[f'{key}_load_s']} s; phases {result[f'{key}_phases_s']}")
        figures = {mode: [result[f"{label}_in_flight_{mode}_{name}_s"]
                          for name in ("mean", "max", "pause")] for mode in ("keep", "recompute")}
        print(f"{label}, {arguments.stall_requests} requests of {arguments.stall_prompt_tokens} "
              f"prompt tokens in flight: stall mean/max (engine paused) keep "
              f"{figures['keep'][0]}/{figures['keep'][1]} s ({figures['keep'][2]} s), recompute "
              f"{figures['recompute'][0]}/{figures['recompute'][1]} s "
              f"({figures['recompute'][2]} s)")
    print(f"stall_keep_vs_recompute = {result['stall_keep_vs_recompute']}")
    if not arguments.quick:
        print(f"push to 1..N receivers: {result['push_seconds_by_receivers']} s "
              f"(x{result['push_growth_per_doubling']} per doubling); relayed: "
              f"{result['relay_push_seconds_by_receivers']} s "
              f"(x{result['relay_push_growth_per_doubling']})")
    if arguments.json:
        print(json.dumps(result))
