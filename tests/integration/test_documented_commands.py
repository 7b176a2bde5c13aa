"""Every command that README.md and docs/*.md show in a shell block is
checked, so that a documented command cannot break unnoticed.

Commands are read from the fenced ``sh``/``bash`` blocks (continuation lines
joined, trailing ``# comments`` dropped, here-documents attached to their
command). Each one must be classified in ``COMMANDS``, and only once:

- ``RunAsWritten``: run exactly as written, through bash, from the repository root
  (with ``.venv/bin`` first on PATH, as in an activated venv, for a bare
  ``python`` or ``compactionrl``), with its quick flag appended where it has
  one (the benchmarks' ``--quick``; ``--dry-run`` for the two that train for
  minutes to hours). It must exit 0 and, with ``--json``, end with a JSON
  object holding the keys the benchmark documents.
- ``Elsewhere``: run by another test, which is named, and which holds the
  command's arguments.
- ``Offline``: it cannot run here (a cluster, a registry, Slurm, placeholders
  such as ``my.toml`` or ``HOST``, or an hour of training): the reason is
  given, and what can be checked offline is (files it reads, manifests it
  refers to, and, for a ``compactionrl`` command, its arguments through the
  real parser and configuration loader with placeholders made real).

A documented command missing from ``COMMANDS`` fails
``test_every_documented_command_is_classified``; a shell command written
outside a shell block fails ``test_no_command_outside_a_shell_block``. The
README's command table (syntax, with [brackets]) is checked through each
subcommand's ``--help``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from deploy.cli import build_parser, main
from deploy.config import JobConfig, load_config, to_toml
from tests.processes import VENV_BIN, run_command

#: Each command runs in a process of its own: xdist may spread them over its workers.
pytestmark = pytest.mark.independent

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
K8S = ROOT / "deploy" / "k8s"
LOCAL_CPU_TOML = ROOT / "deploy" / "configs" / "local-cpu.toml"
#: Fenced blocks that hold commands.
SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}
#: Fenced blocks that hold data or code, never commands.
DATA_LANGUAGES = {"json", "toml", "yaml", "yml", "python", "py"}
#: A line that begins like a command.
COMMAND_START = re.compile(
    r"^\s*(?:\$\s+)?(?:\.venv/bin/\S+|python3?|compactionrl|make|pytest|kubectl|docker|"
    r"sbatch|srun|source|bash|pip|torchrun|helm)(?:\s|$)")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")


# -- reading the documentation -------------------------------------------------

@dataclass(frozen=True)
class Documented:
    """One command as the documentation shows it."""

    #: The command, whitespace collapsed: the key of ``COMMANDS``.
    command: str
    #: What bash is given: continuations joined, the comment dropped.
    shell: str
    #: ``docs/running.md:6``
    where: str
    #: The body of its here-document, if it has one.
    heredoc: str = ""


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _blocks(text: str) -> Iterator[tuple[str, int, list[str]]]:
    """(language, line number of its first line, lines) of each fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.group(1), opening.group(2).lower()
        end = i + 1
        while end < len(lines) and not (lines[end].strip().startswith(fence)
                                        and set(lines[end].strip()) == {fence[0]}):
            end += 1
        yield language, i + 2, lines[i + 1:end]
        i = end + 1


