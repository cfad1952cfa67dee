"""The capture file: a JSON header line, then one JSON line per ZMQ message (sequence number, topic
and the msgpack payload in base64), exactly as received, so import can decode it later."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

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
    """(sequence number, payload) per message; CaptureError names the line that is wrong."""
    path = Path(path)
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise CaptureError(f"{path}: no such file") from None
    with f:
        try:
            header = json.loads(f.readline(MAX_LINE) or "null")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CaptureError(f"{path}: line 1 is not a capture header") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise CaptureError(f"{path}: not a kvviz vLLM capture (line 1 must name format {FORMAT!r})")
        if header.get("version") != VERSION:
            raise CaptureError(f"{path}: capture version {header.get('version')!r} is not supported")
        for n, line in enumerate(f, start=2):
            try:
                rec = json.loads(line)
                yield int(rec["seq"]), base64.b64decode(rec["payload"], validate=True)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError):
                raise CaptureError(f"{path}: line {n} is not a captured message") from None
