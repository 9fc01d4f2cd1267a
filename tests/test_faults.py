"""Faults inside and around the monitor never reach the training loop: a collector that
raises, a full disk under the log file, a layer that disappears, a checkpoint resume, a
monitor closed twice, a fork (the child must not serve), SIGINT and SIGTERM mid-step."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import require
from helpers.scrape import flat, metrics_text

from lossbeat import Monitor, MonitorConfig

WORKER = Path(__file__).resolve().parent / "workers" / "signal_worker.py"


def scrape(port: int) -> dict[str, float]:
    return flat(metrics_text(port))


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


def train_steps(monitor: Monitor, model: torch.nn.Module, steps, loss_override=None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for step in steps:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        monitor.observe(step, loss=loss if loss_override is None else loss_override, optimizer=optimizer, model=model)
        optimizer.step()


def test_a_collector_that_raises_is_counted_logged_once_and_the_scrape_still_answers(caplog):
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1")) as m:
        train_steps(m, small_model(), range(5))
        m.state.health = {("no component",): 0}  # what a bug in our own rendering looks like
        with caplog.at_level(logging.ERROR, logger="lossbeat"):
            for _ in range(5):
                samples = scrape(m.port)
                assert samples['training_exporter_errors_total{where="collect"}'] > 0
        assert samples['training_exporter_errors_total{where="collect"}'] == 5
        assert len([r for r in caplog.records if "rendering metrics" in r.getMessage()]) == 1
        m.state.health = {}
        train_steps(m, small_model(), range(5, 10))  # training went on all along
        assert scrape(m.port)["training_steps_total"] == 10


def test_a_full_disk_under_the_log_file_never_reaches_training(capsys):
    require(Path("/dev/full").exists(), "no /dev/full on this system")  # Linux has it; CI=true fails without
    handler = logging.FileHandler("/dev/full")  # every write fails with ENOSPC, as on a full disk
    logger = logging.getLogger("lossbeat")
    logger.addHandler(handler)
    # Independent of what earlier tests left: the warnings are emitted, and logging reports
    # a failing handler on stderr (its default).
    level, raise_exceptions, disabled = logger.level, logging.raiseExceptions, logger.disabled
    logger.setLevel(logging.WARNING)
    logger.disabled = False
    logging.raiseExceptions = True
    try:
        with Monitor(MonitorConfig(port=0, addr="127.0.0.1")) as m:
            train_steps(m, small_model(), range(30), loss_override=float("nan"))  # each NaN is a log line
            assert m.state.steps_total == 30 and m.state.nonfinite_loss_total == 30
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
        logging.raiseExceptions = raise_exceptions
        try:
            handler.close()
        except OSError:
            pass
    assert "No space left on device" in capsys.readouterr().err  # logging reported it; training went on


def test_a_layer_that_disappears_mid_run():
    model = small_model()
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1")) as m:
        train_steps(m, model, range(5))
        assert "2" in m.state.layer_norms
        model[2] = torch.nn.Identity()  # the 8x8 layer is gone (pruned, swapped for an adapter...)
        model[4] = torch.nn.Linear(8, 1)
        train_steps(m, model, range(5, 250))
        assert m.state.steps_total == 250 and sum(m.state.errors.values()) == 0
        assert "2" not in m.state.layer_norms  # regrouped: no series for a layer that no longer exists


def test_resume_from_a_checkpoint_steps_go_back():
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1")) as m:
        model = small_model()
        train_steps(m, model, range(0, 100))
        before = scrape(m.port)
        train_steps(m, model, range(60, 90))  # resumed from the step-60 checkpoint
        after = scrape(m.port)
        assert after["training_step"] == 89.0
        assert after["training_steps_total"] == before["training_steps_total"] + 30  # counters never go back
        assert sum(m.state.errors.values()) == 0


def test_close_twice_and_the_port_is_released():
    m = Monitor(MonitorConfig(port=0, addr="127.0.0.1"))
    port = m.port
    m.observe(0, loss=1.0)
    m.close()
    m.close()
    assert m.closed
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free again: a restarted run can take its port
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_forked_child_never_serves():
    """Forked children (DataLoader workers) inherit the listening socket but no serving thread;
    whatever they do with their copy of the monitor, scrapes are answered by the parent."""
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1")) as m:
        m.observe(7, loss=1.0)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: record a step the parent never saw, then linger
            try:
                os.close(read_end)
                m.observe(999_999, loss=5.0)
                names = [t.name for t in __import__("threading").enumerate()]
                os.write(write_end, b"serving" if "lossbeat-metrics" in names else b"idle")
                time.sleep(4)
            finally:
                os._exit(0)
        os.close(write_end)
        assert os.read(read_end, 16) == b"idle"
        os.close(read_end)
        try:
            steps = {scrape(m.port)["training_step"] for _ in range(40)}
        finally:
            os.waitpid(pid, 0)
        assert steps == {7.0}


def test_dataloader_workers_during_scrapes():
    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            time.sleep(0.01)
            return torch.tensor([float(i)])

    with Monitor(MonitorConfig(port=0, addr="127.0.0.1")) as m:
        loader = torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=2, multiprocessing_context="fork")
        for step, batch in enumerate(loader):
            m.observe(step, loss=float(batch.mean()))
            assert scrape(m.port)["training_step"] == float(step)
        assert m.state.steps_total == 16


def run_worker(tmp_path, mode: str, sig: signal.Signals) -> tuple[int, str, float]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY"):
                break
        port = int(lines[-1].split()[1])
        assert scrape(port)["training_steps_total"] > 0
        sent = time.monotonic()
        proc.send_signal(sig)
        try:
            out, _ = proc.communicate(timeout=600)  # a hang guard only: the verdict is on close()'s own time
        except subprocess.TimeoutExpired:  # hung: SIGABRT makes faulthandler print every thread's stack
            proc.send_signal(signal.SIGABRT)
            out, _ = proc.communicate(timeout=60)
            pytest.fail(
                f"the worker did not exit within 600 s of {sig.name}; its output and stacks:\n"
                + "".join(lines)
                + out[-20000:],
                pytrace=False,
            )
        return proc.returncode, "".join(lines) + out, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "mode, sig, code",
    [
        ("with", signal.SIGINT, -signal.SIGINT),  # KeyboardInterrupt through the with-block
        ("exit-handler", signal.SIGTERM, 143),  # the usual SIGTERM -> sys.exit() handler
        ("with", signal.SIGTERM, -signal.SIGTERM),  # Python's default: killed, nothing runs, nothing hangs
    ],
)
def test_signals_mid_step_shut_down_cleanly(tmp_path, mode, sig, code):
    returncode, output, _ = run_worker(tmp_path, mode, sig)
    assert returncode == code, output
    if sig == signal.SIGTERM and code < 0:
        return
    # close() neither hangs nor lingers for a scraper that will never come back (its own clock).
    (close_seconds,) = [float(line.split()[1]) for line in output.splitlines() if line.startswith("CLOSE_SECONDS")]
    assert close_seconds < 10, output
    # The with-block closed the monitor: every observed step was applied, nothing left pending.
    closed = [line for line in output.splitlines() if line.startswith("CLOSED")]
    assert closed, output
    _, observed, applied, pending = closed[0].split()
    assert observed == applied and pending == "0", closed[0]
