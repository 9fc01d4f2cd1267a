"""Opening a log safely: refuse what is not a readable log before parsing, read lines with bounded memory.

Every refusal is a :class:`LogFormatError` whose message names the file and the
problem in one line (a directory, a FIFO, an empty file, binary data...).
"""

from __future__ import annotations

import codecs
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Iterator

from lossbeat.logs.records import LogFormatError, RecordBuilder

__all__ = [
    "Source",
    "open_source",
    "iter_lines",
    "text_lines",
    "clean_line",
    "unwrap_json",
    "parse_number",
    "compressed",
    "MAX_JSON_BYTES",
    "MAX_LINE_CHARS",
]

MAX_JSON_BYTES = 256 << 20
"""Largest JSON document read at once (trainer_state.json, golden values): json.load holds it all."""
MAX_LINE_CHARS = 1 << 16
"""Longer lines are not log records (embedded data, a binary blob): skipped and counted, read in chunks."""
SNIFF_BYTES = 1 << 20
"""Bytes read from the start of the file to detect its format and encoding."""

_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


@dataclass(frozen=True)
class Source:
    path: str
    size: int
    head_bytes: bytes
    encoding: str | None
    """The text codec, or None for binary data."""
    head: str
    """The first bytes decoded ('' for binary data)."""
    lines: Iterator[str] | None = None
    """A live file's lines as they are written (``lossbeat watch``): read instead of opening ``path``."""


def _fail(path: str, problem: str) -> LogFormatError:
    return LogFormatError(f"{path}: {problem}")


