"""How one replay process scales with the number of actors, against raw ZeroMQ
with the same clients, in one run.

Simulated actors are light clients multiplexed over a few processes: each has
its own DEALER socket and identity, registers (``Hello``), starts a rollout
only by spending a credit, sends its two segments of ``--tokens`` tokens,
counts its credits by the replay's ledger and sends heartbeats. A learner
client takes batches as fast as the replay serves them (no training), so
credits come back. For 64, 256 and 1,024 actors (``--actors``), with the
durable log on (fsync per ingest pass):

- saturation, every actor starting a rollout as soon as it may: accepted
  segments/s at the replay against a raw ZeroMQ ROUTER that answers each
  frame of the same clients (same sockets, frames and sizes; no credits) with
  a small reply, ``vs_raw_zmq_<N>``; and the acknowledgement latency there,
  ``ack_p99_ms_saturated_<N>`` (raw: ``raw_ack_p99_ms_saturated_<N>``), which
  is queueing: in a closed loop it is the clients in flight over the rate;
- an offered load of ``--load`` (0.5) times the replay's saturated rate,
  each actor starting a rollout once per interval at a random phase: the
  acknowledgement latency, send to the ``Ack`` listing the segment, p50/p99,
  ``ack_p50_ms_<N>``, ``ack_p99_ms_<N>``, against the raw router at the same
  load, ``raw_ack_p99_ms_<N>``;
- the replay process's RSS at the end and its CPU seconds per accepted
  segment at saturation: ``replay_rss_mb_<N>``, ``replay_cpu_us_per_segment_<N>``.

The server under test (replay or raw router) runs on core 0, the clients on
the others (see :data:`SERVER_CORES`).

    python bench/replay_scale.py [--json] [--quick] [--actors 64 256 1024] [--seconds 10]
        [--processes 4] [--tokens 2048] [--load 0.5]

``--quick``: 64 actors for 2 s (a smoke test of the same code).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import zmq
from _options import BenchmarkParser  # bench/_options.py

from protocol import Ack, Batch, BatchRequest, Heartbeat, Stamp, Welcome, decode, encode
from protocol.synthetic import synthetic_hello, synthetic_segment
from protocol.transport import TransportConfig, bind_router, connect_dealer
from replay.config import ReplayConfig
from replay.service import ReplayService

HEARTBEAT_S = 1.0
TRANSPORT = TransportConfig(heartbeat_interval_s=HEARTBEAT_S, heartbeat_liveness=30,
                            max_message_bytes=512 * 1024 * 1024)


#: The server under test (the replay, or the raw router) gets a core of its
#: own; the clients (and the learner) the others: on a shared pair of cores the
#: clients' CPU would count against the server, as it does not across hosts.
SERVER_CORES = {0}
CLIENT_CORES = set(range(1, os.cpu_count() or 1)) or {0}


def pin(cores: set[int]) -> None:
    os.sched_setaffinity(0, cores)


class SimulatedActor:
    """One actor's socket and ledger; ``raw``: no protocol, every frame answered."""

    def __init__(self, context: zmq.Context, address: str, name: str, incarnation: int,
                 tokens: int, raw: bool) -> None:
        self.stamp = Stamp(name, incarnation)
        self.socket = connect_dealer(context, address, TRANSPORT)
        self.raw = raw
        self.tokens = tokens
        self.ledger, self.seen, self.credits = 0, 0, 1 if raw else 0
        self.sent: dict[int, float] = {}
        self.rollouts = 0
        self.next_heartbeat = time.monotonic() + HEARTBEAT_S

    def hello(self) -> None:
        if not self.raw:
            self.socket.send(encode(synthetic_hello(self.stamp)))

    def start_rollout(self, now: float) -> None:
        """Spend a credit: both segments of a rollout go out at once."""
        self.credits -= 1
        rollout = f"{self.stamp.sender_id}-{self.stamp.incarnation}-{self.rollouts}"
        self.rollouts += 1
        for index in (0, 1):
            segment = synthetic_segment(self.stamp, rollout, index, index == 1,
                                        tokens=self.tokens)
            self.sent[segment.seq] = now
            self.socket.send(encode(segment), copy=False)

    def receive(self, now: float, latencies: list[float]) -> int:
        """Take every reply waiting; returns the segments acknowledged."""
        acked = 0
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return acked
            if self.raw:  # answered in order: the oldest frame sent
                latencies.append(now - self.sent.pop(next(iter(self.sent))))
                acked += 1
                if not self.sent:
                    self.credits = 1  # the raw router grants nothing: one rollout at a time
                continue
            message = decode(frame)
            if isinstance(message, Ack | Welcome):
                if message.credit_ledger != self.ledger:
                    self.ledger, self.seen = message.credit_ledger, 0
                self.credits += max(0, message.credits_total - self.seen)
                self.seen = max(self.seen, message.credits_total)
            if isinstance(message, Ack):
                for seq in message.stored_seqs:
                    if (sent := self.sent.pop(seq, None)) is not None:
                        latencies.append(now - sent)
                        acked += 1

    def heartbeat(self, now: float) -> None:
        if self.raw or now < self.next_heartbeat:
            return
        self.next_heartbeat = now + HEARTBEAT_S
        self.socket.send(encode(Heartbeat(
            **self.stamp.next(), active_rollouts=1 if self.sent else 0, stall_seconds={},
            credit_ledger=self.ledger, credits_seen=self.seen)))


