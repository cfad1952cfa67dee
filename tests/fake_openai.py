"""A stand-in OpenAI completions server whose time to first token the test sets: what the timing
audit's tests measure when the question is the audit's, not a model's.

Not a test module. It streams `/v1/completions` like a real server (server-sent events, usage with
prompt and cached tokens). Its "prefill" sleeps `per_token` seconds for each prompt token not in its
cache; its cache is none, one for everyone, or one per API key, and keeps a request's prompt only
when the request asks for at least `cache_after` tokens (transformers serve caches nothing of a
request that ends in its prefill step: 2). `tail` keeps it busy for that long after each reply (a
server finishing the last step, a client redrawing), so the next request waits: the leftover work an
asymmetric schedule puts on misses only. `usage` is what its replies report: full (cached tokens
too), zero (cached tokens always 0, whatever it served), counts (no prompt_tokens_details), timings
(counts, with the cached tokens said only as llama-server says them, `timings.cache_n` on the last
chunk) or none.
`max_tokens` refuses (HTTP 400) a request asking for more. `fail_after` answers every request after
that many with `fail`: an HTTP status ("429", "500"), "break" (the stream breaks off mid-reply),
"silent" (a stream that ends with nothing in it) or "close" (the connection closed unanswered).
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
    cache_after: int = 1  # a request's prompt is cached only when it asks for at least this many tokens
    usage: str = "full"  # full | zero | counts | timings | none
    max_tokens: int | None = None  # refuse requests asking for more
    fail_after: int | None = None
    fail: str = "429"  # an HTTP status | break | silent | close


class FakeOpenAI:
    """Started on construction on a free port; `url` is the API's base; `close` stops it."""

    def __init__(self, behaviour: Behaviour):
        self.behaviour, self.lock = behaviour, threading.Lock()
        self.cached: set[tuple[str, str]] = set()
        self.requests, self.busy_until = 0, 0.0
        self.log: list[tuple[str, str, int]] = []  # each request's API key, prompt and max_tokens
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
            self.log.append((key.removeprefix("Bearer "), body["prompt"], body["max_tokens"]))
            time.sleep(max(0.0, self.busy_until - time.monotonic()))
            failing = b.fail_after is not None and self.requests > b.fail_after
            if failing and b.fail.isdigit():
                return _refuse(h, int(b.fail), "over capacity")
            if b.max_tokens is not None and body["max_tokens"] > b.max_tokens:
                return _refuse(h, 400, f"max_tokens must be at most {b.max_tokens}")
            if failing and b.fail == "close":
                h.close_connection = True
                return
            words = body["prompt"].split()
            scope = {"off": None, "global": "", "per-key": key}[b.cache]
            hit = scope is not None and (scope, body["prompt"]) in self.cached
            cached = len(words) if hit else 0
            time.sleep(b.per_token * (len(words) - cached))
            if scope is not None and body["max_tokens"] >= b.cache_after:
                self.cached.add((scope, body["prompt"]))
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.end_headers()
            if failing and b.fail == "silent":  # a stream with nothing in it
                h.wfile.write(b"data: [DONE]\n\n")
                return
            h.wfile.write(_event({"choices": [{"index": 0, "text": " x", "finish_reason": None}]}))
            h.wfile.flush()
            if failing:  # break: no end, no [DONE]
                h.wfile.write(b"data: {not json\n\n")
                h.wfile.flush()
                h.close_connection = True
                return
            last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
            if b.usage == "timings":
                last["timings"] = {"cache_n": cached, "prompt_n": len(words) - cached, "predicted_n": 1}
            h.wfile.write(_event(last))
            if b.usage != "none":
                counts = {"prompt_tokens": len(words), "completion_tokens": 1, "total_tokens": len(words) + 1}
                if b.usage not in ("counts", "timings"):
                    counts["prompt_tokens_details"] = {"cached_tokens": cached if b.usage == "full" else 0}
                h.wfile.write(_event({"choices": [], "usage": counts}))
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


def _refuse(h: BaseHTTPRequestHandler, status: int, message: str) -> None:
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.end_headers()
    h.wfile.write(json.dumps({"error": {"message": message, "type": "fake"}}).encode())


def _event(chunk: dict) -> bytes:
    frame = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake", **chunk}
    return f"data: {json.dumps(frame)}\n\n".encode()
