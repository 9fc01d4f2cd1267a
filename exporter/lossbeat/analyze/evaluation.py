"""``python -m lossbeat.analyze.evaluation``: how far the judgments can be trusted, measured.

Two tables, written into ``docs/analyze.md`` between the evaluation markers:

* **False alarms** on healthy runs: every real public log of
  ``tests/data/real-logs`` (their SOURCES.md says what each shows), the
  healthy ``lossbeat demo`` model, and synthetic healthy shapes (fast early
  drop, slow late descent, noisy small batch, high stable grad norm, cosine to
  zero, logging every step and every 100 steps). Target: no danger, no page,
  no flapping; warnings only where a reader of the curve would agree.
* **Detection** of faults: the demo's faults, the real logs' known problems and
  synthetic faults, each with the step it was caught at.

Every run goes through :func:`lossbeat.analyze.replay.replay` (the live
monitor's :class:`~lossbeat.diagnosis.Judge`); the demo runs go through a real
:class:`~lossbeat.monitor.Monitor`, whose findings are checked against the
replay of the same series (live path = offline path).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lossbeat.analyze.replay import Analysis, replay
from lossbeat.analyze.truth import FLAPPING_ENTRIES, flapping, render_truth, score_dir, truth_dirs
from lossbeat.diagnosis import Status
from lossbeat.diagnosis.thresholds import Thresholds, load_thresholds
from lossbeat.diagnosis.vitals import LIVE_ONLY_CHECKS
from lossbeat.logs import EvalRecord, ParsedLog, TrainRecord, parse_log

__all__ = [
    "Run",
    "healthy_shapes",
    "synthetic_faults",
    "evaluate",
    "render",
    "update_doc",
    "update_truth",
    "main",
    "BEGIN",
    "END",
    "PAGING_CHECKS",
]

BEGIN, END = "<!-- evaluation:begin -->", "<!-- evaluation:end -->"
REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data" / "real-logs"
"""The checkout's corpora of real logs (``tests/data/real-logs``), some with a ``truth.json``."""
DEFAULT_LOGS = DATA / "real-logs"
"""The first corpus; its SOURCES.md says what each file shows."""
DOC = REPO / "docs" / "analyze.md"
PAGING_CHECKS = ("grad_norm", "loss_trend", "nonfinite")
"""Checks whose danger pages (critical alerts: explosion, diverging, NaN)."""


@dataclass
class Run:
    """One series to judge, and what a reader of its curve expects."""

    name: str
    log: ParsedLog
    profile: str | None = None
    fault: str = ""
    """Empty for a healthy run; else what goes wrong."""
    onset: int | None = None
    """The step the fault starts at."""
    expect: tuple[str, ...] = ()
    """Checks (or ``event:<kind>``) any of which catching the fault counts."""
    agreed: tuple[str, ...] = ()
    """Healthy runs: warnings a reader would agree with (e.g. memorisation)."""
    note: str = ""
    exact: bool = False
    """The fault is one event at ``onset``: caught only by an event within a few records of it."""
    analysis: Analysis | None = None
    live_matches: bool | None = None


# --- synthetic series ------------------------------------------------------------------


def _log(
    name: str,
    steps: range,
    loss: Callable[[int], float],
    grad: Callable[[int], float] | None = None,
    lr: Callable[[int], float] | None = None,
    evals: Callable[[int], float] | None = None,
    eval_every: int = 0,
) -> ParsedLog:
    log = ParsedLog(path=name, format="synthetic")
    for s in steps:
        log.train.append(TrainRecord(s, loss(s), grad(s) if grad else None, lr(s) if lr else None))
        if evals and eval_every and s > 0 and s % eval_every == 0:
            log.evals.append(EvalRecord(s, evals(s)))
    return log


