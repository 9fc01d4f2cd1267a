"""Pure, torch-free diagnosis of a training run: checks over bounded windows.

Each check returns a :class:`Finding` (status, message, suggested fix).
"""

from .findings import Finding, Status
from .gradients import check_grad_norm, check_layer_grad_norms
from .history import History, StepEvents
from .learning_rate import check_learning_rate, check_warmup
from .loss import check_loss_range, check_loss_trend, check_loss_volatility, check_overfitting, is_spike
from .run import diagnose

__all__ = [
    "Finding",
    "Status",
    "History",
    "StepEvents",
    "diagnose",
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
