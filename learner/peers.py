"""What the learner says to its peers, the replay and the actors: rank 0
speaks (:class:`RankZeroPeers`: its replay client and the control plane),
the other ranks say nothing (:class:`Peers`), and the collectives around
each call (learner/collectives.py) carry rank 0's answers to them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from learner.control import ControlPlane
from learner.members import ExclusionPolicy
from learner.metrics import LearnerMetrics
from learner.replay_client import ReplayClient, TakenBatch
from learner.settings import LearnerSettings
from protocol.transport import listen_address


def starting_version(restored: int, announced: int, replay_version: int) -> int:
    """The version the learner's weights carry at start: the restored
    checkpoint's (0 without one), unless an earlier learner process of the run
    got further: it announced ``announced`` to actors, and the replay heard
    ``replay_version`` in its batch requests. Those weights are lost, but
    actors may still generate with them, so the restored weights take a label
    above both, never one that named other weights."""
    seen = max(announced, replay_version)
    return restored if seen <= restored else seen + 1


class Peers:
    """What the learner says to its peers (the replay, the actors), as the
    ranks other than 0 do it: nothing. Every rank calls the same methods at
    the same points, and the collectives around them carry rank 0's values
    (:class:`RankZeroPeers`) to the others."""

    control: ControlPlane | None = None

    def join(self) -> int:
        """Register with the replay; the batch size B."""
        return 0

    def starting_version(self, restored: int) -> int:
        return restored

    def weights_wanted(self, version: int) -> bool:
        """Whether an actor needs weights at once (and tell the control
        plane the learner's ``version``)."""
        return False

    def request(self, size: int, version: int) -> None:
        """Ask the replay for the next batch (unless a request is outstanding)."""

    def next_batch(self, size: int, version: int, stopping: Callable[[], bool]
                   ) -> TakenBatch | None:
        """The next batch (its frame, and the batch decoded once), or None
        once ``stopping()`` or weights are wanted. None on the other ranks:
        they decode the frame rank 0 broadcasts them."""
        return None

    def close(self) -> None:
        pass


class RankZeroPeers(Peers):
    """Rank 0: the link to the replay, and (once the replay has said the
    staleness bound, its one source) the control plane actors register with."""

    def __init__(self, settings: LearnerSettings, metrics: LearnerMetrics,
                 announced_record: Path) -> None:
        self.settings = settings
        self.metrics = metrics
        self.announced_record = announced_record
        self.link = ReplayClient(settings.replay_address, settings.transport,
                                 settings.learner.replay_timeout_s, metrics.replay_client())
        self.replay_version = 0
        """The newest version the replay has heard, from its welcome."""

    def join(self) -> int:
        welcome = self.link.hello()
        self.replay_version = welcome.policy_version
        config = self.settings.learner
        self.control = ControlPlane(listen_address(config.control_bind, config.control_address),
                                    self.settings.transport,
                                    self.settings.run_id, welcome.max_staleness,
                                    config.late_joiner, self.metrics, self.announced_record,
                                    ExclusionPolicy(config.member_backoff_s,
                                                    config.member_failures_allowed))
        return welcome.rollouts_per_batch

    def starting_version(self, restored: int) -> int:
        return starting_version(restored, self.control.announced, self.replay_version)

    def weights_wanted(self, version: int) -> bool:
        self.control.version = version
        return self.control.table.publication_wanted(version)

    def request(self, size: int, version: int) -> None:
        self.link.request(size, version)

    def next_batch(self, size: int, version: int, stopping: Callable[[], bool]
                   ) -> TakenBatch | None:
        return self.link.next_batch(
            size, version, lambda: stopping() or self.control.table.publication_wanted(version))

    def close(self) -> None:
        self.link.close()
        if self.control is not None:
            self.control.close()
