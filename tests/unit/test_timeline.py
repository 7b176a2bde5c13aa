"""The run timeline (ops/timeline.py): spans on lanes in each process's file,
merged into one document of the Chrome trace event format."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import viewer_timeline
from ops.timeline import (
    TRACE_FOLDER,
    Timeline,
    add_span,
    chrome_trace,
    close_timeline,
    open_timeline,
    set_lane,
    span,
)

#: What the trace event format asks of a complete event and of a metadata one.
COMPLETE_KEYS = {"name", "ph", "ts", "dur", "pid", "tid"}


@pytest.fixture
def closed() -> Iterator[None]:
    """Whatever a test opens is closed after it: the timeline is the process's."""
    yield
    close_timeline()


def test_each_task_s_spans_go_on_its_lane_and_two_processes_merge(tmp_path: Path,
                                                                  closed: None) -> None:
    open_timeline(tmp_path, "actor-a/0")  # an actor id with a slash still names one file

    async def slot(number: int) -> None:
        set_lane(f"slot {number}")
        with span("episode", rollout=f"r{number}"):
            began = time.monotonic()
            await asyncio.sleep(0.01)
            add_span("summary", began, time.monotonic(), tokens=5)

    async def both() -> None:
        await asyncio.gather(slot(0), slot(1))
        with span("weights load", lane="weights", version=3):
            pass

    asyncio.run(both())
    for lane in ("slot 10", "slot 2"):
        with span("weights", lane=lane):
            pass
    close_timeline()
    other = Timeline(tmp_path / TRACE_FOLDER / "learner.jsonl", "learner")
    other.add("step", time.monotonic() - 1.0, time.monotonic() - 0.5, "learner", step=1)
    other.close()
    assert sorted(p.name for p in (tmp_path / TRACE_FOLDER).iterdir()) == [
        "actor-a_0.jsonl", "learner.jsonl"]
    trace = chrome_trace(tmp_path)
    json.dumps(trace)  # one JSON document, as Perfetto reads it
    events = trace["traceEvents"]
    processes = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    lanes = {(e["pid"], e["args"]["name"]): e["tid"] for e in events
             if e["name"] == "thread_name"}
    assert set(processes) == {"actor-a/0", "learner"}
    actor = processes["actor-a/0"]
    assert sorted((number, name) for (pid, name), number in lanes.items() if pid == actor) == [
        (1, "slot 0"), (2, "slot 1"), (3, "slot 2"), (4, "slot 10"), (5, "weights")]
    spans = [e for e in events if e["ph"] == "X"]
    assert all(COMPLETE_KEYS <= e.keys() and isinstance(e["pid"], int)
               and isinstance(e["tid"], int) and e["dur"] >= 0 for e in spans)
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)
    for number in (0, 1):
        lane = lanes[actor, f"slot {number}"]
        episode, = [e for e in spans if e["tid"] == lane and e["name"] == "episode"]
        summary, = [e for e in spans if e["tid"] == lane and e["name"] == "summary"]
        assert episode["args"] == {"rollout": f"r{number}"} and summary["args"] == {"tokens": 5}
        assert episode["ts"] <= summary["ts"] and (summary["ts"] + summary["dur"]
                                                   <= episode["ts"] + episode["dur"] + 1)
    step, = [e for e in spans if e["name"] == "step"]
    assert step["ts"] < min(e["ts"] for e in spans if e["pid"] == actor)  # on the wall clock


def test_a_full_file_stops_growing_and_says_how_many_spans_it_left_out(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "a.jsonl", "a", max_bytes=400)
    now = time.monotonic()
    for _ in range(20):
        timeline.add("episode", now, now + 1.0, "slot 0")
    timeline.close()
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert len("\n".join(lines[:-1])) <= 400
    assert json.loads(lines[-1])["args"]["spans"] == 20 - (len(lines) - 1)


def test_without_an_open_timeline_a_span_writes_nothing(tmp_path: Path) -> None:
    with span("episode"):
        add_span("summary", 0.0, 1.0)
    assert chrome_trace(tmp_path) == {"traceEvents": [], "displayTimeUnit": "ms"}


def test_lines_cut_short_or_foreign_are_skipped(tmp_path: Path) -> None:
    folder = tmp_path / TRACE_FOLDER
    folder.mkdir()
    good = {"name": "step", "ph": "X", "pid": "learner", "tid": "learner", "ts": 5, "dur": 2}
    (folder / "learner.jsonl").write_text(
        json.dumps(good) + '\n{"name": "st\n[1, 2]\n{"name": "x"}\n\xff\n')
    spans = [e for e in chrome_trace(tmp_path)["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"]) for e in spans] == [("step", 5)]


def test_the_page_draws_the_longest_spans_of_a_long_run(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setattr(viewer_timeline, "PAGE_SPANS", 2)
    trace = {"traceEvents": [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "learner"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "learner"}},
        *({"name": kind, "ph": "X", "pid": 1, "tid": 1, "ts": 1000 * n, "dur": dur}
          for n, (kind, dur) in enumerate([("step", 10), ("publication", 5000),
                                           ("step", 3000)]))]}
    drawn = viewer_timeline.timeline_data(trace)
    assert drawn["lanes"] == ["learner · learner"] and (drawn["shown"], drawn["total"]) == (2, 3)
    assert [drawn["kinds"][kind] for _, kind, _, _ in drawn["spans"]] == ["publication", "step"]
    assert drawn["spans"][0][2:] == [0.0, 5.0]  # from the first drawn span, in ms
