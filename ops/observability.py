"""Prometheus and Grafana as code: the dashboard panels, the alerting rules and
the scrape configuration, generated from the definitions here.

Every panel and alert is written against docs/design.md §4's metric names. An alert
keeps its *signal* (the PromQL whose value it judges) apart from its
threshold, so tests can check that every signal returns data from a real run
while the alert itself stays quiet.

The actors are found through Prometheus's file-based service discovery: the
replay rewrites ``RUN/prometheus/actor-targets.json`` (:data:`ACTOR_TARGETS_FILE`,
:func:`write_actor_targets`) as actors register and leave, and Prometheus
rereads it, so an actor added by hand is scraped without a restart or a new
configuration, and one that left is no longer judged.

Usage::

    dashboards()                 # Grafana dashboard JSON models (dicts)
    alert_rules(thresholds)      # the Prometheus rule file (dict, YAML-ready)
    scrape_config(replay_port, learner_port, actor_targets)  # prometheus.yml (dict)
    write_actor_targets(path, {"actor-0": "127.0.0.1:9110"}, run)  # the actors' file
    panel_queries(run)           # each panel's PromQL without Grafana's variables
    promql_expressions()         # every expression used anywhere: what the tests query
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ops.files import atomic_write_text

#: Grafana datasource uid the provisioning file creates and panels refer to.
DATASOURCE_UID = "compactionrl-prometheus"
#: The actors' file-based discovery file, relative to a run folder: the
#: replay rewrites it as actors register and leave.
ACTOR_TARGETS_FILE = "prometheus/actor-targets.json"


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[tuple[str, str], ...]
    """(legend, PromQL) per series."""
    unit: str = "short"
    kind: Literal["timeseries", "table"] = "timeseries"


@dataclass(frozen=True)
class Alert:
    name: str
    signal: str
    """The PromQL the alert judges; its value is what a dashboard would show."""
    condition: str
    """Appended to the signal, e.g. ``> 0.5``."""
    for_: str
    summary: str
    severity: Literal["warning", "critical"] = "warning"

    @property
    def expr(self) -> str:
        return f"({self.signal}) {self.condition}"


#: Range of the alert rules' rates (Prometheus evaluates them; no Grafana macro).
RATE = "[1m]"
#: Range of the panels' rates: Grafana's, from the scrape interval and the zoom.
RANGE = "[$__rate_interval]"
#: Label matchers of the dashboard variables (Grafana fills them in). Actors are
#: told apart by the ``actor`` label that the replay's discovery file gives each
#: target (:func:`write_actor_targets`): an id, not a scrape address.
RUN = 'run=~"$run"'
ACTORS = 'run=~"$run", actor=~"$actor"'
#: The rate window of a panel's query outside Grafana (Grafana's
#: ``$__rate_interval`` is at least four scrape intervals: 20 s at 5 s).
PLAIN_RANGE = "1m"
#: A label matcher on a dashboard variable, as a plain query drops it (every value).
VARIABLE_MATCHER = re.compile(r'^\w+=~"\$\w+"$')
#: An actor series joined with its engine's labels (device = GPU type).
BY_ENGINE = f'* on(actor) group_left(device) crl_actor_engine_info{{{ACTORS}, device=~"$gpu"}}'

DASHBOARDS: dict[str, tuple[Panel, ...]] = {
    "CompactionRL: training": (
        Panel("Reward (batch mean)", (("reward", f"crl_learner_reward{{{RUN}}}"),)),
        Panel("Rollout reward and compactions (quantiles over rollouts trained on)", tuple(
            (f"{name} p{q}", f"histogram_quantile(0.{q}, sum by (le) "
                             f"(rate(crl_learner_rollout_{name}_bucket{{{RUN}}}{RANGE})))")
            for name in ("reward", "compactions") for q in (10, 50, 90))),
        Panel("Success rate by compaction", (
            ("compacted", f'crl_learner_success_rate{{{RUN}, compacted="true"}}'),
            ("uncompacted", f'crl_learner_success_rate{{{RUN}, compacted="false"}}')),
              "percentunit"),
        Panel("Compaction rate", (
            ("per rollout (actors)", f"sum(rate(crl_actor_compactions_total{{{ACTORS}}}{RANGE}))"
                                     f" / sum(rate(crl_actor_rollouts_total{{{ACTORS}}}{RANGE}))"),
            ("per rollout (trained batch)", f"crl_learner_compactions_per_rollout{{{RUN}}}"))),
        Panel("Losses", (("policy", f"crl_learner_policy_loss{{{RUN}}}"),
                         ("value", f"crl_learner_value_loss{{{RUN}}}"))),
        Panel("PPO statistics", (("clip fraction", f"crl_learner_clip_fraction{{{RUN}}}"),
                                 ("approx KL", f"crl_learner_approx_kl{{{RUN}}}"),
                                 ("IS weight mean", f"crl_learner_is_weight_mean{{{RUN}}}"),
                                 ("IS truncated",
                                  f"crl_learner_is_truncated_fraction{{{RUN}}}"),
                                 ("explained variance",
                                  f"crl_learner_explained_variance{{{RUN}}}"))),
        Panel("Grouped rollouts trained with their whole group (advantage = grpo)", (
            ("learner", f'sum(rate(crl_learner_group_rollouts_total{{{RUN}, complete="true"}}'
                        f"{RANGE})) / sum(rate(crl_learner_group_rollouts_total{{{RUN}}}"
                        f"{RANGE}))"),),
              "percentunit"),
        Panel("Policy version", (("learner", f"crl_learner_policy_version{{{RUN}}}"),
                                 ("published", f"crl_learner_published_version{{{RUN}}}"),
                                 ("actors (min)", f"min(crl_actor_policy_version{{{ACTORS}}})"))),
    ),
    "CompactionRL: system": (
        Panel("Stall time by reason (share of episode-slot time)", (
            ("{{reason}}", f"sum by (reason) (rate(crl_actor_stall_seconds_total{{{ACTORS}}}"
                           f"{RANGE})) / scalar(sum(crl_actor_episode_slots{{{ACTORS}}}))"),),
              "percentunit"),
        Panel("Staleness of trained rollouts", (
            ("p50", "histogram_quantile(0.5, sum by (le) "
                    f"(rate(crl_replay_staleness_bucket{{{RUN}}}{RANGE})))"),
            ("p95", "histogram_quantile(0.95, sum by (le) "
                    f"(rate(crl_replay_staleness_bucket{{{RUN}}}{RANGE})))"))),
        Panel("Throughput (tokens/s)", (
            ("actors", f"sum(rate(crl_actor_generated_tokens_total{{{ACTORS}}}{RANGE}))"),
            ("summary tokens",
             f"sum(rate(crl_actor_compaction_tokens_total{{{ACTORS}}}{RANGE}))"),
            ("learner", f"rate(crl_learner_tokens_total{{{RUN}}}{RANGE})")), "short"),
        Panel("Replay: segments and drops (per s)", (
            ("{{result}}", f"sum by (result) (rate(crl_replay_segments_total{{{RUN}}}{RANGE}))"),
            ("dropped {{reason}}",
             f"sum by (reason) (rate(crl_replay_dropped_total{{{RUN}}}{RANGE}))"))),
        Panel("Replay: rollouts held", (("{{state}}", f"crl_replay_rollouts{{{RUN}}}"),
                                        ("credits outstanding",
                                         f"crl_replay_credits_outstanding{{{RUN}}}"))),
        Panel("Weight sync seconds by phase (mean per publication)", (
            ("{{phase}}", f"sum by (phase) (rate(crl_learner_weight_sync_seconds_sum{{{RUN}}}"
                          f"{RANGE})) / sum by (phase) "
                          f"(rate(crl_learner_weight_sync_seconds_count{{{RUN}}}{RANGE}))"),
        ), "s"),
        Panel("Processes up", (("{{job}}", f'sum by (job) (up{{{RUN}, job=~"$job"}})'),)),
    ),
    "CompactionRL: actors": (
        Panel("Engines", (("{{actor}} {{device}} {{dtype}} tp={{tp}}",
                           f'crl_actor_engine_info{{{ACTORS}, device=~"$gpu"}}'),),
              kind="table"),
        Panel("Policy version loaded, by actor", (
            ("{{actor}}", f"crl_actor_policy_version{{{ACTORS}}}"),)),
        Panel("Tokens/s by actor", (
            ("{{actor}}", "sum by (actor) "
                             f"(rate(crl_actor_generated_tokens_total{{{ACTORS}}}{RANGE}))"),)),
        Panel("Stall share by actor and reason", (
            ("{{actor}} {{reason}}",
             f"sum by (actor, reason) (rate(crl_actor_stall_seconds_total{{{ACTORS}}}{RANGE}))"
             f" / on(actor) group_left sum by (actor) "
             f"(crl_actor_episode_slots{{{ACTORS}}})"),), "percentunit"),
        Panel("Tokens/s by GPU type", (
            ("{{device}}", "sum by (device) "
                           f"(rate(crl_actor_generated_tokens_total{{{ACTORS}}}{RANGE}) "
                           f"{BY_ENGINE})"),)),
        Panel("Stall share by GPU type", (
            ("{{device}}", "sum by (device) "
                           f"(rate(crl_actor_stall_seconds_total{{{ACTORS}}}{RANGE}) {BY_ENGINE})"
                           " / sum by (device) "
                           f"(crl_actor_episode_slots{{{ACTORS}}} {BY_ENGINE})"),),
              "percentunit"),
    ),
}


@dataclass(frozen=True)
class AlertThresholds:
    """What the alerts judge against, rendered from the run's config
    (``deploy`` builds it: ``compactionrl dashboards export --config FILE``)."""

    max_staleness: int = 2
    """replay.max_staleness."""
    stale_grace: int = 0
    """replay.stale_grace: the replay serves rollouts up to max_staleness +
    stale_grace versions stale; a median trained rollout that old means
    actors lag."""
    stall_share: float = 0.5
    """Share of episode-slot time spent waiting for weights or summaries,
    sustained, that warns (waiting for credits is the learner's pace)."""
    no_step_minutes: int = 10
    """Minutes without a learner step that page."""
    disk_free_fraction: float = 0.1
    """Free share of the filesystem under the run folder or the segment log
    below which to warn (checkpoints and the log grow)."""


#: The signal of a counter that may not exist yet (no failure so far): 0.
def _or_zero(expr: str) -> str:
    return f"({expr}) or vector(0)"


def alerts(thresholds: AlertThresholds) -> tuple[Alert, ...]:
    losses = "abs(crl_learner_policy_loss) + abs(crl_learner_value_loss)"
    # Served staleness never exceeds the bound (older rollouts are dropped),
    # so a quantile interpolated in the bound's bucket stays below it: the
    # median past bound - 1 means over half the trained rollouts are at it
    # (with a bound of 0 every rollout is, and the median is 0: never past 0).
    bound = thresholds.max_staleness + thresholds.stale_grace
    failed = 'sum(increase(crl_learner_weight_publications_total{result="failed"}[15m]))'
    return (
        # With file-based discovery a target is listed while its actor is
        # registered: an actor that left has no up series, so it is not judged.
        Alert("CompactionRLActorDown", 'up{job="actors"}', "== 0", "1m",
              "A registered actor's /metrics has not answered for a minute"),
        Alert("CompactionRLLearnerDown", 'up{job="learner"}', "== 0", "2m",
              "The learner's /metrics has not answered for two minutes", "critical"),
        Alert("CompactionRLReplayDown", 'up{job="replay"}', "== 0", "1m",
              "The replay's /metrics has not answered for a minute", "critical"),
        # Waiting for credits is the learner's pace (it is the bottleneck in
        # a healthy run): only the waits of the actors' own making warn.
        Alert("CompactionRLStallShareHigh",
              f'sum(rate(crl_actor_stall_seconds_total{{reason!="credits"}}{RATE})) '
              "/ sum(crl_actor_episode_slots)",
              f"> {thresholds.stall_share:g}", "10m",
              f"Actors spend over {thresholds.stall_share:.0%} of their episode-slot time "
              "waiting for weights or summaries"),
        Alert("CompactionRLStalenessAtBound",
              "histogram_quantile(0.5, sum by (le) "
              f"(rate(crl_replay_staleness_bucket{RATE})))",
              f"> {max(bound - 1, 0)}", "10m",
              f"Over half the trained rollouts are {bound} versions stale, the most the replay "
              "serves (replay.max_staleness + stale_grace): actors fall behind the learner"),
        Alert("CompactionRLLearnerStuck",
              f"changes(crl_learner_policy_version[{thresholds.no_step_minutes}m])", "== 0",
              "5m", f"No learner step for {thresholds.no_step_minutes} minutes", "critical"),
        Alert("CompactionRLLossNotFinite", losses, f"unless (({losses}) < +Inf)", "0m",
              "A loss of the last step is NaN or infinite", "critical"),
        # A share, not a count: an actor leaving fails the publication in
        # flight, and the next one reaches the others.
        Alert("CompactionRLWeightPublicationsFailing",
              f"({_or_zero(failed)}) / "
              "sum(increase(crl_learner_weight_publications_total[15m]))", "> 0.5", "10m",
              "Most weight publications of the last 15 minutes failed: actors generate with "
              "old weights"),
        # A member left out after failed generations (learner/members.py)
        # is back within minutes unless it keeps failing; past its last
        # backoff it is out until it restarts, and generates with old weights.
        Alert("CompactionRLMembersExcluded", "max(crl_learner_members_excluded)", "> 0", "10m",
              "An actor's engine keeps failing to join or load weight groups: it is left "
              "out of publications (docs/weights.md \"A member that never joins\")"),
        Alert("CompactionRLRolloutsExpiring",
              _or_zero('sum(rate(crl_replay_dropped_total{reason="expired"}[10m]))'), "> 0",
              "15m", "Rollouts expire in the replay: actors die or stall mid-episode"),
        Alert("CompactionRLDiskFilling",
              "(crl_replay_disk_free_bytes / crl_replay_disk_size_bytes) or "
              "(crl_learner_disk_free_bytes / crl_learner_disk_size_bytes)",
              f"< {thresholds.disk_free_fraction:g}", "5m",
              f"Under {thresholds.disk_free_fraction:.0%} free on the filesystem of the run "
              "folder or the segment log", "critical"),
    )


#: Panels query the data source the dashboard's variable names: importable into
#: any Grafana whatever its data source's uid.
PANEL_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    """A query variable over label values, all selected by default."""
    return {"name": name, "label": label, "type": "query", "datasource": PANEL_DATASOURCE,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2,
            "includeAll": True, "allValue": ".*", "multi": True, "sort": 1,
            "current": {"text": ["All"], "value": ["$__all"]}}


TEMPLATING = [
    {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
     "current": {}, "hide": 0},
    _variable("run", "Run", "label_values(up, run)"),
    _variable("job", "Job", f"label_values(up{{{RUN}}}, job)"),
    _variable("actor", "Actor", f"label_values(crl_actor_engine_info{{{RUN}}}, actor)"),
    _variable("gpu", "GPU type", f"label_values(crl_actor_engine_info{{{RUN}}}, device)"),
]


def _panel_json(panel: Panel, index: int) -> dict[str, Any]:
    return {
        "id": index + 1,
        "type": panel.kind,
        "title": panel.title,
        "datasource": PANEL_DATASOURCE,
        "gridPos": {"x": (index % 2) * 12, "y": (index // 2) * 8, "w": 12, "h": 8},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": PANEL_DATASOURCE,
                     **({"format": "table", "instant": True} if panel.kind == "table" else {})}
                    for i, (legend, expr) in enumerate(panel.exprs)],
    }


def dashboards() -> dict[str, dict[str, Any]]:
    """File stem -> Grafana dashboard JSON model."""
    out = {}
    for title, panels in DASHBOARDS.items():
        stem = title.split(": ")[1].replace(" ", "-")
        out[f"compactionrl-{stem}"] = {
            "uid": f"compactionrl-{stem}", "title": title, "tags": ["compactionrl"],
            "timezone": "browser", "schemaVersion": 39, "version": 1, "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": TEMPLATING},
            "panels": [_panel_json(p, i) for i, p in enumerate(panels)],
        }
    return out


