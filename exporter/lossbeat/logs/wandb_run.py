"""W&B run folders: the history in the run's binary ``run-<id>.wandb`` file, read without wandb.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic ``0xBEE1``, version 0), then
LevelDB-log framing (32 KiB blocks; each chunk a 7-byte header: CRC32C, length, type FULL /
FIRST / MIDDLE / LAST) around protobuf ``Record`` messages. Only three messages are read, with a
small protobuf wire-format decoder: ``Record.history`` (field 2: ``HistoryRecord`` items, each
``key`` or ``nested_key`` and ``value_json``, or the typed ``integer`` / ``number``; and its
``step``), ``Record.exit`` (field 18: the exit code), and nothing else. So no wandb import (a
large package with a service binary) is needed to read a run, live or finished; the tests write
the runs with the real wandb and check the field numbers against its own protobuf definitions.
CRCs are not checked (a torn last record is simply incomplete). Each history row goes to the
table reader (:mod:`lossbeat.logs.tables`): the loss, LR, grad-norm and eval keys chosen by name
(``train/loss``, ``train/learning_rate``, ``eval/loss``; HF's ``train/global_step`` as the step, else
``_step``), or by ``--map``. Torch-free.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterator, Literal

from lossbeat.logs.records import LogFormatError, RecordBuilder
from lossbeat.logs.tables import TableReader

__all__ = ["is_wandb", "parse_wandb", "wandb_file", "RecordStream", "decode_record", "WANDB_HEADER"]

WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32768
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_HISTORY, _EXIT = 2, 18
_MAX_ROW_KEYS = 512


def wandb_file(path: str) -> str | None:
    """The ``.wandb`` file of a run folder, a ``wandb`` folder (its latest run), or the file itself."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path if path.endswith(".wandb") or _has_header(path) else None
    if not os.path.isdir(path):
        return None
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    files = [n for n in names if n.endswith(".wandb") and os.path.isfile(os.path.join(path, n))]
    if files:
        return os.path.join(path, files[-1])
    latest = os.path.join(path, "latest-run")
    if os.path.isdir(latest):
        return wandb_file(latest)
    runs = [n for n in names if n.startswith(("run-", "offline-run-")) and os.path.isdir(os.path.join(path, n))]
    # run folders are named by their start time: the last is the latest
    runs.sort(key=lambda n: n.removeprefix("offline-"))
    return wandb_file(os.path.join(path, runs[-1])) if runs else None


