"""The run timeline: where each process's time went, as spans on lanes.

Each process of a run (every actor incarnation, the learner's rank 0, the
replay) writes its spans to ``RUN/trace/<process>.jsonl`` as it goes, one
complete event of the Chrome trace event format per line (``ph = "X"``,
microseconds since the epoch): an actor's episodes, one lane per episode
slot, with the waits inside them (``summary``: generating a summary;
``weights``, ``credits``: before an episode could start) and its weight
loads; the learner's steps, the waits for a batch and the publications; the
replay's batches. ``compactionrl view`` merges them into ``RUN/trace.json``,
which Perfetto and chrome://tracing open, and draws them in the viewer.

A process opens its timeline once (:func:`open_timeline`); code anywhere in
it then marks a span with :func:`span`, on the lane of the task it runs in
(:func:`set_lane`, a context variable that asyncio tasks inherit). Without an
open timeline a span costs a check. Each file stops growing at
:data:`MAX_BYTES` (the last line then says how many spans were left out).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The run folder's timeline files and the merged trace.
TRACE_FOLDER = "trace"
TRACE_FILE = "trace.json"
#: A process's timeline file stops growing here (a long run's actors write
#: a few hundred bytes per episode).
MAX_BYTES = 32 * 2**20

_LANE: contextvars.ContextVar[str] = contextvars.ContextVar("timeline_lane", default="main")


class Timeline:
    """One process's timeline file."""

    def __init__(self, path: Path, process: str, max_bytes: int = MAX_BYTES) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.process = process
        self.max_bytes = max_bytes
        self._file = path.open("a", encoding="utf-8")
        self._written = path.stat().st_size
        self._left_out = 0
        self._lock = threading.Lock()
        # wall-clock microseconds of a monotonic instant: spans are timed on
        # the monotonic clock, and placed beside other processes' on the wall
        self._offset_us = time.time() * 1e6 - time.monotonic() * 1e6

    def add(self, name: str, began: float, ended: float, lane: str | None = None,
            **args: Any) -> None:
        """A span from monotonic ``began`` to ``ended`` on ``lane`` (the
        current one by default)."""
        event = {"name": name, "ph": "X", "pid": self.process, "tid": lane or _LANE.get(),
                 "ts": round(began * 1e6 + self._offset_us), "dur": round((ended - began) * 1e6),
                 **({"args": args} if args else {})}
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with self._lock:
            if self._written + len(line) > self.max_bytes:
                self._left_out += 1
                return
            self._file.write(line)
            # every span on disk at once: `compactionrl view` of a running
            # run, and a killed process, see all of them (a few per episode)
            self._file.flush()
            self._written += len(line)

    def close(self) -> None:
        with self._lock:
            if self._left_out:
                self._file.write(json.dumps({"name": "spans left out (file bound)", "ph": "i",
                                             "pid": self.process, "tid": "main", "s": "p",
                                             "ts": round(time.time() * 1e6),
                                             "args": {"spans": self._left_out}}) + "\n")
            self._file.close()


_timeline: Timeline | None = None


def open_timeline(run_dir: Path, process: str) -> Timeline:
    """This process's timeline, ``run_dir/trace/<process>.jsonl``; spans go there from now on."""
    global _timeline
    name = re.sub(r"[^A-Za-z0-9._-]", "_", process)  # an actor id names a file
    _timeline = Timeline(run_dir / TRACE_FOLDER / f"{name}.jsonl", process)
    return _timeline


def close_timeline() -> None:
    global _timeline
    if _timeline is not None:
        _timeline.close()
        _timeline = None


def add_span(name: str, began: float, ended: float, lane: str | None = None,
             **args: Any) -> None:
    """A span timed by the caller (monotonic seconds), if a timeline is open."""
    if _timeline is not None:
        _timeline.add(name, began, ended, lane, **args)


@contextlib.contextmanager
def span(name: str, lane: str | None = None, **args: Any) -> Iterator[None]:
    """Mark the time inside as a span of this process's timeline (none open: nothing)."""
    if _timeline is None:
        yield
        return
    began = time.monotonic()
    try:
        yield
    finally:
        add_span(name, began, time.monotonic(), lane, **args)


def set_lane(name: str) -> None:
    """The spans marked from now on in this task (an asyncio task has a
    context of its own, and the tasks it starts inherit it) go on lane ``name``."""
    _LANE.set(name)


def _natural(name: str) -> list[str | int]:
    """Sorts "slot 2" before "slot 10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def chrome_trace(run_dir: Path) -> dict[str, Any]:
    """Every process's spans of the run in one Chrome trace event document:
    processes and lanes named, numbered in order of their names."""
    events: list[dict[str, Any]] = []
    for path in sorted((run_dir / TRACE_FOLDER).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and {"name", "ph", "pid", "tid", "ts"} <= event.keys():
                    events.append(event)
    processes = {name: n for n, name in enumerate(
        sorted({str(e["pid"]) for e in events}, key=_natural), 1)}
    lanes = {key: n for n, key in enumerate(
        sorted({(str(e["pid"]), str(e["tid"])) for e in events},
               key=lambda key: (_natural(key[0]), _natural(key[1]))), 1)}
    named = [{"name": "process_name", "ph": "M", "pid": number, "tid": 0,
              "args": {"name": name}} for name, number in processes.items()]
    named += [{"name": "thread_name", "ph": "M", "pid": processes[process], "tid": number,
               "args": {"name": lane_name}} for (process, lane_name), number in lanes.items()]
    spans = [{**event, "pid": processes[str(event["pid"])],
              "tid": lanes[str(event["pid"]), str(event["tid"])]}
             for event in sorted(events, key=lambda e: e["ts"])]
    return {"traceEvents": named + spans, "displayTimeUnit": "ms"}
