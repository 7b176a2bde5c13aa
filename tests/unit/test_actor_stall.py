"""An actor's stall as its /metrics and heartbeats show it: each wait counts
from its start, so an actor whose slots never got a credit shows their whole
wait (issue 59: it showed none, and the stall share of the actors' slot time
read half what it was)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from actors.config import ActorConfig
from actors.metrics import ActorMetrics
from actors.rollout_writer import InFlight
from actors.slots import EpisodeSlots
from actors.state import CreditAccount, LearnerView

#: Slots waiting, and for how long before the scrape.
SLOTS, WAIT_S = 3, 0.4


def scraped_stall(metrics: ActorMetrics) -> dict[str, float]:
    """``crl_actor_stall_seconds_total`` by reason, as Prometheus reads it."""
    text = generate_latest(metrics.registry).decode()
    return {sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "crl_actor_stall_seconds" for sample in family.samples}


async def _never_credited() -> None:
    metrics, stopping = ActorMetrics(), asyncio.Event()

    class Host:
        """An actor whose weights are always fresh and whose replay grants nothing."""

        def __init__(self) -> None:
            self.metrics, self.stopping = metrics, stopping
            self.replay_link = SimpleNamespace(credits=CreditAccount())
            self.in_flight, self.weights = InFlight("actor", 1), LearnerView()

        def weights_fresh(self) -> bool:
            return True

        async def tell_replay(self) -> None:
            pass

    # no engine, chat or episode is reached: no credit ever comes
    slots = EpisodeSlots(ActorConfig(), 0, None, None, Host())  # type: ignore[arg-type]
    slots.start(SLOTS)
    await asyncio.sleep(WAIT_S)
    during = scraped_stall(metrics)
    assert during["credits"] >= SLOTS * WAIT_S * 0.9, during
    assert during["weights"] < 0.1 * SLOTS, during  # fresh from the start
    heartbeat = metrics.stall_totals()  # what the replay hears, read a moment later
    assert heartbeat["credits"] >= during["credits"] and heartbeat["summary"] == 0.0
    stopping.set()
    await asyncio.gather(*slots.tasks)
    after = scraped_stall(metrics)
    # the waits ended with the stop: kept, never read lower
    assert after["credits"] >= during["credits"] and scraped_stall(metrics) == after


def test_slots_that_never_get_a_credit_count_their_wait_while_it_lasts() -> None:
    asyncio.run(asyncio.wait_for(_never_credited(), 30))


def test_a_wait_is_counted_once_when_it_ends_and_a_finished_stall_adds() -> None:
    stall = ActorMetrics().stall_seconds
    began = time.monotonic()
    with stall.waiting("weights"):
        time.sleep(0.05)
        inside = stall.totals()["weights"]
    waited = time.monotonic() - began
    assert 0.05 <= inside <= stall.totals()["weights"] <= waited
    stall.add("summary", 1.5)
    assert stall.totals()["summary"] == 1.5 and stall.totals()["credits"] == 0.0
