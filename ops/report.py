"""The run report: one self-contained HTML page with SVG plots, written from
the run folder (``metrics.jsonl``, one snapshot per line, see
:mod:`ops.summary`; ``summary.txt``, the run's figures and how it ended;
``evaluation.json``, a held-out evaluation if one ran). No plotting library:
the charts are plain SVG, each with labelled axes (units) and its legend
beside the plot, never on the data.

Usage::

    write_report(run_dir, title="local-cpu")
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from ops.fleet import STALL_REASONS, actor_rows, stall_shares

#: Plot area; the legend is to its right, the axis labels around it.
PLOT_W, PLOT_H = 460, 200
LEFT, TOP, BOTTOM, LEGEND_W = 70, 16, 46, 250
WIDTH, HEIGHT = LEFT + PLOT_W + LEGEND_W, TOP + PLOT_H + BOTTOM
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd")


def read_history(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _scale(values: list[float], low: float, high: float, out_low: float, out_high: float
           ) -> list[float]:
    span = (high - low) or 1.0
    return [out_low + (v - low) / span * (out_high - out_low) for v in values]


def _text(x: float, y: float, text: str, anchor: str = "start", rotate: bool = False,
          colour: str = "#222") -> str:
    transform = f' transform="rotate(-90 {x:.0f} {y:.0f})"' if rotate else ""
    return (f'<text x="{x:.0f}" y="{y:.0f}" font-size="11" text-anchor="{anchor}" '
            f'fill="{colour}"{transform}>{html.escape(text)}</text>')


def _axes(x_low: float, x_high: float, y_low: float, y_high: float, x_label: str,
          y_label: str, x_ticks: list[tuple[float, str]] | None = None) -> list[str]:
    """Both axes with three ticks each (or ``x_ticks``: position, label) and
    their labels with units."""
    bottom, right = TOP + PLOT_H, LEFT + PLOT_W
    parts = [f'<line x1="{LEFT}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#888"/>',
             f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}" stroke="#888"/>']
    ticks = x_ticks or [(x_low + (x_high - x_low) * f, f"{x_low + (x_high - x_low) * f:.4g}")
                        for f in (0.0, 0.5, 1.0)]
    for value, label in ticks:
        [px] = _scale([value], x_low, x_high, LEFT, right) if x_high > x_low else [LEFT]
        parts += [f'<line x1="{px:.1f}" y1="{bottom}" x2="{px:.1f}" y2="{bottom + 4}" '
                  'stroke="#888"/>', _text(px, bottom + 16, label, "middle")]
    for fraction in (0.0, 0.5, 1.0):
        value = y_low + (y_high - y_low) * fraction
        py = bottom - fraction * PLOT_H
        parts += [f'<line x1="{LEFT - 4}" y1="{py:.1f}" x2="{LEFT}" y2="{py:.1f}" '
                  'stroke="#888"/>', _text(LEFT - 6, py + 4, f"{value:.3g}", "end")]
    parts += [_text(LEFT + PLOT_W / 2, HEIGHT - 8, x_label, "middle"),
              _text(14, TOP + PLOT_H / 2, y_label, "middle", rotate=True)]
    return parts


def _legend(names: list[str]) -> list[str]:
    x = LEFT + PLOT_W + 14
    parts = []
    for index, name in enumerate(names):
        colour = COLOURS[index % len(COLOURS)]
        y = TOP + 10 + 16 * index
        parts += [f'<line x1="{x}" y1="{y - 4}" x2="{x + 16}" y2="{y - 4}" stroke="{colour}" '
                  'stroke-width="3"/>', _text(x + 22, y, name)]
    return parts


def line_chart(title: str, x: list[float], series: dict[str, list[float | None]],
               x_label: str, y_label: str) -> str:
    """An SVG line chart of ``series`` (name -> values aligned with ``x``;
    None where a value has no data: the line skips it)."""
    values = [v for ys in series.values() for v in ys if v is not None]
    if not x or not values:
        return f"<h3>{html.escape(title)}</h3><p>no data</p>"
    low, high = min(values + [0.0]), max(values + [1e-9])
    xs = _scale(x, min(x), max(x), LEFT, LEFT + PLOT_W)
    parts = [f'<svg width="{WIDTH}" height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg">',
             *_axes(min(x), max(x), low, high, x_label, y_label)]
    for index, ys in enumerate(series.values()):
        colour = COLOURS[index % len(COLOURS)]
        known = [(px, y) for px, y in zip(xs, ys, strict=True) if y is not None]
        points = " ".join(f"{px:.1f},{py:.1f}" for (px, _), py in zip(
            known, _scale([y for _, y in known], low, high, TOP + PLOT_H, TOP), strict=True))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" '
                     f'points="{points}"/>')
    parts += [*_legend(list(series)), "</svg>"]
    return f"<h3>{html.escape(title)}</h3>" + "".join(parts)


def bar_chart(title: str, bars: dict[str, float], x_label: str, y_label: str) -> str:
    if not bars or max(bars.values()) <= 0:
        return f"<h3>{html.escape(title)}</h3><p>no data</p>"
    top = max(bars.values())
    width = PLOT_W / len(bars)
    ticks = [(index + 0.5, name) for index, name in enumerate(bars)]
    parts = [f'<svg width="{WIDTH}" height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg">',
             *_axes(0, len(bars), 0, top, x_label, y_label, ticks)]
    for index, value in enumerate(bars.values()):
        height = value / top * PLOT_H
        left = LEFT + index * width
        parts.append(f'<rect x="{left + 6:.1f}" y="{TOP + PLOT_H - height:.1f}" '
                     f'width="{width - 12:.1f}" height="{height:.1f}" fill="{COLOURS[0]}"/>')
    parts.append("</svg>")
    return f"<h3>{html.escape(title)}</h3>" + "".join(parts)


def _per_step(history: list[dict]) -> list[dict]:
    """The first snapshot after each new learner step."""
    out, last = [], -1.0
    for snapshot in history:
        step = snapshot.get("learner_step")
        if step is not None and step > last:
            out.append(snapshot)
            last = step
    return out


def _rates(history: list[dict], key: str) -> tuple[list[float], list[float]]:
    times, rates = [], []
    for before, now in zip(history, history[1:], strict=False):
        elapsed = now["time"] - before["time"]
        if elapsed > 0:
            times.append(now["time"] - history[0]["time"])
            rates.append(max(0.0, (now.get(key, 0.0) - before.get(key, 0.0)) / elapsed))
    return times, rates


def _summary_tokens_per_compaction(steps: list[dict]) -> list[float | None]:
    """Between consecutive step snapshots: summary tokens over compactions."""
    out: list[float | None] = [None]
    for before, now in zip(steps, steps[1:], strict=False):
        compactions = now.get("actor_compactions", 0) - before.get("actor_compactions", 0)
        tokens = now.get("actor_summary_tokens", 0) - before.get("actor_summary_tokens", 0)
        out.append(tokens / compactions if compactions > 0 else None)
    return out[:len(steps)]


def _read_summary(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    return dict(line.split(": ", 1) for line in path.read_text().splitlines() if ": " in line)


def _evaluation(path: Path) -> str:
    """The held-out evaluation ``compactionrl eval --out`` wrote, as a table."""
    if not path.is_file():
        return ""
    data = json.loads(path.read_text())
    reports = ({"trained": data["trained"], "baseline": data["baseline"]}
               if "trained" in data else {"evaluated": data})
    keys = ("model", "episodes", "success", "success_ci95", "mean_reward",
            "compactions_per_episode", "summary_tokens_per_compaction")
    head = "".join(f"<th>{html.escape(name)}</th>" for name in reports)
    rows = "".join(f"<tr><th>{key}</th>" + "".join(
        f"<td>{html.escape(_shown(report.get(key)))}</td>" for report in reports.values())
        + "</tr>" for key in keys)
    return (f"<h2>Held-out evaluation</h2><table border='1' cellpadding='4'><tr><th></th>{head}"
            f"</tr>{rows}</table>")


def _actors(last: dict) -> str:
    """Each actor the replay registered in the run, whoever started it, and
    what it contributed (ops/fleet.py)."""
    rows = actor_rows(last)
    if not rows:
        return ""
    head = ("actor", "trained rollouts", "share", "credits granted", "version lag",
            *(f"stall: {reason}" for reason in STALL_REASONS))
    body = "".join(
        f"<tr><th align='left'>{html.escape(actor)}{'' if row.registered else ' (gone)'}</th>"
        + "".join(f"<td>{cell}</td>" for cell in (
            f"{row.trained:.0f}", _percent(row.share), f"{row.credits:.0f}",
            _shown(row.version_lag), *(_percent(row.stall.get(r)) for r in STALL_REASONS)))
        + "</tr>" for actor, row in rows.items())
    total = sum(row.trained for row in rows.values())
    return ("<h2>Actors</h2><table border='1' cellpadding='4'><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in head) + f"</tr>{body}"
            + f"<tr><th align='left'>all</th><td>{total:.0f}</td></tr></table>"
            "<p>Stall: the share of each actor's episode-slot time (capacity x time "
            "registered) its episodes waited.</p>")


def _percent(share: float | None) -> str:
    return "" if share is None else f"{100 * share:.0f} %"


def _shown(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return " - ".join(_shown(v) for v in value)
    return "" if value is None else str(value)


#: The rollout viewer's page in a run folder (``compactionrl view``), linked
#: from the report where it is there.
VIEWER_FILE = "viewer.html"


def write_report(run_dir: Path, title: str) -> Path:
    """``run_dir/report.html`` from what the run folder holds."""
    history = read_history(run_dir / "metrics.jsonl")
    summary = _read_summary(run_dir / "summary.txt")
    steps = _per_step(history)
    x = [s["learner_step"] for s in steps]
    last = history[-1] if history else {}
    bounds = sorted(float(k.removeprefix("staleness_le_")) for k in last
                    if k.startswith("staleness_le_"))
    cumulative = [last[f"staleness_le_{b:g}"] for b in bounds]
    staleness = {f"<={b:g}": c - (cumulative[i - 1] if i else 0.0)
                 for i, (b, c) in enumerate(zip(bounds, cumulative, strict=True))}
    times, actor_rate = _rates(history, "actor_generated_tokens")
    _, learner_rate = _rates(history, "learner_tokens")
    windows = [stall_shares(now, before) for before, now in zip(history, history[1:],
                                                                  strict=False)
               if now["time"] > before["time"]]
    stall = {reason: [window.get(reason) for window in windows] for reason in STALL_REASONS}
    whole_run = stall_shares(last)
    sections = [
        line_chart("Reward and success by learner step", x, {
            "reward": [s.get("reward") for s in steps],
            "success (compacted)": [s.get("success_compacted") for s in steps],
            "success (uncompacted)": [s.get("success_uncompacted") for s in steps]},
            "learner step", "reward, success rate"),
        line_chart("Compactions per rollout (batch mean)", x,
                   {"compactions": [s.get("compactions_per_rollout") for s in steps]},
                   "learner step", "compactions per rollout"),
        line_chart("Summary length", x,
                   {"summary tokens per compaction": _summary_tokens_per_compaction(steps)},
                   "learner step", "tokens"),
        line_chart("Actor stall by reason over time", times, stall, "time since start (s)",
                   "share of episode-slot time"),
        bar_chart("Actor stall by reason (whole run)", {
            reason: whole_run.get(reason, 0.0) for reason in STALL_REASONS},
            "reason", "share of episode-slot time"),
        bar_chart("Staleness of trained rollouts", staleness, "staleness (versions)",
                  "rollouts"),
        line_chart("Throughput", times, {"actors": actor_rate, "learner": learner_rate},
                   "time since start (s)", "tokens per second"),
    ]
    rows = "".join(f"<tr><th align='left'>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in summary.items())
    out = run_dir / "report.html"
    out.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>"
                   f"{html.escape(title)}</title></head><body style='font-family:sans-serif'>"
                   f"<h1>CompactionRL run: {html.escape(title)}</h1><table>{rows}</table>"
                   + (f"<p><a href='{VIEWER_FILE}'>Rollout viewer</a>: the rollouts the learner "
                      "kept, token by token as the loss used them</p>"
                      if (run_dir / VIEWER_FILE).is_file() else "")
                   + _evaluation(run_dir / "evaluation.json") + _actors(last)
                   + "".join(sections)
                   + "</body></html>")
    return out
