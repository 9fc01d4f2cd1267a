"""``lossbeat demo``: a small transformer LM learning a synthetic corpus on CPU, monitored live.

The corpus is learnable but not trivial: each sequence counts up by a stride
drawn per sequence (the model must infer it from the context), and 10% of the
tokens are random noise, so the loss floor sits near 0.8 nats, inside the
causal-LM healthy range. ``--fault`` injects a failure at ``--fault-step``:

- ``nan``:     the loss is NaN from that step on (a corrupted batch stream);
               the optimizer skips non-finite steps, as AMP's GradScaler does.
- ``explode``: the gradients of ``blocks.1.mlp.fc`` are scaled by 1e4 (clipping
               keeps the weights alive); that layer tops the per-layer norms.
- ``lr-high``: the learning rate jumps to 0.3: the loss turns volatile and rises.
- ``plateau``: the learning rate drops to 1e-8: the loss stops falling.
- ``vanish``:  the gradients of ``blocks.0.attn.qkv`` are scaled by 1e-9: that
               layer's norm falls below the per-layer vanishing threshold.
- ``leak``:    every step keeps a 4 MiB tensor alive (a list that is never
               emptied): the process's memory grows step after step.
- ``slow``:    every step takes four times as long (a throttled node, a stalled
               data loader): the throughput falls below the run's own level
               (with ``--step-time``: four slots of it).

Faults combine: ``--fault explode,vanish``. ``--multi-task`` adds a second task
(tell, for each token, whether it is noise that breaks its sequence's pattern):
the loss is ``lm + noise``, each component monitored on its own (profile ``multi-task``).
``--grad-scaler`` trains with fp16's dynamic loss scaling (a ``GradScaler``; the
weights stay float32 on CPU) and passes the scaler to the monitor: with ``nan``,
every step overflows, the scaler skips it and the loss scale collapses.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lossbeat.measure.memory import anonymous_resident_bytes

__all__ = ["TinyLM", "ModelSize", "SyntheticCorpus", "add_arguments", "run", "FAULTS"]

FAULTS = ("nan", "explode", "lr-high", "plateau", "vanish", "leak", "slow")
LEAK_BYTES_PER_STEP = 4 * 2**20
EXPLODING_LAYER = "blocks.1.mlp.fc"
VANISHING_LAYER = "blocks.0.attn.qkv"


@dataclass(frozen=True)
class ModelSize:
    vocab: int = 64
    context: int = 32
    width: int = 64
    layers: int = 2
    heads: int = 4


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A GPT-style decoder; module paths read ``blocks.N.attn.qkv`` and so on."""

    training_step: int
    """The step being trained, set by the training loop (the fault hooks read it)."""

    def __init__(self, size: ModelSize = ModelSize(), noise_head: bool = False) -> None:
        super().__init__()
        self.size = size
        self.tok_emb = nn.Embedding(size.vocab, size.width)
        self.pos_emb = nn.Embedding(size.context, size.width)
        self.blocks = nn.ModuleList(Block(size.width, size.heads) for _ in range(size.layers))
        self.ln_f = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, size.vocab, bias=False)
        # Optional second task for the multi-task demo: is this token noise?
        self.noise_head = nn.Linear(size.width, 1) if noise_head else None

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.hidden(tokens))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def losses(self, tokens: torch.Tensor, targets: torch.Tensor, noisy: torch.Tensor) -> dict[str, torch.Tensor]:
        """The multi-task losses: next-token ``lm`` and per-token ``noise`` detection."""
        assert self.noise_head is not None, "losses() needs TinyLM(noise_head=True)"
        h = self.hidden(tokens)
        logits = self.head(h)
        return {
            "lm": F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)),
            "noise": F.binary_cross_entropy_with_logits(self.noise_head(h).squeeze(-1), noisy.float()),
        }


