"""``compactionrl view``: the rollout viewer, one static page from a run folder.

It shows the rollouts the learner kept (learner/samples.py: every step while
the run is at most 64 steps long; past that, the multiples of the smallest
power of two that leaves at most 64, so every second step up to step 128,
every fourth up to 256, and so on, from the start to the end), each named
with the actor that played it and the policy versions that sampled it, its
segments in order as the loss saw them: every token of each segment's
window, the trained ones tinted by a chosen quantity (the advantage, the
importance weight, the loss weight, the version lag, the behaviour
log-probability) on one scale for both rollouts shown, whose legend gives
its ends and middle, each segment labelled with its type and cross factor
``(γλ)^N_>s``, the compaction point where a summary begins, and, for
keyvault, the facts each summary kept and dropped of those in the window it
summarised (:func:`deploy.fact_survival.mentions_in`), and for every
environment the ``info`` its last step gave (``RolloutStats.info``).

Two rollouts are shown side by side: where the run was evaluated (``compactionrl
eval --out RUN/evaluation.json --baseline ...``, as ``make demo`` does), one
held-out task played by the policy before training and by the trained one
(:data:`HELD_OUT_FILE`, written by that command), since a training run never
plays a task twice (each episode's seed is drawn from 2^31); otherwise the
earliest and the latest kept rollout of the most alike tasks.

The page is one file with its data, style and script inside: it opens
offline, from disk, with nothing fetched.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import torch

from actors.envs.keyvault import CODE_NAMES
from deploy.config import load_config
from deploy.fact_survival import mentions_in
from deploy.viewer_pair import before_and_after, comparison_pair
from deploy.viewer_timeline import timeline_data
from learner.batch import shares_prefix
from learner.samples import read_samples, rounded
from ops.report import VIEWER_FILE
from ops.timeline import TRACE_FILE, chrome_trace

#: The held-out episodes each evaluated policy played first, kept whole
#: (deploy.evaluate.ShownEpisodes): ``{"trained" | "baseline": {"model",
#: "episodes"}}``.
HELD_OUT_FILE = "held_out.json"
#: Who played a held-out episode, as the page names it.
HELD_OUT_ROLES = {"baseline": "before training", "trained": "trained"}
#: The quantities a token can be coloured by: sample key -> label.
QUANTITIES = {"advantage": "advantage", "is_weight": "importance weight π_prox/μ",
              "loss_weight": "loss weight c_t", "lag": "version lag",
              "behaviour_logprob": "behaviour log-probability"}


def _token_texts(tokenizer: Any, ids: list[int], cache: dict[int, str]) -> list[str]:
    """Each token's own text (decoded alone: what it adds to the window)."""
    for token in ids:
        if token not in cache:
            cache[token] = tokenizer.decode([token])
    return [cache[token] for token in ids]


def _facts(window: str, summary: str, ordered: bool) -> dict[str, list[str]]:
    """The facts of ``window`` that ``summary`` kept and dropped, as words."""
    before = mentions_in(window, CODE_NAMES, ordered)
    after = mentions_in(summary, CODE_NAMES, ordered)

    def words(facts: set) -> list[str]:
        return sorted(f"{f.code} {'' if f.position is None else f.position + 1} {f.digit}"
                      .replace("  ", " ") for f in facts)
    return {"kept": words(before & after), "dropped": words(before - after)}


def _sequence(trained: dict[str, Any], version: int, texts: list[str],
              keyvault: bool, ordered: bool) -> dict[str, Any]:
    """One sequence for the page: its token texts, the trained positions
    with their quantities, its segments with where each one's trained
    tokens begin, and a summary's kept and dropped facts."""
    positions = trained["trainable"]
    segments, first = [], 0
    for kind, count, factor in zip(trained["segment_types"], trained["segment_lengths"],
                                   trained["factors"], strict=True):
        start = positions[first] if count else None
        segment: dict[str, Any] = {"type": kind, "trained": count, "factor": factor,
                                   "start": start}
        if kind == "summary" and count and keyvault:
            window = "".join(texts[:start])
            written = "".join(texts[p] for p in positions[first:first + count])
            segment["facts"] = _facts(window, written, ordered)
        segments.append(segment)
        first += count
    return {"texts": texts, "trainable": positions, "segments": segments,
            "values": {"advantage": trained["advantage"], "is_weight": trained["is_weight"],
                       "loss_weight": trained["loss_weight"],
                       "behaviour_logprob": trained["behaviour_logprob"],
                       "lag": [version - v if v >= 0 else None for v in trained["versions"]]}}


def _sampled_by(sequences: list[dict[str, Any]]) -> str:
    """The policy versions that sampled a kept rollout's trained tokens: one,
    or the range that a weight update in the middle of its episode makes."""
    versions = [v for s in sequences for v in s["versions"] if v >= 0]
    if not versions:
        return "version unknown"  # a kept rollout none of whose tokens was trained
    low, high = min(versions), max(versions)
    return f"version {low}" if low == high else f"versions {low}–{high}"


