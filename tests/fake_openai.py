"""A stand-in OpenAI completions server whose time to first token the test sets: what the timing
audit's tests measure when the question is the audit's, not a model's.

Not a test module. It streams `/v1/completions` like a real server (server-sent events, usage with
prompt and cached tokens). Its "prefill" sleeps `per_token` seconds for each prompt token not in its
cache; its cache is none, one for everyone, or one per API key. `tail` keeps it busy for that long
after each reply (a server finishing the last step, a client redrawing), so the next request waits:
the leftover work an asymmetric schedule puts on misses only. `fail_after` answers every request after
that many with `fail_status` (0: the stream breaks off mid-reply instead).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Behaviour:
    cache: str = "off"  # off | global | per-key
    per_token: float = 0.0  # seconds of prefill per uncached prompt token
    tail: float = 0.0  # seconds of leftover work after each reply
    fail_after: int | None = None
    fail_status: int = 429


class FakeOpenAI:
    """Started on construction on a free port; `url` is the API's base; `close` stops it."""

    def __init__(self, behaviour: Behaviour):
        self.behaviour, self.lock = behaviour, threading.Lock()
        self.cached: set[tuple[str, str]] = set()
        self.requests, self.busy_until = 0, 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.answer(self, body, self.headers.get("Authorization", ""))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, h: BaseHTTPRequestHandler, body: dict, key: str) -> None:
        b = self.behaviour
        with self.lock:  # one request at a time, like a server with one engine
            self.requests += 1
            time.sleep(max(0.0, self.busy_until - time.monotonic()))
            failing = b.fail_after is not None and self.requests > b.fail_after
            if failing and b.fail_status:
                h.send_response(b.fail_status)
                h.send_header("Content-Type", "application/json")
                h.end_headers()
                h.wfile.write(json.dumps({"error": {"message": "over capacity", "type": "fake"}}).encode())
                return
            words = body["prompt"].split()
            scope = {"off": None, "global": "", "per-key": key}[b.cache]
            hit = scope is not None and (scope, body["prompt"]) in self.cached
            cached = len(words) if hit else 0
            time.sleep(b.per_token * (len(words) - cached))
            if scope is not None:
                self.cached.add((scope, body["prompt"]))
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.end_headers()
            h.wfile.write(_event({"choices": [{"index": 0, "text": " x", "finish_reason": None}]}))
            h.wfile.flush()
            if failing:  # the stream breaks off: no end, no [DONE]
                h.wfile.write(b"data: {not json\n\n")
                h.wfile.flush()
                h.close_connection = True
                return
            h.wfile.write(_event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
            h.wfile.write(_event({"choices": [], "usage": {
                "prompt_tokens": len(words), "completion_tokens": 1, "total_tokens": len(words) + 1,
                "prompt_tokens_details": {"cached_tokens": cached}}}))
            h.wfile.write(b"data: [DONE]\n\n")
            h.wfile.flush()
            self.busy_until = time.monotonic() + b.tail

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeOpenAI:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _event(chunk: dict) -> bytes:
    frame = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake", **chunk}
    return f"data: {json.dumps(frame)}\n\n".encode()