def _cosine(peak: float, total: int, warmup: int = 100, floor: float = 0.1) -> Callable[[int], float]:
    def lr(s: int) -> float:
        if s < warmup:
            return peak * (s + 1) / warmup
        p = min(1.0, (s - warmup) / max(1, total - warmup))
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))

    return lr


def _noise(seed: int, scale: float) -> Callable[[], float]:
    rng = random.Random(seed)
    return lambda: rng.gauss(0.0, scale)


def _settling_grad(start: float, level: float, tau: float, seed: int, jitter: float = 0.1) -> Callable[[int], float]:
    n = _noise(seed, jitter)
    return lambda s: (level + (start - level) * math.exp(-s / tau)) * math.exp(n())


def healthy_shapes() -> list[Run]:
    """Synthetic healthy runs of several shapes (deterministic)."""
    runs = []
    n = _noise(1, 0.03)
    # Real curves keep a slow power-law tail while the LR is high (no synthetic perfect floor).
    fast = lambda s: 0.7 + 9.0 * math.exp(-s / 60) + 1.0 * (1 + s / 100) ** -0.5 + n()  # noqa: E731
    runs.append(
        Run(
            "synthetic: fast early drop (from scratch, every step)",
            _log("fast-drop", range(3000), fast, _settling_grad(15.0, 0.3, 80, 2), _cosine(6e-4, 3000)),
        )
    )
    n2 = _noise(3, 0.02)
    runs.append(
        Run(
            "synthetic: slow late descent (power law, every step)",
            _log(
                "slow",
                range(6000),
                lambda s: 2.0 + 3.0 * (1 + s / 50) ** -0.35 + n2(),
                _settling_grad(2.0, 0.6, 300, 4),
                _cosine(3e-4, 6000, floor=0.1),
            ),
        )
    )
    n3 = _noise(5, 0.08)  # the article's "normal convergence with noise, small batch" [A §1.3]
    runs.append(
        Run(
            "synthetic: noisy small batch (every step)",
            _log(
                "noisy",
                range(3000),
                lambda s: 0.6 + 2.8 * math.exp(-s / 250) + 0.3 * (1 + s / 100) ** -0.5 + n3(),
                _settling_grad(3.0, 1.0, 200, 6, 0.3),
                _cosine(1e-4, 3000),
            ),
        )
    )
    n4, n4e = _noise(7, 0.04), _noise(8, 0.01)
    runs.append(
        Run(
            "synthetic: high stable grad norm (~17.5, clipped at 1)",
            _log(
                "high-grad",
                range(0, 4000, 25),
                lambda s: 0.4 + 0.8 * math.exp(-s / 800) + n4(),
                lambda s: 17.5 + n4() * 10,
                _cosine(1e-5, 4000, warmup=200),
                lambda s: 0.45 + 0.6 * math.exp(-s / 900) + n4e(),
                eval_every=500,
            ),
        )
    )
    n5 = _noise(9, 0.02)
    runs.append(
        Run(
            "synthetic: cosine to zero, flat at the end",
            _log(
                "cosine-zero",
                range(0, 5000, 10),
                lambda s: (
                    1.5
                    + 0.8 * math.exp(-s / 600)
                    + 0.6 * (1 + s / 200) ** -0.5 * (1 + math.cos(math.pi * s / 5000)) / 2
                    + n5()
                ),
                _settling_grad(1.5, 0.8, 500, 10),
                _cosine(2e-4, 5000, warmup=100, floor=0.0),
            ),
        )
    )
    n6, n7 = _noise(11, 0.05), _noise(12, 0.005)
    curve = lambda s: 2.0 + 1.5 * math.exp(-s / 500) + 0.5 * (1 + s / 1000) ** -0.5  # noqa: E731
    runs.append(
        Run(
            "synthetic: the same run logged every step",
            _log(
                "every-step",
                range(20000),
                lambda s: curve(s) + n6(),
                _settling_grad(2.0, 0.8, 2000, 13),
                _cosine(3e-4, 20000),
            ),
        )
    )
    runs.append(
        Run(
            "synthetic: the same run logged every 100 steps",
            _log(
                "every-100",
                range(0, 20000, 100),
                lambda s: curve(s) + n7(),
                _settling_grad(2.0, 0.8, 2000, 14, 0.03),
                _cosine(3e-4, 20000),
            ),
        )
    )
    return runs


