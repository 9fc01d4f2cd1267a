"""The metric contract: every series lossbeat exports, with its type, labels and help.

Alert rules, dashboards and users' queries depend on these names; they change
only with a major version. Every series also carries a ``rank`` label and a ``run_id`` label,
the run identity (:func:`with_run_id`).
The collector that renders them lives in :mod:`lossbeat.exposition.collector`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from prometheus_client.metrics_core import Metric

__all__ = ["MetricSpec", "METRICS", "HEALTH_CHECKS", "PHASES", "PREFIX", "RUN_ID_LABEL", "with_run_id", "SKIP_REASONS"]

SKIP_REASONS = ("nonfinite", "explosion", "spike")
"""Why the optimizer guard skipped a step (the ``reason`` label of training_skipped_steps_total)."""

PREFIX = "training_"
RUN_ID_LABEL = "run_id"
"""The run identity on every series: the rules compare ranks only within one (job, run_id)."""


def with_run_id(families: Iterable[Metric], run_id: str) -> Iterator[Metric]:
    """``families`` (prometheus_client metric families) with ``run_id`` added to every sample."""
    for family in families:
        if not getattr(family, "labelled_run_id", False):  # a LayerFamily's lines carry it already
            family.samples = [s._replace(labels={**s.labels, RUN_ID_LABEL: run_id}) for s in family.samples]
        yield family


@dataclass(frozen=True)
class MetricSpec:
    name: str
    """Full metric name; counters include the ``_total`` suffix."""
    kind: str
    """``gauge``, ``counter`` or ``info``."""
    help: str
    labels: tuple[str, ...] = ()
    """Labels besides ``rank``."""
    unit: str = ""
    """Grafana unit for dashboards."""


_SPECS = [
    # --- gauges: the latest observed values -------------------------------------
    MetricSpec(
        "training_loss",
        "gauge",
        "Training loss of the last step observed with one; NaN when it was not finite. Absent on a rank that computes none (a pipeline stage before the last).",
        unit="none",
    ),
    MetricSpec("training_eval_loss", "gauge", "Evaluation loss of the last evaluation.", unit="none"),
    MetricSpec(
        "training_loss_component",
        "gauge",
        "Components of a multi-task loss, each on its own.",
        ("component",),
        unit="none",
    ),
    MetricSpec("training_grad_norm", "gauge", "Global L2 norm of the gradients before clipping.", unit="none"),
    MetricSpec(
        "training_learning_rate", "gauge", "Learning rate of each optimizer param group.", ("param_group",), unit="none"
    ),
    MetricSpec(
        "training_layer_grad_norm",
        "gauge",
        "L2 norm of the gradients of each layer (parameters grouped by module path).",
        ("layer",),
        unit="none",
    ),
    MetricSpec("training_step", "gauge", "The last observed optimizer step.", unit="none"),
    MetricSpec("training_epoch", "gauge", "The current epoch (may be fractional).", unit="none"),
    MetricSpec(
        "training_last_step_timestamp_seconds",
        "gauge",
        "Unix time at which the last step was observed.",
        unit="dateTimeAsIso",
    ),
    MetricSpec(
        "training_last_heartbeat_timestamp_seconds",
        "gauge",
        "Unix time of the last sign of progress: a step, an evaluation, a phase change or heartbeat().",
        unit="dateTimeAsIso",
    ),
    MetricSpec(
        "training_heartbeat_age_seconds",
        "gauge",
        "Seconds since the last sign of progress (a step, an evaluation, a phase change or heartbeat()), measured at scrape time on the node's own clock: TrainingStalled reads it, so a skew between the node's and Prometheus' clocks does not matter.",
        unit="s",
    ),
    MetricSpec(
        "training_phase",
        "gauge",
        "1 for the phase the run is in (set by Monitor.phase()), 0 for the others.",
        ("phase",),
        unit="none",
    ),
    MetricSpec(
        "training_run_completed",
        "gauge",
        "1 once Monitor.close() ended the run normally, else 0: a target that vanishes without it died.",
        unit="none",
    ),
    MetricSpec("training_step_duration_seconds", "gauge", "Wall time between the last two observed steps.", unit="s"),
    MetricSpec(
        "training_loss_cv",
        "gauge",
        "Coefficient of variation (std / mean) of the finite losses over the volatility window.",
        unit="none",
    ),
    MetricSpec(
        "training_loss_trend_ratio",
        "gauge",
        "(mean of the previous window - mean of the recent window) / previous mean; positive means the loss falls.",
        unit="percentunit",
    ),
    MetricSpec(
        "training_grad_norm_baseline",
        "gauge",
        "Rolling median of the recent global grad norms: the run's own level, against which explosions are judged.",
        unit="none",
    ),
    MetricSpec(
        "training_health_status",
        "gauge",
        "Diagnosis per check: 0 good, 1 warning, 2 danger.",
        ("check", "component"),
        unit="none",
    ),
    MetricSpec(
        "training_memory_allocated_bytes",
        "gauge",
        "Device memory allocated by tensors (CUDA), or the process's resident anonymous memory on CPU (mapped files left out).",
        ("device",),
        unit="bytes",
    ),
    MetricSpec(
        "training_memory_peak_bytes",
        "gauge",
        "Peak device memory allocated (CUDA), or the process's peak resident anonymous memory on CPU.",
        ("device",),
        unit="bytes",
    ),
    MetricSpec(
        "training_memory_limit_bytes",
        "gauge",
        "Total memory of the device (CUDA), or the memory limit of the process (its cgroup's, else the machine's RAM) on CPU.",
        ("device",),
        unit="bytes",
    ),
    MetricSpec(
        "training_loss_pattern",
        "gauge",
        "1 for the loss-curve pattern the run shows now (converging, oscillating, overfitting, diverging, no_progress), 0 for the others.",
        ("pattern",),
        unit="none",
    ),
    MetricSpec(
        "training_loss_pattern_since_step",
        "gauge",
        "The step at which the current loss-curve pattern began.",
        unit="none",
    ),
    MetricSpec(
        "training_grad_clip_coefficient",
        "gauge",
        "Factor the last clip_grad_norm_ through lossbeat scaled gradients by (1 = not clipped).",
        unit="none",
    ),
    MetricSpec(
        "training_grad_scale",
        "gauge",
        "Loss scale of the fp16 GradScaler passed to observe(grad_scaler=...).",
        unit="none",
    ),
    MetricSpec(
        "training_signal",
        "gauge",
        "Named signals of the task beside the loss, as passed to observe(metrics=...) or observe_eval(metrics=...): reward, reward_std, frac_reward_zero_std, kl (RL), margins, preference_accuracy (preference), eval_accuracy, eval_f1, eval_wer, eval_cer, entropy (the policy's, RL); each under its canonical name (TRL's rewards/std is reward_std, stable-baselines3's rollout/ep_rew_mean is reward).",
        ("signal",),
        unit="none",
    ),
    MetricSpec(
        "training_layers_without_grad",
        "gauge",
        "Layers none of whose parameters had a gradient at the last per-layer measurement (unused this step); they are left out of training_layer_grad_norm.",
        unit="none",
    ),
    # Mixture-of-experts routers (observe(expert_load=...)): per layer, never per expert.
    MetricSpec(
        "training_moe_load_imbalance",
        "gauge",
        "Tokens routed to the busiest expert of each MoE layer over the mean per expert, at the last step observed with expert_load (1 = uniform; E/k = every token on the same k of E experts); NaN when the layer routed no token.",
        ("layer",),
        unit="none",
    ),
    MetricSpec(
        "training_moe_dead_experts",
        "gauge",
        "Experts of each MoE layer that got no token over the last moe.dead_window_steps observed steps.",
        ("layer",),
        unit="none",
    ),
    MetricSpec("training_moe_experts", "gauge", "Experts of each MoE layer.", ("layer",), unit="none"),
    # --- info ---------------------------------------------------------------------
    MetricSpec(
        "training_run",
        "info",
        "Metadata of the training run; feed: 'process' (the training process observes its own steps) or 'log' (lossbeat watch reads its log).",
        ("run", "profile", "world_size", "local_rank", "feed", "version", "torch_version"),
    ),
    MetricSpec(
        "training_profile",
        "info",
        "The task profile the run is judged with, and why: source 'given' (MonitorConfig.profile), 'detected' (from the names observe was given, listed in fields) or 'default' (no name says; the thresholds file's profile).",
        ("profile", "source", "fields"),
    ),
    MetricSpec(
        "training_nonfinite_grad_first_layer",
        "info",
        "Where the last non-finite gradient started: the last layer in model order whose gradient was non-finite (backprop spreads it to the layers before), or 'all layers' when a non-finite loss (on a pipeline stage without one: the gradient from the later stages) poisoned every one, or 'poisoned by the gradient all-reduce from another rank' when every layer is non-finite but this rank's loss is finite (another rank's NaN, averaged in by DDP).",
        ("layer",),
    ),
    # --- counters: events are never missed between scrapes ------------------------
    MetricSpec("training_steps_total", "counter", "Observed training steps."),
    MetricSpec("training_tokens_total", "counter", "Tokens processed, as passed to observe(tokens=...)."),
    MetricSpec("training_eval_total", "counter", "Observed evaluations."),
    MetricSpec("training_nonfinite_loss_total", "counter", "Steps whose loss was NaN or infinite."),
    MetricSpec("training_nonfinite_grad_total", "counter", "Steps whose gradient norm was NaN or infinite."),
    MetricSpec(
        "training_loss_spikes_total",
        "counter",
        "Steps whose loss exceeded its recent median by spike_sigma robust standard deviations (and spike_min_rise).",
    ),
    MetricSpec(
        "training_grad_explosions_total",
        "counter",
        "Steps whose global grad norm departed from the run's baseline: above jump_ratio x its median, or above the explosion ceiling and ceiling_ratio x it.",
    ),
    MetricSpec(
        "training_grad_scaler_overflows_total",
        "counter",
        "Steps whose gradients overflowed under fp16 loss scaling: the GradScaler skips them (not counted as non-finite gradients).",
    ),
    # The optimizer guard (MonitorConfig.guard): exported unless it is off.
    MetricSpec(
        "training_skipped_steps_total",
        "counter",
        "Steps the optimizer guard kept from the optimizer (parameters, optimizer state and loss scale untouched), by reason: nonfinite, explosion, spike.",
        ("reason",),
    ),
    MetricSpec(
        "training_guard_consecutive_skips",
        "gauge",
        "Steps skipped in a row by the optimizer guard up to the last applied one (0: the last step was applied).",
        unit="none",
    ),
    MetricSpec(
        "training_guard_undecided_steps_total",
        "counter",
        "Optimizer steps taken through monitor.step with no decision from observe() for them (observe not called, or it failed): the guard decided them from their gradients, non-finite values only.",
    ),
    MetricSpec(
        "training_guard_level_changes_total",
        "counter",
        "Times the optimizer guard accepted a lasting new gradient-norm level with a healthy loss as the run's baseline, after guard.accept_level_after skipped steps.",
    ),
    MetricSpec(
        "training_halted",
        "gauge",
        "1 once the optimizer guard stopped the run (TrainingHalted raised on every rank), else 0.",
        unit="none",
    ),
    MetricSpec(
        "training_phase_seconds_total",
        "counter",
        "Wall time spent in each phase since the monitor started (the current phase up to the scrape).",
        ("phase",),
    ),
    MetricSpec(
        "training_exporter_errors_total",
        "counter",
        "Errors inside lossbeat itself, by where they happened; training is never interrupted.",
        ("where",),
    ),
    # Cross-rank signals (lossbeat.measure.cross_rank): compared across the ranks of a job by the rules.
    MetricSpec(
        "training_grad_norm_aligned",
        "gauge",
        "Global gradient norm at the last step that is a multiple of grad_norm_align_every (equal on every data-parallel replica).",
        unit="none",
    ),
    MetricSpec("training_grad_norm_aligned_step", "gauge", "The step of training_grad_norm_aligned.", unit="none"),
    MetricSpec(
        "training_rank_work_seconds",
        "gauge",
        "This rank's own work per step, host time, mean of the last 50 steps: end of the previous observe() to the start of the forward, plus the forward (no collectives; under asynchronous CUDA the kernels' launch, not their run).",
        unit="s",
    ),
]

METRICS: dict[str, MetricSpec] = {spec.name: spec for spec in _SPECS}
"""Metric name (as exposed, without the ``_info`` suffix for info metrics) to its spec."""

HEALTH_CHECKS = (
    "loss_range",
    "loss_trend",
    "loss_volatility",
    "grad_norm",
    "layer_grad_norm",
    "learning_rate",
    "warmup",
    "overfitting",
    "nonfinite",
    "loss_spikes",
    "grad_explosions",
    "learning",
    "memory",
    "throughput",
    "lr_schedule",
    "moe_router",
    "rl_entropy",
    "rl_kl",
)
"""Values of the ``check`` label of ``training_health_status``."""


PHASES = ("train", "eval", "checkpoint")
"""Values of the ``phase`` label: what the run is doing (``Monitor.phase``). Alerts judge
progress and throughput against the phase; a new phase (a pause, say) is a new value here."""


REFERENCE_DOC = "docs/metrics.md"
"""The checked-in file that holds :func:`markdown_table` between its markers (``make generate``)."""
TABLE_START = "<!-- metrics:start -->"
TABLE_END = "<!-- metrics:end -->"


def markdown_table() -> str:
    """The metric table of ``docs/metrics.md``, from the specs above (kept in sync by a test)."""
    rows = [
        TABLE_START,
        "<!-- Generated by `make generate` from exporter/lossbeat/exposition/metrics.py; do not edit. -->",
        "",
        "| Metric | Type | Labels (besides `rank`) | Meaning |",
        "|---|---|---|---|",
    ]
    for spec in _SPECS:
        name = spec.name + ("_info" if spec.kind == "info" else "")
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        rows.append(f"| `{name}` | {spec.kind} | {labels} | {spec.help} |")
    rows.append("")
    rows.append("`training_health_status` checks: " + ", ".join(f"`{c}`" for c in HEALTH_CHECKS) + ".")
    rows.append("")
    rows.append("`training_phase` phases: " + ", ".join(f"`{p}`" for p in PHASES) + ".")
    rows.append(TABLE_END)
    return "\n".join(rows)


def update_reference_doc(path: str = REFERENCE_DOC) -> bool:
    """Rewrite the metric table between the markers of ``path`` (default ``docs/metrics.md``,
    relative to the current folder); returns True when the file changed. ValueError when the
    markers are missing."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"{path}: missing {TABLE_START} ... {TABLE_END} markers")
    new = text[:start] + markdown_table() + text[end + len(TABLE_END) :]
    if new != text:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(new)
    return new != text
