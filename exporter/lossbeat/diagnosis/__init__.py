"""Pure, torch-free diagnosis of a training run: checks over bounded windows.

Each check returns a :class:`Finding` (status, message, suggested fix);
a :class:`Judge` adds hysteresis and is what the monitor and ``analyze`` use.
"""

from lossbeat.diagnosis.findings import Finding, Status
from lossbeat.diagnosis.gradients import check_grad_norm, check_layer_grad_norms
from lossbeat.diagnosis.history import History, StepEvents
from lossbeat.diagnosis.judge import Judge, StatusChange
from lossbeat.diagnosis.learning_rate import check_learning_rate, check_warmup
from lossbeat.diagnosis.loss import (
    Trend,
    check_loss_range,
    check_loss_trend,
    check_loss_volatility,
    check_overfitting,
    is_spike,
    robust_cv,
    trend_of,
    uniform_classes,
)
from lossbeat.diagnosis.run import diagnose

__all__ = [
    "Finding",
    "Status",
    "History",
    "StepEvents",
    "Judge",
    "StatusChange",
    "diagnose",
    "Trend",
    "trend_of",
    "robust_cv",
    "uniform_classes",
    "check_loss_range",
    "check_loss_trend",
    "check_loss_volatility",
    "check_overfitting",
    "is_spike",
    "check_grad_norm",
    "check_layer_grad_norms",
    "check_learning_rate",
    "check_warmup",
]
