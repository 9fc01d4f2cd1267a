"""``--plot``: a file's runs drawn so that a person can check the diagnosis at a glance.

Panels: loss (train, smoothed when dense, and eval per set), grad norm against the
explosion threshold and the healthy band, learning rate. Readability rules:

* the loss goes on a log axis when it spans more than a decade (the first records of a
  run from scratch must not squash the rest of the curve);
* every axis shows a minimum range, so a flat run looks flat, not wild;
* legends sit outside the axes, never over the data;
* a few events are markers; many (over :data:`MANY_EVENTS`) are a rug of ticks or a band;
* overfitting (the span from the step the check first fired) and each run of a file are marked;
* steps with no loss value are a grey band, non-finite values magenta lines or bands.

Needs matplotlib (the ``plots`` extra), imported here only.
"""

from __future__ import annotations

import math
import os

from lossbeat.analyze.replay import Analysis
from lossbeat.diagnosis import Status
from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.logs import ParsedLog

__all__ = ["plot_file", "plot_run", "draw", "MANY_EVENTS"]

MANY_EVENTS = 40
"""More events than this of one kind are drawn as a rug (ticks on the axis) instead of one marker each."""
_SMOOTH_ABOVE = 300
"""Runs with more train records than this get a smoothed line over the raw one (drawn faint)."""
_MIN_RELATIVE_RANGE = 0.2
"""The y-axis spans at least this fraction of the values' median (a flat run stays flat)."""


def _finite(pairs):
    return [(x, y) for x, y in pairs if y is not None and math.isfinite(y)]


def _smoothed(ys: list[float], n: int) -> list[float]:
    """A centred moving average over ``n`` records (shorter at the ends): no lag behind a fast fall."""
    sums = [0.0]
    for y in ys:
        sums.append(sums[-1] + y)
    half = n // 2
    out = []
    for i in range(len(ys)):
        k = min(half, i, len(ys) - 1 - i)  # symmetric window, so the first records stay where they are
        out.append((sums[i + k + 1] - sums[i - k]) / (2 * k + 1))
    return out


def _bands(steps: list[int], gap: int) -> list[tuple[int, int]]:
    """Contiguous ranges of ``steps`` (sorted), joining steps at most ``gap`` apart."""
    bands: list[tuple[int, int]] = []
    for s in sorted(steps):
        if bands and s - bands[-1][1] <= gap:
            bands[-1] = (bands[-1][0], s)
        else:
            bands.append((s, s))
    return bands


def _scale(ax, values: list[float], allow_log: bool = True) -> None:
    """Log when positive and spanning more than a decade; otherwise a linear axis with a minimum range."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return
    lo, hi = min(values), max(values)
    if allow_log and lo > 0 and hi / lo > 10:
        ax.set_yscale("log")
        return
    mid = sorted(values)[len(values) // 2]
    floor = _MIN_RELATIVE_RANGE * abs(mid) or 1e-3
    if hi - lo < floor:
        centre = (hi + lo) / 2
        ax.set_ylim(centre - floor / 2, centre + floor / 2)
    else:
        pad = 0.05 * (hi - lo)
        ax.set_ylim(lo - pad, hi + pad)


def _events_on(ax, kind: str, steps: list[int], total: int, at: dict[int, float], marker: str, color: str) -> None:
    label = f"{kind.replace('_', ' ')} ({total})"
    if not steps:
        return
    if total <= MANY_EVENTS:
        pts = [(s, at[s]) for s in steps if s in at]
        if pts:
            ax.plot(*zip(*pts), marker, color=color, ms=7, mew=1.5, ls="none", label=label, zorder=5)
            return
    # many events: a rug of ticks along the bottom edge, one per event step
    ax.plot(
        steps,
        [0.0] * len(steps),
        "|",
        color=color,
        ms=12,
        mew=0.8,
        alpha=0.7,
        transform=ax.get_xaxis_transform(),
        label=f"{label}: rug",
        clip_on=False,
    )


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'lossbeat[plots]'") from exc
    return plt


def plot_run(log: ParsedLog, analysis: Analysis, thresholds: Thresholds, out: str | os.PathLike) -> str:
    """One run (kept for callers of the former API); see :func:`plot_file`."""
    return _save(draw(log, [analysis], thresholds, runs=[log]), out)


def plot_file(log: ParsedLog, analyses: list[Analysis], thresholds: Thresholds, out: str | os.PathLike) -> str:
    """Write a PNG (or any format matplotlib infers from ``out``) of every run in ``log``; returns the path."""
    return _save(draw(log, analyses, thresholds), out)


def _save(fig, out: str | os.PathLike) -> str:
    out = os.fspath(out)
    try:
        fig.savefig(out, dpi=100, bbox_inches="tight")
    finally:
        _pyplot().close(fig)
    return out


def draw(log: ParsedLog, analyses: list[Analysis], thresholds: Thresholds, runs: list[ParsedLog] | None = None):
    """The matplotlib Figure for ``log``'s runs (``analyses``: one per run, in order)."""
    runs = runs or log.segments or [log]
    plot = _Plot(_pyplot(), runs)
    for i, (run, a) in enumerate(zip(runs, analyses)):
        plot.add_run(i, run, a, runs[i - 1] if i > 0 else None)
    return plot.finish(log, analyses, thresholds)