def _without_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` in quotes stays)."""
    quote = None
    escaped = False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _commands_of(lines: list[str], first_line: int, document: str) -> Iterator[Documented]:
    i = 0
    while i < len(lines):
        where = f"{document}:{first_line + i}"
        logical = lines[i]
        i += 1
        while logical.rstrip().endswith("\\") and i < len(lines):
            logical = logical.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        shell = _without_comment(logical).strip()
        if not shell:
            continue
        heredoc = ""
        if marker := HEREDOC.search(shell):
            body = []
            while i < len(lines) and lines[i].strip() != marker.group(2):
                body.append(lines[i])
                i += 1
            i += 1  # the terminator
            heredoc = "\n".join(body) + "\n"
        yield Documented(" ".join(shell.split()), shell, where, heredoc)


def documented_commands() -> list[Documented]:
    """Every command of every shell block in README.md and docs/*.md."""
    found = []
    for path in DOCUMENTS:
        for language, first_line, lines in _blocks(path.read_text()):
            if language in SHELL_LANGUAGES:
                found += _commands_of(lines, first_line, _relative(path))
    return found


def _documented(command: str) -> Documented:
    (match,) = [d for d in documented_commands() if d.command == command]
    return match


def _yaml_block(first_line: str) -> str:
    """The fenced YAML block of the docs that begins with ``first_line``."""
    for path in DOCUMENTS:
        for language, _, lines in _blocks(path.read_text()):
            if language in ("yaml", "yml") and lines and lines[0].strip() == first_line:
                return "\n".join(lines) + "\n"
    raise AssertionError(f"no YAML block beginning with {first_line!r} in the docs")


# -- what the checks use -----------------------------------------------------------

@dataclass
class Check:
    """What an offline check gets."""

    documented: Documented
    tmp_path: Path
    request: pytest.FixtureRequest

    def tiny_model(self) -> Path:
        return self.request.getfixturevalue("tiny_model_dir")

    def argv(self, **placeholders: str) -> list[str]:
        """The command's words after ``compactionrl``, placeholders replaced
        (each key, wherever it occurs in a word, by its value)."""
        words = shlex.split(self.documented.shell)
        assert words[0] == "compactionrl", words
        for old, new in placeholders.items():
            words = [word.replace(old, new) for word in words]
        return words[1:]


def cli(argv: list[str]) -> tuple[argparse.Namespace, JobConfig | None]:
    """What ``compactionrl ARGV`` does before it runs anything: parse the
    arguments as ``deploy.cli.main`` does and load the configuration
    (validation included)."""
    try:
        args, overrides = build_parser().parse_known_args(argv)
    except SystemExit as exit_:
        raise AssertionError(f"compactionrl {shlex.join(argv)}: arguments rejected "
                             f"({exit_.code})") from None
    if not hasattr(args, "config"):
        assert not overrides, f"unrecognised arguments: {overrides}"
        return args, None
    return args, load_config(args.config, overrides)


def k8s_documents() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_names(kind: str) -> set[str]:
    return {doc["metadata"]["name"] for doc in k8s_documents() if doc["kind"] == kind}


def _walk(node: object) -> Iterator[dict]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def make_dry_run(target: str) -> list[str]:
    """The commands ``make TARGET`` would run (``make -n``), continuations joined."""
    result = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.replace("\\\n", " ").splitlines() if line.strip()]


# -- the offline checks ----------------------------------------------------------

def check_make_demo(check: Check) -> None:
    """Each ``compactionrl`` command of the target parses and configures."""
    commands = [shlex.split(line, comments=True) for line in make_dry_run("demo")
                if "bin/compactionrl " in line]
    subcommands = []
    for words in commands:
        args, _ = cli(words[1:])
        subcommands.append(args.command)
    assert subcommands == ["up", "eval"], commands


def check_make_test(check: Check) -> None:
    """The target runs the whole of tests/: the cases not marked ``exclusive``
    on xdist workers, then the ``exclusive`` ones."""
    commands = " ".join(make_dry_run("test"))
    assert ('-m pytest tests -n 2 --dist loadgroup --no-loadscope-reorder -m "not exclusive"'
            in commands), commands
    assert "-m pytest tests -m exclusive" in commands, commands


def check_make_check(check: Check) -> None:
    """The quick tier: ruff, then the unit tests and the documented commands'
    classification, not the slow or exclusive cases, failing if it started
    a vLLM engine."""
    commands = make_dry_run("check")  # under make test, with make's own lines among them
    assert any(command.endswith("ruff check .") for command in commands), commands
    (tests,) = [command for command in commands if " -m pytest " in command]
    assert all(word in tests for word in (
        "tests/unit", '-m "not slow and not exclusive and not trains"', "--max-engines 0",
        "test_documented_commands.py::test_every_documented_command_is_classified")), tests


def check_dockerfile(check: Check) -> None:
    """The Dockerfile exists and what it copies from the context (``.``) does."""
    words = shlex.split(check.documented.shell)
    dockerfile = ROOT / words[words.index("-f") + 1]
    assert words[-1] == "."
    copied = [word for line in dockerfile.read_text().splitlines() if line.startswith("COPY ")
              for word in line.split()[1:-1] if not word.startswith("--")]
    assert copied and all((ROOT / source).exists() for source in copied), copied


def check_pushed_tag_is_built(check: Check) -> None:
    (build,) = [d for d in documented_commands() if d.command.startswith("docker build ")]
    words = shlex.split(build.shell)
    assert shlex.split(check.documented.shell)[-1] == words[words.index("-t") + 1]


def check_secret_keys(check: Check) -> None:
    """``--from-file=keys/`` takes the files directly in keys/ (not its
    subfolders): each key the manifests mount from the Secret must be one of
    those that ``compactionrl keys init keys --clients 1`` writes there."""
    folder = check.tmp_path / "keys"
    assert main(["keys", "init", str(folder), "--clients", "1"]) == 0
    files = {path.name for path in folder.iterdir() if path.is_file()}
    secret = re.search(r"secret generic (\S+)", check.documented.command).group(1)
    mounted = {item["key"] for node in _walk(k8s_documents())
               if isinstance(node.get("secret"), dict) and node["secret"].get("name") == secret
               for item in node["secret"].get("items", [])}
    assert mounted, f"no manifest mounts the Secret {secret}"
    assert mounted <= files, f"mounted but not in keys/: {mounted - files}"


def _fill_pod() -> dict:
    return yaml.safe_load(_documented("kubectl apply -f - <<'EOF'").heredoc)


def _run_model() -> str:
    return tomllib.loads((K8S / "run.toml").read_text())["run"]["model"]


def check_fill_pod(check: Check) -> None:
    """The pod mounts the manifests' model claim where run.model lives."""
    pod = yaml.safe_load(check.documented.heredoc)
    assert pod["kind"] == "Pod"
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] in k8s_names("PersistentVolumeClaim")
    (mount,) = pod["spec"]["containers"][0]["volumeMounts"]
    assert _run_model().startswith(mount["mountPath"] + "/")


def check_copy_into_pod(check: Check) -> None:
    destination = shlex.split(check.documented.shell)[-1]
    assert destination == f"{_fill_pod()['metadata']['name']}:{_run_model()}"


def check_delete_pod(check: Check) -> None:
    assert shlex.split(check.documented.shell)[-1] == _fill_pod()["metadata"]["name"]


def check_overlay_renders(check: Check) -> None:
    """The documented overlay, beside a copy of deploy/k8s, renders with
    kustomize and sets the image, namespace and replicas it says."""
    overlay = yaml.safe_load(_yaml_block("# my-cluster/kustomization.yaml"))
    assert check.documented.command.split()[-1] == "my-cluster"
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: cannot render the overlay offline")
    shutil.copytree(K8S, check.tmp_path / "deploy" / "k8s")
    (check.tmp_path / "my-cluster").mkdir()
    (check.tmp_path / "my-cluster" / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    result = subprocess.run(["kubectl", "kustomize", str(check.tmp_path / "my-cluster")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rendered = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert {doc["metadata"].get("namespace") for doc in rendered
            if doc["kind"] != "Namespace"} == {overlay["namespace"]}
    replicas = {doc["metadata"]["name"]: doc["spec"].get("replicas") for doc in rendered
                if doc["kind"] in ("Deployment", "StatefulSet")}
    for wanted in overlay["replicas"]:
        assert replicas[wanted["name"]] == wanted["count"], (wanted, replicas)
    (image,) = overlay["images"]
    images = {node["image"] for node in _walk(rendered) if "image" in node}
    assert images == {f"{image['newName']}:{image['newTag']}"}


def check_workload(kind: str) -> Callable[[Check], None]:
    def check_(check: Check) -> None:
        name = re.search(r"\b\w+/([\w-]+)", check.documented.command).group(1)
        assert name in k8s_names(kind), f"no {kind} {name} in deploy/k8s"
    return check_


def check_sbatch_overrides(check: Check) -> None:
    words = shlex.split(check.documented.shell)
    assert (ROOT / words[1]).is_file()
    load_config(None, words[2:])


def check_actor_on_cluster(check: Check) -> None:
    args, config = cli(check.argv(**{"run.toml": str(K8S / "run.toml"),
                                     "REPLAY_HOST": "127.0.0.1", "LEARNER_HOST": "127.0.0.1"}))
    assert args.command == "actor" and args.index == 0 and args.actor_id.endswith("-gpu0")
    assert (args.replay, args.learner) == ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5557")


def check_script_help(check: Check) -> None:
    """The module the command runs (``python -m MODULE``) starts and knows its arguments."""
    words = shlex.split(check.documented.shell)
    assert words[1] == "-m", words
    completed = run_command([str(VENV_BIN / "python"), "-m", words[2], "--help"], 120)
    assert completed.returncode == 0, completed.stderr


def check_carried_wheels(check: Check) -> None:
    """The GPU check's wheels are pinned at the versions of the project's environment."""
    pinned = dict(word.split("==") for word in shlex.split(check.documented.shell)
                  if "==" in word)
    assert pinned == {name: version(name) for name in ("pyzmq", "msgspec", "numpy",
                                                       "prometheus-client")}, pinned


def check_carried_wheels_installed(check: Check) -> None:
    """The GPU machine installs the wheels the download wrote, into the
    folder the check's command puts first on ``PYTHONPATH``."""
    (download,) = [d for d in documented_commands() if d.command.startswith(
        "python3 -m pip download ")]
    (gpu_check,) = [d for d in documented_commands()
                    if d.command.endswith("bench/gpu_check.py --json --out gpu_check")
                    and d.command.startswith("PYTHONPATH=")]
    words, fetched = shlex.split(check.documented.shell), shlex.split(download.shell)
    assert f"{fetched[fetched.index('-d') + 1]}/*.whl" in words
    target = words[words.index("--target") + 1]
    assert gpu_check.command.startswith(f"PYTHONPATH={target}:. python3 ")


def check_up_parses(check: Check) -> None:
    args, config = cli(check.argv())
    assert args.command == "up"


def check_parses(check: Check) -> None:
    cli(check.argv())


def check_up_trains_the_paper_recipe(check: Check) -> None:
    args, config = cli(check.argv())
    assert args.command == "up"
    assert (config.learner.advantage, config.learner.lam_mode, config.actors.group_size) == (
        "cross", "adaptive", 1)


def assert_restores_its_kept_base(config: JobConfig) -> None:
    """A recipe's base is one the checkout keeps, made for exactly its
    settings (so ``up`` restores it instead of bootstrapping)."""
    from starting_points.keyvault_bootstrap import KEPT_BASES, differences

    kept = KEPT_BASES[config.run.model]
    assert differences(kept.folder, config.actors, config.bootstrap) == []


def check_up_trains_the_size_range_recipe(check: Check) -> None:
    """The recipe's sizes, from the kept base made for it."""
    args, config = cli(check.argv())
    assert args.command == "up"
    options = config.actors.environment.options
    assert (options["rooms"], options["distractor_words"]) == ([6, 20], [2, 8])
    # GRPO, as the seeds of docs/horizons-runs.json were trained
    assert (config.learner.advantage, config.actors.group_size) == ("grpo", 4)
    assert_restores_its_kept_base(config)


def check_up_trains_the_unequal_tables_full(check: Check) -> None:
    """Keyvault with retries and the paper's recipe (the unequal table's
    ``full``, tests/unit/test_results_doc.py), from the kept base made for it."""
    args, config = cli(check.argv())
    assert args.command == "up"
    assert config.actors.environment.options["retries"] == 2
    assert (config.learner.advantage, config.learner.lam_mode) == ("cross", "adaptive")
    assert_restores_its_kept_base(config)


def check_up_with_my_toml(check: Check) -> None:
    args, config = cli(check.argv(**{"my.toml": str(LOCAL_CPU_TOML)}))
    assert args.command == "up"
    if "--learner.max_steps" in check.documented.command:
        assert config.learner.max_steps == 200
    if "--resume" in check.documented.command:
        assert args.resume


def check_actor_beside_up(check: Check) -> None:
    """RUN/config.toml is what ``up`` writes: the effective configuration."""
    run_config = check.tmp_path / "config.toml"
    run_config.write_text(to_toml(load_config(None, [])))
    args, _ = cli(check.argv(**{"RUN/config.toml": str(run_config), "HOST": "127.0.0.1"}))
    assert args.command == "actor" and args.actor_id == "my-gpu-box-0" and args.index == 1


def check_eval_parses(check: Check) -> None:
    args, config = cli(check.argv(**{"runs/local-cpu/export": str(check.tiny_model())}))
    assert (args.command, args.episodes, args.compaction, args.max_compactions) == (
        "eval", 200, "on", 3)


def run_eval_against_baseline(check: Check) -> None:
    """Run it, both folders the tiny model, on 2 episodes instead of 200."""
    model = str(check.tiny_model())
    argv = check.argv(**{"runs/local-cpu/export": model, "runs/base-model": model})
    result = run_command([str(VENV_BIN / "compactionrl"), *argv, "--episodes", "2"],
                         timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "success compacted:" in result.stdout, result.stdout[-2000:]
    # a float32 model into the bfloat16 engine is the configured cast: not one
    # warning per tensor
    assert "Attempted to load weight" not in result.stderr, result.stderr[-2000:]


# -- the registry --------------------------------------------------------------------

@dataclass(frozen=True)
class RunAsWritten:
    """Run as written from the repository root (``in_tmp``: from an empty
    folder, for a command that writes into the current one), ``extra``
    appended."""

    extra: tuple[str, ...] = ()
    #: The last line of stdout is a JSON object with these keys (each > 0 or non-empty).
    json_keys: tuple[str, ...] = ()
    exit_codes: tuple[int, ...] = (0,)
    #: Text that stdout must contain.
    prints: tuple[str, ...] = ()
    in_tmp: bool = False
    slow: bool = False
    timeout: float = 300


@dataclass(frozen=True)
class Elsewhere:
    """Run by ``test``, whose text holds each of ``argv`` as a Python string."""

    test: str
    argv: tuple[str, ...]
    why: str
    check: Callable[[Check], None] | None = None
    slow: bool = False


@dataclass(frozen=True)
class Offline:
    why: str
    check: Callable[[Check], None]
    slow: bool = False


CLUSTER = "needs a Kubernetes cluster"
BENCH_DRY_RUN = ("--dry-run",)

#: Every documented command, by its text (whitespace collapsed, comment dropped).
COMMANDS: dict[str, RunAsWritten | Elsewhere | Offline] = {
    # README.md
    "make demo": Offline(
        "bootstraps the base policy (~5 min), trains 5 min and evaluates 400 episodes; "
        "`compactionrl up` is run by tests/faults/test_up_faults.py and `compactionrl eval "
        "--baseline` below; here: each compactionrl command of `make -n demo` parses and "
        "loads its configuration", check_make_demo),
    "make test": Offline(
        "the whole suite, this test included (hours on 2 cores); here: the target runs "
        "pytest on tests/", check_make_test),
    "make check": Offline(
        "the quick tier (about 3 minutes), whose tests the suite runs itself; here: the "
        "target runs ruff and those tests, and fails on an engine start", check_make_check),
    "compactionrl up --config deploy/configs/paper-recipe.toml": Offline(
        "trains a whole run (minutes); here: the arguments parse and configure the "
        "paper's recipe over the local default", check_up_trains_the_paper_recipe),
    "compactionrl up --config deploy/configs/retries.toml": Offline(
        "trains a whole run (15 to 22 minutes of `up`); here: the arguments parse and "
        "configure the unequal-compaction table's recipe, from the kept base made for it",
        check_up_trains_the_unequal_tables_full),
    "compactionrl up --config deploy/configs/size-range.toml": Offline(
        "trains a whole run (7.4 to 8.3 minutes); here: the arguments parse and configure "
        "the size-range recipe over the local default, from the kept base made for it",
        check_up_trains_the_size_range_recipe),
    ".venv/bin/python bench/codec.py --json": RunAsWritten(
        ("--quick",), ("vs_pickle_32k", "vs_memcpy_32k", "vs_pickle_1k")),
    ".venv/bin/python bench/actor.py --json": RunAsWritten(
        ("--quick",), ("vs_raw_vllm", "summary_token_share", "compactions"), slow=True),
    ".venv/bin/python bench/replay_ingest.py --json": RunAsWritten(
        ("--quick",), ("vs_raw_zmq_log_off", "vs_raw_zmq_log_on", "batch_latency_ms_p50")),
    # --quick measures 64 actors (the full run 64, 256 and 1,024: _1024 keys)
    ".venv/bin/python bench/replay_scale.py --json": RunAsWritten(
        ("--quick",), ("vs_raw_zmq_64", "ack_p99_ms_64", "raw_ack_p99_ms_64",
                       "ack_p99_ms_saturated_64", "replay_rss_mb_64",
                       "replay_cpu_us_per_segment_64")),
    ".venv/bin/python bench/ppo_step.py --json": RunAsWritten(
        ("--quick",), ("gae_vs_loop", "ppo_vs_bare", "shared_vs_separate")),
    ".venv/bin/python bench/learner_memory.py --json": RunAsWritten(
        ("--quick",), ("peak_vs_today_8k", "tokens_per_s_vs_today_8k", "table")),
    # --quick leaves the fan-out curves to the --fanout-only command below
    ".venv/bin/python bench/weights.py --json": RunAsWritten(
        ("--quick",), ("push_vs_raw_100m", "ipc_push_vs_raw_100m", "stall_vs_load",
                       "stall_keep_vs_recompute"), slow=True),
    # docs/weights.md: the fan-out curves alone
    ".venv/bin/python bench/weights.py --fanout-only --json": RunAsWritten(
        ("--quick",), ("push_seconds_by_receivers", "push_growth_per_doubling",
                       "relay_push_growth_per_doubling", "projected_push_s")),
    ".venv/bin/python bench/samples.py --json": RunAsWritten(
        ("--quick",), ("recording_vs_off", "bytes_per_kept_step", "kept_mb_bound")),
    ".venv/bin/python bench/checkpoint.py --json": RunAsWritten(
        ("--quick",), ("sync_save_s", "async_stall_s", "async_stall_vs_sync")),
    ".venv/bin/python bench/async.py --json": RunAsWritten(BENCH_DRY_RUN, ("commands",)),
    ".venv/bin/python bench/stale.py --json": RunAsWritten(BENCH_DRY_RUN, ("commands",)),
    # docs/endpoint.md
    ".venv/bin/python bench/endpoint.py --json": RunAsWritten(
        ("--quick",), ("endpoint_vs_own_loop", "endpoint_vs_raw_vllm", "own_loop_vs_raw_vllm"),
        slow=True),
    "compactionrl up --actors.endpoint.enabled true": Elsewhere(
        "tests/integration/test_endpoint_harness.py",
        ("harness", "--actors.endpoint.enabled", "true"),
        "as written it bootstraps (~5 min) and serves for 5 min; that test runs it on the "
        "tiny model with a harness; here: the arguments parse and configure", check_up_parses),
    ".venv/bin/python examples/keyvault_agent.py --base-url http://127.0.0.1:8100/v1 "
    "--episodes 8": Elsewhere(
        "tests/integration/test_endpoint_harness.py",
        ("keyvault_agent.py", "--base-url", "--episodes"),
        "needs a running endpoint: that test runs the harness against one"),
    ".venv/bin/python bench/compaction_cost.py --json": RunAsWritten(
        ("--quick",), ("base", "trained", "trained_frozen_summariser",
                       "frozen_vs_trained_stall"), slow=True),
    ".venv/bin/python bench/horizons.py --json": RunAsWritten(
        ("--quick",), ("policies", "sizes", "success", "facts"), slow=True),
    ".venv/bin/python bench/gpu_check.py --json": Elsewhere(
        "tests/unit/test_gpu_check.py", ("--dry-run", "--json"),
        "needs a CUDA device; that test runs it as written (refused without CUDA, saying "
        "to add --dry-run) and its whole dry run, whose report it checks part by part"),
    ".venv/bin/python bench/ablations.py --quick": RunAsWritten(BENCH_DRY_RUN,
                                                                 prints=("dry run:",)),
    # docs/deploy.md
    "docker build -f deploy/Dockerfile -t registry.example.com/compactionrl:latest .": Offline(
        "needs a Docker daemon and the network (base image, vLLM); here: the Dockerfile and "
        "what it copies exist", check_dockerfile),
    "docker push registry.example.com/compactionrl:latest": Offline(
        "needs a registry; here: it pushes the tag the build step makes",
        check_pushed_tag_is_built),
    "compactionrl keys init keys --clients 1": RunAsWritten(
        in_tmp=True, prints=("authorized client keys: keys/authorized",)),
    "kubectl create secret generic compactionrl-keys --from-file=keys/": Offline(
        f"{CLUSTER}; here: every key the manifests mount from the Secret is a file "
        "directly in the keys/ that `keys init` writes", check_secret_keys),
    "kubectl apply -f - <<'EOF'": Offline(
        f"{CLUSTER}; here: the pod mounts the manifests' model claim at run.model's folder",
        check_fill_pod),
    "kubectl cp ./Qwen2.5-7B-Instruct models-fill:/models/Qwen2.5-7B-Instruct": Offline(
        f"{CLUSTER} and the 7B weights; here: it copies into that pod, at run.model",
        check_copy_into_pod),
    "kubectl delete pod models-fill": Offline(
        f"{CLUSTER}; here: it names that pod", check_delete_pod),
    "kubectl apply -k my-cluster": Offline(
        f"{CLUSTER}; here: the documented overlay renders with kustomize (the base itself "
        "is validated by tests/unit/test_deploy_manifests.py)", check_overlay_renders),
    "kubectl logs -f statefulset/learner": Offline(
        f"{CLUSTER}; here: the StatefulSet exists", check_workload("StatefulSet")),
    "kubectl scale deployment/actors-h100 --replicas 16": Offline(
        f"{CLUSTER}; here: the Deployment exists", check_workload("Deployment")),
    "source .venv/bin/activate": RunAsWritten(),
    "sbatch deploy/slurm/compactionrl.sbatch --run.out_dir /shared/runs": Elsewhere(
        "tests/unit/test_deploy_manifests.py", ("--run.out_dir",),
        "no Slurm here: that test runs the script with stand-ins for srun, scontrol and "
        "hostname and the same override; here: the script exists, the override loads",
        check_sbatch_overrides),
    "compactionrl actor --config run.toml --replay tcp://REPLAY_HOST:5555 --learner "
    "tcp://LEARNER_HOST:5557 --actor-id \"$(hostname -s)-gpu0\" --index 0": Offline(
        "placeholders (the hosts, the cluster's run.toml) and a GPU with the 7B model; "
        "actors run for real in tests/integration/test_actor_process.py; here: the "
        "arguments parse and deploy/k8s/run.toml loads", check_actor_on_cluster),
    # docs/design.md
    "compactionrl config show --learner.advantage independent "
    "--actors.compaction.keep_steps 1": RunAsWritten(
        prints=('advantage = "independent"', "keep_steps = 1")),
    # docs/deploy.md: the GPU check's wheels, for a machine without the project
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
    "--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "
    "--platform manylinux2014_x86_64 -d .whl pyzmq==27.3.0 msgspec==0.23.0 numpy==2.3.5 "
    "prometheus-client==0.26.0": Offline(
        "downloads from PyPI; here: the pins are the project's environment's versions",
        check_carried_wheels),
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
    "--target /tmp/site .whl/*.whl": Offline(
        "runs on the GPU machine, with the downloaded wheels; here: it installs what the "
        "download wrote where the check's command looks", check_carried_wheels_installed),
    "PYTHONPATH=/tmp/site:. python3 bench/gpu_check.py --json --out gpu_check": Elsewhere(
        "tests/unit/test_gpu_check.py", ("--json", "--out"),
        "needs a GPU; that test runs its dry run with these arguments"),
    # docs/deploy.md: starts nothing, whatever the machine
    "compactionrl up --plan --gpus 8 --config deploy/configs/gpu-8xh100.toml": RunAsWritten(
        prints=("weights over nccl", "0,1,2,3")),
    # the 7B folder is not here: the plan says the memory was not checked (the
    # arithmetic itself is tests/unit/test_memory_plan.py's, with the 7B's shape)
    "compactionrl up --plan --gpus 8 --gpu-memory-gib 79.6 --config "
    "deploy/configs/gpu-8xh100.toml": RunAsWritten(prints=("weights over nccl",
                                                   "memory: not checked: no config.json")),
    # a mixed fleet, sized from a named family's shape (no weights on this machine)
    "compactionrl up --plan --fleet h100=8x79.6,a100-40=8x39.4 --model-shape Qwen2.5-7B "
    "--config deploy/configs/gpu-7b.toml": RunAsWritten(
        prints=("lane 8 x h100 (79.6 GiB): learner; 0 free",
                "lane 8 x a100-40 (39.4 GiB): actor-0 to actor-7; 0 free")),
    "compactionrl up --plan --fleet a100-40=8x39.4 --model-shape Qwen2.5-7B "
    "--config deploy/configs/gpu-8xh100.toml": RunAsWritten(
        exit_codes=(2,), prints=("memory, learner on a100-40: 53.6 GiB",)),
    # docs/environments.md: the bring-your-own guide, run in a temporary folder
    "compactionrl model init --out runs/qwen3-tiny": Elsewhere(
        "tests/integration/test_bring_your_own.py", ("compactionrl", "model", "init", "--out"),
        "that test runs the guide's three commands; here: the arguments parse", check_parses),
    "cp tests/unit/chat_templates/qwen3.jinja runs/qwen3-tiny/chat_template.jinja": Elsewhere(
        "tests/integration/test_bring_your_own.py", ("qwen3.jinja", "chat_template.jinja"),
        "the guide's copy, into that test's model folder"),
    "compactionrl play --model runs/qwen3-tiny --json --actors.compaction.context_tokens 400 "
    "--actors.compaction.reserve_tokens 120": Elsewhere(
        "tests/integration/test_bring_your_own.py",
        ("play", "--model", "--json", "--actors.compaction.context_tokens", "400",
         "--actors.compaction.reserve_tokens", "120"),
        "starts an engine on the model the guide made: that test runs it; here: the arguments "
        "parse and configure", check_parses),
    # docs/running.md
    "compactionrl up": Elsewhere(
        "tests/faults/test_up_faults.py", ("up", "--learner.max_steps"),
        "as written it bootstraps (~5 min) and trains 5 min; that test runs it on the tiny "
        "model with test-sized overrides; here: the arguments parse and configure",
        check_up_parses),
    "compactionrl up --config my.toml --learner.max_steps 200": Offline(
        "my.toml stands for your configuration; here: with the shipped local-cpu.toml, the "
        "arguments parse and configure", check_up_with_my_toml),
    "compactionrl up --config my.toml --resume": Offline(
        "my.toml stands for your configuration, resuming a run that has checkpoints; here: "
        "with the shipped local-cpu.toml, the arguments parse and configure",
        check_up_with_my_toml),
    "compactionrl view --run runs/local-cpu --screenshot runs/local-cpu/viewer.png": Elsewhere(
        "tests/integration/test_viewer_page.py", ("view", "--run", "--screenshot"),
        "draws the viewer of the run `make demo` trains: that test runs the command on a "
        "run's kept samples; here: the arguments parse", check_parses),
    # 0: a run is up or ended as asked; 1: it failed or up was killed; 2: there is none yet
    "compactionrl status": RunAsWritten(exit_codes=(0, 1, 2)),
    "compactionrl actor --config RUN/config.toml --replay tcp://HOST:5555 --learner "
    "tcp://HOST:5557 --actor-id my-gpu-box-0 --index 1": Elsewhere(
        "tests/faults/test_up_faults.py",
        ("actor", "--config", "config.toml", "--replay", "--learner", "--actor-id", "--index"),
        "joins a running `up` (RUN and HOST are placeholders): that test starts this command "
        "beside one; here: with a run's config.toml, the arguments parse and configure",
        check_actor_beside_up),
    "compactionrl eval --model runs/local-cpu/export --episodes 200 --compaction on "
    "--max-compactions 3": Offline(
        "evaluates the policy `make demo` trains; the next command runs eval; here: with "
        "the tiny model, the arguments parse and configure", check_eval_parses),
    "compactionrl eval --model runs/local-cpu/export --baseline runs/base-model": Offline(
        "compares the policy `make demo` trains with the base: run with the tiny model as "
        "both, on 2 episodes", run_eval_against_baseline, slow=True),
    "python bench/async.py --json --steps 12 --step-latency 0.3 --episodes 200": RunAsWritten(
        BENCH_DRY_RUN, ("commands",)),
    # docs/results.md (written by bench/ablations.py: the command of the last
    # invocation of each recipe's table, which was made in parts)
    "python bench/ablations.py --json --variants full,advantage=independent,"
    "train_summary=false,loss_norm=segment,advantage=grpo,compaction=false": RunAsWritten(
        BENCH_DRY_RUN, ("commands",)),
    "python bench/ablations.py --json --recipe paper": RunAsWritten(
        BENCH_DRY_RUN, ("commands",)),
    "python bench/ablations.py --json --recipe retries --variants advantage=grpo": RunAsWritten(
        BENCH_DRY_RUN, ("commands",)),
    "python bench/ablations.py --json --recipe blind-critic --variants "
    "full,advantage=independent,advantage=grpo": RunAsWritten(BENCH_DRY_RUN, ("commands",)),
    "python -m deploy.answer_lengths runs/ablations-paper-padreward/full-seed0 "
    "runs/ablations-paper-padreward/full-seed1": Offline(
        "reads the replay logs of the table's runs (hours of training, not in a fresh clone); "
        "here: the script starts and knows its arguments", check_script_help),
}


