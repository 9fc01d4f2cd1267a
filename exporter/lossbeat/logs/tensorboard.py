"""TensorBoard event files, read with TensorBoard's own loader (the ``tensorboard`` extra).

Events are read one at a time (bounded memory) and never downsampled. Scalar tags
are mapped to the record fields by name (the HF ``TensorBoardCallback``'s
``train/loss``, Lightning's ``train_loss`` / ``lr-AdamW``, ...); the tags not
read are listed in the notes.
"""

from __future__ import annotations

import bisect
import os
import re
from typing import Any, Callable, Collection, Iterator

from lossbeat.logs.records import LogFormatError, RecordBuilder

__all__ = ["parse_tensorboard", "event_files", "is_event_file"]

_TRAIN = ("train/loss", "train_loss", "train_loss_step", "loss", "training_loss", "train/lm_loss", "loss/train")
_GRAD = ("train/grad_norm", "grad_norm", "train/global_grad_norm")
_LR = ("train/learning_rate", "learning_rate", "train/lr", "lr")
_EPOCH = ("train/epoch", "epoch")
_EVAL = re.compile(r"^(?:eval|val|valid|validation)[/_](?:(.+)_)?loss(?:_epoch)?$|^loss/(?:val|eval|validation)$")


def is_event_file(path: str, head: bytes = b"") -> bool:
    return "tfevents" in os.path.basename(path) or b"brain.Event:" in head[:64]


def event_files(directory: str) -> list[str]:
    """The event files directly inside ``directory``, oldest first (their names start with a timestamp)."""
    try:
        names = sorted(n for n in os.listdir(directory) if "tfevents" in n)
    except OSError as exc:
        raise LogFormatError(f"{directory}: cannot list: {exc.strerror or exc}") from None
    return [os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))]


def _loader() -> Callable[[str], Iterator[tuple[Any, int]]] | None:
    """A generator of ``(event, bytes consumed so far)`` for one file, or None without tensorboard.

    TensorBoard's own pieces, as its ``EventFileLoader`` chains them, with the byte count kept so
    that a file cut short (a crash while writing) can be told from a complete one.
    """
    try:
        from tensorboard import data_compat, dataclass_compat
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
        from tensorboard.compat.proto import event_pb2
    except ImportError:
        return None

    def events(path: str) -> Iterator[tuple[Any, int]]:  # Any: a tensorboard Event (protobuf, untyped)
        consumed = 0
        metadata: dict[str, Any] = {}
        for raw in RawEventFileLoader(path).Load():
            consumed += len(raw) + 16  # TFRecord framing: length (8), its CRC (4), data, data CRC (4)
            event = data_compat.migrate_event(event_pb2.Event.FromString(raw))
            for migrated in dataclass_compat.migrate_event(event, metadata):
                yield migrated, consumed

    return events


def _tensor_util():
    from tensorboard.util import tensor_util

    return tensor_util


def _pick(tags: Collection[str], names: tuple[str, ...], prefix: str | None = None) -> str | None:
    hit = next((n for n in names if n in tags), None)
    if hit is None and prefix:
        hit = next((t for t in tags if t.startswith(prefix)), None)
    return hit


def parse_tensorboard(paths: list[str], out: RecordBuilder) -> None:
    """Scalars of one or more event files (in order): a train record per step with a train loss."""
    loader = _loader()
    if loader is None:
        raise LogFormatError(
            f"{out.path}: a TensorBoard event file: reading it needs the tensorboard "
            "package (pip install 'lossbeat[tensorboard]')"
        )
    out.counts.unit = "events"
    tensor_util = _tensor_util()
    ordered: dict[str, list[tuple[int, int, float]]] = {}  # tag -> (arrival, step, value), in file order
    latest: dict[str, dict[int, float]] = {}  # tag -> step -> latest value (grad norm, LR, epoch lookups)
    skipped_tags: set[str] = set()
    arrival = 0
    for path in paths:
        consumed = 0
        try:
            for event, consumed in loader(path):  # noqa: B007 (read after the loop: how far it got)
                out.counts.read += 1
                if not event.HasField("summary"):
                    out.skip("events without scalars (file version, graphs, metadata)")
                    continue
                for v in event.summary.value:
                    plugin = v.metadata.plugin_data.plugin_name
                    array = tensor_util.make_ndarray(v.tensor) if v.HasField("tensor") else None
                    if (plugin and plugin != "scalars") or array is None or array.size != 1:
                        skipped_tags.add(v.tag)
                        out.skip("values that are not scalars (histograms, images, text)")
                        continue
                    value = float(array.reshape(()))
                    arrival += 1
                    ordered.setdefault(v.tag, []).append((arrival, event.step, value))
                    latest.setdefault(v.tag, {})[event.step] = value
                if arrival >= 4 * out.max_records:
                    out.stop(f"event {out.counts.read} of {path}")
                    break
        except Exception as exc:
            if not ordered:
                raise LogFormatError(
                    f"{path}: not a readable TensorBoard event file ({type(exc).__name__}: {exc})"
                ) from None
            out.note(f"{path}: reading stopped at event {out.counts.read} ({type(exc).__name__}: {exc})")
        if out.counts.stopped_at:
            break
        size = os.path.getsize(path)
        if consumed < size:
            out.note(
                f"{path}: the last {size - consumed} bytes are not a complete event "
                "(the file was cut short while being written): not read"
            )
    if out.counts.read == 0:
        raise LogFormatError(f"{out.path}: no TensorBoard event could be read (not an event file, or a corrupt one)")
    train = _pick(latest, _TRAIN)
    if train is None:
        candidates = [t for t in latest if "loss" in t.lower() and not _EVAL.match(t)]
        train = min(candidates, key=len) if candidates else None
    grad = _pick(latest, _GRAD)
    lr = _pick(latest, _LR, "lr-")
    epoch = _pick(latest, _EPOCH)
    evals = {t: (m.group(1) or "") for t in latest if t != train and (m := _EVAL.match(t))}
    out.field_names(sorted(latest))  # the task profile is named from the tags (val_MAE, eval/accuracy, ...)
    used = {train, grad, lr, epoch, *evals}
    unused = sorted(t for t in latest if t not in used) + sorted(skipped_tags - set(latest))
    out.note(f"tags read: loss {train!r}, grad norm {grad!r}, LR {lr!r}, eval {sorted(evals) or None}")
    if unused:
        out.note(f"tags not read: {', '.join(unused[:12])}{', ...' if len(unused) > 12 else ''}")
    if train is None:
        out.note("no train-loss tag found")
    merged: list[tuple[int, int, float, str | None]] = (
        [(a, s, v, None) for a, s, v in ordered.get(train, [])] if train else []
    )
    merged += [(a, s, v, group) for tag, group in evals.items() for a, s, v in ordered[tag]]
    merged.sort(key=lambda item: item[0])
    lr_steps = sorted(latest[lr]) if lr else []
    for _, step, value, group in merged:  # file order, so that runs split where the step goes back
        out.where = f"step {step}"
        if group is None:
            # the LR holds until its next value (a LearningRateMonitor may log at other steps)
            i = bisect.bisect_right(lr_steps, step)
            rate = latest[lr][lr_steps[i - 1]] if i and lr else None  # i > 0: there are LR steps, so lr
            out.train(
                step, value, latest[grad].get(step) if grad else None, rate, latest[epoch].get(step) if epoch else None
            )
        else:
            out.eval(step, value, group)