def held_out_sequences(segments: list[dict[str, Any]], share_prefixes: bool
                       ) -> list[dict[str, Any]]:
    """A held-out episode's segments (deploy.evaluate.ShownEpisodes) as the
    learner's sequences are cut (:func:`learner.batch.shares_prefix`, under
    the run's ``share_prefixes``): a summary segment that extends the
    execution segment before it goes into that one's sequence. Only the
    behaviour log-probability is known of their sampled tokens: nothing
    trained them."""
    sequences: list[dict[str, Any]] = []
    previous: torch.Tensor | None = None  # the last sequence's tokens
    for segment in segments:
        tokens = torch.tensor(segment["tokens"], dtype=torch.int64)
        mask = torch.tensor(segment["loss_mask"], dtype=torch.bool)
        extends = (share_prefixes and previous is not None and shares_prefix(
            sequences[-1]["segment_types"][-1], previous, segment["type"], tokens, mask))
        start = len(previous) if extends else 0
        sampled = [p for p in range(start, len(tokens)) if segment["loss_mask"][p]]
        if not extends:
            sequences.append({"tokens": [], "trainable": [], "segment_types": [],
                              "segment_lengths": [], "behaviour_logprob": []})
        sequence = sequences[-1]
        sequence["tokens"] = segment["tokens"]
        sequence["trainable"] += sampled
        sequence["segment_types"].append(segment["type"])
        sequence["segment_lengths"].append(len(sampled))
        sequence["behaviour_logprob"] += rounded([segment["logprobs"][p] for p in sampled])
        previous = tokens
    for sequence in sequences:
        n = len(sequence["trainable"])
        sequence.update(factors=[None] * len(sequence["segment_types"]), advantage=[None] * n,
                        is_weight=[None] * n, loss_weight=[None] * n, versions=[-1] * n)
    return sequences


def viewer_data(run_dir: Path, tokenizer: Any) -> dict[str, Any]:
    """Everything the page shows, from the run folder's samples and, where
    it was evaluated, its held-out episodes."""
    config = load_config([run_dir / "config.toml"]) if (run_dir / "config.toml").is_file() \
        else load_config(None, [])
    environment = config.actors.environment
    keyvault = environment.factory.endswith("keyvault:KeyVault")
    ordered = bool(environment.options.get("ordered", True))
    cache: dict[int, str] = {}

    def rollout(id_: str, label: str, step: int, version: int, played: dict[str, Any],
                sequences: list[dict[str, Any]], actor: str, policy: str) -> dict[str, Any]:
        return {"id": id_, "label": label, "step": step, "version": version, "actor": actor,
                "policy": policy,
                **{key: played[key] for key in ("task_id", "reward", "success", "compactions",
                                                "tags")},
                "info": played.get("info", {}),  # none in samples recorded before it was
                "sequences": [_sequence(s, version, _token_texts(tokenizer, s["tokens"], cache),
                                        keyvault, ordered) for s in sequences]}

    # the samples recorded before TrainedRollout.actor was kept name no actor
    rollouts = [rollout(f"{step['step']}-{n}", f"step {step['step']}", step["step"],
                        step["version"], kept, kept["sequences"], kept.get("actor") or "unknown",
                        _sampled_by(kept["sequences"]))
                for step in read_samples(run_dir) for n, kept in enumerate(step["rollouts"])]
    last_step = max((r["step"] for r in rollouts), default=0)
    held_out = []
    for role, played in read_held_out(run_dir).items():
        step = 0 if role == "baseline" else last_step
        held_out += [rollout(f"{role}-{episode['episode']}",
                             f"held-out episode {episode['episode']}, {HELD_OUT_ROLES[role]}",
                             step, step, episode,
                             held_out_sequences(episode["segments"], config.learner.share_prefixes),
                             "compactionrl eval", f"model {played['model']}")
                     for episode in played["episodes"]]
    return {"run": run_dir.name, "environment": environment.factory, "quantities": QUANTITIES,
            "rollouts": held_out + rollouts,
            "pair": before_and_after(held_out) or comparison_pair(rollouts)}


def write_held_out(run_dir: Path, played: dict[str, tuple[str, list[dict[str, Any]]]]) -> None:
    """:data:`HELD_OUT_FILE`: by role, the model evaluated and the held-out
    episodes it played first (deploy.evaluate.Evaluation.shown)."""
    (run_dir / HELD_OUT_FILE).write_text(json.dumps(
        {role: {"model": model, "episodes": episodes}
         for role, (model, episodes) in played.items()}))


def read_held_out(run_dir: Path) -> dict[str, Any]:
    """The run's :data:`HELD_OUT_FILE` by role (none where the run was not
    evaluated, or the file is not one ``compactionrl eval`` writes)."""
    try:
        played = json.loads((run_dir / HELD_OUT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(played, dict):
        return {}
    return {role: played[role] for role in HELD_OUT_ROLES
            if isinstance(played.get(role), dict) and isinstance(played[role].get("model"), str)
            and isinstance(played[role].get("episodes"), list)}


def write_viewer(run_dir: Path, tokenizer: Any | None = None) -> Path:
    """``run_dir/viewer.html`` and ``run_dir/trace.json`` (the run timeline
    in the Chrome trace event format); the tokenizer is the run's export's
    (or its model's)."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        source = run_dir / "export"
        if not (source / "tokenizer_config.json").is_file():
            config = load_config([run_dir / "config.toml"])
            source = Path(config.run.model)
        tokenizer = AutoTokenizer.from_pretrained(source)
    data = viewer_data(run_dir, tokenizer)
    trace = chrome_trace(run_dir)
    (run_dir / TRACE_FILE).write_text(json.dumps(trace))
    data["timeline"] = timeline_data(trace)
    # "</" would end the script element early: JSON may write it as "<\/"
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    page = (PAGE.replace("__TITLE__", html.escape(f"rollouts of {run_dir.name}"))
            .replace("__DATA__", payload))
    out = run_dir / VIEWER_FILE
    out.write_text(page)
    return out


PAGE = (Path(__file__).with_name("viewer_page.html")).read_text()
