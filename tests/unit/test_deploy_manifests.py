"""Deployment beyond one machine, checked offline: the Kubernetes base
(deploy/k8s) rendered by kustomize and validated against the API schemas, the
command line of every container loaded by the real configuration loader, the
Slurm script's syntax and a dry run of it with stand-ins for srun and
scontrol, and the 7B example configuration. No API server, Slurm or GPU is
involved."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from deploy.cli import build_parser
from deploy.config import JobConfig, load_config
from deploy.memory_plan import GIB, engine_memory, learner_host_memory
from deploy.model_shapes import shape_of

ROOT = Path(__file__).parents[2]
K8S = ROOT / "deploy" / "k8s"
SBATCH = ROOT / "deploy" / "slurm" / "compactionrl.sbatch"
GPU_7B = ROOT / "deploy" / "configs" / "gpu-7b.toml"
CONFIG_IN_POD = "/etc/compactionrl/run.toml"

kubernetes_validate = pytest.importorskip("kubernetes_validate")
# The oldest release still common in production and the newest bundled.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: cannot render the kustomization offline")
    result = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


@pytest.fixture(scope="module")
def run_toml(rendered: list[dict], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ConfigMap's run.toml, as the pods see it."""
    (config_map,) = [d for d in by_kind(rendered, "ConfigMap").values()
                     if d["metadata"]["name"].startswith("compactionrl-config-")]
    path = tmp_path_factory.mktemp("configmap") / "run.toml"
    path.write_text(config_map["data"]["run.toml"])
    return path


#: What the downward API gives a pod (a Deployment's pod name; a StatefulSet
#: pod's ordinal).
POD_ENV = {"POD_NAME": "actors-h100-5d8f7c9b4-x7k2p", "POD_INDEX": "0"}


def effective(workload: dict, run_toml: Path) -> tuple[object, JobConfig]:
    """What `compactionrl ARGS` would run with: the CLI's own parser, then the
    configuration loader on the ConfigMap's file (validation included)."""
    c = container(workload)
    assert c["command"] == ["compactionrl"]
    # Kubernetes expands $(VAR) in args from the container's env, which must define it
    defined = {e["name"] for e in c.get("env", [])}
    args = []
    for arg in c["args"]:
        for name, value in POD_ENV.items():
            if f"$({name})" in arg:
                assert name in defined, name
                arg = arg.replace(f"$({name})", value)
        args.append(arg)
    args[args.index("--config") + 1] = str(run_toml)
    assert CONFIG_IN_POD in c["args"]
    parsed, overrides = build_parser().parse_known_args(args)
    return parsed, load_config(parsed.config, overrides)


def service_port(docs: list[dict], service: str, name: str) -> int:
    ports = by_kind(docs, "Service")[service]["spec"]["ports"]
    return next(p["port"] for p in ports if p["name"] == name)


# --------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_document_matches_the_api_schema(rendered: list[dict],
                                                        version: str) -> None:
    kinds = sorted(d["kind"] for d in rendered)
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "Deployment", "NetworkPolicy",
                     "PersistentVolumeClaim", "PersistentVolumeClaim", "PersistentVolumeClaim",
                     "Service", "Service", "StatefulSet"]
    for doc in rendered:
        # strict: unknown fields (a misspelt key) fail too
        kubernetes_validate.validate(doc, version, strict=True)


def test_config_map_loads_with_the_project_loader(run_toml: Path) -> None:
    config = load_config(run_toml)
    assert config.run.model == "/models/Qwen2.5-7B-Instruct"
    assert config.transport.metrics_address == "0.0.0.0"


def test_run_toml_is_gpu_7b_with_the_cluster_addresses(run_toml: Path) -> None:
    """Only the addresses (and the vocabulary size the replay would otherwise
    read from a model volume it does not mount, and its log, on its own
    volume) may differ."""
    def flat(config: JobConfig) -> dict[str, object]:
        out = {}
        for section, fields in asdict(config).items():
            stack = [(section, fields)]
            while stack:
                prefix, table = stack.pop()
                for key, value in table.items():
                    if isinstance(value, dict) and key != "options":
                        stack.append((f"{prefix}.{key}", value))
                    else:
                        out[f"{prefix}.{key}"] = value
        return out

    cluster, example = flat(load_config(run_toml)), flat(load_config(GPU_7B))
    differing = {key for key in example if cluster[key] != example[key]}
    assert differing == {"replay.actor_address", "replay.learner_address",
                         "learner.control_address", "learner.weight_store_address",
                         "replay.actor_bind", "replay.learner_bind", "learner.control_bind",
                         "learner.weight_store_bind", "replay.vocab_size", "replay.log_path"}


