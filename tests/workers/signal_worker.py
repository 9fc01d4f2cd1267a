"""A training script that test_faults.py interrupts with SIGINT or SIGTERM mid-step.

    python tests/workers/signal_worker.py with|exit-handler

Prints ``READY <port>`` once serving, and ``CLOSED <observed> <applied> <pending>`` after
the monitor's with-block has closed it (however the loop ended), after ``CLOSE_SECONDS <s>``,
the time close() took.
"""

from __future__ import annotations

import signal
import sys
import time

import torch

from lossbeat import Monitor, MonitorConfig


def main() -> None:
    # What Ctrl-C in a terminal does. A shell that starts the suite in the background
    # (`nohup make test &`) leaves SIGINT ignored in every child, and Python then installs no
    # KeyboardInterrupt handler: the worker would train on through the signal this test sends.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.argv[1] == "exit-handler":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the pattern docs/reliability.md shows
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    x, y = torch.randn(256, 64), torch.randn(256, 1)
    observed = 0
    monitor = Monitor(MonitorConfig(port=0, addr="127.0.0.1"))
    close = monitor.close

    def timed_close(*args, **kwargs):
        # The time close() itself takes (flush, linger), on this process's clock: what a hang
        # in lossbeat would stretch, unlike the interpreter's start and exit on a busy machine.
        started = time.monotonic()
        try:
            return close(*args, **kwargs)
        finally:
            print(f"CLOSE_SECONDS {time.monotonic() - started:.3f}", flush=True)

    monitor.close = timed_close
    try:
        with monitor:
            step = 0
            while True:
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                monitor.observe(step, loss=loss, model=model)
                observed += 1
                # Plain SGD by hand: a torch.optim optimizer imports torch._dynamo (1.8 CPU-s a
                # process); what is interrupted here is the step, not the optimizer.
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 1e-3 * p.grad
                        p.grad = None
                if step == 20:
                    print(f"READY {monitor.port}", flush=True)
                step += 1
    finally:
        print(f"CLOSED {observed} {monitor.state.steps_total} {len(monitor._transfer.pending)}", flush=True)


if __name__ == "__main__":
    main()
