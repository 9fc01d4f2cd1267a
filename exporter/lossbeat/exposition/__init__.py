"""Expose (prometheus_client): the metric contract, the state the training thread writes, the collector
that renders it at scrape time, the HTTP endpoint, its web config, and file_sd self-registration."""
