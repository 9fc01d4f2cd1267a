"""Shared fixtures: real training loops, real monitors, real scrapes."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest
import torch

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, reason: str) -> None:
    """Skip outside CI; under CI=true a missing real component is a failure, never a skip."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true and a real component is missing: {reason}")
    pytest.skip(reason)


def require_binary(*names: str, install: str = "apt-get install prometheus prometheus-alertmanager") -> str:
    """Path of the first of ``names`` on PATH; missing fails under CI=true and skips elsewhere."""
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    require(False, f"{' or '.join(names)} not installed ({install})")
    raise AssertionError("unreachable")


def require_module(name: str) -> ModuleType:
    """The imported module ``name`` (an optional extra); missing fails under CI=true and skips elsewhere."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        require(False, f"{name} not importable ({e}); pip install -e .[test]")
        raise AssertionError("unreachable")


@pytest.fixture(autouse=True)
def _one_thread():
    # Small models on a 2-core machine: intra-op threads only add noise.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
