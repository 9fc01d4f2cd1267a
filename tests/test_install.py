"""Installed, not cloned: the wheel in a fresh virtual environment, used from an empty folder.

Builds the wheel from this working tree, installs it (not editable) into a new venv that reuses
the running interpreter's torch (system or virtualenv), reports its version, analyzes a real log, then, in an empty folder and with nothing of the repository on the path:
generates the full set for a custom thresholds file and checks it with promtool and amtool,
starts the local stack, pages with `lossbeat demo --fault nan`, sees the page in
`lossbeat stack status`, and stops the stack.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import require, require_binary
from e2e.e2e_harness import free_port
from helpers.promtool_runs import changed_rule_tests

REPO = Path(__file__).resolve().parents[1]
# What a copy of the working tree leaves out: VCS data, build outputs, caches, local results.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "results", ".venv", "*.pyc"
)


def _run(args: list[str], cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(map(str, args))} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


def _site_packages() -> list[str]:
    """The folders this interpreter imports installed packages from (system or virtualenv)."""
    import site
    import sysconfig

    found = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        found.append(site.getusersitepackages())
    return [p for p in dict.fromkeys(found) if Path(p).is_dir()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """(the venv's bin folder, an environment without this checkout on the path)."""
    root = tmp_path_factory.mktemp("install")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    source = root / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=_NOT_SOURCES)
    # setuptools >= 70.1 builds wheels itself; without it here, pip fetches it (build isolation).
    offline = importlib.util.find_spec("setuptools") is not None
    require(offline or bool(os.environ.get("CI")), "setuptools is needed to build the wheel offline")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            *(["--no-build-isolation"] if offline else []),
            "-w",
            str(root / "dist"),
            str(source),
        ],
        cwd=root,
        env=env,
    )
    (wheel,) = (root / "dist").glob("lossbeat-*.whl")
    venv = root / "venv"
    # --without-pip: no ensurepip needed (Debian splits it into python3-venv); this pip installs into it.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root, env=env)
    bin_dir = venv / "bin"
    # torch, numpy, prometheus-client and PyYAML are those of the interpreter running the tests,
    # wherever it keeps them: --system-site-packages would reach the base interpreter's, which
    # from inside a virtualenv is not where they are. A .pth file only adds the folders to the
    # path (their own .pth files, such as this checkout's editable install, are not run).
    purelib = _run(
        [str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root, env
    ).stdout.strip()
    Path(purelib, "tests-site-packages.pth").write_text("\n".join(_site_packages()) + "\n", encoding="utf-8")
    # --no-deps: torch, numpy, prometheus-client and PyYAML come from the folders the .pth file adds.
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(bin_dir / "python"),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        cwd=root,
        env=env,
    )
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return bin_dir, env


def test_the_wheel_not_the_checkout_is_imported(installed, tmp_path):
    bin_dir, env = installed
    where = _run([str(bin_dir / "python"), "-c", "import lossbeat; print(lossbeat.__file__)"], tmp_path, env)
    path = Path(where.stdout.strip()).resolve()
    assert path.is_relative_to((bin_dir.parent / "lib").resolve()), path
    assert not path.is_relative_to(REPO.resolve())
    assert (path.parent / "py.typed").is_file()  # type checkers read the installed package's annotations
    shipped = path.parent / "shipped"
    for name in ("alertmanager.yml", "runbooks.md"):
        assert (shipped / name).is_file() and not (shipped / name).is_symlink(), name
        assert (shipped / name).read_text() == (
            REPO / {"alertmanager.yml": "alerting", "runbooks.md": "docs"}[name] / name
        ).read_text()
    # The status page is package data: the installed exporter serves it at /.
    page = _run(
        [
            str(bin_dir / "python"),
            "-c",
            "from lossbeat.exposition.status import page_html; import sys; sys.stdout.write(page_html().decode())",
        ],
        tmp_path,
        env,
    )
    assert page.stdout == (REPO / "exporter/lossbeat/exposition/status_page.html").read_text()


