"""The run timeline as the rollout viewer's page draws it (deploy/viewer.py):
the merged trace (:func:`ops.timeline.chrome_trace`) cut down to the lanes,
the span names and the longest spans, in milliseconds from the first one."""

from __future__ import annotations

from typing import Any

#: The page draws at most this many spans of the run timeline (the longest).
PAGE_SPANS = 20_000


def timeline_data(trace: dict[str, Any]) -> dict[str, Any]:
    """The run timeline as the page draws it: its lanes (process and lane
    names), the span names, and each span as [lane, name, start ms, length
    ms] from the first span's start; the longest :data:`PAGE_SPANS` where
    there are more (trace.json keeps them all)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    if len(spans) > PAGE_SPANS:
        spans = sorted(sorted(spans, key=lambda e: -e["dur"])[:PAGE_SPANS], key=lambda e: e["ts"])
    lanes = sorted(names)  # numbered by chrome_trace in their reading order
    kinds = sorted({e["name"] for e in spans})
    start = min((e["ts"] for e in spans), default=0)
    return {"lanes": [f"{processes[pid]} · {names[pid, tid]}" for pid, tid in lanes],
            "kinds": kinds, "spans": [[lanes.index((e["pid"], e["tid"])), kinds.index(e["name"]),
                                       round((e["ts"] - start) / 1e3, 1),
                                       round(e["dur"] / 1e3, 1)] for e in spans],
            "shown": len(spans), "total": sum(e["ph"] == "X" for e in trace["traceEvents"])}