def _params(kind: type) -> list:
    return [pytest.param(command, entry, id=command,
                         marks=[pytest.mark.slow] if entry.slow else [])
            for command, entry in COMMANDS.items() if isinstance(entry, kind)]


# -- the tests -------------------------------------------------------------------------

def test_every_documented_command_is_classified() -> None:
    documented = documented_commands()
    assert len(documented) > 20  # the reader found the blocks
    unclassified = [f"{d.where}: {d.command}" for d in documented if d.command not in COMMANDS]
    assert not unclassified, ("documented commands missing from COMMANDS in "
                              f"{_relative(Path(__file__))}:\n" + "\n".join(unclassified))
    stale = set(COMMANDS) - {d.command for d in documented}
    assert not stale, f"COMMANDS lists commands that no document shows: {sorted(stale)}"


def test_no_command_outside_a_shell_block() -> None:
    """Commands go in ```sh blocks, where the test above finds them: not in
    untagged or other blocks, nor in indented code blocks."""
    misplaced = []
    for path in DOCUMENTS:
        lines = path.read_text().splitlines()
        in_blocks: set[int] = set()
        for language, first_line, block in _blocks(path.read_text()):
            numbers = range(first_line, first_line + len(block))
            in_blocks.update(numbers)
            if language not in SHELL_LANGUAGES | DATA_LANGUAGES:
                misplaced += [f"{_relative(path)}:{n}"
                              for n, line in zip(numbers, block, strict=True)
                              if COMMAND_START.match(line)]
        misplaced += [f"{_relative(path)}:{n}" for n, line in enumerate(lines, start=1)
                      if n not in in_blocks and line.startswith("    ")
                      and COMMAND_START.match(line)]
    assert not misplaced, f"commands outside a ```sh block: {misplaced}"


