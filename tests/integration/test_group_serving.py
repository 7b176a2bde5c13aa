"""GRPO's groups against the real replay process: a group's rollouts are
served in one batch, whole, however far apart its members finish; a group
that lost a member is served with the rest once they are settled; and an
actor that leaves with half a group leaves that half served, not stranded
(docs/replay.md, "Groups")."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import pytest
import zmq

from protocol import Abandon, Batch, Goodbye, GroupTag
from tests.processes import ReplayProcess, scripted_replay
from tests.protocol_clients import ActorClient, LearnerClient

#: G, rollouts per group, and B, rollouts per batch (two groups).
GROUP, BATCH = 4, 8
_incarnations = itertools.count(1)


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplayProcess]:
    with scripted_replay(tmp_path_factory.mktemp("replay"), BATCH) as process:
        yield process


class Learner:
    """The learner's side of a test: one batch per step, the version moving
    by one per batch."""

    def __init__(self, client: LearnerClient, version: int) -> None:
        self.client = client
        self.version = version

    def step(self, actors: list[ActorClient]) -> Batch:
        self.client.request(BATCH, self.version)
        batch = None
        for _ in range(200):  # the actors' replies keep flowing while it waits
            for actor in actors:
                actor.pump(0.01)
            batch = self.client.receive(0.05)
            if batch is not None:
                break
        assert batch is not None, "no batch was served"
        self.version += 1
        return batch


@pytest.fixture
def learner(replay: ReplayProcess, context: zmq.Context) -> Iterator[Learner]:
    """Each test's learner is a new incarnation, at the version the last one
    left, and confirms its last batch as it goes (a size-0 request): the
    next would otherwise be served it again."""
    incarnation, version = next(_incarnations), int(replay.metric("crl_replay_learner_version"))
    steps = Learner(LearnerClient(context, replay.learner_address, incarnation=incarnation),
                    version)
    yield steps
    steps.client.request(0, steps.version)
    replay.wait_learner_version(steps.version)
    steps.client.close()


def groups_in(batch: Batch) -> Counter[tuple[str, str]]:
    """Members per (actor, group id) in ``batch``."""
    found: Counter[tuple[str, str]] = Counter()
    for rollout in batch.rollouts:
        final = rollout.segments[-1]
        assert final.group is not None
        found[final.sender_id, final.group.id] += 1
    return found


def registered(replay: ReplayProcess, context: zmq.Context, name: str) -> ActorClient:
    actor = ActorClient(context, replay.actor_address, name, capacity=2 * GROUP,
                        group_size=GROUP)
    actor.hello()
    assert actor.pump_until(lambda: actor.registered), actor.errors
    return actor


def pushed_group(actor: ActorClient, group: str, members: int = GROUP, version: int = 0
                 ) -> list[str]:
    rollouts = [actor.push_rollout(segments=2, group=group, version=version)
                for _ in range(members)]
    assert actor.pump_until(lambda: not actor.unacked), actor.errors
    return rollouts


def test_a_group_whose_last_member_finishes_steps_later_is_still_served_whole(
        replay: ReplayProcess, context: zmq.Context, learner: Learner) -> None:
    """Three members of a group finish, then the learner trains two batches
    of other groups (two versions) before the fourth finishes: no batch
    holds part of a group, and the slow group is served whole, within the
    staleness bound. Credits come a whole group at a time."""
    slow, fast = (registered(replay, context, name) for name in ("slow", "fast"))
    assert slow.credits % GROUP == 0 and fast.credits % GROUP == 0, (slow.credits, fast.credits)
    before = replay.metric("crl_replay_groups_served_total", complete="true")
    waiting = pushed_group(slow, "g", members=GROUP - 1)
    steps = learner
    for round_ in range(2):
        pushed_group(fast, f"a{round_}", version=steps.version)
        pushed_group(fast, f"b{round_}", version=steps.version)
        batch = steps.step([slow, fast])
        assert set(groups_in(batch).values()) == {GROUP}
        assert ("slow", "g") not in groups_in(batch)
    waiting += pushed_group(slow, "g", members=1, version=steps.version)
    pushed_group(fast, "c", version=steps.version)
    batch = steps.step([slow, fast])
    assert groups_in(batch) == {("slow", "g"): GROUP, ("fast", "c"): GROUP}
    assert {r.rollout_id for r in batch.rollouts} >= set(waiting)
    assert max(r.staleness for r in batch.rollouts) == 2
    assert replay.metric("crl_replay_groups_served_total", complete="true") - before == 6
    for actor in (slow, fast):
        actor.send(Goodbye(**actor.stamp.next()))


def test_a_member_abandoned_mid_group_leaves_the_rest_served_together(
        replay: ReplayProcess, context: zmq.Context, learner: Learner) -> None:
    """One member is given up after its first segment, another before it
    sent any (its abandon names the group): the group's other two are
    served together, counted incomplete, and nothing waits for the missing."""
    actor = registered(replay, context, "abandoning")
    before = replay.metric("crl_replay_groups_served_total", complete="false")
    kept = pushed_group(actor, "g", members=2)
    started = actor.push_rollout(segments=1, group="g", final=False)
    assert actor.pump_until(lambda: not actor.unacked), actor.errors
    tag = GroupTag(id="g", size=GROUP)
    for rollout_id in (started, "abandoning-1-never-sent"):
        actor.send(Abandon(**actor.stamp.next(), rollout_id=rollout_id, group=tag))
    whole = pushed_group(actor, "h") + pushed_group(actor, "k")
    batch = learner.step([actor])
    # the fewest whole groups that fill the batch: the two, then both whole groups
    assert {r.rollout_id for r in batch.rollouts} == set(kept) | set(whole)
    assert groups_in(batch) == {("abandoning", "g"): 2, ("abandoning", "h"): GROUP,
                                ("abandoning", "k"): GROUP}
    assert replay.metric("crl_replay_groups_served_total", complete="false") - before == 1
    actor.send(Goodbye(**actor.stamp.next()))


def test_an_actor_that_leaves_with_half_a_group_leaves_that_half_served(
        replay: ReplayProcess, context: zmq.Context, learner: Learner) -> None:
    """Two members finished, a third under way, when the actor says goodbye:
    the third is dropped (abandoned), the two are served together in the
    next batch (incomplete), and the credits go to the actor that stays."""
    leaving, staying = (registered(replay, context, name) for name in ("leaving", "staying"))
    half = pushed_group(leaving, "g", members=2)
    leaving.push_rollout(segments=1, group="g", final=False)
    assert leaving.pump_until(lambda: not leaving.unacked), leaving.errors
    abandoned = replay.metric("crl_replay_dropped_total", reason="abandoned")
    leaving.send(Goodbye(**leaving.stamp.next()))
    assert staying.pump_until(lambda: replay.metric(
        "crl_replay_dropped_total", reason="abandoned") - abandoned == 1)
    pushed_group(staying, "s")
    pushed_group(staying, "t")
    batch = learner.step([staying])
    served = {r.rollout_id for r in batch.rollouts}
    assert set(half) <= served, served
    assert groups_in(batch)["leaving", "g"] == 2
    staying.send(Goodbye(**staying.stamp.next()))


def test_a_hello_whose_groups_cannot_fit_a_batch_is_refused(
        replay: ReplayProcess, context: zmq.Context) -> None:
    actor = ActorClient(context, replay.actor_address, "too-big", capacity=64,
                        group_size=BATCH + 1)
    actor.hello()
    actor.pump(1.0)
    assert not actor.registered and [e.code for e in actor.errors] == ["invalid"], actor.errors
    actor.close()


def test_a_segment_whose_group_size_is_not_its_actors_is_refused(
        replay: ReplayProcess, context: zmq.Context) -> None:
    actor = registered(replay, context, "liar")
    actor.group_size = 2  # its hello said GROUP
    actor.push_rollout(segments=1, group="g")
    assert actor.pump_until(lambda: bool(actor.errors)), "no refusal"
    assert actor.errors[0].code == "invalid" and "group size" in actor.errors[0].text
    actor.send(Goodbye(**actor.stamp.next()))
