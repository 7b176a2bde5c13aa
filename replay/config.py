"""Configuration of the replay service (the ``[replay]`` section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protocol.bounds import bound_problems, bounded
from protocol.registry import DEFAULT_MAX_ACTORS
from protocol.transport import listen_address


@dataclass
class ReplayConfig:
    """Segment ingest, rollout assembly, staleness bound and pacing (docs/design.md §3.3).
    The replay is the source of truth for the batch size and the staleness
    bound: the learner and the actors learn both from its ``Welcome``."""

    actor_address: str = "tcp://127.0.0.1:5555"
    """Where actors connect to the replay (loopback unless you open it on
    purpose): the address it advertises, a Service name or a host's address."""
    actor_bind: str = ""
    """Where the replay listens for actors ("" = ``actor_address``), e.g.
    ``tcp://0.0.0.0:5555`` behind a Service, or one interface of a host."""
    learner_address: str = "tcp://127.0.0.1:5556"
    """Where the learner connects to the replay."""
    learner_bind: str = ""
    """Where the replay listens for the learner ("" = ``learner_address``)."""
    rollouts_per_batch: int = bounded(8, ge=1)
    """B: complete rollouts in one learner batch (one learner step)."""
    max_staleness: int = bounded(2, ge=0, why="0 = on-policy")
    """Rollouts whose oldest trainable token is more than this many learner
    versions behind are never trained on. 0 = fully on-policy."""
    max_buffer_bytes: int = bounded(512 * 1024 * 1024, ge=1024 * 1024, why="at least 1 MiB")
    """Memory bound of stored segments; credits stop before it is reached."""
    max_actors: int = bounded(DEFAULT_MAX_ACTORS, ge=1)
    """Actor incarnations registered at once; a new actor's ``hello`` beyond them is refused
    (``full``), so that no peer can grow the replay's tables without bound."""
    rollout_timeout_s: float = bounded(600.0, gt=0)
    """A rollout not completed this long after its first segment expires."""
    stale_grace: int = bounded(0, ge=0)
    """Versions past ``max_staleness`` a ready rollout may still be served at
    instead of being dropped (its tokens' importance weights are truncated at
    ``learner.is_cap``, as every token's are). Credits keep pacing at
    ``max_staleness``: only the rollouts that generation time pushes past it
    are kept, and those are the long ones (dropping them biases training
    toward short episodes)."""
    serve_order: Literal["fifo", "freshest", "oldest"] = "fifo"
    """Order in which ready rollouts are served: oldest-finished first, newest
    policy version first, or oldest policy version first (those nearest the
    staleness bound)."""
    durable_log: bool = True
    """Acknowledge a segment only after it is in the append-only log."""
    fsync: Literal["batch", "interval"] = "batch"
    """fsync the log after every batch of writes, or every fsync_interval_s."""
    fsync_interval_s: float = 1.0
    """Used with fsync = "interval"."""
    log_path: str = ""
    """The durable log (with durable_log = true). Empty: replay/segments.log in
    the run folder, so that a run never recovers another run's rollouts."""
    vocab_size: int = bounded(0, ge=0)
    """Token ids must be below this; 0 = read it from run.model's config.json."""
    metrics_port: int = bounded(9100, ge=0, le=65535)
    """Prometheus port (0 = off)."""
    actor_targets_path: str = ""
    """Prometheus's file-based discovery list of the actors' metrics addresses,
    rewritten as actors register and leave (``ops.observability``). Empty:
    none; ``compactionrl up`` sets the run's ``prometheus/actor-targets.json``."""

    def validate(self, section: str = "replay") -> list[str]:
        problems = bound_problems(self, section)
        if self.fsync == "interval" and self.fsync_interval_s <= 0:
            problems.append(f"{section}.fsync_interval_s must be > 0 with fsync = \"interval\"")
        if self.durable_log and not self.log_path:
            problems.append(f"{section}.log_path is empty but {section}.durable_log = true")
        if self.actor_address == self.learner_address:
            problems.append(f"{section}.actor_address and {section}.learner_address must differ")
        if listen_address(self.actor_bind, self.actor_address) == listen_address(
                self.learner_bind, self.learner_address):
            problems.append(f"{section}.actor_bind and {section}.learner_bind must differ")
        return problems
