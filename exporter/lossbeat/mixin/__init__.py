"""Generate (torch-free): thresholds → alert and recording rules, promtool tests, the Alertmanager
config, runbooks, Grafana dashboards, and the bundle that writes them all."""
