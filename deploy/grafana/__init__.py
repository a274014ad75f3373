"""Grafana dashboards and Prometheus alert rules as code; ``python -m deploy.grafana`` writes both
into the Helm chart (deploy/helm/tandem/dashboards and deploy/helm/tandem/rules)."""
