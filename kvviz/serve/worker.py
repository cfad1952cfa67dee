"""The server's engine: one engine driver on a background thread that every HTTP request joins between
steps, so concurrent clients share one pool and one batch as in a real server.

Handlers submit a request and read its events from an asyncio queue: text as it is generated, then
the end (finish reason and usage). The thread holds the model's turn only while requests run, so a
CLI run or an app session on the same machine can take it between bursts.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..analysis.run_metrics import LiveMetrics
from ..catalogue.faults import defences_with
from ..engine import Driver, Engine, EngineConfig, StepRecord
from ..engine.sampler import request_generator
from ..engine.workload import RequestSpec, Workload
from ..models import LoadedModel
from ..oracle import ProvenanceOracle
from ..store import RunStore
from ..util.ids import new_run_id
from .recording import ServedRecording


class QueueFull(RuntimeError):
    """More requests in flight than the server takes (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The server is stopping and takes no new request (HTTP 503)."""


@dataclass(frozen=True)
class Submission:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    salt: str | None = None  # the request's prefix-cache namespace (None: shared with every unsalted request)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Failed:
    message: str  # the engine stopped: every request in flight ends with this


@dataclass(frozen=True)
class Done:
    finish_reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class _Flight:
    sub: Submission
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    sent: str = ""  # text delivered so far
    output: list[int] = field(default_factory=list)

    def put(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class ServerStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    peak_batch: int = 0  # most requests computed in one step


class EngineWorker:
    """Owns the loop thread. `submit` from any thread with a running asyncio loop; `close` stops it."""

    def __init__(self, model: LoadedModel, config: EngineConfig, max_in_flight: int = 256, oracle: bool = False,
                 fault: str | None = None, record: RunStore | None = None,
                 on_step: Callable[[StepRecord], None] | None = None):
        """oracle: run the leak oracle on every step (config.compute must be inspect); fault: serve with
        this catalogue fault injected; record: record the served traffic into this store as one run;
        on_step: hears every step on the engine's thread (a KV-event publisher)."""
        self.on_step = on_step
        self.model, self.engine = model, Engine(model, config, defences_with(fault, config.block_size))
        self.max_in_flight = max_in_flight
        self.oracle = ProvenanceOracle() if oracle else None
        self.recording = ServedRecording(record, model, config, fault, self.oracle) if record is not None else None
        self.metrics, self.stats = LiveMetrics(keep_history=False), ServerStats()
        self.findings: Counter[str] = Counter()  # the leak oracle's findings so far, by kind
        self.error: str | None = None  # why the engine stopped, if it did
        self._lock = threading.Condition()
        self._pending: deque[tuple[str, Submission]] = deque()
        self._cancelled: set[str] = set()
        self._resets: list[Future] = []
        self._flights: dict[str, _Flight] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvviz-engine", daemon=True)
        self._thread.start()

    # -- handlers' side ------------------------------------------------------------------------
    def check(self, sub: Submission) -> None:
        """Refuse what the pool or the model cannot hold (WorkloadError), before it is queued."""
        self.engine.resolve(Workload([RequestSpec("request", prompt_ids=sub.prompt_ids, max_new_tokens=sub.max_tokens)],
                                     self.engine.config))

    def submit(self, sub: Submission) -> tuple[str, asyncio.Queue]:
        """Queue a checked request; its events arrive on the returned queue (Delta..., then Done)."""
        with self._lock:
            if self._closing or self.error is not None:
                raise ShuttingDown(self.error or "the server is shutting down")
            if len(self._flights) >= self.max_in_flight:
                raise QueueFull(f"{len(self._flights)} requests in flight, the server takes {self.max_in_flight}")
            rid = new_run_id()
            self._flights[rid] = _Flight(sub, asyncio.Queue(), asyncio.get_running_loop())
            self._pending.append((rid, sub))
            self._lock.notify()
            return rid, self._flights[rid].events

    def cancel(self, rid: str) -> None:
        """The client went away: stop generating for it and free its blocks."""
        with self._lock:
            if rid in self._flights:
                self._cancelled.add(rid)
                self._lock.notify()

    def reset_prefix_cache(self) -> Future:
        """Ask the engine's thread to forget the prefix cache between steps; the future says whether it
        did (False while requests are running or queued, as vLLM refuses then)."""
        done: Future = Future()
        with self._lock:
            if self._closing or self.error is not None:
                raise ShuttingDown(self.error or "the server is shutting down")
            self._resets.append(done)
            self._lock.notify()
        return done

    def in_flight(self) -> int:
        with self._lock:
            return len(self._flights)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the requests in flight (up to `timeout`), then stop the thread."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join(timeout)

    # -- the loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve(self.engine.open(observers=[self.oracle] if self.oracle else []))
            rest = self.oracle.take_findings(final=True) if self.oracle is not None else []  # reads still open
            self.findings.update(f.kind for f in rest)
            if self.recording is not None:
                self.recording.add_findings(rest)
                v = self.metrics.values()
                self.recording.complete(self.stats.steps, self.stats.generated_tokens, v["max_foreign"],
                                        v["leak_rate"])
        except Exception as e:  # noqa: BLE001 (every client must hear why, not hang)
            if self.recording is not None:
                self.recording.fail(e)
            with self._lock:
                self.error = f"the engine stopped: {type(e).__name__}: {e}"
                for f in self._flights.values():
                    f.put(Failed(self.error))
                self._flights.clear()
                for done in self._resets:
                    done.set_exception(ShuttingDown(self.error))
                self._resets.clear()

    def _serve(self, loop: Driver) -> None:
        while True:
            with self._lock:
                while not (self._pending or self._cancelled or self._closing or self._resets):
                    self._lock.wait()
                self._reset(loop)
                if self._closing and not self._flights:
                    return
                if not (self._pending or self._cancelled or self._flights):
                    continue  # a reset alone needs no turn of the model
            with self.model.queue.turn(), torch.inference_mode():
                while self._intake(loop):
                    self._step(loop)

    def _intake(self, loop: Driver) -> bool:
        """Resets, arrivals and cancellations between steps; True while any request runs."""
        with self._lock:
            self._reset(loop)
            while self._pending:
                rid, sub = self._pending.popleft()
                gen = request_generator(sub.seed, "", self.model.device) if sub.seed is not None else None
                spec = RequestSpec(rid, prompt_ids=sub.prompt_ids, max_new_tokens=sub.max_tokens,
                                   arrival_step=loop.step, cache_salt=sub.salt, temperature=sub.temperature,
                                   top_p=sub.top_p, ignore_eos=sub.ignore_eos)
                loop.add(spec, sub.prompt_ids, gen)
            for rid in self._cancelled:
                loop.cancel(rid)
                f = self._flights.pop(rid, None)
                if f is not None:
                    self._recorded(loop.forget(rid), f.sub)
            self._cancelled.clear()
        return loop.busy

    def _reset(self, loop: Driver) -> None:
        """The resets asked for, now (under the lock, between steps)."""
        for done in self._resets:
            done.set_result(not self._pending and loop.backend.reset_prefix_cache())
        self._resets.clear()

    def _step(self, loop: Driver) -> None:
        rec = loop.advance(snapshot=True)
        if rec is None:
            return
        self.metrics.update(rec, self.oracle)
        if self.on_step is not None:
            self.on_step(rec)
        found = self.oracle.take_findings() if self.oracle is not None else []  # cross-tenant reads once ended
        if self.recording is not None:
            self.recording.on_step(rec, found)  # it writes the oracle's steps and then drops them
        if self.oracle is not None:  # a server runs for days: keep the running totals, not every step
            self.findings.update(f.kind for f in found)
            if self.recording is None:
                self.oracle.steps.clear()
        self.stats.steps += 1
        self.stats.peak_batch = max(self.stats.peak_batch, len(rec.work))
        tok = self.model.tokenizer
        with self._lock:
            flights = {rid: self._flights.get(rid) for rid in rec.sampled}
        for rid, token in rec.sampled.items():
            f = flights[rid]
            if f is None:  # cancelled while this step ran
                continue
            f.output.append(token)
            text = tok.decode(f.output, skip_special_tokens=True)
            stop = next((i for i in (text.find(s) for s in f.sub.stop) if i >= 0), None)
            if stop is not None:
                text = text[:stop]
            ending = stop is not None or rid in rec.finished
            if len(text) > len(f.sent) and (ending or not text.endswith("\ufffd")):  # hold a split character
                f.put(Delta(text[len(f.sent):]))
                f.sent = text
            if stop is not None:
                loop.cancel(rid)
                self._finish(loop, rid, "stop")
            elif rid in rec.finished:
                self._finish(loop, rid, None)

    def _finish(self, loop: Driver, rid: str, reason: str | None) -> None:
        """Deliver the end; reason None: as the engine finished it (EOS is OpenAI's "stop")."""
        result = loop.forget(rid)
        with self._lock:
            f = self._flights.pop(rid)
        self._recorded(result, f.sub)
        reason = reason or ("stop" if result.finish_reason == "eos" else "length")
        s = self.stats
        s.requests, s.prompt_tokens = s.requests + 1, s.prompt_tokens + len(result.prompt_ids)
        s.generated_tokens += len(f.output)
        f.put(Done(reason, len(result.prompt_ids), len(f.output), max(result.cached_tokens, 0)))

    def _recorded(self, result, sub: Submission) -> None:
        if self.oracle is not None:  # the reply's cached tokens against what the oracle saw it served
            self.oracle.check_telemetry(result.id, result.cached_tokens)
        if self.recording is not None:
            self.recording.on_request(result, sub.salt, sub.max_tokens, sub.temperature, sub.top_p, sub.ignore_eos)
