"""Replay ingest throughput against raw ZeroMQ, and batch-serving latency.

Several sender processes push realistic segments (8k tokens, two per
rollout) over loopback and wait until every one is acknowledged:

- to the replay service with the durable log off, then on (fsync per batch);
- to a raw ZeroMQ ROUTER that answers each frame with a small reply, with
  byte blobs of the same sizes: the transport's own ceiling.

Then a learner asks for batches of ready rollouts; the time from request to
batch is the serving latency. Ratios are the figures to quote.

    python bench/replay_ingest.py [--json] [--quick] [--senders 3] [--segments 1000]

``--quick``: 2 senders of 40 segments (a smoke test of the same code).
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

import zmq
from _options import BenchmarkParser  # bench/_options.py

from protocol import Ack, Batch, BatchRequest, Stamp, decode, encode
from protocol.synthetic import synthetic_hello, synthetic_segment
from protocol.transport import TransportConfig, bind_router, connect_dealer
from replay.config import ReplayConfig
from replay.service import ReplayService

TOKENS = 8192


def sender(address: str, index: int, segments: int, raw: bool, start: multiprocessing.Event,
           done: multiprocessing.Queue) -> None:
    stamp = Stamp(f"sender-{index}", 1)
    hello = encode(synthetic_hello(stamp))  # the replay hears a connection after its hello
    frames = [encode(synthetic_segment(stamp, f"s{index}-r{n // 2}", n % 2, n % 2 == 1,
                                  tokens=TOKENS)) for n in range(segments)]
    context = zmq.Context()
    socket = connect_dealer(context, address, TransportConfig())
    start.wait()
    began = time.perf_counter()
    if not raw:
        socket.send(hello)
    for frame in frames:
        socket.send(frame, copy=False)
    acknowledged = 0
    while acknowledged < segments:
        reply = socket.recv()
        if raw:
            acknowledged += 1
        elif isinstance(message := decode(reply), Ack):  # not the hello's Welcome
            acknowledged += len(message.stored_seqs)
    done.put((began, time.perf_counter(), sum(len(f) for f in frames)))
    socket.close(linger=0)
    context.term()


def raw_router(address_holder: list, stop: threading.Event) -> None:
    context = zmq.Context()
    socket = bind_router(context, "tcp://127.0.0.1:*", TransportConfig())
    address_holder.append(socket.getsockopt_string(zmq.LAST_ENDPOINT))
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(50):
            identity, _ = socket.recv_multipart(copy=False)
            socket.send_multipart([identity, b"ok"])
    socket.close(linger=0)
    context.term()


def push(address: str, senders: int, segments: int, raw: bool) -> float:
    """Segments per second, from the first send to the last acknowledgement."""
    spawn = multiprocessing.get_context("spawn")
    start, done = spawn.Event(), spawn.Queue()
    processes = [spawn.Process(target=sender, args=(address, i, segments, raw, start, done))
                 for i in range(senders)]
    for process in processes:
        process.start()
    time.sleep(2.0)  # let them connect and encode
    start.set()
    results = [done.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    began = min(r[0] for r in results)
    ended = max(r[1] for r in results)
    return senders * segments / (ended - began)


def replay_ingest(senders: int, segments: int, durable: bool, folder: Path
                  ) -> tuple[float, list[float]]:
    config = ReplayConfig(actor_address="tcp://127.0.0.1:0", learner_address="tcp://127.0.0.1:0",
                          durable_log=durable, log_path=str(folder / f"log-{durable}"),
                          metrics_port=0, rollouts_per_batch=8,
                          max_buffer_bytes=4 * 1024**3)
    service = ReplayService(config, TransportConfig())
    actor_address = service.actor_socket.getsockopt_string(zmq.LAST_ENDPOINT)
    learner_address = service.learner_socket.getsockopt_string(zmq.LAST_ENDPOINT)
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop,))
    thread.start()
    try:
        rate = push(actor_address, senders, segments, raw=False)
        latencies = serve_batches(learner_address, batches=min(20, senders * segments // 16))
    finally:
        stop.set()
        thread.join()
        service.close()
    return rate, latencies


def serve_batches(address: str, batches: int) -> list[float]:
    context = zmq.Context()
    socket = connect_dealer(context, address, TransportConfig())
    stamp = Stamp("learner", 1)
    latencies = []
    for _ in range(batches):
        began = time.perf_counter()
        socket.send(encode(BatchRequest(**stamp.next(), size=8, policy_version=0)))
        reply = decode(socket.recv())
        assert isinstance(reply, Batch) and len(reply.rollouts) == 8
        latencies.append(time.perf_counter() - began)
    socket.close(linger=0)
    context.term()
    return latencies


def main() -> None:
    parser = BenchmarkParser(__doc__.splitlines()[0],
                             quick="2 senders of 40 segments unless given (smoke test)")
    parser.add_size("--senders", 3, 2, "sending processes", type=int)
    parser.add_size("--segments", 1000, 40, "segments per sender", type=int)
    args = parser.parse_args()

    holder: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=raw_router, args=(holder, stop))
    thread.start()
    while not holder:
        time.sleep(0.01)
    raw = push(holder[0], args.senders, args.segments, raw=True)
    stop.set()
    thread.join()
    with tempfile.TemporaryDirectory() as folder:
        log_off, latencies = replay_ingest(args.senders, args.segments, False, Path(folder))
        log_on, _ = replay_ingest(args.senders, args.segments, True, Path(folder))
    result = {
        "senders": args.senders, "segments": args.senders * args.segments,
        "segment_tokens": TOKENS, "raw_zmq_segments_per_s": round(raw, 1),
        "log_off_segments_per_s": round(log_off, 1), "log_on_segments_per_s": round(log_on, 1),
        "vs_raw_zmq_log_off": round(log_off / raw, 3), "vs_raw_zmq_log_on": round(log_on / raw, 3),
        "batch_latency_ms_p50": round(statistics.median(latencies) * 1000, 2),
        "batch_latency_ms_max": round(max(latencies) * 1000, 2),
    }
    print(f"raw ZeroMQ {result['raw_zmq_segments_per_s']} segments/s; replay log off "
          f"{result['log_off_segments_per_s']} ({result['vs_raw_zmq_log_off']}x), log on "
          f"{result['log_on_segments_per_s']} ({result['vs_raw_zmq_log_on']}x); batch of 8 "
          f"served in {result['batch_latency_ms_p50']} ms (p50)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
