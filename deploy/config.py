"""The run's configuration tree: TOML, dotted command-line overrides, checks.

Each component owns the dataclass of its section; this module composes them
into :class:`JobConfig`, reads TOML (every file layers over the embedded
default, ``deploy/configs/local-cpu.toml``; several files compose, later
ones overriding earlier ones field by field), applies overrides such as
``--learner.lr 1e-5`` and rejects incoherent settings with messages that name
the field and the fix. :func:`describe_fields` lists every field with its
docstring (``compactionrl config fields``).

Usage::

    config = load_config("my.toml", ["--learner.lr", "1e-5", "--actors.count", "4"])
    config = load_config(["base.toml", "gpu.toml"])   # over the default; gpu.toml's win
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from actors.config import ActorConfig, read_model_config
from deploy.device_rules import static_device_problems
from learner.config import LearnerConfig, TrackingConfig
from ops.observability import ACTOR_TARGETS_FILE, AlertThresholds
from protocol.schema import attribute_docs
from protocol.transport import TransportConfig, bound_endpoint, is_loopback, listen_address
from replay.config import ReplayConfig
from starting_points.config import BootstrapConfig

DEFAULT_CONFIG = "local-cpu.toml"


class ConfigError(ValueError):
    """The configuration cannot be used; ``problems`` lists every reason."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(problems))
        self.problems = problems


@dataclass
class RunConfig:
    """What the run is and where it writes."""

    name: str = "local-cpu"
    """Run name; the run folder is out_dir/name."""
    out_dir: str = "runs"
    """Parent folder of run folders (checkpoints, metrics history, report)."""
    model: str = "runs/base-model"
    """HF-format model folder the actors and the learner start from, or a
    Hugging Face model id (``Qwen/Qwen3-0.6B``, ``org/name@revision``) already
    in the local Hugging Face cache (``HF_HUB_CACHE`` or ``HF_HOME``; nothing is
    downloaded: fetch it first with ``hf download``). The default is the
    bootstrapped base policy, made on first use (`compactionrl bootstrap`,
    from the tiny model `compactionrl model init` builds)."""
    seed: int = 0
    """Seed of everything random in the run (environment seeds, init, sampling)."""
    max_minutes: float = 0.0
    """`compactionrl up` stops the run after this much wall time (0 = only
    at learner.max_steps)."""


@dataclass
class ObservabilityConfig:
    """Prometheus beside ``compactionrl up``. Every run folder gets the
    configuration (``RUN/prometheus/prometheus.yml`` and ``alerts.yml``); its
    actors are the ones the replay lists as they register and leave
    (``RUN/prometheus/actor-targets.json``)."""

    prometheus: Literal["auto", "on", "off"] = "auto"
    """Whether `compactionrl up` starts a Prometheus server with the run's
    configuration (its data in RUN/prometheus/data), stopped with the run:
    "auto" where a `prometheus` program is on PATH
    (deploy/observability/install-prometheus.sh installs Debian's) and
    prometheus_address is free, "on" always (up refuses to start where it
    cannot), "off" never."""
    prometheus_address: str = "127.0.0.1:9090"
    """HOST:PORT that server listens on: its web UI, and the API Grafana reads."""

    def validate(self, section: str = "observability") -> list[str]:
        host, _, port = self.prometheus_address.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return []
        return [f"{section}.prometheus_address = {self.prometheus_address!r}: expected "
                "HOST:PORT, e.g. 127.0.0.1:9090"]


