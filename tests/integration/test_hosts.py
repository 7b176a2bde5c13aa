"""A run across hosts, with the hosts made on this machine (tests/netns.py):
the replay on host `replay`, the learner on hosts `learner-0` and `learner-1`
(two torchrun nodes, one rank each, FSDP2 over gloo), an actor on `actor-0`,
CURVE on for every service socket and the weight store. (Several actors
against one replay and learner are the fault run's, on loopback: a second
actor host would prove nothing more here, at an engine start's cost on the
one core this test has.) Each
service binds its host's address; only each process's own metrics listen on
its host's loopback (asserted from what listens on each host).

It asserts what the loopback `up` runs assert (publications reach the
actor, versions advance, rollouts with compactions are trained, no process is
left), and that a fifth host without the run's keys, knowing every address,
gets no reply from any socket, cannot read the weight store or join a weight
group, while the publications to the real actor go on.

Not covered by CURVE here, by design (docs/reliability.md, §7): the
learner nodes' own rendezvous (torchrun's store at learner.rdzv_endpoint)
and the gloo/NCCL connections, which carry no keys; the test lists what
listens beyond loopback on every host and checks that only those and the
service ports do."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from protocol.transport import generate_keys
from tests.netns import INTERFACE, Hosts, namespaces_unavailable, our_namespaces
from tests.processes import Background, process_tree, run_command, running, wait_until

pytestmark = pytest.mark.slow

HOSTS = ["replay", "learner-0", "learner-1", "actor-0", "intruder"]
#: Learner steps before the intruder tries, and after it (the run goes on).
STEPS_BEFORE, STEPS_AFTER = 1, 1
PORTS = {"actors": 5555, "learner": 5556, "control": 5557, "store": 5558, "rdzv": 29400}
METRICS = {"replay": 9100, "learner": 9102, "actor": 9110}
ROOT = Path(__file__).parents[2]


def _config(hosts: Hosts, model: Path, out: Path, keys: Path) -> str:
    replay, learner = hosts.address("replay"), hosts.address("learner-0")
    return f"""
[run]
name = "hosts"
out_dir = "{out}"
model = "{model}"
max_minutes = 0.0

[actors]
concurrent_episodes = 2
metrics_port = {METRICS["actor"]}

[actors.environment]
max_steps = 12  # with the window of 260 tokens: episodes compact

[replay]
actor_address = "tcp://{replay}:{PORTS["actors"]}"
learner_address = "tcp://{replay}:{PORTS["learner"]}"
rollouts_per_batch = 4
metrics_port = {METRICS["replay"]}

[learner]
nproc = 1
nnodes = 2
rdzv_endpoint = "{learner}:{PORTS["rdzv"]}"
max_steps = 1000
control_address = "tcp://{learner}:{PORTS["control"]}"
weight_store_address = "{learner}:{PORTS["store"]}"
metrics_port = {METRICS["learner"]}

[transport]
heartbeat_interval_s = 2.0  # 2 cores carry 2 engines and 2 learner ranks

[transport.curve]
enabled = true
server_secret_key = "{keys}/server.key_secret"
server_public_key = "{keys}/server.key"
client_secret_key = "{keys}/client-0.key_secret"
authorized_keys_dir = "{keys}/authorized"
"""


def _scrape(hosts: Hosts, host: str, port: int, name: str) -> float:
    """Sum of metric ``name`` at a process's metrics port, read on its host."""
    program = ("import sys; from ops.summary import scrape; "
               "s = scrape(f'http://127.0.0.1:{sys.argv[1]}/metrics') or {}; "
               "print(sum(v for _, v in s.get(sys.argv[2], [])))")
    result = run_command(hosts.run(host, [sys.executable, "-c", program, str(port), name]),
                         timeout=60, env={"PYTHONPATH": str(ROOT)})
    return float(result.stdout.strip() or 0)


def _listening(hosts: Hosts, host: str) -> set[str]:
    """HOST:PORT of every TCP socket listening on ``host``."""
    result = run_command(hosts.run(host, ["ss", "-Hltn"]), timeout=30)
    return {line.split()[3] for line in result.stdout.splitlines() if line.strip()}


def _published(log: str) -> list[int]:
    return [int(v) for v in re.findall(r"published version (\d+) to 1 actors", log)]


def _steps(log: str) -> int:
    return len(re.findall(r"compactionrl.learner step \d+", log))


@pytest.fixture
def hosts() -> Hosts:
    if (why := namespaces_unavailable()) is not None:
        pytest.skip(why)
    with Hosts(HOSTS) as made:
        yield made
    assert our_namespaces(made.prefix) == [], "a host outlived the test"


