"""Following a TensorBoard run directory (or one event file) as a ``SummaryWriter`` writes it.

TensorBoard's own loader reads each file once, resuming at its end on the next poll (a record
half written is left for the next one). The newest event file of the directory is followed; a
newer one (a resumed or restarted run) is switched to after the rest of the old one is read.
The scalars of one step arrive as separate events: a step's record is handed on when an event
of another step arrives, or once nothing new came for a moment (``lossbeat.watch.runs.settle_seconds``).
Tags are mapped by name as the offline reader does (``train/loss``, ``train/grad_norm``, ``train/learning_rate``, ``eval/loss``...).
The HF Trainer's final summary (``train/train_runtime``, ``train/train_loss``, ...) says the run
ended: it completes the run, and its mean ``train_loss`` is no step's loss.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from lossbeat.logs.records import LogFormatError
from lossbeat.logs.tensorboard import _EPOCH, _EVAL, _GRAD, _LR, _TRAIN, event_files

__all__ = ["EventFollower", "records"]


class EventFollower:
    """``poll()`` returns the new scalars as ``(step, tag, value)`` in file order."""

    def __init__(self, path: str) -> None:
        try:
            from tensorboard import data_compat, dataclass_compat
            from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
            from tensorboard.compat.proto import event_pb2
            from tensorboard.util import tensor_util
        except ImportError:
            raise LogFormatError(
                f"{path}: following TensorBoard events needs the tensorboard package "
                "(pip install 'lossbeat[tensorboard]')"
            ) from None
        self._mods = (data_compat, dataclass_compat, RawEventFileLoader, event_pb2, tensor_util)
        self.path = path
        self.file: str | None = None
        self.files_seen = 0
        self._loader: Any = None  # tensorboard's RawEventFileLoader (untyped) of the open file
        self._metadata: dict[str, Any] = {}

    def _files(self) -> list[str]:
        if os.path.isdir(self.path):
            return event_files(self.path)
        return [self.path] if os.path.isfile(self.path) else []

    def _drain(self) -> list[tuple[int, str, float]]:
        data_compat, dataclass_compat, _, event_pb2, tensor_util = self._mods
        out = []
        for raw in self._loader.Load():
            event = data_compat.migrate_event(event_pb2.Event.FromString(raw))
            for migrated in dataclass_compat.migrate_event(event, self._metadata):
                if not migrated.HasField("summary"):
                    continue
                for v in migrated.summary.value:
                    plugin = v.metadata.plugin_data.plugin_name
                    array = tensor_util.make_ndarray(v.tensor) if v.HasField("tensor") else None
                    if (plugin and plugin != "scalars") or array is None or array.size != 1:
                        continue
                    out.append((int(migrated.step), v.tag, float(array.reshape(()))))
        return out

    def poll(self) -> list[tuple[int, str, float]]:
        files = self._files()
        if not files:
            return []
        out: list[tuple[int, str, float]] = []
        if files[-1] != self.file:
            if self._loader is not None:
                out += self._drain()  # the rest of the older file first
            self.file, self._metadata = files[-1], {}
            self._loader = self._mods[2](self.file)
            self.files_seen += 1
        return out + self._drain()


# What the HF Trainer logs once, at the end of training (TensorBoardCallback prefixes "train/").
_SUMMARY = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss")


def records(scalars: list[tuple[int, str, float]], pending: dict, flush: bool) -> Iterator[tuple]:
    """Group scalars by step: yields ``("train", step, loss, grad, lr, epoch)``, ``("eval", step,
    loss, group)`` and, for the HF Trainer's final summary, ``("complete", step)`` for each finished step. ``pending`` holds the step still open (``{"step": s,
    "values": {tag: v}}``); ``flush`` finishes it too."""
    for step, tag, value in scalars:
        if pending.get("step") is not None and step != pending["step"]:
            yield from _finish(pending)
        pending["step"] = step
        pending.setdefault("values", {})[tag] = value
    if flush and pending.get("step") is not None:
        yield from _finish(pending)


def _finish(pending: dict) -> Iterator[tuple]:
    step, values = pending["step"], pending.get("values", {})
    pending.clear()
    completed = any(t.rsplit("/", 1)[-1] == "train_runtime" for t in values)
    if completed:  # the summary's tags are no record (its train_loss is the run's mean)
        values = {t: v for t, v in values.items() if not (t.startswith("train/") and t[6:] in _SUMMARY)}
    train = next((t for t in _TRAIN if t in values), None)
    if train is None:
        train = min((t for t in values if "loss" in t.lower() and not _EVAL.match(t)), key=len, default=None)
    if train is not None:
        grad = next((values[t] for t in _GRAD if t in values), None)
        lr = next((values[t] for t in _LR if t in values), None)
        if lr is None:
            lr = next((v for t, v in values.items() if t.startswith("lr-")), None)
        epoch = next((values[t] for t in _EPOCH if t in values), None)
        yield ("train", step, values[train], grad, lr, epoch)
    for tag, value in values.items():
        if tag != train and (m := _EVAL.match(tag)):
            yield ("eval", step, value, m.group(1) or "")
    if completed:
        yield ("complete", step)
