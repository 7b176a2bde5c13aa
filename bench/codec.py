"""Segment encode+decode throughput against pickle, plain msgpack and memcpy.

For segments of 1k, 32k and 128k tokens, one round trip is encode then
decode (with validation) back to arrays usable by the receiver. Baselines in
the same run, on the same data:

- pickle (protocol 5) of the same segment as a dataclass of numpy arrays;
- the reference ``msgpack`` package, arrays as ``bytes`` (what a hand-rolled
  MessagePack codec without typed structs does);
- one plain memory copy (numpy.copyto) of the encoded frame's bytes into a
  preallocated buffer: the floor any codec that moves the bytes once has.

Throughput counts the segment's array bytes (13 bytes per token). Ratios are
the figures to quote; absolute numbers on a shared machine are noise.

    python bench/codec.py [--json] [--quick]
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
from _options import BenchmarkParser  # bench/_options.py

from protocol import Array, Segment, decode, encode

SIZES = {"1k": 1024, "32k": 32 * 1024, "128k": 128 * 1024}


@dataclass
class PickledSegment:
    """The same content as a Segment, for the pickle baseline."""

    sender_id: str
    incarnation: int
    seq: int
    sent_at: float
    rollout_id: str
    task_id: str
    index: int
    segment_type: str
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    final: bool
    reward: float | None


def make_arrays(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    mask = (rng.random(n) < 0.6).astype(np.uint8)
    return {
        "tokens": rng.integers(0, 150_000, n, dtype=np.int32),
        "loss_mask": mask,
        "logprobs": np.where(mask, -rng.random(n, dtype=np.float32) * 5, 0).astype(np.float32),
        "versions": np.where(mask, 7, -1).astype(np.int32),
    }


HEADER = dict(sender_id="actor-12", incarnation=3, seq=4711, sent_at=1.7e9, rollout_id="r-9f2c",
              task_id="keyvault-123", index=2, segment_type="execution", final=True, reward=1.0)


def round_trip_ours(arrays: dict[str, np.ndarray]) -> Callable[[], object]:
    segment = Segment(**HEADER, **{k: Array.from_numpy(v) for k, v in arrays.items()})

    def run() -> object:
        received = decode(encode(segment))
        return received.tokens.numpy(), received.logprobs.numpy()
    return run


def round_trip_pickle(arrays: dict[str, np.ndarray]) -> Callable[[], object]:
    segment = PickledSegment(**HEADER, **arrays)
    return lambda: pickle.loads(pickle.dumps(segment, protocol=5))


def round_trip_msgpack(arrays: dict[str, np.ndarray]) -> Callable[[], object]:
    def run() -> object:
        frame = msgpack.packb({**HEADER, **{k: [v.dtype.name, list(v.shape), v.tobytes()]
                                            for k, v in arrays.items()}})
        plain = msgpack.unpackb(frame)
        return {k: np.frombuffer(plain[k][2], dtype=plain[k][0]) for k in arrays}
    return run


def memory_copy(arrays: dict[str, np.ndarray]) -> Callable[[], object]:
    frame = encode(Segment(**HEADER, **{k: Array.from_numpy(v) for k, v in arrays.items()}))
    source = np.frombuffer(frame, dtype=np.uint8)
    target = np.empty_like(source)
    return lambda: np.copyto(target, source)


def best_seconds(run: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Best per-call time over ``repeats`` timed loops of about budget_s/repeats each."""
    start = time.perf_counter()
    run()
    calls = max(1, int(budget_s / repeats / max(time.perf_counter() - start, 1e-7)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    args = BenchmarkParser(__doc__.splitlines()[0],
                           quick="short timing loops (smoke test)").parse_args()
    repeats, budget = (3, 0.05) if args.quick else (7, 1.0)

    rng = np.random.default_rng(0)
    methods = {"ours": round_trip_ours, "pickle": round_trip_pickle,
               "msgpack": round_trip_msgpack, "memcpy": memory_copy}
    result: dict[str, float] = {}
    print(f"{'tokens':>6} {'method':>8} {'GB/s':>8} {'us/segment':>11}")
    for label, n in SIZES.items():
        arrays = make_arrays(n, rng)
        payload = sum(a.nbytes for a in arrays.values())
        throughput = {}
        for name, make in methods.items():
            seconds = best_seconds(make(arrays), repeats, budget)
            throughput[name] = payload / seconds
            print(f"{label:>6} {name:>8} {throughput[name] / 1e9:8.2f} {seconds * 1e6:11.1f}")
        result[f"ours_gbps_{label}"] = round(throughput["ours"] / 1e9, 3)
        result[f"vs_pickle_{label}"] = round(throughput["ours"] / throughput["pickle"], 2)
        result[f"vs_msgpack_{label}"] = round(throughput["ours"] / throughput["msgpack"], 2)
        result[f"vs_memcpy_{label}"] = round(throughput["ours"] / throughput["memcpy"], 3)
    print("ratios (throughput, higher is better): " + ", ".join(
        f"{k}={v}" for k, v in result.items() if k.startswith("vs_")))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