class SyntheticCorpus:
    """Sequences x[t+1] = x[t] + stride (mod vocab), stride per sequence, with 10% noise."""

    def __init__(self, vocab: int, context: int, noise: float = 0.1, strides: int = 5, seed: int = 0) -> None:
        self.vocab, self.context, self.noise, self.strides = vocab, context, noise, strides
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets, _ = self.batch_with_noise(size)
        return tokens, targets

    def batch_with_noise(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens, next-token targets, and which input tokens are noise."""
        g, n = self.generator, self.context + 1
        start = torch.randint(0, self.vocab, (size, 1), generator=g)
        stride = torch.randint(1, self.strides + 1, (size, 1), generator=g)
        seq = (start + stride * torch.arange(n)) % self.vocab
        noisy = torch.rand(size, n, generator=g) < self.noise
        seq = torch.where(noisy, torch.randint(0, self.vocab, (size, n), generator=g), seq)
        return seq[:, :-1], seq[:, 1:], noisy[:, :-1]


def learning_rate_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Progress:
    """A one-line progress bar on stderr: no dependency, redrawn a few times a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self._last_draw = 0.0
        self._start = time.perf_counter()

    def update(self, step: int, loss: float, lr: float, grad_norm: float, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < 0.2:
            return
        self._last_draw = now
        done = (step + 1) / self.total
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        rate = (step + 1) / max(now - self._start, 1e-9)
        sys.stderr.write(
            f"\r[{bar}] {step + 1}/{self.total}  loss {loss:7.4f}  lr {lr:.2e}  grad {grad_norm:8.3g}  {rate:5.1f} it/s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


class Pace:
    """Steps on a fixed schedule (``--step-time``): the loop sleeps until the step's slot ends.

    A step that ran late (an evaluation, a busy machine) is made up by the next ones, so the
    steps/s over a few seconds stay 1/seconds as long as the work fits in the slots on average.
    More than ``catch_up_s`` behind (the work itself is slower): the schedule restarts from now.
    """

    def __init__(self, seconds: float, catch_up_s: float = 2.0) -> None:
        self.seconds, self.catch_up_s = seconds, catch_up_s
        self._next = time.perf_counter()

    def wait(self, slots: int = 1) -> None:
        """Sleep until the end of this step's ``slots`` slots (4 for the ``slow`` fault)."""
        self._next += slots * self.seconds
        now = time.perf_counter()
        if self._next > now:
            time.sleep(self._next - now)
        elif now - self._next > self.catch_up_s:
            self._next = now


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8470, help="exporter port (default 8470; 0 = a free port)")
    parser.add_argument("--addr", default="127.0.0.1", help="exporter address (default 127.0.0.1)")
    parser.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    parser.add_argument(
        "--fault", type=_faults, default=(), help=f"inject failures, comma-separated: {', '.join(FAULTS)}"
    )
    parser.add_argument(
        "--multi-task",
        action="store_true",
        help="add a noise-detection task; components lm and noise (profile multi-task)",
    )
    parser.add_argument("--fault-step", type=int, help="step at which the fault starts (default: steps / 2)")
    parser.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step, to watch it live")
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="pace the steps: each takes this many seconds of wall time, whatever its work took "
        "(the loop sleeps the rest and catches up after a late step), so the steps/s stay "
        "steady on a busy machine; not with --step-delay",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--eval-every", type=int, default=50, help="evaluate every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--thresholds", help="thresholds YAML overriding the packaged defaults")
    parser.add_argument("--profile", help="task profile (default causal-lm)")
    parser.add_argument("--run-name", "--job-name", dest="run_name", default="lossbeat-demo")
    parser.add_argument(
        "--linger", type=float, default=0.0, help="keep serving /metrics this many seconds after training"
    )
    parser.add_argument(
        "--metrics-csv",
        metavar="FILE",
        help="also write the run's per-step loss, grad norm, LR, step time, memory and per-layer grad norms, "
        "and its eval losses, to FILE as a Lightning metrics.csv (for lossbeat analyze)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--guard",
        choices=("off", "skip", "stop"),
        default="off",
        help="the optimizer guard (monitor.step): skip or stop a bad step before the optimizer "
        "applies it; with it, --fault nan is one bad batch (at --fault-step), not every step after",
    )
    parser.add_argument(
        "--grad-scaler", action="store_true", help="dynamic loss scaling with a GradScaler, as fp16 training does"
    )


def _faults(text: str) -> tuple[str, ...]:
    faults = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"invalid choice: {unknown[0]!r} (choose from {', '.join(FAULTS)})")
    return faults


def _scale_gradients_from(model: TinyLM, layer: str, factor: float, start: int, once: bool = False) -> None:
    for p in model.get_submodule(layer).parameters():
        p.register_hook(
            lambda g, _m=model: g * factor if (_m.training_step == start if once else _m.training_step >= start) else g
        )


def _layer_norms(layers: list[tuple[str, list[torch.Tensor]]]) -> list[float]:
    """Each module's gradient norm over its own parameters (0 for a module with no gradient)."""
    norms = []
    for _, params in layers:
        grads = [p.grad.detach().norm() for p in params if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack(grads)) if grads else torch.zeros(()))
    return [float(x) for x in torch.stack(norms).tolist()]  # one host sync for all of them