def test_a_run_across_hosts_with_curve_trains_and_keeps_an_intruder_out(
        hosts: Hosts, tiny_model_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, ["server", "client-0"])
    generate_keys(tmp_path / "intruder-keys", ["intruder"])
    config = tmp_path / "hosts.toml"
    config.write_text(_config(hosts, tiny_model_dir, tmp_path / "runs", keys))
    # the local configuration (its small window makes episodes compact), then
    # the hosts' settings over it
    common = ["--config", str(ROOT / "deploy" / "configs" / "local-cpu.toml"),
              "--config", str(config)]
    # gloo picks its interface by the host name, which names no namespace's address
    env = {"GLOO_SOCKET_IFNAME": INTERFACE}
    logs = tmp_path / "logs"
    logs.mkdir()
    processes: dict[str, Background] = {}

    def start(name: str, host: str, *args: str) -> Background:
        processes[name] = Background([*args, *common], logs / f"{name}.log", env,
                                     hosts.run(host, []))
        return processes[name]

    trees: set[int] = set()
    try:
        replay = start("replay", "replay", "replay")
        learners = [start(f"learner-{n}", f"learner-{n}", "learner",
                          "--learner.node_rank", str(n)) for n in (0, 1)]
        cores = sorted(os.sched_getaffinity(0))  # this test's cores (one xdist worker's)
        start("actor-0", "actor-0", "actor", "--actor-id", "actor-0",
              "--actors.engine.cpu_threads_bind", str(cores[0]))
        learner = learners[0]
        learner.wait_for("published version 1 to 1 actors", timeout=600)
        end = time.monotonic() + 600
        while _steps(learner.log()) < STEPS_BEFORE:
            assert time.monotonic() < end, f"no {STEPS_BEFORE} steps:\n{learner.log()[-3000:]}"
            for process in processes.values():
                assert process.process.poll() is None, process.log()[-3000:]
            time.sleep(1)
        for process in processes.values():
            trees.update(process_tree(process.process.pid))

        # the services listen on their host's address, never on a wildcard;
        # loopback holds each process's metrics (and the engines' own sockets)
        replay_address, learner_address = hosts.address("replay"), hosts.address("learner-0")
        assert {f"{replay_address}:{PORTS['actors']}", f"{replay_address}:{PORTS['learner']}"
                } <= _listening(hosts, "replay")
        assert {f"{learner_address}:{PORTS['control']}", f"{learner_address}:{PORTS['store']}"
                } <= _listening(hosts, "learner-0")
        listening = {host: _listening(hosts, host) for host in HOSTS[:-1]}
        print("MEASURED listening:", json.dumps({h: sorted(a) for h, a in listening.items()}))
        for host, addresses in listening.items():
            metrics = METRICS[host.split("-")[0]]
            assert {a for a in addresses if a.startswith("127.")} == {f"127.0.0.1:{metrics}"}
            beyond = {a for a in addresses if not a.startswith(("127.", hosts.address(host)))}
            # torchrun's rendezvous store on learner node 0 binds every
            # interface (not a service socket: see the docstring)
            assert beyond == ({f"*:{PORTS['rdzv']}"} if host == "learner-0" else set()), beyond

        # the intruder, with every address and a key pair of its own
        before = _published(learner.log())
        result = run_command(hosts.run("intruder", [
            sys.executable, str(ROOT / "tests" / "programs" / "intruder.py"),
            "--replay", f"{replay_address}:{PORTS['actors']}",
            "--replay-learner", f"{replay_address}:{PORTS['learner']}",
            "--control", f"{learner_address}:{PORTS['control']}",
            "--store", f"{learner_address}:{PORTS['store']}",
            "--key", str(tmp_path / "intruder-keys" / "intruder.key_secret"),
            "--server-key", str(keys / "server.key")]),
            timeout=300, env={**env, "PYTHONPATH": str(ROOT)})
        assert result.returncode == 0, result.stderr[-3000:]
        attempts = json.loads(result.stdout.strip().splitlines()[-1])
        print("MEASURED intruder:", json.dumps(attempts))
        for what, outcome in attempts.items():
            assert outcome.get("replies", 0) == 0, (what, outcome)
            assert outcome.get("joined", 0) == 0, what
        # a plain TCP client gets the ZeroMQ greeting at most, never data
        assert attempts["store / plain TCP"]["bytes"] <= 64

        # the run goes on: later publications reach the actor
        target = _steps(learner.log()) + STEPS_AFTER
        end = time.monotonic() + 600
        while _steps(learner.log()) < target or _published(learner.log())[-1:] <= before[-1:]:
            assert time.monotonic() < end, learner.log()[-3000:]
            time.sleep(1)
        versions = _published(learner.log())
        assert versions == sorted(versions) and versions[-1] > before[-1] >= 1
        processes["actor-0"].wait_for(f"loaded version {versions[-1]}", 60)
        assert _scrape(hosts, "learner-0", METRICS["learner"],
                       "crl_learner_rollout_compactions_sum") > 0  # trained on compactions
        assert _scrape(hosts, "replay", METRICS["replay"], "crl_replay_rejected_total") == 0

        # a clean stop: the learner writes its checkpoint, then the others go
        for process in learners:
            process.send(signal.SIGTERM)
        learner.wait_for("stopped cleanly (signal)", timeout=300)
        for name in ("actor-0", "replay"):
            processes[name].send(signal.SIGTERM)
        for process in processes.values():
            process.process.wait(timeout=120)
        assert replay.process.returncode == 0, replay.log()[-2000:]
    finally:
        for process in processes.values():
            trees.update(process_tree(process.process.pid) if running(process.process.pid)
                         else [])
            process.stop()
        for pid in trees:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    left = lambda: [pid for pid in trees if running(pid)] + hosts.pids()  # noqa: E731
    wait_until(lambda: not left(), 30, "every process's exit", context=lambda: f"left: {left()}")