def open_source(path: str) -> Source:
    """Stat and sniff ``path``; raises :class:`LogFormatError` for anything that is not a readable file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise _fail(
            path,
            "is a directory, not a log file (a directory is read when it holds TensorBoard "
            f"event files, an MLflow run or a W&B run){_known_inside(path)}",
        )
    for test, kind in _KINDS:
        if test(st.st_mode):  # opening a FIFO would block until a writer comes
            raise _fail(path, f"is {kind}, not a regular file: save the log to a file first")
    if st.st_size == 0:
        raise _fail(path, "empty file")
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror or exc}") from None
    encoding = _encoding(head)
    text = head.decode(encoding, errors="replace") if encoding else ""
    if encoding and text:
        bad = text.count("\ufffd")
        if bad > max(8, len(text) // 20):
            encoding, text = None, ""  # mostly undecodable: binary, or an encoding we would only garble
    return Source(path, st.st_size, head, encoding, text)


_KNOWN_NAMES = ("trainer_state.json", "trainer_log.jsonl", "metrics.csv", "main.log", "progress.csv", "metrics.json")


def _known_inside(directory: str) -> str:
    try:
        names = set(os.listdir(directory))
    except OSError:
        return ""
    found = [n for n in _KNOWN_NAMES if n in names]
    return f"; it holds {', '.join(found)}: pass that file" if found else ""


_COMPRESSED = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"(\xb5/\xfd", "zstd"),
    (b"PK\x03\x04", "zip"),
)


def compressed(head: bytes) -> str | None:
    """The compression format of a file from its first bytes, or None."""
    return next((name for magic, name in _COMPRESSED if head.startswith(magic)), None)


def _encoding(head: bytes) -> str | None:
    for bom, name in _BOMS:
        if head.startswith(bom):
            return name
    if b"\x00" not in head:
        return "utf-8"
    sample = head[:4096]
    even, odd = sample[0::2], sample[1::2]
    # UTF-16 without a BOM (a Windows redirect): ASCII text has every other byte NUL.
    if odd and odd.count(0) > 0.9 * len(odd) and even.count(0) < 0.1 * len(even):
        return "utf-16-le"
    if even and even.count(0) > 0.9 * len(even) and odd.count(0) < 0.1 * len(odd):
        return "utf-16-be"
    return None


def iter_lines(src: Source, out: RecordBuilder) -> Iterator[str]:
    """The file's lines (split at \\n, \\r\\n and bare \\r: progress bars), counted in ``out``.

    Memory stays bounded: a line longer than :data:`MAX_LINE_CHARS` is read in
    chunks, skipped and counted; bytes that are not valid text are replaced and counted.
    """
    assert src.encoding is not None
    if src.lines is not None:  # a followed file: the follower bounds each line and holds the offset
        for n, line in enumerate(src.lines, 1):
            out.counts.read += 1
            out.where = f"line {n}"
            yield line
        return
    garbled = 0
    with open(src.path, encoding=src.encoding, errors="replace", newline="") as fh:
        n = 0
        while True:
            line = fh.readline(MAX_LINE_CHARS)
            if not line:
                break
            n += 1
            out.counts.read += 1
            out.where = f"line {n}"
            if len(line) >= MAX_LINE_CHARS and not line.endswith(("\n", "\r")):
                while True:  # drain the rest of this line without holding it
                    chunk = fh.readline(MAX_LINE_CHARS)
                    if not chunk or chunk.endswith(("\n", "\r")):
                        break
                out.skip(f"overlong lines (over {MAX_LINE_CHARS} characters)")
                continue
            if "\ufffd" in line:
                garbled += 1
            yield line
            if out.full:
                out.stop(f"line {n}")
                break
    if garbled:
        out.note(f"{garbled} lines hold bytes that are not valid {src.encoding} (replaced by U+FFFD)")


def parse_number(raw: object) -> tuple[float | None, bool]:
    """``(value, ok)``: a float from a number or numeric text; ``ok`` False when ``raw`` is not a number.

    Missing values (None, '', the strings 'none'/'null') are ``(None, True)``; 'nan' and
    'inf' words are the floats they name.
    """
    if raw is None:
        return None, True
    if isinstance(raw, bool):
        return None, False
    if isinstance(raw, (int, float)):
        return float(raw), True
    if isinstance(raw, str):
        text = raw.strip()
        if not text or text.lower() in ("none", "null"):
            return None, True
        try:
            return float(text), True
        except ValueError:
            return None, False
    return None, False


# --- printed logs as people have them: prefixed, coloured, wrapped in JSON --------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
_PREFIXES = (
    re.compile(r"^\d{1,5}:\s"),  # srun --label: "0: "
    re.compile(r"^\[(?:rank|default|global_rank|local_rank)?\s*\d+\]\s*:?\s*"),  # torchrun: "[rank0]:", "[default0]:"
    re.compile(r"^\[[^\]]{0,40}\d{1,2}:\d{2}:\d{2}[^\]]{0,40}\]\s*"),  # "[2024-05-01 12:00:00]", "[12:00:00 INFO]"
    re.compile(r"^\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\s*"),  # ISO timestamps
    re.compile(r"^\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\s+"),  # a bare time of day
    re.compile(
        r"^[IWEF]\d{4} \d{2}:\d{2}:\d{2}\.\d+\s+\d+\s+[\w.-]+:\d+\]\s*"
    ),  # absl / glog: "I0501 12:00:00.123 42 f.py:9] "
    # "[titan]", "[INFO]", Hydra's "[__main__][INFO] - ", DeepSpeed's "[loss_scaler.py:188:update_scale]"
    re.compile(r"^\[(?:[A-Za-z_][\w.-]{0,39}|[\w.-]+\.py:\d+(?::\w+)?)\](?:\s*-(?=\s))?\s*"),
    # logging's separators and level: "- root - INFO - ", "| INFO | ", "INFO:root:", "INFO     "
    re.compile(
        r"^(?:[-|:]\s*)?(?:[\w.\[\]<>]+\s*[-|:]\s*)?(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)"
        r"(?::[\w.]+:|\s*[-|:]\s+|\s+|$)"
    ),
)


def clean_line(line: str) -> str:
    """A printed line without its colour codes and the prefixes launchers and loggers add
    (``srun --label``'s ``0: ``, torchrun's ``[rank0]:`` / ``[default0]:``, timestamps, logging levels)."""
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    text = line.lstrip()
    for _ in range(8):
        for rx in _PREFIXES:
            m = rx.match(text)
            if m and m.end():
                text = text[m.end() :].lstrip()  # "0:       Train loss: ..." is the line "Train loss: ..."
                break
        else:
            break
    return text


_STREAM_KEYS = ("text", "data", "output", "message", "msg", "log", "line")


def _strings(value: object, found: list[str]) -> None:
    if isinstance(value, str):
        found.append(value)
    elif isinstance(value, list):
        for v in value:
            _strings(v, found)
    elif isinstance(value, dict):
        keys = [k for k in _STREAM_KEYS if k in value]
        for k in keys or list(value):
            _strings(value[k], found)


def unwrap_json(line: str) -> list[str] | None:
    """The printed lines inside a line of a JSON stream (a notebook's ``{"name": "stdout", "text": [...]}``,
    Kaggle's ``{"stream_name": "stdout", "data": "..."}``, a bare JSON string), or None when the line is not one."""
    text = line.strip().rstrip(",")
    if text.startswith(("[", ",")):
        text = text.lstrip("[,").strip()
    if text.endswith("]") and not text.endswith("\\]"):
        text = text[:-1].rstrip().rstrip(",")
    if not (text.startswith('"') and text.endswith('"')) and not (text.startswith('{"') and text.endswith("}")):
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    found: list[str] = []
    _strings(value, found)
    if not found:
        return None
    return [part for s in found for part in re.split(r"\r\n|\r|\n", s)]


def text_lines(src: Source, out: RecordBuilder) -> Iterator[str]:
    """:func:`iter_lines` for printed logs: lines inside JSON streams unwrapped, colour codes and
    launcher / logger prefixes removed (counted in the notes), each printed line yielded on its own."""
    wrapped = prefixed = 0
    for line in iter_lines(src, out):
        parts = unwrap_json(line) if ('"' in line and ("{" in line or line.lstrip().startswith('"'))) else None
        if parts is None:
            parts = [line]
        else:
            wrapped += 1
            out.counts.read += len(parts) - 1  # count the printed lines it holds
        for part in parts:
            clean = clean_line(part)
            if clean != part.lstrip() and clean:
                prefixed += 1
            yield clean
    if wrapped:
        out.note(f"{wrapped} lines are JSON stream entries (notebook or Kaggle output): their printed text was read")
    if prefixed:
        out.note(
            f"{prefixed} lines carry colour codes or launcher/logger prefixes (rank labels, timestamps, "
            "log levels): removed before reading"
        )


def head_lines(src: Source) -> list[str]:
    """The printed lines of the sniffed head, cleaned as :func:`text_lines` does (for detection)."""
    lines: list[str] = []
    for line in re.split(r"\r\n|\r|\n", src.head):
        parts = unwrap_json(line) if '"' in line else None
        lines.extend(clean_line(p) for p in (parts if parts is not None else [line]))
        if len(lines) >= 40000:
            break
    return lines
