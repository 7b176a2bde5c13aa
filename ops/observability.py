"""Prometheus and Grafana as code: the dashboard panels, the alerting rules and
the scrape configuration, generated from the definitions here.

Every panel and alert is written against DESIGN §4's metric names. An alert
keeps its *signal* (the PromQL whose value it judges) apart from its
threshold, so tests can check that every signal returns data from a real run
while the alert itself stays quiet.

Usage::

    dashboards()                 # Grafana dashboard JSON models (dicts)
    alert_rules(thresholds)      # the Prometheus rule file (dict, YAML-ready)
    scrape_config(config)        # prometheus.yml for a local run (dict)
    promql_expressions()         # every expression used anywhere: what the tests query
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

#: Grafana datasource uid the provisioning file creates and panels refer to.
DATASOURCE_UID = "compactionrl-prometheus"
JOBS = ("replay", "learner", "actors")


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
#: Label matchers of the dashboard variables (Grafana fills them in).
RUN = 'run=~"$run"'
ACTORS = 'run=~"$run", instance=~"$actor"'
#: What each variable stands for when an expression is queried outside Grafana.
ALL_VALUES = {"$__rate_interval": "1m", '"$run"': '".*"', '"$actor"': '".*"',
              '"$gpu"': '".*"', '"$job"': '".*"'}
#: An actor series joined with its engine's labels (device = GPU type).
BY_ENGINE = f'* on(instance) group_left(device) crl_actor_engine_info{{{ACTORS}, device=~"$gpu"}}'

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
        Panel("Engines", (("{{instance}} {{device}} {{dtype}} tp={{tp}}",
                           f'crl_actor_engine_info{{{ACTORS}, device=~"$gpu"}}'),),
              kind="table"),
        Panel("Policy version loaded, by actor", (
            ("{{instance}}", f"crl_actor_policy_version{{{ACTORS}}}"),)),
        Panel("Tokens/s by actor", (
            ("{{instance}}", "sum by (instance) "
                             f"(rate(crl_actor_generated_tokens_total{{{ACTORS}}}{RANGE}))"),)),
        Panel("Stall share by actor and reason", (
            ("{{instance}} {{reason}}",
             f"sum by (instance, reason) (rate(crl_actor_stall_seconds_total{{{ACTORS}}}{RANGE}))"
             f" / on(instance) group_left sum by (instance) "
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
    """replay.max_staleness: p95 staleness at this bound means actors lag."""
    stall_share: float = 0.5
    """Share of episode-slot time stalled, sustained, that warns."""
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
    return (
        Alert("CompactionRLActorDown", 'up{job="actors"}', "== 0", "1m",
              "An actor's /metrics has not answered for a minute"),
        Alert("CompactionRLLearnerDown", 'up{job="learner"}', "== 0", "2m",
              "The learner's /metrics has not answered for two minutes", "critical"),
        Alert("CompactionRLReplayDown", 'up{job="replay"}', "== 0", "1m",
              "The replay's /metrics has not answered for a minute", "critical"),
        Alert("CompactionRLStallShareHigh",
              f"sum(rate(crl_actor_stall_seconds_total{RATE})) / sum(crl_actor_episode_slots)",
              f"> {thresholds.stall_share:g}", "10m",
              f"Actors spend over {thresholds.stall_share:.0%} of their time stalled"),
        Alert("CompactionRLStalenessAtBound",
              "histogram_quantile(0.95, sum by (le) "
              f"(rate(crl_replay_staleness_bucket{RATE})))",
              f">= {thresholds.max_staleness}", "10m",
              f"p95 staleness of trained rollouts is at the bound ({thresholds.max_staleness}, "
              "replay.max_staleness): actors fall behind the learner"),
        Alert("CompactionRLLearnerStuck",
              f"changes(crl_learner_policy_version[{thresholds.no_step_minutes}m])", "== 0",
              "5m", f"No learner step for {thresholds.no_step_minutes} minutes", "critical"),
        Alert("CompactionRLLossNotFinite", losses, f"unless (({losses}) < +Inf)", "0m",
              "A loss of the last step is NaN or infinite", "critical"),
        Alert("CompactionRLWeightPublicationsFailing",
              _or_zero('sum(increase(crl_learner_weight_publications_total{result="failed"}'
                       '[15m]))'), "> 0", "15m",
              "Weight publications keep failing: actors generate with old weights"),
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
    _variable("actor", "Actor", f"label_values(crl_actor_engine_info{{{RUN}}}, instance)"),
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


def scrape_config(replay_port: int, learner_port: int, actor_ports: list[int],
                  host: str = "127.0.0.1", interval_s: float = 5.0,
                  rule_files: tuple[str, ...] = ("alerts.yml",),
                  run: str | None = None) -> dict[str, Any]:
    """prometheus.yml scraping one local run (the job names the panels use);
    ``run`` labels its series for the dashboards' run variable."""
    targets = {"replay": [replay_port], "learner": [learner_port], "actors": actor_ports}
    return {
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval":
                   f"{interval_s:g}s"},
        "rule_files": list(rule_files),
        "scrape_configs": [{"job_name": job, "static_configs": [
            {"targets": [f"{host}:{port}" for port in targets[job]],
             **({"labels": {"run": run}} if run else {})}]} for job in JOBS],
    }


def promql_expressions() -> dict[str, str]:
    """Every expression a dashboard panel or an alert uses, by where it is
    used; the dashboards' variables stand for every value (Grafana's "All"),
    so each can be queried outside Grafana."""
    found = {f"{title} / {panel.title} / {legend}": _all_values(expr)
             for title, panels in DASHBOARDS.items() for panel in panels
             for legend, expr in panel.exprs}
    found.update({f"alert {a.name}": a.signal for a in alerts(AlertThresholds())})
    return found


def _all_values(expr: str) -> str:
    for variable, value in ALL_VALUES.items():
        expr = expr.replace(variable, value)
    return expr


def write_files(out: Path, replay_port: int = 9100, learner_port: int = 9102,
                actor_ports: tuple[int, ...] = (9110, 9111),
                thresholds: AlertThresholds | None = None,
                run: str | None = None) -> list[Path]:
    """Everything under ``deploy/observability``: Prometheus config and rules,
    Grafana provisioning and dashboards (the compose file is hand-written)."""
    import yaml

    files = {
        "prometheus.yml": yaml.safe_dump(scrape_config(replay_port, learner_port,
                                                       list(actor_ports), run=run),
                                         sort_keys=False),
        "alerts.yml": yaml.safe_dump(alert_rules(thresholds), sort_keys=False),
        "grafana/provisioning/datasources/prometheus.yml": yaml.safe_dump({
            "apiVersion": 1, "datasources": [{
                "name": "Prometheus", "type": "prometheus", "uid": DATASOURCE_UID,
                "access": "proxy", "url": "http://localhost:9090", "isDefault": True}]},
            sort_keys=False),
        "grafana/provisioning/dashboards/compactionrl.yml": yaml.safe_dump({
            "apiVersion": 1, "providers": [{
                "name": "compactionrl", "folder": "CompactionRL", "type": "file",
                "options": {"path": "/var/lib/grafana/dashboards/compactionrl"}}]},
            sort_keys=False),
    }
    written = write_dashboards(out / "grafana" / "dashboards")
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
                          "--all); edit the code, not this file.\n"}