def _has_header(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == WANDB_HEADER[:4]
    except OSError:
        return False


def is_wandb(path: str, head: bytes | None = None) -> bool:
    if head is not None:
        return head.startswith(WANDB_HEADER[:4])
    return os.path.isdir(path) and wandb_file(path) is not None


class RecordStream:
    """LevelDB-log framing, fed bytes as they arrive: :meth:`feed` returns the whole records completed."""

    def __init__(self) -> None:
        self.offset = 0
        """Bytes of the file consumed (framing included)."""
        self._buf = b""
        self._partial: bytes | None = None
        self.bad = 0
        """Chunks whose type is unknown or out of order (a torn file): dropped."""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data
        pos = 0
        records: list[bytes] = []
        if self.offset == 0:
            if len(buf) < len(WANDB_HEADER):
                self._buf = buf
                return records
            if buf[:4] != WANDB_HEADER[:4]:
                raise LogFormatError("not a W&B run file (no ':W&B' header)")
            pos = len(WANDB_HEADER)
        while True:
            at = self.offset + pos
            left = _BLOCK - at % _BLOCK
            if left < _CHUNK_HEADER:  # the block's trailer: zero padding
                if len(buf) - pos < left:
                    break
                pos += left
                continue
            if len(buf) - pos < _CHUNK_HEADER:
                break
            length = int.from_bytes(buf[pos + 4 : pos + 6], "little")
            kind = buf[pos + 6]
            if len(buf) - pos < _CHUNK_HEADER + length:
                break
            body = buf[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
            pos += _CHUNK_HEADER + length
            if kind == _FULL:
                records.append(body)
            elif kind == _FIRST:
                self._partial = body
            elif kind == _MIDDLE and self._partial is not None:
                self._partial += body
            elif kind == _LAST and self._partial is not None:
                records.append(self._partial + body)
                self._partial = None
            elif kind == 0 and length == 0:
                pos += left - _CHUNK_HEADER  # zeros to the block's end (preallocated)
            else:
                self.bad += 1
        self.offset += pos
        self._buf = buf[pos:]
        return records


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


# Any: the wire type says which (an int for a varint, wire 0; bytes otherwise), and every caller checks it.
def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message: ints for varints, bytes otherwise."""
    value: int | bytes
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"wire type {wire}")
        yield number, wire, value


def _item(buf: bytes) -> tuple[str, object] | None:
    key, nested, value = "", [], None
    for number, wire, raw in _fields(buf):
        if number == 1 and wire == 2:
            key = raw.decode("utf-8", "replace")
        elif number == 2 and wire == 2:
            nested.append(raw.decode("utf-8", "replace"))
        elif number == 5 and wire == 0:  # sint64
            value = (raw >> 1) ^ -(raw & 1)
        elif number == 6 and wire == 1:
            value = struct.unpack("<d", raw)[0]
        elif number == 16 and wire == 2:
            try:
                value = json.loads(raw.decode("utf-8", "replace"))
            except (ValueError, RecursionError):
                value = raw.decode("utf-8", "replace")
    name = key or "/".join(nested)
    return (name, value) if name else None


History = tuple[dict[str, object], int | None]
"""A history record: (row, step)."""


def decode_record(buf: bytes) -> tuple[Literal["history"], History] | tuple[Literal["exit"], int] | None:
    """('history', (row, step)) or ('exit', exit code) for the records read; None for the others."""
    for number, wire, raw in _fields(buf):
        if number == _HISTORY and wire == 2:
            row: dict[str, object] = {}
            step: int | None = None
            for n, w, sub in _fields(raw):
                if n == 1 and w == 2 and len(row) < _MAX_ROW_KEYS:
                    item = _item(sub)
                    if item is not None and isinstance(item[1], (int, float, str)) and not isinstance(item[1], bool):
                        row[item[0]] = item[1]
                elif n == 2 and w == 2:
                    step = next((v for k, wt, v in _fields(sub) if k == 1 and wt == 0), 0)
            return "history", (row, step)
        if number == _EXIT and wire == 2:
            code = next((v for k, wt, v in _fields(raw) if k == 1 and wt == 0), 0)
            return "exit", code - (1 << 64) if code >= 1 << 63 else code
    return None


class WandbRows:
    """Records of a ``.wandb`` file into a table reader; ``exit`` is the exit code once the run ended."""

    def __init__(self, out: RecordBuilder) -> None:
        self.out = out
        self.reader = TableReader(out)
        self.stream = RecordStream()
        self.exit: int | None = None
        self.history = 0

    def feed(self, data: bytes) -> None:
        out = self.out
        for record in self.stream.feed(data):
            out.counts.read += 1
            try:
                decoded = decode_record(record)
            except (ValueError, IndexError, struct.error):
                out.skip("records that do not decode (a torn write?)")
                continue
            if decoded is None:
                out.skip("records other than history (config, summary, system metrics, output)")
                continue
            if decoded[0] == "exit":
                self.exit = decoded[1]
                if decoded[1] == 0:
                    out.complete("the W&B run exited with code 0")
                continue
            row, step = decoded[1]
            self.history += 1
            if step is not None and "_step" not in row:
                row["_step"] = step
            self.reader.row(row, f"history row {self.history}")


def parse_wandb(path: str, out: RecordBuilder) -> None:
    """A run's ``.wandb`` file (a run folder, a ``wandb`` folder's latest run, or the file)."""
    file = wandb_file(path)
    if file is None:
        raise LogFormatError(f"{path}: no W&B run file (run-<id>.wandb) here")
    out.counts.unit = "records"
    rows = WandbRows(out)
    try:
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 20):
                rows.feed(chunk)
                if out.full:
                    out.stop(out.where)
                    break
    except OSError as exc:
        raise LogFormatError(f"{file}: cannot read: {exc.strerror or exc}") from None
    except LogFormatError as exc:
        raise LogFormatError(f"{file}: {exc}") from None
    rows.reader.finish()
    if file != path:
        out.note(f"W&B run file read: {file}")
    if rows.stream.bad:
        out.note(f"{rows.stream.bad} chunks of the file's framing were not whole (a torn write): dropped")
    if rows.exit is not None:
        out.note(f"the W&B run exited with code {rows.exit}")
    else:
        out.note("no exit record: the W&B run was still running or was killed")
