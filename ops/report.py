"""The run report: one self-contained HTML page with SVG plots, written from
the metrics history (``metrics.jsonl``, one snapshot per line; see
:mod:`ops.summary`). No plotting library: the charts are plain SVG.

Usage::

    write_report(run_dir / "metrics.jsonl", run_dir / "report.html", title="local-cpu")
"""

from __future__ import annotations

import html
import json
from pathlib import Path

WIDTH, HEIGHT, MARGIN = 560, 220, 40
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd")


def read_history(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _scale(values: list[float], low: float, high: float, out_low: float, out_high: float
           ) -> list[float]:
    span = (high - low) or 1.0
    return [out_low + (v - low) / span * (out_high - out_low) for v in values]


def line_chart(title: str, x: list[float], series: dict[str, list[float | None]],
               x_label: str) -> str:
    """An SVG line chart of ``series`` (name -> values aligned with ``x``;
    None where a value has no data: the line skips it)."""
    values = [v for ys in series.values() for v in ys if v is not None]
    if not x or not values:
        return f"<h3>{html.escape(title)}</h3><p>no data</p>"
    low, high = min(values + [0.0]), max(values + [1e-9])
    xs = _scale(x, min(x), max(x), MARGIN, WIDTH - 10)
    parts = [f'<svg width="{WIDTH}" height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg">',
             f'<line x1="{MARGIN}" y1="{HEIGHT - MARGIN}" x2="{WIDTH - 10}" '
             f'y2="{HEIGHT - MARGIN}" stroke="#888"/>',
             f'<line x1="{MARGIN}" y1="10" x2="{MARGIN}" y2="{HEIGHT - MARGIN}" stroke="#888"/>',
             f'<text x="{MARGIN}" y="{HEIGHT - 10}" font-size="11">{html.escape(x_label)}: '
             f'{min(x):.0f} .. {max(x):.0f}</text>',
             f'<text x="2" y="14" font-size="11">{high:.3g}</text>',
             f'<text x="2" y="{HEIGHT - MARGIN}" font-size="11">{low:.3g}</text>']
    for index, (name, ys) in enumerate(series.items()):
        colour = COLOURS[index % len(COLOURS)]
        known = [(px, y) for px, y in zip(xs, ys, strict=True) if y is not None]
        points = " ".join(f"{px:.1f},{py:.1f}" for (px, _), py in zip(
            known, _scale([y for _, y in known], low, high, HEIGHT - MARGIN, 10), strict=True))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" '
                     f'points="{points}"/>')
        parts.append(f'<text x="{WIDTH - 200}" y="{16 + 14 * index}" font-size="11" '
                     f'fill="{colour}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return f"<h3>{html.escape(title)}</h3>" + "".join(parts)


def bar_chart(title: str, bars: dict[str, float]) -> str:
    if not bars or max(bars.values()) <= 0:
        return f"<h3>{html.escape(title)}</h3><p>no data</p>"
    top = max(bars.values())
    width = (WIDTH - MARGIN - 10) / len(bars)
    parts = [f'<svg width="{WIDTH}" height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg">']
    for index, (name, value) in enumerate(bars.items()):
        height = value / top * (HEIGHT - MARGIN - 20)
        left = MARGIN + index * width
        parts.append(f'<rect x="{left + 4:.1f}" y="{HEIGHT - MARGIN - height:.1f}" '
                     f'width="{width - 8:.1f}" height="{height:.1f}" fill="{COLOURS[0]}"/>')
        parts.append(f'<text x="{left + 4:.1f}" y="{HEIGHT - MARGIN + 14}" font-size="11">'
                     f'{html.escape(name)}</text>')
        parts.append(f'<text x="{left + 4:.1f}" y="{HEIGHT - MARGIN - height - 4:.1f}" '
                     f'font-size="11">{value:.3g}</text>')
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
            rates.append(max(0.0, (now[key] - before[key]) / elapsed))
    return times, rates


def write_report(history_path: Path, out: Path, title: str, summary: dict[str, str]) -> Path:
    history = read_history(history_path)
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
    sections = [
        line_chart("Reward and success by learner step", x, {
            "reward": [s.get("reward") for s in steps],
            "success (compacted)": [s.get("success_compacted") for s in steps],
            "success (uncompacted)": [s.get("success_uncompacted") for s in steps]}, "step"),
        line_chart("Compactions per rollout (batch mean)", x,
                   {"compactions": [s.get("compactions_per_rollout") for s in steps]}, "step"),
        bar_chart("Actor stall by reason (seconds, whole run)", {
            reason: last.get(f"stall_{reason}_s", 0.0)
            for reason in ("weights", "credits", "summary")}),
        bar_chart("Staleness of trained rollouts (versions)", staleness),
        line_chart("Throughput (tokens per second)", times,
                   {"actors": actor_rate, "learner": learner_rate}, "seconds"),
    ]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in summary.items())
    out.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>"
                   f"{html.escape(title)}</title></head><body style='font-family:sans-serif'>"
                   f"<h1>CompactionRL run: {html.escape(title)}</h1><table>{rows}</table>"
                   + "".join(sections) + "</body></html>")
    return out