class _Plot:
    """One figure: the loss axes, the grad-norm and LR axes when a run logs them, and every value
    drawn on each (their scales are set once all runs are in)."""

    def __init__(self, plt, runs: list[ParsedLog]) -> None:
        self.runs = len(runs)
        self.several = self.runs > 1
        has_grad = any(r.grad_norm is not None for run in runs for r in run.train)
        has_lr = any(r.learning_rate is not None for run in runs for r in run.train)
        heights = [3.2] + [2.2] * (has_grad + has_lr)
        self.fig, axes = plt.subplots(
            len(heights),
            1,
            sharex=True,
            figsize=(12, sum(heights) + 0.6),
            squeeze=False,
            gridspec_kw={"height_ratios": heights},
        )
        self.axes = [ax for (ax,) in axes]
        self.loss_ax = self.axes[0]
        self.grad_ax = self.axes[1] if has_grad else None
        self.lr_ax = self.axes[1 + has_grad] if has_lr else None
        self.colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        self.all_loss: list[float] = []
        self.all_grad: list[float] = []
        self.all_lr: list[float] = []

    def add_run(self, i: int, run: ParsedLog, a: Analysis, previous: ParsedLog | None) -> None:
        """Run ``i`` of the file: its curves, its gaps, its overfitting, its start, its events."""
        colors, several = self.colors, self.several
        tag = f"run {i + 1}: " if several else ""
        c_train = colors[(2 * i) % len(colors)] if several else "C0"
        c_eval = colors[(2 * i + 1) % len(colors)] if several else "C1"
        loss_at = self._train_loss(run, tag, c_train)
        self._eval_losses(run, i, tag, c_eval)
        interval = self._gaps(run, tag)
        self._overfitting(run, a, tag)
        previous_end = previous.train[-1].step if previous is not None and previous.train else None
        if several and run.train and previous_end is not None and run.train[0].step > previous_end:
            for ax in self.axes:  # runs one after the other on the step axis: mark where each starts
                ax.axvline(run.train[0].step, color=c_train, ls=":", lw=1)
        self._grad_and_lr(run, tag, c_train)
        self._events(run, a, tag, interval, loss_at)

    def _train_loss(self, run: ParsedLog, tag: str, c_train: str) -> dict[int, float]:
        """The training loss (smoothed over a faint raw line when long); its finite values by step."""
        loss_ax = self.loss_ax
        pts = _finite((r.step, r.loss) for r in run.train)
        if pts:
            xs, ys = zip(*pts)
            self.all_loss += ys
            # the raw line breaks where the loss is missing or non-finite (never drawn across a NaN)
            gx = [r.step for r in run.train]
            gy = [r.loss if r.loss is not None and math.isfinite(r.loss) else math.nan for r in run.train]
            if len(pts) > _SMOOTH_ABOVE:
                loss_ax.plot(gx, gy, lw=0.5, color=c_train, alpha=0.3)
                loss_ax.plot(
                    xs,
                    _smoothed(list(ys), max(5, len(ys) // 100)),
                    lw=1.3,
                    color=c_train,
                    label=f"{tag}train loss (smoothed; raw faint)",
                )
            else:
                loss_ax.plot(gx, gy, lw=1, color=c_train, label=f"{tag}train loss")
        return dict(pts)

    def _eval_losses(self, run: ParsedLog, i: int, tag: str, c_eval: str) -> None:
        """Each eval set's losses, as points joined by a line."""
        for g_i, group in enumerate(run.eval_groups):
            ev = _finite((e.step, e.loss) for e in run.evals if e.group == group)
            if ev:
                self.all_loss += [y for _, y in ev]
                color = c_eval if not group else self.colors[(3 + g_i + 2 * i) % len(self.colors)]
                self.loss_ax.plot(*zip(*ev), "o-", ms=3.5, lw=1, color=color, label=f"{tag}eval loss {group}".strip())

    def _gaps(self, run: ParsedLog, tag: str) -> int:
        """Steps with no loss value: a grey band (not a fault, a gap in the log). Returns the
        run's usual step interval between records."""
        interval = max(1, (run.train[-1].step - run.train[0].step) // max(1, len(run.train) - 1)) if run.train else 1
        missing = [r.step for r in run.train if r.loss is None]
        for j, (lo, hi) in enumerate(_bands(missing, 2 * interval)):
            self.loss_ax.axvspan(
                lo,
                hi + interval,
                color="0.6",
                alpha=0.25,
                lw=0,
                label=f"{tag}no loss logged ({len(missing)} records)" if j == 0 else None,
            )
        return interval

    def _overfitting(self, run: ParsedLog, a: Analysis, tag: str) -> None:
        """One span from the first step the check fired (any eval set) to the end of the run, and
        each overfitting set's best eval loss."""
        loss_ax = self.loss_ax
        fired = sorted(
            (w.step, component)
            for (check, component), w in a.worst.items()
            if check == "overfitting" and w.finding.status >= Status.WARNING
        )
        if not (fired and run.train):
            return
        end = max(run.train[-1].step, max((e.step for e in run.evals), default=0))
        sets = [c for _, c in fired if c]
        which = f" ({', '.join(sets[:4])}{', ...' if len(sets) > 4 else ''})" if sets else ""
        loss_ax.axvspan(
            fired[0][0],
            end,
            color="orange",
            alpha=0.15,
            lw=0,
            label=f"{tag}overfitting{which} from step {fired[0][0]}",
        )
        bests = []
        for _, component in fired:
            ev = _finite((e.step, e.loss) for e in run.evals if e.group == component)
            if ev:
                bests.append(min(ev, key=lambda p: p[1]))
        if bests:
            one = bests[0] if len(bests) == 1 else None
            loss_ax.plot(
                *zip(*bests),
                "*",
                color="orange",
                ms=11,
                mec="k",
                mew=0.5,
                ls="none",
                zorder=6,
                label=f"{tag}best eval {one[1]:.4g} (step {one[0]})" if one else f"{tag}best eval per set",
            )

    def _grad_and_lr(self, run: ParsedLog, tag: str, c_train: str) -> None:
        """The gradient norm and the learning rate, on their own axes."""
        if self.grad_ax is not None:
            gpts = _finite((r.step, r.grad_norm) for r in run.train)
            if gpts:
                grad_steps, grad_norms = zip(*gpts)
                self.all_grad += grad_norms
                self.grad_ax.plot(grad_steps, grad_norms, lw=0.8, color=c_train, label=f"{tag}grad norm")
        if self.lr_ax is not None:
            lpts = _finite((r.step, r.learning_rate) for r in run.train)
            if lpts:
                lx, ly = zip(*lpts)
                self.all_lr += ly
                self.lr_ax.plot(lx, ly, lw=1, color=c_train, label=f"{tag}learning rate")

    def _events(self, run: ParsedLog, a: Analysis, tag: str, interval: int, loss_at: dict[int, float]) -> None:
        """The counted events on the curve they belong to; non-finite steps across every axes."""
        grad_at = dict(_finite((r.step, r.grad_norm) for r in run.train))
        nonfinite: set[int] = set()
        nonfinite_labels = []
        for kind, steps in a.event_steps.items():
            total = a.counters.get(kind, len(steps))
            if not steps:
                continue
            if "nonfinite" in kind:  # drawn once below, whatever value was non-finite
                nonfinite.update(steps)
                nonfinite_labels.append(f"{kind.replace('nonfinite_', '')} {total}")
            elif "grad" in kind and self.grad_ax is not None:
                _events_on(self.grad_ax, tag + kind, steps, total, grad_at, "v", "red")
            else:
                _events_on(self.loss_ax, tag + kind, steps, total, loss_at, "x", "red")
        if nonfinite:
            many = len(nonfinite) > MANY_EVENTS
            for lo, hi in _bands(sorted(nonfinite), 2 * interval) if many else [(s, s) for s in sorted(nonfinite)]:
                for ax in self.axes:
                    if hi > lo:
                        ax.axvspan(lo, hi, color="m", alpha=0.15, lw=0)
                    else:
                        ax.axvline(lo, color="m", lw=1, alpha=0.7)
            self.loss_ax.plot([], [], color="m", lw=2, label=f"{tag}non-finite ({', '.join(nonfinite_labels)})")

    def finish(self, log: ParsedLog, analyses: list[Analysis], thresholds: Thresholds):
        """Scales, labels, legends and the title, once every run is drawn; the Figure."""
        loss_ax, grad_ax, lr_ax, all_grad = self.loss_ax, self.grad_ax, self.lr_ax, self.all_grad
        _scale(loss_ax, self.all_loss)
        loss_ax.set_ylabel("loss" + (" (log)" if loss_ax.get_yscale() == "log" else ""))
        if grad_ax is not None:
            g = getattr(thresholds, "gradients", None)
            explosion = getattr(g, "explosion", None)
            low, high = getattr(g, "healthy_low", None), getattr(g, "healthy_high", None)
            if low is not None and high is not None:
                grad_ax.axhspan(low, high, color="g", alpha=0.08, label=f"healthy band {low:g}-{high:g}")
            if explosion is not None and all_grad and max(all_grad) > 0.5 * explosion:
                grad_ax.axhline(explosion, color="r", ls="--", lw=1, label=f"explosion ceiling {explosion:g}")
            _scale(
                grad_ax, all_grad + ([explosion] if explosion and all_grad and max(all_grad) > 0.5 * explosion else [])
            )
            grad_ax.set_ylabel("grad norm" + (" (log)" if grad_ax.get_yscale() == "log" else ""))
        if lr_ax is not None:
            _scale(lr_ax, self.all_lr, allow_log=False)
            lr_ax.set_ylabel("learning rate")
            lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        for ax in self.axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
            ax.grid(alpha=0.25)
        derived = " (derived: the log prints none; see the notes)" if log.derived_steps else ""
        self.axes[-1].set_xlabel("step" + derived)
        statuses = ", ".join(a.status.name.lower() for a in analyses)
        title = f"{os.path.basename(log.path)} [{log.format}]: final status {statuses}"
        if self.several:
            title += f" ({self.runs} runs in one file)"
        loss_ax.set_title(title, fontsize="medium")
        self.fig.tight_layout()
        return self.fig
