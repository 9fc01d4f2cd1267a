"""End-to-end tests: real training runs, Prometheus and Alertmanager (marked e2e)."""
