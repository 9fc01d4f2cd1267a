"""Is the run learning at all? The ``learning`` check, judged by each task's own signals.

* Nothing is trained: the loss is exactly the same on every record (exactly 0, or ln V
  with non-finite gradients), or exactly constant with zero gradients.
* At chance: a loss (train or eval) at ln K for a small K, within the loss's own noise
  (the standard error of the window's mean, not a fixed tolerance), and not falling.
* No significant fall from the initial level over the whole run.
* RL (GRPO, PPO, RLOO): the reward spread collapsed (``reward_std`` -> 0,
  ``frac_reward_zero_std`` -> 1: no advantage, no learning signal) or the gradient norm did
  (exactly 0, or a hundredth of its earlier level, on each of the last records), the KL to the
  reference runs away, most groups give no gradient, or the reward does not improve.
* Preference (DPO, ORPO, KTO, SimPO): the loss at ln 2 with accuracies at 0.5 (chance),
  or a loss saturated at exactly 0 while the margins run away.

Pure functions over a :class:`~lossbeat.diagnosis.history.History`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding
from lossbeat.diagnosis.prior import check_class_prior
from lossbeat.diagnosis.thresholds import Profile, Thresholds
from lossbeat.diagnosis.window import fsum, median, robust_noise

if TYPE_CHECKING:
    from lossbeat.diagnosis.history import History
    from lossbeat.diagnosis.loss import Trend
    from lossbeat.diagnosis.profiles import RLThresholds, SignalTrack
    from lossbeat.diagnosis.run_memory import Regression
    from lossbeat.diagnosis.series import LossSeries

__all__ = ["check_learning", "learned", "chance_level", "MIN_CONSTANT_RECORDS"]

CHECK = "learning"
MIN_CONSTANT_RECORDS = 10
"""An exactly constant loss needs this many records (or every record of the run) to say nothing trains."""
_MAX_CLASSES = 100
_CHANCE_Z = 3.0  # within this many standard errors of the mean of ln K is "at" ln K
_CHANCE_MIN_TOL = 1e-4  # relative: printed losses are rounded
_FEW_RECORDS_FALL = 0.1
_CONSTANT_AFTER_FIRST = 5
"""Identical records after the run's first needed to say nothing is trained after the first update.
The first logged loss is the model before (or during) its first updates; every record after it
exactly equal, 5 times or more, is a model whose output no longer changes with its batches (a
loss printed to 4 significant digits does not repeat 5 times in a row while anything moves)."""
_BEST_BELOW_CHANCE = 0.05  # a best eval loss this fraction below ln K: not at chance all along
_FIX_NOTHING = (
    "check that the loss is computed from the model's outputs (not detached, not under no_grad), "
    "that some labels are not the ignore index, that parameters have requires_grad and are in the "
    "optimizer, and that the LR is not 0"
)
_FIX_CHANCE = (
    "the model is not learning: check that labels match inputs (shuffled together), the learning rate "
    "(too small or too large), and that the head being trained is the one evaluated"
)


def chance_level(mean: float, se: float) -> int | None:
    """K when ``mean`` is ln K for a small K within ``_CHANCE_Z`` standard errors ``se``."""
    if not 0 < mean <= math.log(_MAX_CLASSES) + 1.0:  # exp() of a larger loss is no class count (and overflows)
        return None
    k = round(math.exp(mean))
    if not 2 <= k <= _MAX_CLASSES:
        return None
    tol = max(_CHANCE_Z * se if math.isfinite(se) else 0.0, _CHANCE_MIN_TOL * math.log(k))
    return k if abs(mean - math.log(k)) <= tol else None


def learned(history: History, t: Thresholds) -> bool | None:
    """Whether the loss ever fell significantly below where it started (None: too early to say)."""
    series = history.loss
    if series.fell_once:  # once learned, learned: a later divergence is the trend's finding
        return True
    s = series.summary
    initial, noise = series.initial, series.noise
    first_step, last_step = s.first_step, s.last_step
    if first_step is None or last_step is None or not math.isfinite(initial):  # both set by the first record
        return None
    if len(s) < t.windows.trend_min_records:
        # Few records: only a loss that never went below its first value says anything.
        # Few records: a loss that never went below its first value did not learn; one whose last
        # two records sit well below it (no noise estimate yet: by a margin) did.
        values = series.ring.last(len(series.ring))
        if len(values) < 3:
            return None
        if min(values) >= initial:
            return False
        if (values[-1] + values[-2]) / 2 < initial - _FEW_RECORDS_FALL * abs(initial):
            series.fell_once = True
            return True
        return None
    width = max(1.0, 0.1 * s.span)
    n_best, best = s.best(width, max(1, min(t.windows.trend_min_records, len(s) // 10)), last_step)
    if not n_best:
        return None
    floor = t.profile.volatility_floor or 0.0
    fall = initial - best
    se = noise * math.sqrt(1.0 + 1.0 / n_best) if math.isfinite(noise) else 0.0
    series.fell_once = fall > t.loss.plateau_max_fall * max(abs(initial), floor) and fall > t.loss.fall_min_z * se
    if not series.fell_once and math.isfinite(noise):
        # The first record alone is one noisy value: a loss whose per-record noise is a third of its
        # level (SFT on small batches of variable length) cannot fall "significantly" below one record.
        # The mean of the run's first window (as wide as the best one) is measured as the best is.
        n_first, first = s.window(first_step - 1, first_step + width)
        # Against full windows only (about as many records as the first): a partial one at the start
        # is a piece of the first window itself, lower by chance or by a loss that rose after it.
        n_full, best = s.best(width, max(t.windows.trend_min_records, int(0.8 * n_first)), last_step)
        if n_first >= t.windows.trend_min_records and n_full and last_step - first_step > 2 * width:
            fall = first - best
            se = noise * math.sqrt(1.0 / n_first + 1.0 / n_full)
            series.fell_once = fall > t.loss.plateau_max_fall * max(abs(first), floor) and fall > t.loss.fall_min_z * se
    return series.fell_once


def _nothing_trained(history: History, profile: Profile) -> Finding | None:
    loss = history.loss
    run = loss.same_run
    value = loss.ring.back(0)
    # A preference loss of exactly 0 is saturated (-log sigmoid(x) rounds to 0 only for x > ~36).
    saturated = profile.name == "preference" and value == 0.0 and run >= 2
    after_first = run == loss.records - 1 and run >= _CONSTANT_AFTER_FIRST
    if run < MIN_CONSTANT_RECORDS and not (run == loss.records and run >= 3) and not saturated and not after_first:
        return None
    every = (
        "every record"
        if run == loss.records
        else ("every record after the first" if after_first else f"the last {run} records")
    )
    grads = history.grad_records
    zero_grad = grads and history.grad_zero_run >= min(run, history.grad_records)
    bad_grad = grads and history.grad_nonfinite_run >= min(run, history.grad_records)
    if loss.fell_once and not (zero_grad or bad_grad) and not saturated:
        return None  # a run that learned and now prints the same rounded value (0.0002) has converged
    if profile.name == "preference" and value == 0.0:
        margins = history.signals.get("margins")
        grown = f"; reward margins {margins.first:.3g} -> {margins.latest:.3g}" if margins and margins.count > 1 else ""
        return Finding(
            CHECK,
            DANGER,
            f"preference loss saturated at exactly 0 on {every}{grown}: the policy drives the rejected "
            "answers' likelihood away instead of learning the preference (over-optimisation)",
            "lower the learning rate or raise beta, check the chosen/rejected pairs (trivially separable?), "
            "and watch logps/chosen: it should not fall",
        )
    if zero_grad or (value == 0.0 and not bad_grad):
        what = f"gradient norm 0 on {every}" if zero_grad else "no gradient norm logged"
        return Finding(
            CHECK,
            DANGER,
            f"nothing is trained: the loss is exactly {value:.6g} on {every} ({what}): the loss is "
            "detached from the model, or every label is masked",
            _FIX_NOTHING,
        )
    k = chance_level(value, 0.0)
    at = (
        f" = ln {k}, a uniform prediction over {k} classes"
        if k
        else (f" = ln {math.exp(value):,.0f}, a uniform prediction over the vocabulary" if 5.0 < value < 15.0 else "")
    )
    if bad_grad:
        return Finding(
            CHECK,
            DANGER,
            f"the loss is exactly {value:.6g}{at} on {every} and the gradient norm is not finite on "
            f"{every}: the model never moves off its initial output (every update skipped or poisoned)",
            "find the first non-finite gradient (torch.autograd.set_detect_anomaly(True)), check the "
            "initialisation and the precision (fp16 overflow), and lower the learning rate",
        )
    return Finding(
        CHECK,
        DANGER,
        f"nothing is trained: the loss is exactly {value:.6g}{at} on {every}: the parameters do not change",
        _FIX_NOTHING,
    )


def _eval_chance(history: History) -> tuple[int, float] | None:
    for _group, track in history.evals.items():
        values = track.recent.last(len(track.recent))
        if len(values) < 2:
            continue
        tail = values[-3:]
        mean = fsum(tail) / len(tail)
        noise = robust_noise(values)
        if not math.isfinite(noise):  # few evals: their spread; eval losses are far less noisy than train
            noise = (max(values) - min(values)) / 2.0
        se = noise / math.sqrt(len(tail))
        k = chance_level(mean, se)
        # At chance all along: the first and the best eval at ln K too (an eval loss falling or
        # rising through ln K is learning or overfitting, not chance), within its noise but never
        # more than _BEST_BELOW_CHANCE from it: a best that far below ln K learned something.
        tol = min(max(se, noise), _BEST_BELOW_CHANCE * math.log(k) / _CHANCE_Z) if k is not None else 0.0
        if k is not None and chance_level(track.best, tol) == k and chance_level(track.first, tol) == k:
            return k, mean  # the first evaluation at ln K too: not an eval loss falling through it
    return None


def _rl(history: History, t: Thresholds) -> Finding | None:
    sig = history.signals
    std, zero, reward = sig.get("reward_std"), sig.get("frac_reward_zero_std"), sig.get("reward")
    # Collapsed: every one of the last records (a zero-spread step now and then is a group that
    # was all solved or all failed, not a collapse).
    rl = t.rl
    std_gone = (
        std is not None
        and std.count >= rl.collapse_records
        and max(abs(v) for v in std.recent.last(len(std.recent))) <= rl.reward_std_zero
    )
    zero_all = (
        zero is not None
        and zero.count >= rl.collapse_records
        and min(zero.recent.last(len(zero.recent))) >= rl.zero_std_fraction
    )
    gone = std if std_gone else zero if zero_all else None  # not None exactly when std_gone or zero_all
    if gone is not None:
        n = len(gone.recent)
        which = (
            f"reward_std 0 on each of the last {n} records"
            if std_gone
            else f"frac_reward_zero_std 1 on each of the last {n} records"
        )
        return Finding(
            CHECK,
            DANGER,
            f"the learning signal collapsed: {which}: every completion of a group "
            "gets the same reward, so there is no advantage and no gradient",
            "raise the sampling temperature or the group size, check the reward function (constant? "
            "saturated?) and make the prompts neither all solved nor all failed",
        )
    grads = _grad_collapsed(history, rl)
    if grads is not None:
        return Finding(
            CHECK,
            DANGER,
            f"the learning signal collapsed: {grads}: no advantage reaches the policy (every completion "
            "of a group gets the same reward, or the loss is detached from it)",
            "log reward_std to confirm; raise the sampling temperature or the group size, check the reward "
            "function, and that the policy loss is computed from the model's outputs",
        )
    runaway = _kl_runs_away(sig.get("kl"), rl)
    if runaway is not None:
        return runaway
    if reward is not None and reward.count >= 20:
        n0, m0, n1, m1 = reward.ends()
        noise = reward.noise()
        se = noise * math.sqrt(1.0 / max(1, n0) + 1.0 / max(1, n1)) if math.isfinite(noise) else math.nan
        if n0 and n1 and math.isfinite(se) and not (m1 - m0 > t.loss.fall_min_z * se):
            dead = ""
            if zero is not None and zero.mean() >= 0.5:
                dead = f"; in {zero.mean() * 100:.0f}% of the groups every completion got the same reward (no gradient)"
            return Finding(
                CHECK,
                WARNING,
                f"the reward is not improving: {m0:.4g} over the first fifth of the run, {m1:.4g} over the "
                f"last fifth ({(m1 - m0):+.3g}, within its noise){dead}: the policy is not learning",
                "raise the learning rate (GRPO/PPO often need 1e-6 to 1e-5 with a real warmup), check the "
                "reward function and the group size, and look at the completions",
            )
    if zero is not None and zero.count >= 5 and zero.mean() >= 0.5:
        return Finding(
            CHECK,
            WARNING,
            f"in {zero.mean() * 100:.0f}% of the prompt groups every completion got the same reward: "
            "those groups give no gradient",
            "raise the group size or the temperature; filter prompts that are always or never solved",
        )
    if reward is not None and reward.count >= 2:
        return Finding(CHECK, GOOD, f"reward {reward.latest:.4g} (first {reward.first:.4g})")
    return None


def _grad_collapsed(history: History, rl: RLThresholds) -> str | None:
    """Why the RL run's gradient norm has collapsed, or None: exactly 0, or at most
    ``grad_collapse_ratio`` of the run's earlier level, on each of the last ``collapse_records``."""
    n = rl.collapse_records
    if history.grad_zero_run >= n:
        return f"the gradient norm is exactly 0 on each of the last {history.grad_zero_run} records"
    values = history.grad.ring.last(len(history.grad.ring))
    if len(values) < 2 * n:
        return None
    # The earlier level: the highest median of the records before the latest ones a diagnosis has
    # seen (kept on the history: the window itself follows a collapse within its length).
    before = median(values[:-n])
    history.note_grad_level(before)
    level, last = history.grad_level_peak, values[-n:]
    if level > 0 and max(last) <= rl.grad_collapse_ratio * level:
        return (
            f"the gradient norm fell to {median(last):.3g} on each of the last {n} records, at most "
            f"{rl.grad_collapse_ratio:.0%} of its earlier level {level:.3g}"
        )
    return None


