"""Screenshots of the exporter's status page (docs/img/status-*.png) on live `lossbeat demo` runs.

    make screenshots                      # all of them: a healthy run and each demo fault
    python3 scripts/status_screenshots.py [healthy nan explode lr-high plateau vanish leak slow]

Needs chromium, chromium-driver and selenium (scripts/setup.sh --servers). Each run: a demo
(seed 0, fault at step 120 but for ``slow``) on a free port, the page opened in headless chromium at 1300 px
wide, a screenshot of the whole page once it shows the step of ``RUNS`` (230 of 300 steps, later
for the faults the diagnosis needs longer windows to see), before the demo's end. The curves are the same from one run to the next (the demo is seeded);
the uptime, timing-dependent counters and the step a screenshot lands on vary by a few steps.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.by import By

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img"
# (the demo's steps, the fault's step, the step a screenshot waits for): by default 110 steps past
# the fault, 70 before the end (the demo closes its exporter when it finishes). Longer for the
# faults whose checks need longer windows: `plateau`, a trend over two windows of at least 100
# steps, both past the fault from step 320; `leak`, the memory slope over 60 samples, one per
# 10 steps (4 MiB a step reaches 5% of 24 GiB over ~50 samples); `slow`, blocks of 50 timed steps
# after 100 of warm-up against the run's level from the normal blocks before the fault.
RUNS = {"plateau": (450, 120, 380), "leak": (800, 120, 700), "slow": (400, 250, 310)}
DEFAULT_RUN = (300, 120, 230)
# Every demo fault (lossbeat.demo.FAULTS), after a healthy run.
SHOTS = ("healthy", "nan", "explode", "lr-high", "plateau", "vanish", "leak", "slow")
MAX_BYTES = 300_000  # a screenshot over this is re-encoded with a palette (Pillow, when installed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shoot(fault: str, driver: webdriver.Chrome) -> Path:
    port = free_port()
    steps, fault_step, target = RUNS.get(fault, DEFAULT_RUN)
    args = [
        sys.executable,
        "-m",
        "lossbeat",
        "demo",
        "--port",
        str(port),
        "--steps",
        str(steps),
        "--step-delay",
        "0.05",
        "--fault-step",
        str(fault_step),
        "--seed",
        "0",
        "--no-progress",
    ]
    if fault != "healthy":
        args += ["--fault", fault]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "exporter"), os.environ.get("PYTHONPATH")])),
    }
    demo = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                driver.get(f"http://127.0.0.1:{port}/")
                break
            except Exception:
                time.sleep(1)
        while time.monotonic() < deadline:
            text = driver.find_element(By.ID, "run-step").text
            if text.isdigit() and int(text) >= target:
                break
            time.sleep(0.5)
        time.sleep(2.5)  # one more refresh
        path = OUT / f"status-{fault}.png"
        # The whole page, not the window: the content's height through the DevTools protocol.
        height = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]["height"]
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1300, "height": int(height) + 20, "deviceScaleFactor": 1, "mobile": False},
        )
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(shot["data"]))
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        shrink(path)
        return path
    finally:
        demo.terminate()
        demo.wait(timeout=30)


def shrink(path: Path) -> None:
    """Re-encode a screenshot over MAX_BYTES with a 256-colour palette (the page is flat colours)."""
    if path.stat().st_size <= MAX_BYTES:
        return
    try:
        from PIL import Image
    except ImportError:
        print(f"{path}: {path.stat().st_size} bytes (install Pillow to shrink it)", file=sys.stderr)
        return
    with Image.open(path) as image:
        image.convert("RGB").quantize(256).save(path, optimize=True)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1300,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path="/usr/bin/chromedriver"), options=options)
    try:
        for fault in sys.argv[1:] or SHOTS:
            path = shoot(fault, driver)
            print(f"{path} ({path.stat().st_size // 1000} KB)", flush=True)
    finally:
        driver.quit()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
