"""The capture file: a JSON header line, then one JSON line per ZMQ message (sequence number, topic
and the msgpack payload in base64), exactly as received, so import can decode it later."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ..jsonio import parse_json
from .events import CaptureError

FORMAT, VERSION = "kvviz-vllm-capture", 1
MAX_LINE = 64 << 20


class CaptureWriter:
    def __init__(self, path: str | Path, endpoint: str):
        self.f = open(path, "w", encoding="utf-8")
        self.f.write(json.dumps({"format": FORMAT, "version": VERSION, "endpoint": endpoint}) + "\n")
        self.count, self.gaps, self.last = 0, [], None

    def add(self, seq: int, topic: bytes, payload: bytes) -> None:
        if self.last is not None and seq > self.last + 1:
            self.gaps.append((self.last + 1, seq - 1))
        self.last = seq if self.last is None else max(self.last, seq)
        self.f.write(json.dumps({"seq": seq, "topic": topic.decode("utf-8", "replace"),
                                 "payload": base64.b64encode(payload).decode()}) + "\n")
        self.count += 1

    def close(self) -> None:
        self.f.close()


def read_capture(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(sequence number, payload) per message; CaptureError names the line that is wrong. Read as
    bytes line by line, so another encoding or an endless line is a refusal, not a traceback."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CaptureError(f"{path}: no such file") from None
    except OSError as e:
        raise CaptureError(f"{path}: cannot read it ({e.strerror or e})") from None
    with f:
        lines = _lines(f, path)
        header = parse_json(next(lines, (1, b"null"))[1], f"{path}: line 1", CaptureError, one_line=True)
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise CaptureError(f"{path}: not a kvviz vLLM capture (line 1 must name format {FORMAT!r})")
        if header.get("version") != VERSION:
            raise CaptureError(f"{path}: capture version {header.get('version')!r} is not supported")
        for n, line in lines:
            rec = parse_json(line, f"{path}: line {n}", CaptureError, one_line=True)
            seq, payload = (rec.get("seq"), rec.get("payload")) if isinstance(rec, dict) else (None, None)
            if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(payload, str):
                raise CaptureError(f"{path}: line {n} is not a captured message "
                                   '({"seq": integer, "payload": base64 text})')
            try:
                yield seq, base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise CaptureError(f"{path}: line {n}: the payload is not base64") from None


def _lines(f: BinaryIO, path: Path) -> Iterator[tuple[int, bytes]]:
    """Numbered non-blank lines, each at most MAX_LINE bytes."""
    n = 0
    while line := f.readline(MAX_LINE + 1):
        n += 1
        if len(line) > MAX_LINE:
            raise CaptureError(f"{path}: line {n} is longer than {MAX_LINE >> 20} MiB")
        if line.strip():
            yield n, line