def _kl_runs_away(kl: SignalTrack | None, rl: RLThresholds) -> Finding | None:
    """A KL to the reference still multiplying late in the run (see ``rl.kl_growth``)."""
    if kl is None or kl.count < 20:
        return None
    n0, m0, n1, m1 = kl.last_fifths()
    if not (n0 and n1 and m1 > rl.kl_floor and m0 > 0 and m1 > rl.kl_growth * m0):
        return None
    return Finding(
        CHECK,
        WARNING,
        f"the KL to the reference runs away: {m0:.3g} -> {m1:.3g} over the last two fifths of the run "
        f"(x{m1 / m0:.1f}): the policy leaves the reference model (reward hacking, or a learning rate "
        "too high)",
        "raise the KL coefficient (beta), lower the learning rate, and read the latest completions for reward hacking",
    )


def _preference(history: History, mean: float, se: float, falling: bool) -> Finding | None:
    acc = history.signals.get("preference_accuracy")
    k = chance_level(mean, se)
    if k == 2 and not falling:
        chance_acc = acc is None or abs(acc.recent_median(10) - 0.5) <= 0.1
        if chance_acc:
            accuracy = f", preference accuracy {acc.recent_median(10):.2f}" if acc is not None else ""
            return Finding(
                CHECK,
                WARNING,
                f"not learning preferences: the loss {mean:.4g} sits at ln 2{accuracy} (chance): the policy "
                "does not separate chosen from rejected answers",
                "raise the learning rate or beta, check that chosen and rejected are not swapped or "
                "identical, and that the reference model is the policy's starting point",
            )
    return None