def client_process(address: str, first: int, count: int, tokens: int, raw: bool,
                   seconds: float, interval: float, incarnation: int,
                   start: multiprocessing.Event,
                   results: multiprocessing.Queue) -> None:
    """``interval`` 0: each actor starts a rollout as soon as it may
    (saturation); otherwise one every ``interval`` seconds, at a random phase
    (an offered load), or as soon as it may after that if it could not."""
    pin(CLIENT_CORES)
    phases = random.Random(first)
    context = zmq.Context()
    actors = [SimulatedActor(context, address, f"sim-{first + i}", incarnation, tokens, raw)
              for i in range(count)]
    poller = zmq.Poller()
    by_socket = {}
    for actor in actors:
        poller.register(actor.socket, zmq.POLLIN)
        by_socket[actor.socket] = actor
    start.wait()
    for actor in actors:
        actor.hello()
    latencies: list[float] = []
    acked = 0
    began = time.monotonic()
    end = began + seconds
    due = [began + phases.uniform(0, interval) for _ in actors]
    while (now := time.monotonic()) < end:
        for i, actor in enumerate(actors):
            if actor.credits > 0 and not actor.sent and now >= due[i]:
                actor.start_rollout(now)
                due[i] += interval
            actor.heartbeat(now)
        for socket, _ in poller.poll(10):
            acked += by_socket[socket].receive(time.monotonic(), latencies)
    results.put((acked, time.monotonic() - began, latencies))
    for actor in actors:
        actor.socket.close(linger=0)
    context.term()