def test_the_installed_command_reports_its_version_and_analyzes_a_log(installed, tmp_path):
    from lossbeat import __version__

    bin_dir, env = installed
    lossbeat = str(bin_dir / "lossbeat")
    assert _run([lossbeat, "--version"], tmp_path, env).stdout.strip() == f"lossbeat {__version__}"
    # A real run whose loss is NaN from its first step (tests/data/real-logs/real-logs-2/SOURCES.md),
    # copied into the empty folder: a DANGER exits 1, and the report names the NaN.
    log = tmp_path / "metrics.csv"
    shutil.copy(REPO / "tests/data/real-logs/real-logs-2/lightning-timeseries-gan-nan-from-step0-metrics.csv", log)
    result = subprocess.run(
        [lossbeat, "analyze", log.name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "DANG nonfinite" in result.stdout and "320 non-finite loss values" in result.stdout


def test_from_an_empty_folder_generate_check_and_page(installed, tmp_path):
    promtool = require_binary("promtool")
    amtool = require_binary("amtool", install="apt-get install prometheus-alertmanager")
    require_binary("prometheus")
    require_binary("alertmanager", "prometheus-alertmanager")
    bin_dir, env = installed
    lossbeat = str(bin_dir / "lossbeat")
    work = tmp_path / "empty"
    work.mkdir()
    (work / "my-thresholds.yaml").write_text("gradients:\n  explosion: 40\nalerts:\n  stalled_after: 3m\n")

    # The full set for the user's numbers, in the folder they name.
    _run(
        [
            lossbeat,
            "generate",
            "--thresholds",
            "my-thresholds.yaml",
            "--output-dir",
            "monitoring",
            "--runbook-url-base",
            "https://wiki.example.com/runbooks",
        ],
        work,
        env,
    )
    out = work / "monitoring"
    for name in (
        "rules.yml",
        "alertmanager.yml",
        "runbooks.md",
        "grafana/lossbeat-overview.json",
        "grafana/lossbeat-layers.json",
        "kubernetes/prometheusrule.yaml",
        "kubernetes/grafana-dashboards-configmap.yaml",
    ):
        assert (out / name).is_file(), name
    rules_text = (out / "rules.yml").read_text()
    assert "above 40 and" in rules_text and "https://wiki.example.com/runbooks#traininglossnan" in rules_text
    checked = _run([promtool, "check", "rules", "rules.yml"], out, env)
    assert "SUCCESS" in checked.stdout
    assert len(list((out / "tests").glob("*.yml"))) >= 16
    # The files these thresholds changed (the others are the checked-in ones, run by test_rules.py).
    tests = changed_rule_tests(out, runbook_page="https://wiki.example.com/runbooks")
    assert {"tests/traininggradientexplosion.yml", "tests/trainingstalled.yml"} <= set(tests)
    tested = _run([promtool, "test", "rules", *tests], out, env)
    assert tested.stdout.count("SUCCESS") == len(tests)
    assert "SUCCESS" in _run([amtool, "check-config", "alertmanager.yml"], out, env).stdout

    # The local stack, from the package alone; a NaN run pages and the page arrives.
    stack_dir, exporter_port = work / "stack", free_port()
    _run(
        [
            lossbeat,
            "stack",
            "up",
            "--dir",
            str(stack_dir),
            "--prometheus-port",
            str(free_port()),
            "--alertmanager-port",
            str(free_port()),
            "--receiver-port",
            str(free_port()),
            "--targets",
            f"127.0.0.1:{exporter_port}",
            "--scrape-interval",
            "1s",
            "--thresholds",
            "my-thresholds.yaml",
        ],
        work,
        env,
        timeout=600,
    )
    demo = None
    try:
        demo = subprocess.Popen(
            [
                lossbeat,
                "demo",
                "--fault",
                "nan",
                "--port",
                str(exporter_port),
                "--steps",
                "60",
                "--fault-step",
                "10",
                "--batch-size",
                "8",
                "--no-progress",
                "--linger",
                "240",
            ],
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline, status = time.monotonic() + 240, ""
        notifications = stack_dir / "notifications.jsonl"
        while time.monotonic() < deadline:
            # `stack status` (a process) only once the receiver has written the page down.
            if notifications.is_file() and "TrainingLossNaN" in notifications.read_text():
                status = _run([lossbeat, "stack", "status", "--dir", str(stack_dir)], work, env).stdout
                if "paged: TrainingLossNaN" in status:
                    break
            assert demo.poll() is None, f"the demo exited early: {demo.stderr.read()[-2000:]}"
            time.sleep(1)
        line = next((row for row in status.splitlines() if "paged: TrainingLossNaN" in row), None)
        assert line, f"no page arrived within 240 s:\n{status}\n{(stack_dir / 'alertmanager.log').read_text()[-2000:]}"
        assert "firing" in line and "receiver page" in line
        assert (stack_dir / "notifications.jsonl").read_text().count("TrainingLossNaN") >= 1
        # The paged alert's runbook link leads somewhere: the receiver serves the runbooks.
        rules = yaml.safe_load((stack_dir / "rules.yml").read_text())
        url = next(
            r["annotations"]["runbook_url"]
            for g in rules["groups"]
            for r in g["rules"]
            if r.get("alert") == "TrainingLossNaN"
        )
        page, _, anchor = url.partition("#")
        with urllib.request.urlopen(page, timeout=10) as resp:
            assert f'id="{anchor}"' in resp.read().decode()
    finally:
        if demo is not None:
            demo.terminate()
            demo.wait(timeout=60)
        down = subprocess.run(
            [lossbeat, "stack", "down", "--dir", str(stack_dir)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert down.returncode == 0, down.stderr
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    assert not [row for row in ps.splitlines() if str(stack_dir) in row and " Z" not in row], "stack processes survived"
    # The folder holds what the user asked for, and the stack folder it named: nothing else.
    assert sorted(p.name for p in work.iterdir()) == ["monitoring", "my-thresholds.yaml", "stack"]