def test_every_benchmark_is_run_as_documented() -> None:
    """Each benchmark has a documented command that runs here: by this test,
    or by the test named (``Elsewhere``, which holds its arguments)."""
    ran = " ".join(command for command, entry in COMMANDS.items()
                   if isinstance(entry, RunAsWritten | Elsewhere))
    missing = [path.name for path in sorted((ROOT / "bench").glob("[!_]*.py"))
               if f"bench/{path.name}" not in ran]
    assert not missing, f"benchmarks no documented command runs: {missing}"


def test_paths_named_in_the_docs_exist() -> None:
    pattern = re.compile(r"\b(?:bench|tests|deploy|ops|actors|replay|learner|protocol)/"
                         r"[\w./-]+\.(?:py|toml|yaml|yml|sbatch|json)\b")
    missing = sorted({f"{_relative(path)}: {name}" for path in DOCUMENTS
                      for name in pattern.findall(path.read_text())
                      if not (ROOT / name).exists()})
    assert not missing, f"paths the docs name that do not exist: {missing}"


@pytest.mark.parametrize("command, entry", _params(RunAsWritten))
def test_documented_command_runs(command: str, entry: RunAsWritten, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path if entry.in_tmp else ROOT)
    shell = _documented(command).shell
    if entry.extra:
        shell += " " + shlex.join(entry.extra)
    result = run_command(["bash", "-c", shell], timeout=entry.timeout,
                         env={"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    output = f"{shell}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode in entry.exit_codes, output
    assert "Traceback" not in result.stderr, output
    for text in entry.prints:
        assert text in result.stdout, output
    if entry.json_keys:
        report = json.loads(result.stdout.strip().splitlines()[-1])
        for key in entry.json_keys:
            value = report[key]
            assert (len(value) > 0 if isinstance(value, list | dict) else value > 0), (key, value)


@pytest.mark.parametrize("command, entry", _params(Elsewhere))
def test_documented_command_is_run_elsewhere(command: str, entry: Elsewhere, tmp_path: Path,
                                             request: pytest.FixtureRequest) -> None:
    text = (ROOT / entry.test).read_text()
    absent = [word for word in entry.argv if f'"{word}"' not in text]
    assert not absent, f"{entry.test} does not run {command!r}: no {absent}"
    if entry.check:
        entry.check(Check(_documented(command), tmp_path, request))


@pytest.mark.parametrize("command, entry", _params(Offline))
def test_documented_command_checked_offline(command: str, entry: Offline, tmp_path: Path,
                                            request: pytest.FixtureRequest) -> None:
    entry.check(Check(_documented(command), tmp_path, request))


def command_table() -> list[tuple[list[str], list[str]]]:
    """(subcommand words, flags) of each command in the README's table."""
    rows = []
    for line in README.read_text().splitlines():
        if not line.startswith("| `compactionrl "):
            continue
        cell = re.split(r"(?<!\\)\|", line)[1]
        top = None
        for span in re.findall(r"`([^`]*)`", cell):
            words = span.replace("\\|", "|").split()
            if words[0] == "compactionrl":
                words = words[1:]
                top = words[0]
            else:  # `push --url ...` beside `compactionrl dashboards export ...`
                words = [top, *words]
            subcommand = []
            for word in words:
                if not re.fullmatch(r"[a-z]+", word):
                    break
                subcommand.append(word)
            rows.append((subcommand, re.findall(r"--[a-z][a-z-]*(?![\w.])", span)))
    return rows


def test_the_command_table_is_read() -> None:
    table = {" ".join(subcommand) for subcommand, _ in command_table()}
    assert {"up", "eval", "dashboards export", "dashboards push", "keys init"} <= table


@pytest.mark.parametrize("subcommand, flags", [
    pytest.param(subcommand, flags, id=" ".join(subcommand))
    for subcommand, flags in command_table()])
def test_command_table_entry_has_help(subcommand: list[str], flags: list[str]) -> None:
    """``compactionrl SUBCOMMAND --help`` exits 0 and lists each flag the table shows."""
    result = run_command([str(VENV_BIN / "compactionrl"), *subcommand, "--help"], timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    absent = [flag for flag in flags if not re.search(rf"{flag}(?![\w-])", result.stdout)]
    assert not absent, f"compactionrl {' '.join(subcommand)} --help lacks {absent}"