def raw_router(address: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """Answers each frame at once: the transport's ceiling with these clients."""
    pin(SERVER_CORES)
    context = zmq.Context()
    socket = bind_router(context, "tcp://127.0.0.1:*", TRANSPORT)
    address.put(socket.getsockopt_string(zmq.LAST_ENDPOINT))
    while not stop.is_set():
        if socket.poll(50):
            while True:
                try:
                    identity, _ = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    socket.send_multipart([identity, b"ok"])
                except zmq.ZMQError:  # a client gone at the end (ROUTER_MANDATORY)
                    pass
    socket.close(linger=0)
    context.term()


def replay_process(folder: str, batch: int, addresses: multiprocessing.Queue,
                   stop: multiprocessing.Event) -> None:
    pin(SERVER_CORES)
    config = ReplayConfig(actor_address="tcp://127.0.0.1:0", learner_address="tcp://127.0.0.1:0",
                          durable_log=True, log_path=f"{folder}/segments.log", metrics_port=0,
                          rollouts_per_batch=batch, max_staleness=8,
                          max_buffer_bytes=8 * 1024**3, vocab_size=100)
    service = ReplayService(config, TRANSPORT)
    addresses.put((service.actor_socket.getsockopt_string(zmq.LAST_ENDPOINT),
                   service.learner_socket.getsockopt_string(zmq.LAST_ENDPOINT)))
    service.serve(stop)
    service.close()


def drain_batches(address: str, batch: int, stop: threading.Event) -> None:
    """The learner: a request at a time, each answered batch taken at once."""
    context = zmq.Context()
    socket = connect_dealer(context, address, TRANSPORT)
    stamp = Stamp("learner", 1)
    waiting = False
    while not stop.is_set():
        if not waiting:
            socket.send(encode(BatchRequest(**stamp.next(), size=batch, policy_version=0)))
            waiting = True
        if socket.poll(50) and isinstance(decode(socket.recv()), Batch):
            waiting = False
    socket.close(linger=0)
    context.term()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_clients(address: str, actors: int, processes: int, tokens: int, raw: bool,
                seconds: float, interval: float = 0.0, incarnation: int = 1
                ) -> tuple[float, list[float]]:
    """Acknowledged segments per second over the window, and every latency."""
    spawn = multiprocessing.get_context("spawn")
    start, results = spawn.Event(), spawn.Queue()
    shares = [actors // processes + (i < actors % processes) for i in range(processes)]
    firsts = [sum(shares[:i]) for i in range(processes)]
    workers = [spawn.Process(target=client_process, args=(
        address, first, share, tokens, raw, seconds, interval, incarnation, start, results))
        for first, share in zip(firsts, shares, strict=True) if share]
    for worker in workers:
        worker.start()
    time.sleep(1.0 + actors / 500)  # sockets connected
    start.set()
    outcomes = [results.get(timeout=seconds + 300) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    acked = sum(o[0] for o in outcomes)
    window = max(o[1] for o in outcomes)
    return acked / window, [latency for o in outcomes for latency in o[2]]


def percentile_ms(latencies: list[float], q: float) -> float:
    ordered = sorted(latencies)
    return round(ordered[int(q * (len(ordered) - 1))] * 1000, 2)


def measure(actors: int, args: argparse.Namespace) -> dict:
    """Saturation (every actor starts a rollout as soon as it may) for the raw
    router and the replay, then both again at an offered load of
    ``args.load`` times the replay's saturated rate, for latency."""
    spawn = multiprocessing.get_context("spawn")
    stop, addresses = spawn.Event(), spawn.Queue()
    router = spawn.Process(target=raw_router, args=(addresses, stop))
    router.start()
    raw_address = addresses.get(timeout=60)
    raw_rate, raw_saturated = run_clients(raw_address, actors, args.processes, args.tokens,
                                          True, args.seconds)
    with tempfile.TemporaryDirectory() as folder:
        replay_stop, addresses = spawn.Event(), spawn.Queue()
        batch = max(8, actors // 8)
        replay = spawn.Process(target=replay_process,
                               args=(folder, batch, addresses, replay_stop))
        replay.start()
        actor_address, learner_address = addresses.get(timeout=60)
        drained = threading.Event()
        learner = threading.Thread(target=drain_batches, args=(learner_address, batch, drained))
        learner.start()
        cpu_before = cpu_seconds(replay.pid)
        rate, saturated = run_clients(actor_address, actors, args.processes, args.tokens, False,
                                      args.seconds)
        cpu = cpu_seconds(replay.pid) - cpu_before
        offered = args.load * rate
        interval = 2 * actors / offered  # two segments per rollout
        # a new incarnation: the same seqs again would be taken as duplicates
        paced_rate, paced = run_clients(actor_address, actors, args.processes, args.tokens,
                                        False, args.seconds, interval, incarnation=2)
        rss = rss_mb(replay.pid)
        drained.set()
        learner.join(timeout=30)
        replay_stop.set()
        replay.join(timeout=60)
    _, raw_paced = run_clients(raw_address, actors, args.processes, args.tokens, True,
                               args.seconds, interval)
    stop.set()
    router.join(timeout=30)
    accepted = rate * args.seconds
    return {f"raw_zmq_segments_per_s_{actors}": round(raw_rate, 1),
            f"replay_segments_per_s_{actors}": round(rate, 1),
            f"vs_raw_zmq_{actors}": round(rate / raw_rate, 3),
            f"offered_segments_per_s_{actors}": round(offered, 1),
            f"replay_paced_segments_per_s_{actors}": round(paced_rate, 1),
            f"ack_p50_ms_{actors}": percentile_ms(paced, 0.5),
            f"ack_p99_ms_{actors}": percentile_ms(paced, 0.99),
            f"raw_ack_p99_ms_{actors}": percentile_ms(raw_paced, 0.99),
            f"ack_p99_ms_saturated_{actors}": percentile_ms(saturated, 0.99),
            f"raw_ack_p99_ms_saturated_{actors}": percentile_ms(raw_saturated, 0.99),
            f"replay_rss_mb_{actors}": round(rss, 1),
            f"replay_cpu_us_per_segment_{actors}": round(cpu / max(1.0, accepted) * 1e6, 1)}


def main() -> None:
    parser = BenchmarkParser(__doc__.splitlines()[0],
                             quick="--actors 64 --seconds 2 unless given (smoke test)")
    parser.add_size("--actors", [64, 256, 1024], [64], "simulated actor counts", type=int,
                    nargs="+")
    parser.add_size("--seconds", 10.0, 2.0, "measured window per case", type=float)
    parser.add_argument("--processes", type=int, default=4, help="client processes: 4")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per segment: 2048")
    parser.add_argument("--load", type=float, default=0.5,
                        help="offered load for latency, times the replay's saturated rate: 0.5")
    args = parser.parse_args()
    result: dict = {"actors": args.actors, "seconds": args.seconds, "tokens": args.tokens,
                    "load": args.load, "durable_log": True}
    for actors in args.actors:
        figures = measure(actors, args)
        result.update(figures)
        print(f"{actors} actors: saturated, replay {figures[f'replay_segments_per_s_{actors}']} "
              f"segments/s vs raw {figures[f'raw_zmq_segments_per_s_{actors}']} "
              f"= {figures[f'vs_raw_zmq_{actors}']}x, ack p99 "
              f"{figures[f'ack_p99_ms_saturated_{actors}']} ms (raw "
              f"{figures[f'raw_ack_p99_ms_saturated_{actors}']}); at "
              f"{figures[f'offered_segments_per_s_{actors}']} segments/s offered, ack p50/p99 "
              f"{figures[f'ack_p50_ms_{actors}']}/{figures[f'ack_p99_ms_{actors}']} ms (raw p99 "
              f"{figures[f'raw_ack_p99_ms_{actors}']}); "
              f"RSS {figures[f'replay_rss_mb_{actors}']} MB, "
              f"{figures[f'replay_cpu_us_per_segment_{actors}']} us CPU per segment", flush=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
