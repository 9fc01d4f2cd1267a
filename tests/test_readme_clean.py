"""The README's commands that write files leave a fresh clone as it was (`git status` empty).

In a `git clone` of this repository: `lossbeat generate` as the README shows it (run from a
user's own folder, with the documented `--output-dir`), the benchmark runner (its `--smoke`
plan: the README's `--quick` path in seconds), `lossbeat analyze` with a plot, and
`make generate` on unchanged thresholds. Only the folders the user named may change.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require, require_module

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def _readme_command(pattern: str) -> list[str]:
    """The README's shell command (continuation lines joined; in a bash block, else inline
    code) whose text matches ``pattern``."""
    lines = [
        line
        for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S)
        for line in block.replace("\\\n", " ").splitlines()
    ]
    for command in lines + re.findall(r"`([^`\n]+)`", README):
        command = command.split("  #")[0].strip()
        if re.search(pattern, command):
            return shlex.split(command)
    raise AssertionError(f"no README command matches {pattern!r}")


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    git = shutil.which("git")
    require(git is not None and (REPO / ".git").exists(), "git and a git checkout are needed to clone it")
    target = tmp_path_factory.mktemp("readme") / "clone"
    subprocess.run([git, "clone", "-q", str(REPO), str(target)], check=True, timeout=120)
    return target


def _env(clone: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(clone / "exporter"), "PYTHONDONTWRITEBYTECODE": "1"}
    return env


def _run(args: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{args} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    )
    return result


def _status(clone: Path) -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone, capture_output=True, text=True, check=True
    ).stdout


def test_readme_commands_leave_the_clone_clean(clone, tmp_path):
    env = _env(clone)
    assert _status(clone) == ""

    # `lossbeat generate ...` as documented, from the user's own folder.
    generate = _readme_command(r"^lossbeat generate ")
    assert "--output-dir" in generate
    user = tmp_path / "my-project"
    user.mkdir()
    thresholds = generate[generate.index("--thresholds") + 1]
    (user / thresholds).write_text("gradients:\n  explosion: 30\n", encoding="utf-8")
    _run([sys.executable, "-m", "lossbeat", *generate[1:]], user, env)
    output = generate[generate.index("--output-dir") + 1]
    assert sorted(p.name for p in user.iterdir()) == sorted([thresholds, output])
    assert "above 30 and" in (user / output / "rules.yml").read_text()  # the custom explosion ceiling

    # The same command without a folder refuses, writing nothing, even from inside the checkout.
    refused = subprocess.run(
        [sys.executable, "-m", "lossbeat", "generate", "--thresholds", str(user / thresholds)],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and "--output-dir" in refused.stderr

    # The benchmarks, as the README runs them (from the checkout), in their seconds-long plan.
    bench = _readme_command(r"benchmarks/run\.py")
    assert bench[:2] == ["python", "benchmarks/run.py"]
    committed = (clone / "benchmarks" / "RESULTS.md").read_text()
    _run([sys.executable, "benchmarks/run.py", "--smoke"], clone, env, timeout=900)
    results = json.loads((clone / "benchmarks" / "results" / "results.json").read_text())
    assert results["observe_us"] and (clone / "benchmarks" / "results" / "RESULTS.md").is_file()
    assert (clone / "benchmarks" / "RESULTS.md").read_text() == committed

    # `lossbeat analyze` of a finished run, with its plot going where it is told.
    require_module("matplotlib")
    log = tmp_path / "trainer_state.json"
    history = [
        {"step": s, "loss": 2.0 - s / 100, "grad_norm": 1.0, "learning_rate": 1e-4, "epoch": s / 50}
        for s in range(1, 121)
    ]
    log.write_text(json.dumps({"log_history": history}), encoding="utf-8")
    analyzed = _run(
        [sys.executable, "-m", "lossbeat", "analyze", str(log), "--json", "--plot", str(tmp_path / "run.png")],
        clone,
        env,
    )
    assert len(json.loads(analyzed.stdout)) == 1
    assert (tmp_path / "run.png").stat().st_size > 0

    # The repository's own regeneration, on unchanged thresholds, changes nothing.
    _run(["make", "generate", f"PYTHON={sys.executable}"], clone, env)

    assert _status(clone) == "", "README commands changed the checkout"
