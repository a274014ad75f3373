"""Regenerate the dashboards and the alert rules: ``python -m deploy.grafana``."""

from deploy.grafana import dashboards, rules

for path in [*dashboards.write(), *rules.write()]:
    print(path)