def alert_rules(thresholds: AlertThresholds | None = None) -> dict[str, Any]:
    return {"groups": [{"name": "compactionrl", "rules": [
        {"alert": a.name, "expr": a.expr, "for": a.for_, "labels": {"severity": a.severity},
         "annotations": {"summary": a.summary}}
        for a in alerts(thresholds or AlertThresholds())]}]}


def scrape_config(replay_port: int, learner_port: int, actor_targets: str,
                  host: str = "127.0.0.1", interval_s: float = 5.0,
                  rule_files: tuple[str, ...] = ("alerts.yml",),
                  run: str | None = None) -> dict[str, Any]:
    """prometheus.yml scraping one run (the job names the panels use): the
    replay and the learner at their ports on ``host``, labelled ``run``; the
    actors listed in the file-based discovery file ``actor_targets`` (a path
    relative to the configuration's folder, or absolute), which Prometheus
    rereads when it changes, and every ``interval_s`` where it cannot watch."""
    return {
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval":
                   f"{interval_s:g}s"},
        "rule_files": list(rule_files),
        "scrape_configs": [
            *({"job_name": job, "static_configs": [{"targets": [f"{host}:{port}"],
                                                    **({"labels": {"run": run}} if run else {})}]}
              for job, port in (("replay", replay_port), ("learner", learner_port))),
            {"job_name": "actors", "file_sd_configs": [
                {"files": [actor_targets], "refresh_interval": f"{interval_s:g}s"}]}],
    }


