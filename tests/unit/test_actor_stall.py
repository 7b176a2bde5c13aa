"""An actor's stall as its /metrics and heartbeats show it: each wait counts
from its start, so an actor whose slots never got a credit shows their whole
wait (issue 59: it showed none, and the stall share of the actors' slot time
read half what it was), and a summary counts while it is written."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import ClosedSegment, Generation
from actors.envs.keyvault import KeyVault
from actors.episode import EpisodeResult
from actors.metrics import ActorMetrics
from actors.rollout_writer import InFlight
from actors.slots import EpisodeSlots
from actors.state import CreditAccount, LearnerView
from tests.scripted_policy import ScriptedPolicy

#: Slots waiting, and for how long before the scrape.
SLOTS, WAIT_S = 3, 0.4
#: How long each turn of the slow policy takes, summaries included, and how
#: often the summary stall is read while an episode runs.
TURN_S, READ_EVERY_S = 0.02, 0.005


def scraped_stall(metrics: ActorMetrics) -> dict[str, float]:
    """``crl_actor_stall_seconds_total`` by reason, as Prometheus reads it."""
    text = generate_latest(metrics.registry).decode()
    return {sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "crl_actor_stall_seconds" for sample in family.samples}


class Host:
    """An actor whose weights are always fresh and whose replay grants nothing."""

    def __init__(self, metrics: ActorMetrics) -> None:
        self.metrics, self.stopping = metrics, asyncio.Event()
        self.replay_link = SimpleNamespace(credits=CreditAccount())
        self.in_flight, self.weights = InFlight("actor", 1), LearnerView()

    def weights_fresh(self) -> bool:
        return True

    async def tell_replay(self) -> None:
        pass


async def _never_credited() -> None:
    metrics = ActorMetrics()
    host = Host(metrics)
    stopping = host.stopping
    # no engine, chat or episode is reached: no credit ever comes
    slots = EpisodeSlots(ActorConfig(), 0, None, None, host)  # type: ignore[arg-type]
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


def test_a_weight_load_s_pause_stalls_each_rollout_in_progress_once() -> None:
    """A pause of generation stalls every episode it holds, in its own slot:
    two in progress count it twice, none not at all (a slot that waits for
    the weights counts its own wait; added to that, the pause read a share
    of slot time over 1)."""
    metrics = ActorMetrics()
    metrics.generation_paused(0.5)
    assert metrics.stall_totals()["weights"] == 0.0
    metrics.rollout_begun()
    metrics.rollout_begun()
    metrics.generation_paused(0.5)
    metrics.rollout_landed()
    metrics.generation_paused(0.25)
    assert metrics.stall_totals()["weights"] == 1.25
    assert scraped_stall(metrics)["weights"] == 1.25
    assert "crl_actor_active_rollouts 1.0" in generate_latest(metrics.registry).decode()


class SlowPolicy(ScriptedPolicy):
    """Takes ``TURN_S`` over each turn, summaries included."""

    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                       temperature: float | None = None) -> Generation:
        await asyncio.sleep(TURN_S)
        return await super().generate(prompt, max_tokens, seed, temperature)


class Rollout:
    """Where an episode's segments go: nowhere."""

    rollout_id = "r0"

    async def emit(self, task_id: str, segment: ClosedSegment,
                   result: EpisodeResult | None) -> None:
        pass


async def _summary_stall_read_while_an_episode_runs(tokenizer, metrics: ActorMetrics
                                                    ) -> list[tuple[float, float, float]]:
    """An episode slot plays one episode that compacts; the actor's summary
    stall is read every ``READ_EVERY_S`` meanwhile and once after it:
    (monotonic before the read, summary stall, monotonic after)."""
    config = ActorConfig()
    chat = ChatFormat(tokenizer, config.compaction, config.environment)
    slots = EpisodeSlots(config, 0, SlowPolicy(tokenizer, "next"), chat,  # type: ignore[arg-type]
                         Host(metrics))  # type: ignore[arg-type]
    reads: list[tuple[float, float, float]] = []

    def read() -> None:
        before = time.monotonic()
        reads.append((before, metrics.stall_totals()["summary"], time.monotonic()))

    episode = asyncio.create_task(slots._play(KeyVault(), Rollout(), 1, 1))  # type: ignore[arg-type]
    while not episode.done():
        read()
        await asyncio.sleep(READ_EVERY_S)
    await episode
    read()
    return reads


def test_a_summary_counts_as_stall_while_it_is_written(tokenizer) -> None:
    """An episode's summaries were added to its stall when it ended: a window
    of the views held them whole, and the stall share of slot time read over
    100 %. Counted while they are written, the stall of one slot between two
    reads is at most the time between them, and every summary is counted."""
    metrics = ActorMetrics()
    reads = asyncio.run(_summary_stall_read_while_an_episode_runs(tokenizer, metrics))
    compactions = metrics.registry.get_sample_value("crl_actor_compactions_total")
    assert compactions >= 1
    assert any(0 < stalled for _, stalled, _ in reads[:-1]), "no summary counted as it ran"
    for (began, earlier, _), (_, later, ended) in zip(reads, reads[1:], strict=False):
        assert later - earlier <= ended - began
    assert reads[-1][1] >= compactions * TURN_S  # each summary took a turn's time
