"""The local stack: a loopback Prometheus + Alertmanager (``lossbeat stack``) and the webhook receiver."""
