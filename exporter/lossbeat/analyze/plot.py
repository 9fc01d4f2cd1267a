"""``--plot``: loss and eval loss, grad norm against its thresholds, LR; events marked.

Needs matplotlib (the ``plots`` extra), imported here only.
"""

from __future__ import annotations

import math
import os

from ..logs import ParsedLog
from ..thresholds import Thresholds
from .replay import Analysis

__all__ = ["plot_run"]


def _series(log: ParsedLog, attr: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in log.train:
        v = getattr(r, attr)
        if v is not None and math.isfinite(v):
            xs.append(r.step)
            ys.append(v)
    return xs, ys


def plot_run(log: ParsedLog, analysis: Analysis, thresholds: Thresholds, out: str | os.PathLike) -> str:
    """Write a PNG (or any format matplotlib infers from ``out``); returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'lossbeat[plots]'") from exc

    has_grad = any(r.grad_norm is not None for r in log.train)
    has_lr = any(r.learning_rate is not None for r in log.train)
    rows = 1 + has_grad + has_lr
    fig, axes = plt.subplots(rows, 1, sharex=True, figsize=(10, 3 * rows), squeeze=False)
    axes = [ax for (ax,) in axes]
    ax = axes[0]
    xs, ys = _series(log, "loss")
    ax.plot(xs, ys, lw=0.8, label="train loss")
    for group in log.eval_groups:
        ev = [(e.step, e.loss) for e in log.evals if e.group == group and math.isfinite(e.loss)]
        if ev:
            ax.plot(*zip(*ev), "o-", ms=3, lw=1, label=f"eval loss {group}".strip())
    loss_at = dict(zip(xs, ys))
    spikes = [s for s in analysis.event_steps["loss_spikes"] if s in loss_at]
    if spikes:
        ax.plot(spikes, [loss_at[s] for s in spikes], "rx", label=f"loss spikes ({analysis.counters['loss_spikes']})")
    if ys and min(ys) > 0 and max(ys) / min(ys) > 50:
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize="small")
    row = 1
    if has_grad:
        ax = axes[row]
        row += 1
        gx, gy = _series(log, "grad_norm")
        g = thresholds.gradients
        ax.plot(gx, gy, lw=0.8, label="grad norm")
        ax.axhline(g.explosion, color="r", ls="--", lw=1, label=f"explosion {g.explosion:g}")
        ax.axhspan(g.healthy_low, g.healthy_high, color="g", alpha=0.08, label="healthy band")
        grad_at = dict(zip(gx, gy))
        boom = [s for s in analysis.event_steps["grad_explosions"] if s in grad_at]
        if boom:
            ax.plot(boom, [grad_at[s] for s in boom], "rv", label=f"explosions ({analysis.counters['grad_explosions']})")
        if gy and min(gy) > 0:
            ax.set_yscale("log")
        ax.set_ylabel("grad norm")
        ax.legend(loc="upper right", fontsize="small")
    if has_lr:
        ax = axes[row]
        lx, ly = _series(log, "learning_rate")
        ax.plot(lx, ly, lw=0.8)
        ax.set_ylabel("learning rate")
    for kind in ("nonfinite_loss", "nonfinite_grad"):
        for s in analysis.event_steps[kind]:
            for a in axes:
                a.axvline(s, color="m", lw=0.6, alpha=0.6)
    axes[-1].set_xlabel("step")
    axes[0].set_title(f"{os.path.basename(log.path)} [{log.format}]: final status {analysis.status.name.lower()}")
    fig.tight_layout()
    out = os.fspath(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
