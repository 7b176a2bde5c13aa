"""What each actor did, and where the run's time goes, from a run's
snapshots (ops/summary.py): the rows the live view, ``compactionrl status``,
``summary.txt`` and ``report.html`` show per actor, stall in one unit, and
which side is the bottleneck.

The figures are the replay's, which registers every actor whoever started
it (replay/fleet.py): snapshot keys ``actor/<id>/<figure>``. Stall is given
everywhere as a share of episode-slot time: the seconds episodes waited,
over the slots' time (capacity x seconds) between the heartbeats that
reported them, over a window (two snapshots) or the whole run (one).

Counts (rollouts trained, credits granted) are the whole run's wherever
they are shown, so an actor's add up to the run's and one that left keeps
what it did; a figure over a window (tokens per second, stall while the run
goes on) says which: ``last 30 s``.

Usage::

    for actor, row in actor_rows(now).items(): row.text()  # the whole run
    actor_rows(now, before)[actor].window_text(window_label(now, before))  # a window
    stall_shares(now, before)     # {"weights": 0.03, "credits": 0.45, "summary": 0.01}
    bottleneck(now, before)       # "the learner: ..." / "the actors: ..." / None
"""

from __future__ import annotations

from dataclasses import dataclass

Snapshot = dict[str, float | None]
ACTOR_KEY = "actor/"
#: The reasons episodes wait, as the replay labels its stall series: the
#: keys of the heartbeat's ``stall_seconds`` (``protocol.STALL_REASONS``;
#: ``ops`` imports nothing of ours, and a test keeps the two equal).
STALL_REASONS = ("weights", "credits", "summary")
#: The learner counts as the bottleneck when it is idle less than this share
#: of a window while actors wait for credits at least :data:`CREDIT_BOUND`
#: of their slot time: rollouts wait for it, and more actors add none.
LEARNER_BUSY = 0.1
CREDIT_BOUND = 0.2
#: The actors are the bottleneck when the learner waits at least this share.
LEARNER_STARVED = 0.5


def window_label(now: Snapshot, before: Snapshot) -> str:
    """How a figure over the window from ``before`` to ``now`` is labelled."""
    return f"last {now['time'] - before['time']:.0f} s"  # type: ignore[operator]


def _stall_text(stall: dict[str, float]) -> str:
    return ", ".join(f"{reason} {100 * share:.0f} %" for reason, share in stall.items()) or "-"


@dataclass(frozen=True)
class ActorRow:
    """One actor's contribution over a window (or the run)."""

    registered: bool
    trained: float
    """Its rollouts the learner trained on."""
    share: float | None
    """Its part of all trained rollouts."""
    tokens_per_s: float | None
    """Tokens its complete rollouts generated, per second of the window (None: whole run)."""
    credits: float
    credits_held: float
    stall: dict[str, float]
    """Share of its slot time its episodes waited, by reason."""
    version_lag: float | None
    """Mean staleness of its trained rollouts (versions)."""

    def text(self) -> str:
        """The row of the whole run, in words."""
        return (f"{'' if self.registered else '(gone) '}{self.trained:.0f} rollouts trained"
                + (f" ({100 * self.share:.0f} %)" if self.share is not None else "")
                + f"; credits {self.credits:.0f} (holds {self.credits_held:.0f}); stall "
                + _stall_text(self.stall) + "; version lag "
                + (f"{self.version_lag:.2f}" if self.version_lag is not None else "-"))

    def window_text(self, label: str) -> str:
        """The row of a window, in words, after its ``label``."""
        return (f"{label}: {self.trained:.0f} trained"
                + (f", {self.tokens_per_s:.0f} tokens/s" if self.tokens_per_s is not None
                   else "")
                + f", stall {_stall_text(self.stall)}")


def _figures(snapshot: Snapshot | None) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    for key, value in (snapshot or {}).items():
        if key.startswith(ACTOR_KEY) and value is not None:
            actor, _, figure = key.removeprefix(ACTOR_KEY).rpartition("/")
            found.setdefault(actor, {})[figure] = value
    return found


def _shares(stalled: dict[str, float], slot_s: float) -> dict[str, float]:
    return ({reason: stalled.get(reason, 0.0) / slot_s for reason in STALL_REASONS}
            if slot_s > 0 else {})


def actor_rows(now: Snapshot, before: Snapshot | None = None) -> dict[str, ActorRow]:
    """Each actor the replay has registered in the run: its figures since
    ``before`` (rates included), or over the whole run without it."""
    current, earlier = _figures(now), _figures(before)
    seconds = (now["time"] - before["time"]) if before else 0.0  # type: ignore[operator]

    def delta(actor: str, figure: str) -> float:
        return max(0.0, current[actor].get(figure, 0.0)
                   - earlier.get(actor, {}).get(figure, 0.0))

    trained_all = sum(delta(actor, "trained") for actor in current)
    rows = {}
    for actor in sorted(current):
        trained = delta(actor, "trained")
        rows[actor] = ActorRow(
            registered=bool(current[actor].get("registered")), trained=trained,
            share=trained / trained_all if trained_all else None,
            tokens_per_s=delta(actor, "tokens") / seconds if seconds > 0 else None,
            credits=delta(actor, "credits"), credits_held=current[actor].get("credits_held", 0.0),
            stall=_shares({reason: delta(actor, f"stall_{reason}_s")
                           for reason in STALL_REASONS}, delta(actor, "slot_s")),
            version_lag=delta(actor, "staleness_sum") / trained if trained else None)
    return rows


def stall_shares(now: Snapshot, before: Snapshot | None = None) -> dict[str, float]:
    """The fleet's stall by reason as a share of its slot time, since
    ``before`` or over the run; empty before any slot time."""
    def delta(key: str) -> float:
        return max(0.0, (now.get(key) or 0.0) - ((before or {}).get(key) or 0.0))

    return _shares({reason: delta(f"stall_{reason}_s") for reason in STALL_REASONS},
                   delta("actor_slot_s"))


def bottleneck(now: Snapshot, before: Snapshot | None) -> str | None:
    """Which side holds the run back over the window since ``before``, in
    words, or None when neither clearly does, there is no window, or the
    learner did not answer at either end of it: its idle count then stands
    from an earlier scrape, and covers more time than the window.

    The learner counts a wait for a batch as it goes (``learner_idle_s``,
    the wait under way included), so its idle time between two scrapes is
    at most the time between them: the idle share exceeds 1 only by how much
    sooner the learner was read than the snapshot stamped at the window's
    start than at its end (ops/summary.py reads the learner last, so
    milliseconds, over the window's 30 s)."""
    if (not before or now["time"] <= before["time"]  # type: ignore[operator]
            or not now.get("learner_up") or not before.get("learner_up")):
        return None
    idle = (((now.get("learner_idle_s") or 0.0) - (before.get("learner_idle_s") or 0.0))
            / (now["time"] - before["time"]))  # type: ignore[operator]
    credits = stall_shares(now, before).get("credits", 0.0)
    label = window_label(now, before)
    if idle < LEARNER_BUSY and credits >= CREDIT_BOUND:
        return (f"the learner: idle {100 * idle:.0f} % of the time while actors wait for "
                f"credits {100 * credits:.0f} % of theirs ({label}); more actors will not "
                "train faster")
    if idle >= LEARNER_STARVED:
        return (f"the actors: the learner waits for rollouts {100 * idle:.0f} % of the time "
                f"({label}); more actors (or faster ones) would train faster")
    return None
