"""lossbeat: a training-health monitor for PyTorch, exported to Prometheus."""

__version__ = "0.1.0"