def test_services_bind_on_the_pod_and_clients_reach_the_services(rendered: list[dict],
                                                                  run_toml: Path) -> None:
    """Every process reads run.toml unchanged: services bind the pod's ports
    (*_bind), clients connect to the Service names (*_address)."""
    pods = workloads(rendered)
    actor_port = service_port(rendered, "replay", "actors")
    learner_port = service_port(rendered, "replay", "learner")
    control_port = service_port(rendered, "learner", "control")
    store_port = service_port(rendered, "learner", "store")

    replay_args, replay = effective(pods["replay"], run_toml)
    assert replay_args.command == "replay"
    assert replay.replay.actor_bind == f"tcp://0.0.0.0:{actor_port}"
    assert replay.replay.learner_bind == f"tcp://0.0.0.0:{learner_port}"
    assert not any(arg.startswith("--replay.") for arg in container(pods["replay"])["args"])

    learner_args, learner = effective(pods["learner"], run_toml)
    assert (learner_args.command, learner_args.resume) == ("learner", "latest")
    assert learner.learner.control_bind == f"tcp://0.0.0.0:{control_port}"
    assert learner.learner.weight_store_bind == f"0.0.0.0:{store_port}"
    assert learner.replay.learner_address == f"tcp://replay:{learner_port}"  # it connects
    # the announced store host: the StatefulSet pod behind the headless Service
    statefulset = pods["learner"]
    assert statefulset["spec"]["serviceName"] == "learner"
    assert by_kind(rendered, "Service")["learner"]["spec"]["clusterIP"] == "None"
    assert learner.learner.weight_store_address == f"learner-0.learner:{store_port}"
    assert learner.learner.nproc == int(
        container(statefulset)["resources"]["limits"]["nvidia.com/gpu"])

    for name in ("actors-h100", "actors-a100"):
        actor_args, actor = effective(pods[name], run_toml)
        assert actor_args.command == "actor" and actor_args.replay is None
        assert actor.replay.actor_address == f"tcp://replay:{actor_port}"
        assert actor.learner.control_address == f"tcp://learner-0.learner:{control_port}"
        assert actor.actors.engine.tensor_parallel == int(
            container(pods[name])["resources"]["limits"]["nvidia.com/gpu"])