def run(args: argparse.Namespace) -> int:
    """``lossbeat demo``: train the tiny model with the faults asked for, fed to a served monitor."""
    from lossbeat.monitor import TrainingHalted

    _check_args(args)
    fault_step = args.fault_step if args.fault_step is not None else args.steps // 2
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # small model: threads cost more than they give on a 2-core machine
    size = ModelSize()
    model = TinyLM(size, noise_head=args.multi_task)
    corpus = SyntheticCorpus(size.vocab, size.context, seed=args.seed)
    held_out = SyntheticCorpus(size.vocab, size.context, seed=args.seed + 1).batch(256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    monitor = _start_monitor(args)
    if monitor is None:
        return 1
    faults = set(args.fault)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if args.grad_scaler else None
    print(
        f"lossbeat demo: {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"metrics on http://{args.addr}:{monitor.port}/metrics"
        + (f"; fault {','.join(args.fault)} at step {fault_step}" if faults else ""),
        flush=True,
    )

    _inject_gradient_faults(model, faults, fault_step, args.guard)
    stop = {"now": False}
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    progress = Progress(args.steps, not args.no_progress and sys.stderr.isatty())
    loop = _TrainingLoop(
        args=args,
        monitor=monitor,
        model=model,
        corpus=corpus,
        held_out=held_out,
        optimizer=optimizer,
        scaler=scaler,
        faults=faults,
        fault_step=fault_step,
        progress=progress,
    )
    try:
        for step in range(args.steps):
            if stop["now"]:
                break
            loop.step(step)
    except TrainingHalted as halted:  # the guard stopped the run: no bad step reached the weights
        progress.close()
        print(f"lossbeat demo: {halted}", file=sys.stderr, flush=True)
        print(monitor.report(), flush=True)
        monitor.close(completed=False)
        return 3
    finally:
        progress.close()
        signal.signal(signal.SIGTERM, previous_handler)
        loop.close()
    print(monitor.report(), flush=True)
    _linger(args.linger, stop)
    monitor.close()
    return 0


def _inject_gradient_faults(model: TinyLM, faults: set[str], fault_step: int, guard: str) -> None:
    """The faults made by scaling one layer's gradients: ``explode`` (at ``fault_step`` only under
    a guard, from it on otherwise) and ``vanish`` (from ``fault_step`` on)."""
    if "explode" in faults:
        _scale_gradients_from(model, EXPLODING_LAYER, 1e4, fault_step, once=guard != "off")
    if "vanish" in faults:
        _scale_gradients_from(model, VANISHING_LAYER, 1e-9, fault_step)


def _linger(seconds: float, stop: dict[str, bool]) -> None:
    """``--linger``: keep serving /metrics after training, until SIGTERM."""
    if seconds > 0:
        print(f"lossbeat demo: serving /metrics for {seconds:g} more seconds", flush=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not stop["now"]:
            time.sleep(0.1)


def _check_args(args: argparse.Namespace) -> None:
    """Raises SystemExit for a flag value the demo cannot run with."""
    if args.steps < 1:
        raise SystemExit("lossbeat demo: --steps must be >= 1")
    if args.step_time < 0 or args.step_delay < 0:
        raise SystemExit("lossbeat demo: --step-time and --step-delay must be >= 0")
    if args.step_time and args.step_delay:
        raise SystemExit("lossbeat demo: --step-time or --step-delay, not both")


def _start_monitor(args: argparse.Namespace) -> Any:
    """The demo's served monitor; None (the reason printed) when its port is taken."""
    from lossbeat.monitor import start_exporter

    profile = args.profile or ("multi-task" if args.multi_task else None)
    try:
        return start_exporter(
            args.port,
            addr=args.addr,
            thresholds=args.thresholds,
            profile=profile,
            run_name=args.run_name,
            # The demo shows every signal, the Cluster dashboard's too: per-rank work time, and the
            # aligned grad norm (on by itself only under DDP, where replicas must agree).
            work_time=True,
            grad_norm_align_every=10,
            guard=args.guard,
        )
    except OSError as exc:  # a busy port: the message names it and the fix; no traceback
        print(str(exc) if str(exc).startswith("lossbeat") else f"lossbeat demo: {exc}", file=sys.stderr)
        return None


class _TrainingLoop:
    """The demo's steps, one at a time: the faults, the backward pass, the monitor's observation,
    the optimizer step, the metrics.csv rows, the evaluations and the pacing."""

    def __init__(
        self,
        *,
        args: argparse.Namespace,
        monitor: Any,
        model: TinyLM,
        corpus: SyntheticCorpus,
        held_out: tuple[torch.Tensor, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        faults: set[str],
        fault_step: int,
        progress: Progress,
    ) -> None:
        self.args, self.monitor, self.model, self.corpus, self.held_out = args, monitor, model, corpus, held_out
        self.optimizer, self.scaler, self.faults, self.fault_step = optimizer, scaler, faults, fault_step
        self.progress = progress
        self.pace = Pace(args.step_time)
        self.leaked: list[torch.Tensor] = []  # the ``leak`` fault's tensors, never freed
        self.metrics = open(args.metrics_csv, "w", encoding="utf-8") if args.metrics_csv else None
        # The per-layer columns are named as Lightning's grad_norm() utility logs them (one per module here).
        layers = [(name, list(m.parameters(recurse=False))) for name, m in model.named_modules()]
        self.layers = [(name, params) for name, params in layers if params]
        if self.metrics is not None:
            columns = ",".join(f"grad_2.0_norm/{name}" for name, _ in self.layers)
            self.metrics.write(f"step,train_loss,grad_norm,lr-AdamW,val_loss,step_time,memory_allocated,{columns}\n")
        self.step_began: float | None = None  # the previous step's start: a step's wall time, its sleeps included

    def close(self) -> None:
        """Close the metrics.csv, if one is written."""
        if self.metrics is not None:
            self.metrics.close()

    def step(self, step: int) -> None:
        """One training step, its evaluation when due, and the wait the pacing asks for."""
        args = self.args
        step_started = time.perf_counter()
        self.model.training_step = step
        active = self.faults if step >= self.fault_step else set()
        lr = self._set_learning_rate(step, active)
        loss, components, tokens = self._backward(step, active)
        # The CSV's per-layer norms, before clipping as the monitor measures them: the demo's own
        # reads (one host sync a step), only when asked for.
        layer_norms = _layer_norms(self.layers) if self.metrics is not None else []
        grad_norm = self._observe(step, loss, components, tokens)
        self._optimizer_step(grad_norm)
        if self.metrics is not None:  # the demo's own reads (a host sync), only when asked for
            self._write_row(step, loss, grad_norm, lr, layer_norms)
        if self.progress.enabled:
            self.progress.update(step, float(loss.detach()), lr, float(grad_norm), force=step == args.steps - 1)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            self._evaluate(step)
        if "leak" in active:
            self.leaked.append(torch.ones(LEAK_BYTES_PER_STEP // 4))  # filled: the pages are resident
        step_started = time.perf_counter() - step_started
        if args.step_time:
            self.pace.wait(4 if "slow" in active else 1)
        else:
            if "slow" in active:
                time.sleep(3 * (step_started + args.step_delay))
            if args.step_delay:
                time.sleep(args.step_delay)

    def _set_learning_rate(self, step: int, active: set[str]) -> float:
        """The schedule's LR at ``step``, or a fault's."""
        lr = learning_rate_at(step, self.args.steps, self.args.lr, warmup=20)
        if "lr-high" in active:
            lr = 0.3
        elif "plateau" in active:
            lr = 1e-8
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _backward(self, step: int, active: set[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None, int]:
        """A batch's loss (and its components, multi-task), made NaN by the fault, backpropagated;
        the batch's token count."""
        args = self.args
        tokens, targets, noisy = self.corpus.batch_with_noise(args.batch_size)
        components = self.model.losses(tokens, targets, noisy) if args.multi_task else None
        # cast: sum() of tensors is a tensor; its type counts the int start it never returns here
        loss = cast(torch.Tensor, sum(components.values())) if components else self.model(tokens, targets)
        if "nan" in active and (args.guard == "off" or step == self.fault_step):
            loss = loss * float("nan")
            components = {name: value * float("nan") for name, value in components.items()} if components else None
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)  # measure and clip the real gradients
        else:
            loss.backward()
        return loss, components, tokens.numel()

    def _observe(
        self, step: int, loss: torch.Tensor, components: dict[str, torch.Tensor] | None, tokens: int
    ) -> torch.Tensor:
        """Clip through the monitor and observe the step; the gradient norm before clipping."""
        monitor = self.monitor
        grad_norm = monitor.clip_grad_norm_(self.model, 1.0)
        monitor.observe(
            step,
            loss=loss,
            optimizer=self.optimizer,
            grad_norm=grad_norm,
            model=self.model,
            tokens=tokens,
            epoch=step / 100,
            losses=components,
            grad_scaler=self.scaler,
        )
        return grad_norm

    def _optimizer_step(self, grad_norm: torch.Tensor) -> None:
        """The optimizer's step: through the guard, the GradScaler, or skipped when the fault made it NaN."""
        optimizer, scaler = self.optimizer, self.scaler
        if self.args.guard != "off":  # the guard decides, on the device; with a scaler, its step and update
            self.monitor.step(optimizer, grad_scaler=scaler)
        elif scaler is not None:  # skips a step whose gradients are not finite, lowers the scale
            scaler.step(optimizer)
            scaler.update()
        # The demo reads its own values for the progress bar and for skipping
        # non-finite steps (as GradScaler does): a host sync of the demo, not lossbeat's.
        elif "nan" not in self.faults or bool(torch.isfinite(grad_norm)):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _write_row(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, layer_norms: list[float]
    ) -> None:
        """The step's metrics.csv row (the demo's own host reads)."""
        assert self.metrics is not None
        now = time.perf_counter()
        took = "" if self.step_began is None else repr(now - self.step_began)
        self.step_began = now
        norms = ",".join(map(repr, layer_norms))
        self.metrics.write(
            f"{step},{float(loss.detach())!r},{float(grad_norm)!r},{lr!r},,{took},{anonymous_resident_bytes()!r},{norms}\n"
        )

    def _evaluate(self, step: int) -> None:
        """The held-out loss, in the monitor's "eval" phase; its metrics.csv row."""
        model, monitor = self.model, self.monitor
        with torch.no_grad(), monitor.phase("eval"):
            model.eval()
            eval_loss = model(*self.held_out)
            monitor.observe_eval(step, eval_loss)
            model.train()
        if self.metrics is not None:
            self.metrics.write(f"{step},,,,{float(eval_loss)!r},,{',' * len(self.layers)}\n")
            self.step_began = None  # the next step's time would hold the evaluation's
