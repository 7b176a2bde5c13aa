"""Which two rollouts the rollout viewer (deploy/viewer.py) shows side by
side: one held-out task played before training and by the trained policy
where the run was evaluated, else the earliest and the latest kept rollout
of the most alike tasks."""

from __future__ import annotations

import json
from typing import Any


def before_and_after(held_out: list[dict[str, Any]]) -> list[str]:
    """One held-out episode played before training and after it: the first
    whose outcome training changed, else the first whose reward it changed
    most (none without both)."""
    by_id = {r["id"]: r for r in held_out}
    both = [(by_id[f"baseline-{n}"], by_id[f"trained-{n}"]) for n in range(len(held_out))
            if f"baseline-{n}" in by_id and f"trained-{n}" in by_id]
    if not both:
        return []
    before, after = max(both, key=lambda pair: (pair[0]["success"] != pair[1]["success"],
                                                abs(pair[1]["reward"] - pair[0]["reward"])))
    return [before["id"], after["id"]]


def comparison_pair(rollouts: list[dict[str, Any]]) -> list[str]:
    """The earliest and the latest kept rollout of the most alike tasks: the
    same task if any was kept twice, else the same tags and compaction
    count, else simply the first and the last."""
    if len(rollouts) < 2:
        return [r["id"] for r in rollouts]
    for key in (lambda r: r["task_id"],
                lambda r: (json.dumps(r["tags"], sort_keys=True), r["compactions"])):
        groups: dict[Any, list[dict[str, Any]]] = {}
        for rollout in rollouts:
            groups.setdefault(key(rollout), []).append(rollout)
        spans = [(g[-1]["step"] - g[0]["step"], g[0]["id"], g[-1]["id"])
                 for g in groups.values() if g[-1]["step"] > g[0]["step"]]
        if spans:
            _, early, late = max(spans)
            return [early, late]
    return [rollouts[0]["id"], rollouts[-1]["id"]]
