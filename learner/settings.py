"""What ``compactionrl learner`` hands every torchrun rank, as JSON (this
package cannot read the run's TOML itself)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from learner.config import LearnerConfig, TrackingConfig
from protocol.transport import TransportConfig


@dataclass
class LearnerSettings:
    """What ``compactionrl learner`` hands every rank (as JSON)."""

    model: str
    replay_address: str
    run_dir: str
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    resume: str = ""
    """Checkpoint to resume from: ``latest`` (the newest, if any), a step, or a
    checkpoint folder's path; empty: start from ``model``."""
    run_id: str = "run"
    trust_remote_code: bool = False
    """Run the model folder's own code (``actors.engine.trust_remote_code``)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def read_settings(path: Path) -> LearnerSettings:
    return msgspec.convert(msgspec.json.decode(path.read_bytes()), LearnerSettings)