def _never(loss: LossSeries, now: float) -> Finding:
    return Finding(
        CHECK,
        WARNING,
        f"never learned: the loss started at {loss.initial:.4g} and never fell significantly below it "
        f"over {loss.span} steps (now {now:.4g})",
        "check the learning rate (too large: the loss rises or jumps around its start; too small: it "
        "does not move), that the optimizer holds the model's parameters, and that the labels match "
        "the inputs",
    )


def check_learning(history: History, trend: Trend, t: Thresholds, regression: Regression | None = None) -> Finding:
    """Whether the run learns (see the module). ``regression``: the run settled well above its
    best (:meth:`RunMemory.regressed`): it learned, then lost it, and is never said to be learning."""
    profile = t.profile
    loss = history.loss
    if loss.nonfinite_run:
        return Finding.unknown(CHECK, "cannot judge: the latest loss is not finite")
    # An RL policy loss is exactly 0 by construction on many steps: its signals judge it.
    nothing = _nothing_trained(history, profile) if loss.records and profile.trend else None
    if nothing is not None:
        return nothing
    if profile.name == "rl":
        found = _rl(history, t)
        return found or Finding.unknown(
            CHECK, "an RL loss is not meant to fall: the reward signals judge learning (none logged)"
        )
    did = learned(history, t)
    prior = None
    if profile.name == "classification":  # a binary classifier at its class prior, whatever the train loss did
        ln2 = chance_level(loss.initial, loss.noise) == 2 or any(
            chance_level(track.first, 0.0) == 2 for track in history.evals.values()
        )
        prior = check_class_prior(history, t.class_prior, ln2)
    if loss.records < t.windows.trend_min_records:
        if did is False and loss.span >= t.loss.range_after_steps // 5:
            return _never(loss, loss.ring.back(0))
        return prior or Finding.unknown(CHECK)
    # The last quarter of the noise window's records (at least trend_min_records): read as such.
    tail = loss.ring.last(max(t.windows.trend_min_records, min(len(loss.ring), t.windows.noise_records) // 4))
    mean = fsum(tail) / len(tail)
    noise = loss.noise
    se = noise / math.sqrt(len(tail)) if math.isfinite(noise) else math.nan
    falling = trend.known and trend.falling
    if profile.name == "preference":
        found = _preference(history, mean, se, falling)
        if found is not None:
            return found
    if profile.name in ("classification", "preference") and did is not True:
        # A loss that already fell well below its start passes through ln K on its way down (an
        # 8-class model at ln 3): a model at chance never left it.
        k = chance_level(mean, se)
        if k is not None and not falling:
            return Finding(
                CHECK,
                WARNING,
                f"at chance: the train loss {mean:.4g} equals ln {k} within its noise: the model predicts "
                f"uniformly over {k} classes",
                _FIX_CHANCE,
            )
    if profile.name in ("classification", "seq2seq", "preference", "causal-lm"):
        at = _eval_chance(history) if profile.name != "causal-lm" else None
        if at is not None:
            k, value = at
            return Finding(
                CHECK,
                WARNING,
                f"at chance: the eval loss {value:.4g} equals ln {k} within its noise: the model predicts "
                f"uniformly over {k} classes",
                _FIX_CHANCE,
            )
    if prior is not None:
        return prior
    if did is False and loss.span >= t.loss.range_after_steps // 5:
        return _never(loss, mean)
    if did is None:
        return Finding.unknown(CHECK)
    # The level now: the tail's mean, or its median where one spike lifts the mean above the start;
    # both at or above the start is a run back where it began.
    now = mean if mean < loss.initial else median(tail)
    lost = _lost(history, loss, now, regression)
    if lost is not None:
        return lost
    return Finding(CHECK, GOOD, f"the loss fell from {loss.initial:.4g} to {now:.4g}")


def _lost(history: History, loss: LossSeries, level: float, regression: Regression | None) -> Finding | None:
    """A run that learned and lost it (settled well above its best), or one whose loss is back at or
    above its first: never said to have fallen. ``level``: the loss level of the latest records."""
    if regression is not None:
        return Finding(
            CHECK,
            WARNING,
            f"the loss fell from {loss.initial:.4g} to {regression.best:.4g} (step {regression.best_step}) and lost "
            f"much of it: {level:.4g} now, {regression.above * 100:.0f}% above its best",
            regression.fix(),
        )
    if level < loss.initial:
        return None
    memory, t = history.memory, history.thresholds
    if loss.span < t.loss.range_after_steps // 5:  # as for "never learned": too early to tell either way
        return Finding.unknown(CHECK, f"the loss is not below its start yet ({level:.4g} against {loss.initial:.4g})")
    scale = max(abs(loss.initial), t.profile.volatility_floor or 0.0)
    if memory.best_step is not None and loss.initial - memory.best > t.loss.regress_max * scale:
        # It fell far below its start (by as much as a regression is measured in) and is back.
        return Finding(
            CHECK,
            WARNING,
            f"the loss fell from {loss.initial:.4g} to {memory.best:.4g} (step {memory.best_step}) and lost "
            f"much of it: back at {level:.4g}, at or above its start",
            "go back to the checkpoint of its best loss; lower the learning rate and clip gradients",
        )
    return Finding(
        CHECK,
        WARNING,
        f"the loss is not below its start: {level:.4g} now against {loss.initial:.4g} at first"
        + (f" (its best {memory.best:.4g}, step {memory.best_step})" if memory.best_step is not None else ""),
        "check the learning rate (too large: the loss rises or jumps around its start; too small: it does "
        "not move), that the optimizer holds the model's parameters, and that the labels match the inputs",
    )