def synthetic_faults() -> list[Run]:
    """Synthetic faults on a healthy base run (every step unless said), each with its onset."""
    out = []
    k, total = 1500, 3000
    base_n, grad_n = _noise(21, 0.03), _noise(22, 0.1)
    base = lambda s: 1.0 + 2.0 * math.exp(-s / 400) + base_n()  # noqa: E731
    grad = lambda s: 0.8 * math.exp(grad_n())  # noqa: E731
    lr = _cosine(3e-4, total)
    steps = range(total)
    out.append(
        Run(
            "synthetic: NaN loss and grad from step 1500",
            _log(
                "nan", steps, lambda s: math.nan if s >= k else base(s), lambda s: math.nan if s >= k else grad(s), lr
            ),
            fault="NaN",
            onset=k,
            expect=("nonfinite", "event:nonfinite_loss"),
        )
    )
    out.append(
        Run(
            "synthetic: x10 grad-norm jump from step 1500",
            _log("jump", steps, base, lambda s: grad(s) * (10.0 if s >= k else 1.0), lr),
            fault="x10 grad jump",
            onset=k,
            expect=("grad_norm", "event:grad_explosions"),
        )
    )
    hot_n = _noise(23, 0.25)
    out.append(
        Run(
            "synthetic: LR x30 from step 1500 (loss climbs, jitters)",
            _log(
                "lr-x30",
                steps,
                lambda s: base(s) + ((s - k) * 0.004 + abs(hot_n()) * 1.5 if s >= k else 0.0),
                lambda s: grad(s) * (6.0 if s >= k else 1.0),
                lambda s: lr(s) * (30.0 if s >= k else 1.0),
            ),
            fault="LR x30",
            onset=k,
            expect=("loss_trend", "loss_volatility", "grad_norm", "learning_rate"),
        )
    )
    out.append(
        Run(
            "synthetic: steady grad-norm climb (+1%/step) from step 1500",
            _log("climb", steps, base, lambda s: grad(s) * (1.01 ** (s - k) if s >= k else 1.0), lr),
            fault="grad-norm climb",
            onset=k,
            expect=("grad_norm", "event:grad_explosions"),
        )
    )
    e_n = _noise(24, 0.005)
    evals = lambda s: 1.2 + 1.5 * math.exp(-s / 400) + (0.0002 * (s - 1500) if s > 1500 else 0.0) + e_n()  # noqa: E731
    out.append(
        Run(
            "synthetic: overfitting from the evaluation at step 1500 (eval every 250)",
            _log("overfit", steps, base, grad, lr, evals, eval_every=250),
            fault="overfitting",
            onset=1500,
            expect=("overfitting",),
        )
    )
    return out


# --- real logs -----------------------------------------------------------------------

