"""The JSONL capture: a JSON header line, then one JSON line per ZMQ message exactly as received
(replica, publisher restart count, sequence number, topic, capture clock and the msgpack payload in
base64), so import can decode it later.

Version 2 names the replicas in the header and each message's replica on its line; version 1 (one
endpoint, no replica or restart) is still read: its messages belong to replica-0, and a sequence
number that goes back counts as a publisher restart.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, BinaryIO

import msgspec

from ..util.jsonio import parse_json
from .events import CaptureError

FORMAT, VERSION = "kvviz-vllm-capture", 2
READABLE = (1, 2)
MAX_LINE = 64 << 20
DEFAULT_REPLICA = "replica-0"


@dataclass(frozen=True, slots=True)
class Message:
    """One KV-event batch as a publisher sent it, and where it came from."""
    replica: str
    restart: int  # how many times this replica's publisher had restarted (its seq went back) before it
    seq: int
    topic: str
    payload: bytes
    received: float | None = None  # the capture's clock (seconds since the epoch)


class CaptureWriter:
    """Messages appended as lines; a replica list in the header says what was captured."""

    def __init__(self, path: str | Path, replicas: dict[str, str]):
        self.f = open(path, "w", encoding="utf-8")
        self.f.write(json.dumps({"format": FORMAT, "version": VERSION, "replicas": replicas}) + "\n")
        self.count = 0

    def add(self, m: Message, batch: object = None) -> None:
        """Append a message as received (the decoded batch, if given, is not needed: import decodes)."""
        self.f.write(json.dumps({"replica": m.replica, "restart": m.restart, "seq": m.seq, "topic": m.topic,
                                 "received": m.received, "payload": base64.b64encode(m.payload).decode()}) + "\n")
        self.count += 1

    def close(self) -> None:
        self.f.close()


class CaptureReader:
    """(where, message) per line, `where` naming the file and line; CaptureError names a line that is
    wrong. Read as bytes line by line, so another encoding or an endless line is a refusal.
    `bytes_read` says how far it has got; `body` is where the line after the header starts; `version` is
    the header's."""

    def __init__(self, path: str | Path):
        self.path, self.bytes_read, self.body, self.version = Path(path), 0, 0, VERSION
        self.replicas = self._header()

    def _open(self) -> BinaryIO:
        try:
            return open(self.path, "rb")
        except FileNotFoundError:
            raise CaptureError(f"{self.path}: no such file") from None
        except OSError as e:
            raise CaptureError(f"{self.path}: cannot read it ({e.strerror or e})") from None

    def _header(self) -> dict[str, str]:
        """The replicas the header names (none for version 1); a file that is not a capture is refused."""
        path = self.path
        with self._open() as f:
            header = parse_json(next(self._lines(f), (1, b"null"))[1], f"{path}: line 1", CaptureError,
                                one_line=True)
            self.body = f.tell()
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise CaptureError(f"{path}: not a kvviz vLLM capture (line 1 must name format {FORMAT!r})")
        if header.get("version") not in READABLE:
            raise CaptureError(f"{path}: capture version {header.get('version')!r} is not supported")
        self.version = header["version"]
        named = header.get("replicas")
        return {str(k): str(v) for k, v in named.items()} if isinstance(named, dict) else {}

    def __iter__(self) -> Iterator[tuple[str, Message]]:
        return self.between(self.body, None)

    def between(self, start: int, end: int | None) -> Iterator[tuple[str, Message]]:
        """The messages of the lines from byte `start` (a line's first, past the header) to `end` (None: the
        file's end). From the middle of a file, each `where` counts the lines before `start` only when it
        is said, and a line that does not say its publisher's restarts (counted from the lines before) is
        Unsplittable."""
        last: dict[str, tuple[int, int]] = {}  # replica -> (restart, seq), for files that do not say restarts
        self.bytes_read = start
        counted = _LinesBefore(self.path, start)
        lazy = start > self.body
        skipped = 0 if lazy else counted.count()  # the header's lines: a few bytes to count
        with self._open() as f:
            f.seek(start)
            def line_of(n: int) -> object:
                return _LineOf(counted, n) if lazy else f"{self.path}: line {n + skipped}"

            for n, line in self._lines(f, None if end is None else end - start, line_of):
                where = line_of(n)
                try:
                    rec = _LINE.decode(line)
                except msgspec.MsgspecError:  # parsed again to say what is wrong
                    rec = _line(line, where)
                restart = rec.restart
                if restart is None:
                    if lazy:
                        raise Unsplittable(where)
                    before = last.get(rec.replica)
                    restart = 0 if before is None else before[0] + (rec.seq < before[1])
                last[rec.replica] = (restart, rec.seq)
                yield where, Message(rec.replica, restart, rec.seq, rec.topic, rec.payload, rec.received)

    def _lines(self, f: BinaryIO, size: int | None = None,
               line_of: Callable[[int], object] | None = None) -> Iterator[tuple[int, bytes]]:
        """Numbered non-blank lines, each at most MAX_LINE bytes, up to `size` bytes (None: all); `line_of`
        names the n-th as an error says it (by default: line n of the file)."""
        n = 0
        left = -1 if size is None else size
        while left and (line := f.readline(MAX_LINE + 1)):
            n += 1
            left -= len(line)
            self.bytes_read += len(line)
            if len(line) > MAX_LINE:
                where = line_of(n) if line_of else f"{self.path}: line {n}"
                raise CaptureError(f"{where} is longer than {MAX_LINE >> 20} MiB")
            if line.strip():
                yield n, line