@dataclass
class JobConfig:
    """The whole tree, one section per component."""

    run: RunConfig = field(default_factory=RunConfig)
    actors: ActorConfig = field(default_factory=ActorConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def run_dir(self) -> Path:
        """The run's folder: ``run.out_dir/run.name``."""
        return Path(self.run.out_dir) / self.run.name

    def observability_files(self, out: Path) -> dict[str, Any]:
        """``ops.observability.write_files``' arguments for files written in
        ``out``: this run's metrics ports, the actors' targets file its replay
        keeps (named relative to ``out``, so that a checked-in configuration
        holds no machine's absolute path), and the alert thresholds its
        config implies."""
        return {"replay_port": self.replay.metrics_port,
                "learner_port": self.learner.metrics_port,
                "actor_targets": os.path.relpath(self.replay.actor_targets_path, out),
                "thresholds": self.alert_thresholds(), "run": self.run.name}

    def alert_thresholds(self) -> AlertThresholds:
        """What the alerts judge this run against (its staleness bound)."""
        return AlertThresholds(max_staleness=self.replay.max_staleness,
                               stale_grace=self.replay.stale_grace)

    def validate(self) -> list[str]:
        problems = (self.actors.validate("actors") + self.replay.validate("replay")
                    + self.learner.validate("learner") + self.transport.validate("transport")
                    + self.bootstrap.validate("bootstrap") + self.tracking.validate("tracking")
                    + self.observability.validate("observability"))
        # Pacing deadlocks if the buffer cannot hold the rollouts the learner
        # waits for: (S + 1) * B of the largest possible size.
        largest = max_rollout_bytes(self.actors)
        needed = (self.replay.max_staleness + 1) * self.replay.rollouts_per_batch * largest
        if self.replay.max_buffer_bytes < needed:
            problems.append(
                f"replay.max_buffer_bytes = {self.replay.max_buffer_bytes} cannot hold "
                f"(max_staleness + 1) x rollouts_per_batch = "
                f"{(self.replay.max_staleness + 1) * self.replay.rollouts_per_batch} rollouts "
                f"of up to {largest} bytes (actors.compaction): the learner could wait forever; "
                f"raise it to at least {needed}")
        # Between publications the learner moves publish_every versions
        # ahead of the actors' weights; beyond max_staleness + 1 everything
        # they generate in the last steps before a publication is dropped.
        if self.learner.publish_every > self.replay.max_staleness + 1:
            problems.append(
                f"learner.publish_every = {self.learner.publish_every} exceeds "
                f"replay.max_staleness + 1 = {self.replay.max_staleness + 1}: actors would "
                "generate stale tokens before each publication; lower it or raise the bound")
        if self.learner.advantage.startswith("grpo") and self.actors.group_size < 2:
            problems.append(f"learner.advantage = \"{self.learner.advantage}\" needs groups of "
                            "episodes on the same task: set actors.group_size >= 2 (every "
                            "advantage would be 0)")
        if self.replay.rollouts_per_batch % self.actors.group_size:
            problems.append(f"replay.rollouts_per_batch = {self.replay.rollouts_per_batch} is not "
                            f"a multiple of actors.group_size = {self.actors.group_size}: the "
                            "replay serves groups whole, so a batch would hold more rollouts "
                            "than B (docs/replay.md, \"Groups\")")
        problems += self._shared_ports()
        problems += static_device_problems(self.learner, self.actors)
        problems += self.model_problems()
        # Without CURVE, anyone who reaches a service port joins the run (and
        # whoever reaches the weight store joins a weight group).
        exposed = [f"{name} = {address!r}" for name, address in self.listening()
                   if not is_loopback(address)]
        if exposed and not (self.transport.curve.enabled
                            or self.transport.allow_insecure_network):
            problems.append(
                f"{', '.join(exposed)}: beyond loopback with transport.curve.enabled = false, "
                "anyone who reaches the port can register, push segments, take batches and "
                "receive the weights; enable CURVE (`compactionrl keys init DIR`) or, on a "
                "network you trust, set transport.allow_insecure_network = true")
        return problems

    def listening(self) -> list[tuple[str, str]]:
        """(setting, address) of every service socket the run binds:
        the bind setting where one is given, else the advertised address."""
        replay, learner = self.replay, self.learner
        store = ("learner.weight_store_bind" if learner.weight_store_bind
                 else "learner.weight_store_address",
                 listen_address(learner.weight_store_bind, learner.weight_store_address))
        return [("replay.actor_bind" if replay.actor_bind else "replay.actor_address",
                 listen_address(replay.actor_bind, replay.actor_address)),
                ("replay.learner_bind" if replay.learner_bind else "replay.learner_address",
                 listen_address(replay.learner_bind, replay.learner_address)),
                ("learner.control_bind" if learner.control_bind else "learner.control_address",
                 listen_address(learner.control_bind, learner.control_address)),
                store]

    def model_problems(self) -> list[str]:
        """The engine's settings against run.model's config.json, where the
        folder is on this machine (an id in the local Hugging Face cache is
        its snapshot folder by now: :func:`resolve_model`) (on a launcher without the model, the
        actor's own load, beside its engine, checks it; ``up`` checks again
        after bootstrapping the default model)."""
        try:
            model = read_model_config(self.run.model)
        except (OSError, ValueError) as exc:
            return [f"run.model = {self.run.model!r}: its config.json cannot be read ({exc}): "
                    "point run.model at an HF-format model folder"]
        if model is None:
            return []
        return self.actors.engine.window_problems(model, repr(self.run.model))

    def _shared_ports(self) -> list[str]:
        """Every port the run listens on must differ: ``compactionrl up`` runs
        all its processes on one machine, where the second bind fails (and
        the process would be restarted into the same failure)."""
        listening = [(f"{name} = {address!r}", bound_endpoint(address))
                     for name, address in self.listening()]
        for name in ("replay", "learner"):
            if port := getattr(self, name).metrics_port:
                listening.append((f"{name}.metrics_port = {port}", f"port {port}"))
        if first := self.actors.metrics_port:
            listening += [(f"actor {i}'s metrics port (actors.metrics_port + {i})",
                           f"port {first + i}") for i in range(self.actors.count)]
        owners: dict[str, str] = {}
        problems = []
        for setting, endpoint in listening:
            if endpoint in owners:
                problems.append(f"{setting} and {owners[endpoint]} both listen on {endpoint}: "
                                "every endpoint a run listens on must differ")
            owners.setdefault(endpoint, setting)
        return problems


#: Bytes per token on the wire (int32 id, uint8 mask, float32 log-prob, int32
#: version) and per segment (header, framing).
WIRE_BYTES_PER_TOKEN = 13
WIRE_BYTES_PER_SEGMENT = 1024


def max_rollout_bytes(actors: ActorConfig) -> int:
    """The largest rollout the actors can produce: every compaction adds an
    execution window and a summary segment, each at most one context long."""
    c = actors.compaction
    segments = 2 * c.max_compactions + 1 if c.enabled else 1
    return segments * (c.context_tokens * WIRE_BYTES_PER_TOKEN + WIRE_BYTES_PER_SEGMENT)


# --------------------------------------------------------------------------- loading


ConfigPaths = str | Path | list[str | Path] | None


def load_config(paths: ConfigPaths = None, overrides: list[str] | None = None) -> JobConfig:
    """The configuration a run uses: the embedded default
    (``deploy/configs/local-cpu.toml``), the TOML file(s) ``paths`` layered
    over it in order (each overriding the layers below field by field; a
    layer that names a table's ``factory`` replaces its ``options``,
    :func:`_merge`), then the ``--a.b value`` overrides (a ``factory``
    given there also replaces its table's options); validated. Raises
    :class:`ConfigError` listing every problem."""
    if paths is None or isinstance(paths, str | Path):
        paths = [] if paths is None else [paths]
    data: dict[str, Any] = {}
    for path in [None, *paths]:
        _merge(data, _read_toml(path))
    problems: list[str] = []
    config = _build(JobConfig, data, "", problems)
    pairs = _pair_overrides(overrides or [], problems)
    # a factory first, so that the options given beside it are its own
    for dotted, raw in sorted(pairs, key=lambda pair: not pair[0].endswith(".factory")):
        _override(config, dotted, raw, problems)
    config.run.model = resolve_model(config.run.model)
    if not config.replay.log_path:  # the run's own: one shared by runs mixes their rollouts
        config.replay.log_path = str(config.run_dir() / "replay"
                                     / "segments.log")
    if not config.replay.actor_targets_path:  # what the run's prometheus.yml reads
        config.replay.actor_targets_path = str(config.run_dir()
                                               / ACTOR_TARGETS_FILE)
    # Fields that failed to convert kept their defaults, so the coherence
    # checks still run and every problem is reported at once.
    problems += config.validate()
    if problems:
        raise ConfigError(problems)
    return config


def resolve_model(model: str) -> str:
    """``run.model`` as a folder on this machine: a folder as given; a
    Hugging Face model id (``org/name``, or ``org/name@revision``) as its
    snapshot folder in the local Hugging Face cache (``HF_HUB_CACHE``, else
    ``HF_HOME/hub``), looked up and never downloaded. Anything else is kept:
    where the model is needed, its absence is reported there (a launcher
    need not hold the model its actors load)."""
    if Path(model).exists() or model.count("/") != 1 or model.startswith((".", "/")):
        return model
    repo_id, _, revision = model.partition("@")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision or None, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return model


def _read_toml(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        text = resources.files("deploy").joinpath("configs", DEFAULT_CONFIG).read_text()
        source = f"<embedded {DEFAULT_CONFIG}>"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError([f"cannot read config file {path}: {exc.strerror}"]) from None
        source = str(path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: not valid TOML: {exc}"]) from None


def _merge(into: dict[str, Any], later: dict[str, Any]) -> None:
    """``later``'s values over ``into``'s; tables merge key by key, but for
    ``options``, which belong to the layer that names the table's
    ``factory``: a ``later`` that names one replaces the options below it
    (another factory's keyword arguments would be passed to it, and a file
    ``up`` wrote reads back as it was); one that does not adds to them."""
    if "factory" in later:
        into.pop("options", None)
    for key, value in later.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _pair_overrides(args: list[str], problems: list[str]) -> list[tuple[str, str]]:
    """``["--a.b", "1", "--c=2"]`` -> ``[("a.b", "1"), ("c", "2")]``."""
    pairs = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            problems.append(f"override {arg!r}: expected --section.field VALUE")
            i += 1
            continue
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 2
        else:
            problems.append(f"override {arg}: missing value")
            break
        pairs.append((key, value))
    return pairs


def _override(config: Any, dotted: str, raw: str, problems: list[str]) -> None:
    *parents, leaf = dotted.split(".")
    target = config
    for name in parents:
        if isinstance(target, dict) and isinstance(target.get(name, {}), dict):
            target = target.setdefault(name, {})
            continue
        if not dataclasses.is_dataclass(target) or name not in _fields(type(target)):
            problems.append(f"override --{dotted}: no section {name!r}")
            return
        target = getattr(target, name)
    if isinstance(target, dict):  # a free-form table: --actors.environment.options.rooms 16
        target[leaf] = _parse(raw)
        return
    fields = _fields(type(target))
    if leaf not in fields or dataclasses.is_dataclass(fields[leaf]):
        names = [n for n, t in fields.items() if not dataclasses.is_dataclass(t)]
        problems.append(f"override --{dotted}: no field {leaf!r}; fields here: {', '.join(names)}")
        return
    value = _parse(raw)
    if fields[leaf] is str and not isinstance(value, str):
        value = raw  # a string field takes the text as given: --actors.engine.cpu_threads_bind 0
    converted = _convert(fields[leaf], value, dotted, problems)
    if converted is _INVALID:
        return
    if leaf == "factory" and "options" in fields and converted != target.factory:
        target.options = {}  # the old factory's keyword arguments, as _merge does for a file
    setattr(target, leaf, converted)


_INVALID = object()


def _parse(raw: str) -> Any:
    """A command-line value as TOML; a bare word is a string: --run.name my-run."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build(cls: type, data: Any, where: str, problems: list[str]) -> Any:
    if not isinstance(data, dict):
        problems.append(f"[{where}] must be a table, got {type(data).__name__}")
        return cls()
    fields = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{where}.{key}" if where else key
        if key not in fields:
            problems.append(f"unknown field {dotted!r}; valid here: {', '.join(fields)}")
            continue
        converted = _convert(fields[key], value, dotted, problems)
        if converted is not _INVALID:
            kwargs[key] = converted
    return cls(**kwargs)


def _convert(hint: Any, value: Any, dotted: str, problems: list[str]) -> Any:
    """Check ``value`` against the field's type; ints are accepted for floats."""
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, dotted, problems)
    if hint is Any:  # passed through to a library that checks it (actors.engine.extra_args)
        return value
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value in choices:
            return value
        problems.append(f"{dotted} = {value!r}: choose one of {', '.join(map(repr, choices))}")
        return _INVALID
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            scratch: list[str] = []
            converted = _convert(option, value, dotted, scratch)
            if not scratch:
                return converted
        problems.append(f"{dotted} = {value!r}: expected {hint}")
        return _INVALID
    if origin is dict:
        _, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            problems.append(f"{dotted} = {value!r}: expected a table")
            return _INVALID
        return {str(k): _convert(value_hint, v, f"{dotted}.{k}", problems)
                for k, v in value.items()}
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1]
        if not isinstance(value, list):
            problems.append(f"{dotted} = {value!r}: expected a list")
            return _INVALID
        items = [_convert(item, v, f"{dotted}[{i}]", problems) for i, v in enumerate(value)]
        return origin(items)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is type(None) and value is None:
        return None
    if isinstance(hint, type) and isinstance(value, hint) and not (
        hint is int and isinstance(value, bool)
    ):
        return value
    expected = getattr(hint, "__name__", str(hint))
    problems.append(f"{dotted} = {value!r}: expected {expected}, got {type(value).__name__}")
    return _INVALID


# --------------------------------------------------------------------------- writing


def to_toml(config: Any) -> str:
    """The configuration as TOML (what ``compactionrl config show`` prints);
    ``load_config`` reads it back to an equal tree."""
    lines: list[str] = []
    _write_table(config, "", lines)
    return "\n".join(lines).strip() + "\n"


def _write_table(obj: Any, name: str, lines: list[str]) -> None:
    scalars, tables = [], []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        (tables if dataclasses.is_dataclass(value) else scalars).append((f.name, value))
    if name and scalars:
        lines.append(f"\n[{name}]")
    for key, value in scalars:
        if value is None:  # TOML has no null: unset fields (default None) are left out
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    for key, value in tables:
        _write_table(value, f"{name}.{key}" if name else key, lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}"
                                for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


# --------------------------------------------------------------------------- describing


@dataclass
class FieldDoc:
    """One configuration field, as ``compactionrl config fields`` lists it."""

    name: str
    """Dotted name, as in overrides: ``learner.lr``."""
    type: str
    default: str
    """The value a run gets as TOML: the embedded default's, or that of the
    configuration described (``config fields --config FILE``)."""
    doc: str
    field_default: str = ""
    """The field's own default, where the configuration sets another."""


def describe_fields(cls: type = JobConfig, prefix: str = "", values: Any = None
                    ) -> list[FieldDoc]:
    """Every field under ``cls`` with its type, the value a run gets (that
    of ``values``, a ``cls``; by default the embedded default's) and its
    docstring (the string literal under the field in the dataclass's
    source), and the field's own default where that value differs."""
    if values is None:
        values = load_config(None) if cls is JobConfig else cls()
    docs = attribute_docs(cls)
    defaults = cls()
    out = []
    for name, hint in _fields(cls).items():
        dotted = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            out += describe_fields(hint, f"{dotted}.", getattr(values, name))
            continue
        value, default = getattr(values, name), getattr(defaults, name)
        out.append(FieldDoc(dotted, _type_name(hint), _shown(value), docs.get(name, ""),
                            "" if value == default else _shown(default)))
    return out


def _shown(value: Any) -> str:
    return "unset" if value is None else _toml_value(value)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(hint))
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")