def write_actor_targets(path: Path, targets: Mapping[str, str], run: str | None) -> None:
    """Write Prometheus's file_sd JSON listing ``targets`` (actor id ->
    ``host:port`` of its /metrics), each labelled with its actor id and
    ``run``; atomically, so that Prometheus never reads half a file."""
    entries = [{"targets": [address], "labels": {"actor": actor, **({"run": run} if run else {})}}
               for actor, address in sorted(targets.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(entries, indent=2) + "\n")


def panel_queries(run: str | None = None, rate_range: str = PLAIN_RANGE
                  ) -> dict[str, list[tuple[str, str]]]:
    """Each panel's series as plain PromQL, by "dashboard / panel": the
    dashboards' variables filled in as a query outside Grafana needs them,
    ``$run`` with ``run`` (every run when None), every actor, GPU type and
    job, and Grafana's rate interval with ``rate_range``."""
    return {f"{title} / {panel.title}": [(legend, _plain(expr, run, rate_range))
                                          for legend, expr in panel.exprs]
            for title, panels in DASHBOARDS.items() for panel in panels}


def _plain(expr: str, run: str | None, rate_range: str) -> str:
    """``expr`` without Grafana's variables: a matcher on one that stands for
    every value is dropped rather than written ``=~".*"``, and a selector
    left without matchers loses its braces."""
    expr = expr.replace("$__rate_interval", rate_range)
    if run is not None:
        expr = expr.replace(RUN, f"run={json.dumps(run)}")

    def matchers(selector: re.Match[str]) -> str:
        kept = [m for m in selector.group(1).split(", ") if not VARIABLE_MATCHER.match(m)]
        return "{" + ", ".join(kept) + "}" if kept else ""

    return re.sub(r"\{([^{}]*)\}", matchers, expr)


def promql_expressions() -> dict[str, str]:
    """Every expression a dashboard panel or an alert uses, by where it is
    used; the dashboards' variables stand for every value (Grafana's "All"),
    so each can be queried outside Grafana."""
    found = {f"{where} / {legend}": expr for where, series in panel_queries().items()
             for legend, expr in series}
    found.update({f"alert {a.name}": a.signal for a in alerts(AlertThresholds())})
    return found


def write_prometheus_files(out: Path, replay_port: int, learner_port: int, actor_targets: str,
                           thresholds: AlertThresholds | None = None,
                           run: str | None = None) -> list[Path]:
    """``prometheus.yml`` and ``alerts.yml`` in ``out``: what a Prometheus
    server needs to watch one run (``actor_targets`` as :func:`scrape_config`
    takes it)."""
    import yaml

    return _write_generated(out, {
        "prometheus.yml": yaml.safe_dump(scrape_config(replay_port, learner_port,
                                                       actor_targets, run=run),
                                         sort_keys=False),
        "alerts.yml": yaml.safe_dump(alert_rules(thresholds), sort_keys=False)})


def write_files(out: Path, replay_port: int, learner_port: int, actor_targets: str,
                thresholds: AlertThresholds | None = None,
                run: str | None = None) -> list[Path]:
    """Everything under ``deploy/observability``: Prometheus config and rules
    (:func:`write_prometheus_files`), Grafana provisioning and dashboards
    (the compose file is hand-written)."""
    import yaml

    written = write_dashboards(out / "grafana" / "dashboards")
    written += write_prometheus_files(out, replay_port, learner_port, actor_targets,
                                      thresholds, run)
    written += _write_generated(out, {
        "grafana/provisioning/datasources/prometheus.yml": yaml.safe_dump({
            "apiVersion": 1, "datasources": [{
                "name": "Prometheus", "type": "prometheus", "uid": DATASOURCE_UID,
                "access": "proxy", "url": "http://localhost:9090", "isDefault": True}]},
            sort_keys=False),
        "grafana/provisioning/dashboards/compactionrl.yml": yaml.safe_dump({
            "apiVersion": 1, "providers": [{
                "name": "compactionrl", "folder": "CompactionRL", "type": "file",
                "options": {"path": "/var/lib/grafana/dashboards/compactionrl"}}]},
            sort_keys=False)})
    return written


def _write_generated(out: Path, files: dict[str, str]) -> list[Path]:
    """Each file under ``out`` with the generated-file header."""
    written = []
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(GENERATED_NOTE.get(path.suffix, "") + text)
        written.append(path)
    return written


def write_dashboards(out: Path) -> list[Path]:
    """The dashboards' JSON models, one file each."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, model in dashboards().items():
        path = out / f"{stem}.json"
        path.write_text(json.dumps(model, indent=2) + "\n")
        written.append(path)
    return written


#: Header of generated YAML files (JSON has no comments).
GENERATED_NOTE = {".yml": "# Generated by ops/observability.py (compactionrl dashboards export "
                          "--all; compactionrl up in a run folder); edit the code, not this "
                          "file.\n"}