# What SOURCES.md says each curve shows (matched on the file name): the fault a reader sees and
# the checks that catching it counts; healthy files list the warnings a reader would agree with.
_REAL: dict[str, dict] = {
    "classifier-multi-eval-overfit": dict(
        profile="classification", fault="overfitting (every eval set)", expect=("overfitting",)
    ),
    "token-compressor-plateau": dict(fault="plateau (no progress)", expect=("loss_trend", "learning_rate")),
    "mistral-7b-lora-translator": dict(
        note="flat within epochs, drops at their boundaries; warmup grad norms near 10 (its own level)",
        agreed=("loss_range", "loss_trend"),
    ),
    "law-hugeloss": dict(
        fault="huge loss (285) and grad norm (422)", expect=("loss_range", "grad_norm", "loss_volatility")
    ),
    "nsllm": dict(fault="long plateau after the fast drop", expect=("loss_trend",)),
    "tcm-9epoch": dict(
        note="memorisation over 9 epochs (loss 0.09)", agreed=("loss_range", "loss_volatility", "loss_trend")
    ),
    "t5-small": dict(fault="isolated grad-norm spikes (35.6, 13.2)", expect=("event:grad_explosions",)),
    "tinyllama-1.1b-chat-lora-sft": dict(),
    "dpo": dict(profile="preference", agreed=("loss_trend", "learning"), note="flat near ln 2 for its first epoch"),
    "whisper-large-v2-ja-overfit": dict(fault="overfitting (eval rises at every evaluation)", expect=("overfitting",)),
    "whisper-large-v3-tr": dict(
        fault="degrades as the LR warms up (best checkpoint at 250)", expect=("overfitting", "loss_trend")
    ),
    "lightning-wikitext103": dict(fault="both losses rise after the resume", expect=("loss_trend",)),
    "llamafactory-qwen2.5-3b": dict(
        agreed=("loss_trend",), note="flat through its first epoch, then drops at epoch boundaries"
    ),
    "llmc-gpt2": dict(),
    "megatron-gpt3": dict(marks=(("loss bump 3.16 against 2.99", 2845),)),
    "modded-nanogpt": dict(marks=(("single-step loss spike 5.28 against 3.80", 947),)),
}


def real_runs(directory: Path) -> list[Run]:
    runs = []
    for path in sorted(directory.iterdir()):
        if path.suffix == ".md" or not path.is_file():
            continue
        spec = next((v for k, v in _REAL.items() if k in path.name), {})
        log = parse_log(path)
        runs.append(
            Run(
                f"real: {path.name}",
                log,
                spec.get("profile"),
                spec.get("fault", ""),
                None,
                spec.get("expect", ()),
                spec.get("agreed", ()),
                spec.get("note", ""),
            )
        )
        for what, step in spec.get("marks", ()):  # a known event inside a healthy run: caught as an event
            runs.append(
                Run(f"real: {path.name}", log, spec.get("profile"), what, step, ("event:loss_spikes",), exact=True)
            )
    return runs


# --- the demo, through a live Monitor ------------------------------------------------------