class Unsplittable(Exception):  # noqa: N818 (no error: the import reads the file in one process instead)
    """A line read from the middle of a file that leaves its restarts to be counted from the lines before."""


class _LinesBefore:
    """How many lines precede byte `start`, counted once, when a line after it is named."""

    def __init__(self, path: Path, start: int):
        self.path, self.start, self._count = path, start, None

    def count(self) -> int:
        if self._count is None:
            self._count, left = 0, self.start
            with open(self.path, "rb") as f:
                while left > 0 and (block := f.read(min(left, 1 << 24))):
                    self._count += block.count(b"\n")
                    left -= len(block)
        return self._count


class _LineOf:
    """'PATH: line N' for the n-th line after a _LinesBefore, said as text only when an error names it."""
    __slots__ = ("before", "n")

    def __init__(self, before: _LinesBefore, n: int):
        self.before, self.n = before, n

    def __str__(self) -> str:
        return f"{self.before.path}: line {self.before.count() + self.n}"


def read_capture(path: str | Path) -> CaptureReader:
    """Every message of a capture, in order (see CaptureReader)."""
    return CaptureReader(path)


class _Line(msgspec.Struct):
    """A captured message's line, decoded in C (the payload's base64 too)."""
    seq: int
    payload: bytes
    replica: Annotated[str, msgspec.Meta(min_length=1)] = DEFAULT_REPLICA
    restart: Annotated[int, msgspec.Meta(ge=0)] | None = None
    topic: str = ""
    received: float | None = None


_LINE = msgspec.json.Decoder(_Line)


class _Head(msgspec.Struct):
    """Only whose a line is: the other fields are skipped unparsed."""
    replica: str = DEFAULT_REPLICA


_HEAD = msgspec.json.Decoder(_Head)


def _line(line: bytes, where: str) -> _Line:
    """A line the fast decoder refused, parsed again by hand: this names what is wrong, or accepts
    what JSON allows and msgspec does not (a NaN clock)."""
    try:
        rec = parse_json(line, where, CaptureError, one_line=True)
    except CaptureError as e:
        if not line.endswith(b"\n") and "not valid JSON" in str(e):
            raise CaptureError(f"{where} is cut off: the capture ended in the middle of it (it was still being "
                               "written, or the capture was killed); remove that line to import the rest") from None
        raise
    if not isinstance(rec, dict):
        rec = {}
    seq, payload, replica = rec.get("seq"), rec.get("payload"), rec.get("replica", DEFAULT_REPLICA)
    restart, topic, received = rec.get("restart"), rec.get("topic", ""), rec.get("received")
    if (not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(payload, str)
            or not isinstance(replica, str) or not replica or not isinstance(topic, str)
            or not (received is None or isinstance(received, int | float))
            or not (restart is None or isinstance(restart, int) and restart >= 0)):
        raise CaptureError(f"{where} is not a captured message "
                           '({"seq": integer, "payload": base64 text, "replica": name, ...})')
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise CaptureError(f"{where}: the payload is not base64") from None
    return _Line(seq, data, replica, restart, topic, received)