def test_actor_ids_come_from_the_pod_name(rendered: list[dict]) -> None:
    actors = {n: w for n, w in by_kind(rendered, "Deployment").items()
              if n.startswith("actors-")}
    assert set(actors) == {"actors-h100", "actors-a100"}
    for workload in actors.values():
        c = container(workload)
        assert c["args"][c["args"].index("--actor-id") + 1] == "$(POD_NAME)"
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_gpu_types_have_their_own_nodes_and_engine_settings(rendered: list[dict],
                                                            run_toml: Path) -> None:
    pods = workloads(rendered)
    products = {}
    for name in ("actors-h100", "actors-a100"):
        spec = pods[name]["spec"]["template"]["spec"]
        (term,) = spec["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        (expression,) = term["matchExpressions"]
        assert expression["key"] == "nvidia.com/gpu.product"
        products[name] = set(expression["values"])
    assert not products["actors-h100"] & products["actors-a100"]
    _, h100 = effective(pods["actors-h100"], run_toml)
    _, a100 = effective(pods["actors-a100"], run_toml)
    assert h100.actors.concurrent_episodes != a100.actors.concurrent_episodes


def test_every_pod_is_scraped_on_its_metrics_port(rendered: list[dict],
                                                  run_toml: Path) -> None:
    for name, workload in workloads(rendered).items():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        port = int(annotations["prometheus.io/port"])
        assert port in {p["containerPort"] for p in container(workload)["ports"]}, name
        args, config = effective(workload, run_toml)
        section = {"replay": config.replay, "learner": config.learner,
                   "actor": config.actors}[args.command]
        assert port == section.metrics_port + getattr(args, "index", 0), name


def test_every_pod_is_probed_for_readiness_and_liveness_on_its_metrics_port(
        rendered: list[dict]) -> None:
    """The paths ops/metrics.py serves (tests/unit/test_health.py); the slow
    starters (engines, a learner loading a model) have a startup probe."""
    for name, workload in workloads(rendered).items():
        spec = container(workload)
        ports = {p["name"] for p in spec["ports"]}
        probes = {kind: spec[kind]["httpGet"] for kind in
                  ("readinessProbe", "livenessProbe", "startupProbe") if kind in spec}
        assert probes["readinessProbe"]["path"] == "/readyz", name
        assert probes["livenessProbe"]["path"] == "/healthz", name
        assert all(probe["port"] == "metrics" for probe in probes.values()), name
        assert "metrics" in ports, name
        if name != "replay":
            assert probes["startupProbe"]["path"] == "/healthz", name


def test_config_map_and_claims_referenced_by_pods_exist(rendered: list[dict]) -> None:
    config_maps = set(by_kind(rendered, "ConfigMap"))
    claims = set(by_kind(rendered, "PersistentVolumeClaim"))
    for name, workload in workloads(rendered).items():
        templates = {t["metadata"]["name"]
                     for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        for volume in volumes:
            for source in volume.get("projected", {}).get("sources", []):
                if "configMap" in source:  # kustomize added the content hash
                    assert source["configMap"]["name"] in config_maps, name
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, name
        mounted = {m["name"] for m in container(workload)["volumeMounts"]}
        assert mounted <= {v["name"] for v in volumes} | templates, name


def test_each_learner_pod_is_the_node_of_its_ordinal_on_one_shared_run_folder(
        rendered: list[dict]) -> None:
    learner = workloads(rendered)["learner"]
    c = container(learner)
    args = c["args"]
    assert args[args.index("--learner.node_rank") + 1] == "$(POD_INDEX)"
    [index] = [e for e in c["env"] if e["name"] == "POD_INDEX"]
    assert index["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    assert learner["spec"]["podManagementPolicy"] == "Parallel"
    # checkpoint shards of every pod in one folder
    [runs] = [v for v in learner["spec"]["template"]["spec"]["volumes"] if v["name"] == "runs"]
    claim = by_kind(rendered, "PersistentVolumeClaim")[runs["persistentVolumeClaim"]["claimName"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "volumeClaimTemplates" not in learner["spec"]
    rdzv = service_port(rendered, "learner", "rdzv")
    assert {"name": "rdzv", "containerPort": rdzv} in c["ports"]


# --------------------------------------------------------------------------- Slurm


def test_slurm_script_parses() -> None:
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = SBATCH.read_text()
    assert "#SBATCH hetjob" in text
    assert "--het-group=1" in text


FAKE_SRUN = r'''#!/usr/bin/env python3
"""srun stand-in: runs each task of the step in turn, with the Slurm
variables a task sees (nodes from FAKE_NODES_<group>)."""
import os, signal, subprocess, sys
# The recorded stand-ins exit by themselves; the script's SIGTERM at the end
# must not cut the step short.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
args = sys.argv[1:]
options = {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    options[key] = value
group = options.get("het-group", "0")
nodes = os.environ["FAKE_NODES_" + group].split(",")
per_node = int(options.get("ntasks-per-node", options.get("ntasks", "1")))
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\n")
for n, node in enumerate(nodes[: int(options.get("nodes", len(nodes)))]):
    for local in range(per_node):
        env = dict(os.environ, FAKE_HOST=node, SLURM_LOCALID=str(local),
                   SLURM_PROCID=str(n * per_node + local), SLURM_NODEID=str(n))
        subprocess.run(args, env=env, check=True)
'''

FAKE_SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames ]] && tr ',' '\\n' <<< "$3"
"""

FAKE_HOSTNAME = """#!/bin/bash
echo "$FAKE_HOST"
"""

# The service commands are recorded, not run: what each process would start
# with, from the CLI's parser and the configuration loader.
FAKE_COMPACTIONRL = r'''#!/bin/bash
case $1 in
    replay|learner|actor) exec "$REAL_PYTHON" -c '
import json, os, sys
from dataclasses import asdict
from deploy.cli import build_parser
from deploy.config import load_config
args, overrides = build_parser().parse_known_args(sys.argv[1:])
config = load_config(args.config, overrides)
record = {"command": args.command, "config": asdict(config),
          "args": {k: v for k, v in vars(args).items() if k != "handler"},
          "host": os.environ.get("FAKE_HOST")}
with open(os.environ["FAKE_RECORD"], "a") as out:
    out.write(json.dumps(record) + "\n")
' "$@" ;;
    *) exec "$REAL_COMPACTIONRL" "$@" ;;
esac
'''


def test_slurm_dry_run_wires_every_process(tmp_path: Path) -> None:
    """The script under stand-ins for srun, scontrol and hostname, with the
    real `compactionrl config show` and `keys init`: every process's
    effective configuration, as the real CLI would load it."""
    real = Path(sys.executable).parent / "compactionrl"
    if not real.exists():
        pytest.skip(f"{real} is not installed")
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name, text in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("hostname", FAKE_HOSTNAME), ("compactionrl", FAKE_COMPACTIONRL)]:
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    record, runs = tmp_path / "record.jsonl", tmp_path / "runs"
    env = dict(os.environ,
               PATH=f"{fakes}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               REAL_PYTHON=sys.executable, REAL_COMPACTIONRL=str(real),
               PYTHONPATH=str(ROOT), FAKE_RECORD=str(record), FAKE_LOG=str(tmp_path / "srun"),
               FAKE_NODES_0="head1,head2", FAKE_NODES_1="gpu1,gpu2",
               SLURM_JOB_ID="42", SLURM_SUBMIT_DIR=str(ROOT),
               SLURM_JOB_NODELIST_HET_GROUP_0="head1,head2",
               SLURM_JOB_NODELIST_HET_GROUP_1="gpu1,gpu2",
               ACTOR_GPUS_PER_NODE="2")
    result = subprocess.run(["bash", str(SBATCH), "--run.out_dir", str(runs)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    processes = [json.loads(line) for line in record.read_text().splitlines()]
    by_command: dict[str, list[dict]] = {}
    for p in processes:
        by_command.setdefault(p["command"], []).append(p)
    (replay,), learners = by_command["replay"], by_command["learner"]
    # a learner on both nodes of component 0, node 0 on the first (rank 0, beside the replay)
    assert [(p["host"], p["config"]["learner"]["node_rank"]) for p in learners] == [
        ("head1", 0), ("head2", 1)]
    assert {(p["config"]["learner"]["nnodes"], p["config"]["learner"]["rdzv_endpoint"])
            for p in learners} == {(2, "head1:29400")}
    assert replay["host"] == "head1"
    learner = learners[0]
    actors = by_command["actor"]
    assert len(actors) == 4  # 2 nodes x ACTOR_GPUS_PER_NODE

    run_dir = runs / "qwen2.5-7b-keyvault"
    # one set of settings for every process: services bind every interface,
    # everyone connects to the head node
    for p in processes:
        replay_config, learner_config = p["config"]["replay"], p["config"]["learner"]
        assert (replay_config["actor_address"], replay_config["actor_bind"]) == (
            "tcp://head1:5555", "tcp://0.0.0.0:5555")
        assert replay_config["learner_address"] == "tcp://127.0.0.1:5556"
        assert (learner_config["control_address"], learner_config["control_bind"]) == (
            "tcp://head1:5557", "tcp://0.0.0.0:5557")
        assert (learner_config["weight_store_address"],
                learner_config["weight_store_bind"]) == ("head1:5558", "0.0.0.0:5558")
    assert replay["config"]["replay"]["log_path"] == f"{run_dir}/replay/segments.log"
    assert learner["args"]["resume"] == "latest"
    for p in processes:
        curve = p["config"]["transport"]["curve"]
        assert curve["client_secret_key"] == f"{run_dir}/keys/client-0.key_secret"
    assert (run_dir / "keys" / "authorized" / "client-0.key").is_file()

    assert {(a["args"]["replay"], a["args"]["learner"]) for a in actors} == {(None, None)}
    ids = sorted(a["args"]["actor_id"] for a in actors)
    assert ids == ["gpu1-gpu0", "gpu1-gpu1", "gpu2-gpu0", "gpu2-gpu1"]
    # distinct metrics ports per node, distinct engine seeds overall
    assert sorted(a["args"]["index"] for a in actors) == [0, 0, 1, 1]
    seeds = {a["config"]["actors"]["engine"]["seed"] + a["args"]["index"] for a in actors}
    assert len(seeds) == 4
    steps = (tmp_path / "srun").read_text()
    assert "--het-group=1" in steps and "--gpus-per-task=1" in steps


# --------------------------------------------------------------------------- configs


def test_gpu_7b_config_loads_and_is_a_real_7b_setup() -> None:
    config = load_config(GPU_7B)
    assert config.run.model == "/models/Qwen2.5-7B-Instruct"
    assert config.actors.engine.dtype == "bfloat16"
    assert config.learner.nproc == 8
    assert config.learner.weight_bucket_bytes == 1 << 30
    assert config.actors.engine.max_model_len == config.actors.compaction.context_tokens
    result = subprocess.run([str(Path(sys.executable).parent / "compactionrl"), "config", "show",
                             "--config", str(GPU_7B)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout)["learner"]["nproc"] == 8


#: At least the memory torch reports of a GPU of each product the actor
#: manifests select, in GiB: 80 GB products report about 79.6 (an H100:
#: deploy/fleet.py) or a little less (an A100); the H100 NVL has 94 GB.
REPORTED_GIB = {"NVIDIA-H100-80GB-HBM3": 79.1, "NVIDIA-H100-PCIe": 79.1,
                "NVIDIA-H100-NVL": 93.0, "NVIDIA-A100-SXM4-80GB": 79.1,
                "NVIDIA-A100-80GB-PCIe": 79.1}


def test_each_actor_manifest_s_episodes_fit_its_gpus_kv_cache(rendered: list[dict],
                                                              run_toml: Path) -> None:
    """The manifests and run.toml are one source for what the plan checks:
    the effective configuration of each actor pod (run.toml, then its
    arguments) passes the plan's KV arithmetic on the GPUs it selects, as
    the actor checks its own engine at start."""
    pods = workloads(rendered)
    for name in ("actors-h100", "actors-a100"):
        spec = pods[name]["spec"]["template"]["spec"]
        (term,) = spec["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        (expression,) = term["matchExpressions"]
        assert set(expression["values"]) <= set(REPORTED_GIB), expression
        smallest_gib = min(REPORTED_GIB[product] for product in expression["values"])
        _, config = effective(pods[name], run_toml)
        memory = engine_memory(shape_of("Qwen2.5-7B"), config.actors, int(smallest_gib * GIB),
                               config.actors.engine.gpu_memory_utilization)
        assert memory.needed_tokens <= memory.kv_tokens, (name, memory.describe())
        assert config.actors.kv_shortfall(memory.kv_tokens) is None


def test_the_learner_pod_requests_the_host_memory_the_plan_says_and_is_limited_to_it(
        rendered: list[dict], run_toml: Path) -> None:
    """Background checkpoints copy a node's states to its host memory; the
    pod requests what the plan's arithmetic says for that, and its limit
    (what the learner reads) is the request, so that the learner's own rule
    and the scheduler's agree (learner/checkpoint.py ``background_saves``)."""
    learner = workloads(rendered)["learner"]
    resources = container(learner)["resources"]
    _, config = effective(learner, run_toml)
    assert learner["spec"]["replicas"] == config.learner.nnodes
    host = learner_host_memory(shape_of("Qwen2.5-7B"), config.learner)
    requested = quantity_bytes(resources["requests"]["memory"])
    assert quantity_bytes(resources["limits"]["memory"]) == requested
    assert requested >= host.background, host.describe()


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity in bytes (binary suffixes, as ours are)."""
    for suffix, power in (("Ki", 1), ("Mi", 2), ("Gi", 3), ("Ti", 4)):
        if quantity.endswith(suffix):
            return int(quantity[:-2]) * 1024**power
    return int(quantity)


#: DCP's synchronous write rate measured on the CPU machine, as a floor
#: (docs/learner.md "Checkpoints and host memory").
FLOOR_WRITE_BYTES_PER_S = 0.24 * GIB


def test_the_learner_pod_s_grace_period_holds_a_pending_write_a_final_save_and_the_export(
        rendered: list[dict], run_toml: Path) -> None:
    learner = workloads(rendered)["learner"]
    _, config = effective(learner, run_toml)
    host = learner_host_memory(shape_of("Qwen2.5-7B"), config.learner)
    shutdown_s = (2 * host.staging + host.export) / FLOOR_WRITE_BYTES_PER_S
    assert learner["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= shutdown_s