def demo_runs(steps: int = 400, thresholds: Thresholds | None = None) -> list[Run]:
    """The ``lossbeat demo`` model trained live (healthy and each fault), through a real Monitor."""
    try:
        import torch
    except ImportError:  # the evaluation of logs needs no torch
        return []
    from lossbeat.demo import (
        EXPLODING_LAYER,
        VANISHING_LAYER,
        ModelSize,
        SyntheticCorpus,
        TinyLM,
        _scale_gradients_from,
        learning_rate_at,
    )
    from lossbeat.monitor import Monitor, MonitorConfig

    expects = {
        "": (),
        "nan": ("nonfinite", "event:nonfinite_loss"),
        "explode": ("grad_norm", "event:grad_explosions", "layer_grad_norm"),
        "lr-high": ("loss_trend", "loss_volatility", "learning_rate", "grad_norm"),
        "plateau": ("learning_rate", "loss_trend"),
        "vanish": ("layer_grad_norm",),
    }
    runs = []
    for fault, expect in expects.items():
        torch.manual_seed(0)
        torch.set_num_threads(1)
        model = TinyLM(ModelSize())
        corpus = SyntheticCorpus(64, 32, seed=0)
        held_out = SyntheticCorpus(64, 32, seed=1).batch(128)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        monitor = Monitor(MonitorConfig(port=0, thresholds=thresholds, log_status_changes=False), serve=False)
        k = steps // 2
        if fault == "explode":
            _scale_gradients_from(model, EXPLODING_LAYER, 1e4, k)
        if fault == "vanish":
            _scale_gradients_from(model, VANISHING_LAYER, 1e-9, k)
        log = ParsedLog(path=f"demo-{fault or 'healthy'}", format="demo")
        layer_steps: list[int] = []
        for step in range(steps):
            model.training_step = step
            active = fault if step >= k else ""
            lr = (
                0.3 if active == "lr-high" else 1e-8 if active == "plateau" else learning_rate_at(step, steps, 3e-3, 20)
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = model(*corpus.batch(32))
            if active == "nan":
                loss = loss * float("nan")
            loss.backward()
            grad_norm = monitor.clip_grad_norm_(model, 1.0)
            monitor.observe(step, loss=loss, optimizer=optimizer, grad_norm=grad_norm, model=model)
            # The evaluation's own reads, for the offline replay of the same series.
            log.train.append(TrainRecord(step, float(loss.detach()), float(grad_norm), lr))
            if active != "nan":
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % 50 == 0:
                with torch.no_grad():
                    eval_loss = float(model(*held_out))
                monitor.observe_eval(step, eval_loss)
                log.evals.append(EvalRecord(step, eval_loss))
            if any(f.check == "layer_grad_norm" and f.status for f in monitor.findings) and not layer_steps:
                layer_steps.append(step)
        monitor.flush()
        report = monitor.report()
        run = Run(
            f"demo: {fault or 'healthy'} ({steps} steps" + (f", fault at {k})" if fault else ")"),
            log,
            fault=fault,
            onset=k if fault else None,
            expect=expect,
        )
        run.analysis = replay(log, thresholds or load_thresholds())
        offline = {(f.check, f.component): f.status for f in run.analysis.findings if f.check not in LIVE_ONLY_CHECKS}
        live = {(f.check, f.component): f.status for f in report.findings if f.check not in LIVE_ONLY_CHECKS}
        run.live_matches = offline == live
        if layer_steps:  # per-layer norms exist only live: record when the live check caught it
            run.note = f"layer_grad_norm caught live at step {layer_steps[0]}"
        monitor.close()
        runs.append(run)
    return runs


# --- judging the runs ------------------------------------------------------------------


@dataclass
class Verdict:
    dangers: list[str] = field(default_factory=list)
    pages: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    flapping: list[str] = field(default_factory=list)
    changes: int = 0
    caught: str = ""
    caught_step: int | None = None


def _where(check: str, component: str) -> str:
    return f"{check}[{component}]" if component else check


def verdict(run: Run, t: Thresholds) -> Verdict:
    a = run.analysis
    assert a is not None, "verdict() of a run not analysed yet"
    v = Verdict(changes=a.status_changes)
    for (check, component), w in a.worst.items():
        name = f"{_where(check, component)}@{w.step}"
        if w.finding.status is Status.DANGER:
            v.dangers.append(name)
            if check in PAGING_CHECKS:
                v.pages.append(name)
        elif w.finding.status is Status.WARNING:
            v.warnings.append(name)
    v.flapping = flapping(a)
    # Explosion events page in bursts (alerts.explosion_events within the event window): count
    # a burst as that many events within 10 diagnoses' worth of records.
    burst = _burst(a.event_steps["grad_explosions"], t.alerts.explosion_events, a)
    if burst is not None:
        v.pages.append(f"explosion events@{burst}")
    if run.fault:
        onset = run.onset if run.onset is not None else (a.first_step or 0)
        hits = []
        for (check, component), w in a.worst.items():
            if check in run.expect and w.finding.status >= Status.WARNING:
                first = next(
                    (
                        c.step
                        for c in a.changes
                        if c.finding.check == check
                        and c.finding.component == component
                        and c.finding.status >= Status.WARNING
                        and (c.step or 0) >= onset
                    ),
                    w.step,
                )
                hits.append((first, _where(check, component)))
        for kind in ("nonfinite_loss", "grad_explosions", "loss_spikes"):
            if f"event:{kind}" in run.expect:
                later = [s for s in a.event_steps[kind] if s >= onset and (not run.exact or s - onset <= 50)]
                if later:
                    hits.append((later[0], f"event {kind}"))
        if run.note.startswith("layer_grad_norm caught live at step"):
            hits.append((int(run.note.rsplit(" ", 1)[1]), "layer_grad_norm (live)"))
        if hits:
            step, what = min(hits)
            v.caught, v.caught_step = what, step
    return v


def _burst(steps: list[int], events: int, a: Analysis) -> int | None:
    """The step at which ``events`` explosion events fell within 50 records (an event-triggered page)."""
    if len(steps) < events or not a.train_records:
        return None
    per_record = max(1.0, ((a.last_step or 0) - (a.first_step or 0)) / max(1, a.train_records - 1))
    for i in range(events - 1, len(steps)):
        if steps[i] - steps[i - events + 1] <= 50 * per_record:
            return steps[i]
    return None


def evaluate(logs: Path | None, demo_steps: int = 400) -> list[Run]:
    """Judge every run: real logs (when ``logs`` exists), the demo, synthetic healthy shapes and faults."""
    default = load_thresholds()
    runs = []
    if logs is not None and logs.is_dir():
        runs += real_runs(logs)
    runs += healthy_shapes() + synthetic_faults()
    done: dict[int, Analysis] = {}
    for run in runs:  # runs that share a log (a known event in a healthy run) share its replay
        t = load_thresholds(profile=run.profile) if run.profile else default
        if id(run.log) not in done:
            done[id(run.log)] = replay(run.log, t)
        run.analysis = done[id(run.log)]
    if demo_steps:
        runs += demo_runs(demo_steps, default)
    return runs


def _cell(items: list[str], limit: int = 4) -> str:
    return ", ".join(items[:limit]) + (f" (+{len(items) - limit})" if len(items) > limit else "") if items else "-"


def render(runs: list[Run], t: Thresholds | None = None) -> str:
    t = t or load_thresholds()
    healthy = [r for r in runs if not r.fault]
    faults = [r for r in runs if r.fault]
    lines = [BEGIN, "<!-- Generated by `python -m lossbeat.analyze.evaluation` (make docs); do not edit. -->", ""]
    verdicts = {id(r): verdict(r, t) for r in runs}
    n_danger = sum(bool(verdicts[id(r)].dangers) for r in healthy)
    n_pages = sum(bool(verdicts[id(r)].pages) for r in healthy)
    n_flap = sum(bool(verdicts[id(r)].flapping) for r in healthy)
    lines += [
        f"**Healthy runs: {len(healthy)}; with a danger: {n_danger}; that would page: {n_pages}; flapping: {n_flap}.** "
        f"Flapping: a check entering a worse status {FLAPPING_ENTRIES} times or more in one run. "
        "Pages: a danger of "
        + ", ".join(f"`{c}`" for c in PAGING_CHECKS)
        + f", or {t.alerts.explosion_events} explosion events within 50 records.",
        "",
        "| healthy run | profile | records | danger | would page | warnings (first step) | agreed by a reader | "
        "status changes | flapping |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in healthy:
        v = verdicts[id(r)]
        assert r.analysis is not None  # every run was analysed before its verdict
        agreed = [w for w in v.warnings if w.split("@")[0].split("[")[0] in r.agreed]
        lines.append(
            f"| {r.name} | {r.profile or t.profile.name} | {r.analysis.train_records} | {_cell(v.dangers)} | "
            f"{_cell(v.pages)} | {_cell(v.warnings)} | {_cell(agreed)}{' - ' + r.note if r.note else ''} | "
            f"{v.changes} | {_cell(v.flapping)} |"
        )
    caught = sum(verdicts[id(r)].caught != "" for r in faults)
    lines += [
        "",
        f"**Faults: {len(faults)}; caught: {caught}.** The step is the first status change (or event) at or after "
        "the onset that names the fault; real logs have no single onset (their first step counts).",
        "",
        "| fault | run | onset | caught by | at step | steps after onset |",
        "|---|---|---|---|---|---|",
    ]
    for r in faults:
        v = verdicts[id(r)]
        assert r.analysis is not None  # every run was analysed before its verdict
        onset = r.onset if r.onset is not None else r.analysis.first_step
        delay = "-" if v.caught_step is None or onset is None else str(v.caught_step - onset)
        lines.append(
            f"| {r.fault} | {r.name} | {onset if r.onset is not None else '-'} | {v.caught or 'MISSED'} | "
            f"{v.caught_step if v.caught_step is not None else '-'} | {delay} |"
        )
    live = [r for r in runs if r.live_matches is not None]
    if live:
        same = sum(bool(r.live_matches) for r in live)
        lines += [
            "",
            f"Live path = offline path: the demo runs through a `Monitor` gave the same final findings as "
            f"`analyze`'s replay of the same series in {same} of {len(live)} runs.",
        ]
    lines.append(END)
    return "\n".join(lines)


TRUTH_HEADING = "\n### Against an independent ground truth (`--truth`)\n\n"
"""Where the ground-truth tables start inside the evaluation block."""


def update_truth(path: Path, truth: str) -> bool:
    """Replace only the ground-truth tables of the evaluation block (``--truth --write``)."""
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path}: no evaluation block ({BEGIN} ... {END}); write the whole one first")
    start, end = text.index(BEGIN), text.index(END)
    block = text[start:end]
    head = block.split(TRUTH_HEADING)[0].rstrip("\n") + "\n"
    new = text[:start] + head + TRUTH_HEADING + truth + "\n" + text[end:]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def update_doc(path: Path, table: str) -> bool:
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        text = text.rstrip("\n") + "\n\n## Evaluation: false alarms and detection\n\n" + BEGIN + "\n" + END + "\n"
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + table + text[end:]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lossbeat.analyze.evaluation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--logs", type=Path, default=DEFAULT_LOGS, help="folder of real logs (default: %(default)s)")
    parser.add_argument("--demo-steps", type=int, default=400, help="steps per demo run (0: no demo runs)")
    parser.add_argument(
        "--truth",
        type=Path,
        nargs="*",
        default=None,
        metavar="DIR",
        help="score analyze against the truth.json of each DIR (default: every folder of "
        f"{DATA} that has one) and print that table only",
    )
    parser.add_argument(
        "--write",
        type=Path,
        nargs="?",
        const=DOC,
        default=None,
        help=f"write the tables into this file between the markers (default {DOC}); with "
        "--truth, only the ground-truth tables",
    )
    args = parser.parse_args(argv)
    if args.truth is not None:
        dirs = args.truth or truth_dirs(DATA)
        if not dirs:
            print(f"lossbeat evaluation: no truth.json under {DATA}", file=sys.stderr)
            return 2
        truth = "\n\n".join(render_truth(d.name, score_dir(d)) for d in dirs)
        if args.write:  # the truth tables only: no demo run, no synthetic series
            update_truth(args.write, truth)
            print(f"wrote the ground-truth tables into {args.write}")
        else:
            print(truth)
        return 0
    if not args.logs.is_dir():
        print(
            f"lossbeat evaluation: no real logs at {args.logs}; evaluating the synthetic and demo runs", file=sys.stderr
        )
    table = render(evaluate(args.logs if args.logs.is_dir() else None, args.demo_steps))
    if args.write and truth_dirs(DATA):
        truth = "\n\n".join(render_truth(d.name, score_dir(d)) for d in truth_dirs(DATA))
        table = table.replace(END, TRUTH_HEADING + truth + "\n" + END)
    if args.write:
        update_doc(args.write, table)
        print(f"wrote {args.write}")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
