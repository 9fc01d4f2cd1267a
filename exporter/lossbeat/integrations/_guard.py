"""Routing a framework's optimizer step through the monitor's guard (``guard="skip"``/``"stop"``).

A framework calls ``optimizer.step()`` itself; the callbacks put their own ``step`` on the
instance (the class is untouched) for the run, and take it off at its end. While the guard
applies a step the original is put back, so the guard's ``optimizer.step()`` is the real one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

from lossbeat.monitor import Monitor, NullMonitor

__all__ = ["guard_mode", "settings_guard", "refuse_guard", "Patch", "ScheduleGate"]

_ABSENT = object()


def guard_mode(monitor: Monitor | NullMonitor | None) -> str:
    """The guard of a running monitor: its config's ``guard`` ("off" for a NullMonitor)."""
    return getattr(getattr(monitor, "config", None), "guard", "off")


def settings_guard(monitor: Monitor | NullMonitor | None, settings: Mapping[str, Any]) -> tuple[str, str]:
    """(guard, guard_schedule) a callback will run with, known before training starts."""
    config = getattr(monitor, "config", None)
    if monitor is not None:
        return getattr(config, "guard", "off"), getattr(config, "guard_schedule", "advance")
    if settings.get("enabled") is False:
        return "off", "advance"
    return settings.get("guard", "off"), settings.get("guard_schedule", "advance")


def refuse_guard(
    monitor: Monitor | NullMonitor | None, settings: Mapping[str, Any], callback: str, instead: str
) -> None:
    """Raise at once for a guard that ``callback`` cannot apply (it never sees the optimizer step)."""
    guard = settings_guard(monitor, settings)[0]
    if guard != "off":
        raise ValueError(
            f"guard: the {callback} callback observes the trainer's metrics but does not step its optimizer, "
            f"so guard={guard!r} would never withhold a step; use guard='off' ({instead})"
        )


class Patch:
    """``obj.<name>`` replaced by ``replacement`` on the instance until :meth:`restore`.

    ``original`` is what the attribute resolved to before: the class's bound method, or an
    instance attribute someone else put there (torch's LR schedulers wrap ``optimizer.step``),
    which :meth:`restore` puts back as it was.
    """

    def __init__(self, obj: Any, name: str, replacement: Callable[..., Any]) -> None:
        self.obj, self.name = obj, name
        self._saved = vars(obj).get(name, _ABSENT)
        self.original: Callable[..., Any] = getattr(obj, name)
        scheduled = hasattr(self.original, "_wrapped_by_lr_sched")

        def patched(*args: Any, **kwargs: Any) -> Any:
            if scheduled:  # what torch's LR-scheduler wrapper records (private): a step came first
                obj._opt_called = True
            return replacement(*args, **kwargs)

        if scheduled:  # the scheduler's check that nothing replaced the step after it wrapped it
            patched._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self.replacement = patched
        setattr(obj, name, patched)

    @contextlib.contextmanager
    def unpatched(self) -> Iterator[None]:
        """The original in place while the guard calls it."""
        setattr(self.obj, self.name, self.original)
        try:
            yield
        finally:
            setattr(self.obj, self.name, self.replacement)

    def restore(self) -> None:
        if self._saved is _ABSENT:
            vars(self.obj).pop(self.name, None)
        else:
            setattr(self.obj, self.name, self._saved)


class ScheduleGate:
    """Passed to ``Monitor.step`` as its scheduler: records whether the guard would step the
    schedule (an applied step, or any step with ``guard_schedule="advance"``), for a framework
    that steps its scheduler itself."""

    stepped = False

    def step(self) -> None:
        self.stepped = True
