"""Operations: Prometheus metrics, dashboards as code, alert rules, reports.
Depends on nothing else of the project."""
