"""Records a run step by step, off the engine's thread.

The engine's thread hands each step over as it is (the step record and the pool's snapshot are
immutable, the oracle's step and the attention rows already on the CPU) to one writer thread through
a bounded queue: the engine waits only when the writer is `queue_steps` steps behind. The writer
builds the rows, buffers them in columns and inserts them as Arrow tables every few steps (and
seconds), each flush in its own transaction; the bulky attention rows go to Parquet parts beside the
store (attention_parts.py). The run row is written as `running` before the first
step and finished as `complete` or `failed`; a run killed midway leaves a database that opens, with
the run shown as running and its steps so far readable. The file is held only while a flush writes:
between flushes another process can open it to read. A write that fails stops the writer and is
raised on the engine's thread at its next step, as a StoreError.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .. import __version__
from ..engine import RequestResult, StepRecord
from ..engine.hashing import hash_to_u64
from ..errors import KvvizError, StoreError
from . import schema
from .attention import AttentionRecorder, attention_tables
from .attention_parts import AttentionParts
from .run_store import RunStore
from .token_text import token_label

if TYPE_CHECKING:
    from ..oracle import ProvenanceOracle
    from ..oracle.provenance import Finding, StepLeak
    from ..oracle.reference import Divergence

QUEUE_STEPS = 16  # steps handed over and not yet turned into rows before the engine waits for the writer
_STOP = None  # what the queue holds last: the writer thread ends
# The writer's nice value: about a tenth of a core's share against the engine's threads, enough to stay
# out of the forward's way yet not to starve behind other busy processes (19 would give it a seventieth).
WRITER_NICE = 10
# A flush opens, writes and closes (checkpoints) the file, on cores the engine's forward wants: the next
# one waits until the writer's CPU time in the last one is at most this share of the time between them
# (each open and checkpoint grows with the run's file; on SmolLM2 a flush took 0.1-0.2 s of CPU, and
# one every 2 s cost a tenth of the run's speed). CPU, not wall time: a writer that yields to a busy
# engine takes long to flush without costing it more.
FLUSH_SHARE = 0.05
GROUP_CELLS = 1 << 22  # attention weights held before they are written as a row group (16 MB of float32)


class RunRecorder:
    def __init__(self, store: RunStore, run_id: str, *, model, workload, scenario: str | None = None,
                 fault: str | None = None, fault_scope: dict | None = None, oracle: ProvenanceOracle | None = None,
                 attention: AttentionRecorder | None = None, flush_every: int = 8, flush_seconds: float = 2.0,
                 background: bool = True, queue_steps: int = QUEUE_STEPS):
        """background=False builds and writes on the caller's thread (a test that reads between flushes)."""
        self.store, self.tokenizer = store, model.tokenizer
        self.run_id, self.oracle, self.attention, self.flush_every = run_id, oracle, attention, flush_every
        self.flush_seconds, self._flushed_at = flush_seconds, time.monotonic()
        self._flush_cpu = 0.0  # the writer's CPU seconds in the last flush
        self._parts = None if attention is None else AttentionParts(store.attention_dir / run_id)
        self._oracle_steps = 0  # the oracle's steps handed over (engine thread)
        self._labelled: set[int] = set()  # token ids whose text is recorded (caller's thread: the tokenizer's)
        self.drain_oracle = False  # a server: drop the oracle's steps once handed over (it runs for days)
        # The writer thread's own: rows in columns, the oracle's steps and attention chunks, not yet written.
        self.rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self._metrics: list[StepLeak] = []
        self._chunks: list[dict] = []
        self._held_cells = 0  # attention weights among the chunks held, not yet in a row group
        self._pending = 0
        self._u64: dict[bytes, int] = {}  # each block hash's low 64 bits, computed once
        self._error: BaseException | None = None  # the writer's first failure; it writes nothing after it
        scope = None if fault_scope is None else json.dumps(fault_scope)
        row = [run_id, datetime.now(UTC).replace(tzinfo=None), model.name, model.fingerprint, scenario, fault, scope,
               workload.seed, json.dumps(workload.engine.to_dict()), json.dumps(workload.to_dict(), ensure_ascii=False),
               __version__, workload.engine.backend]
        with self.store.write() as con:
            con.execute("INSERT INTO runs (run_id, created_at, status, model, model_fingerprint, scenario, fault, "
                        "fault_scope, seed, engine, workload, kvviz_version, backend) "
                        "VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
        self._queue: queue.Queue[Callable[[], None] | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max(1, queue_steps))
            self._thread = threading.Thread(target=self._drain, name=f"kvviz-recorder-{run_id}", daemon=True)
            self._thread.start()

    # -- the engine's thread -------------------------------------------------------------------
    def on_step(self, rec: StepRecord) -> None:
        """The engine's per-step callback: hands the step over (waiting only while the queue is full)."""
        metrics, chunks = self._take_observed()
        self._submit(partial(self._step_rows, rec, metrics, chunks))

    def flush(self) -> None:
        """Write everything handed over so far (in the writer's turn: wait() waits for it)."""
        self._raise_if_failed()
        self._hand_over_rest()
        self._raise_if_failed()

    def _hand_over_rest(self) -> None:
        """Everything observed so far, to be written now (a writer that failed writes nothing more)."""
        metrics, chunks = self._take_observed()
        self._put(partial(self._write, metrics, chunks, everything=True))

    def _take_observed(self) -> tuple[list[StepLeak], list[dict]]:
        """The oracle's steps and the attention rows since the last hand-over: taken on the engine's
        thread, which appends to both; the writer gets lists no one else touches."""
        new: list[StepLeak] = []
        if self.oracle is not None:
            new = self.oracle.steps[self._oracle_steps:]
            self._oracle_steps += len(new)
            if self.drain_oracle and new:
                del self.oracle.steps[:self._oracle_steps]
                self._oracle_steps = 0
        return new, self.attention.take_chunks() if self.attention is not None else []

    def _submit(self, work: Callable[[], None]) -> None:
        self._raise_if_failed()
        self._put(work)
        self._raise_if_failed()

    def _put(self, work: Callable[[], None]) -> None:
        """To the writer (waiting while the queue is full), or done here without one."""
        if self._queue is None:
            self._do(work, catch=Exception)
        else:
            self._queue.put(work)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._failure()

    def _failure(self) -> KvvizError:
        e = self._error
        if isinstance(e, KvvizError):
            return e
        return StoreError(f"recording run {self.run_id} into {self.store.path} failed: {failure_reason(e)}")

    def wait(self) -> None:
        """Let the writer write what it was handed, stop it, and raise its failure if it failed."""
        self._stop()
        self._raise_if_failed()

    def _stop(self) -> None:
        """Wait for the writer to finish what it was handed; from then on work is done on the caller's thread."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = self._queue = None

    # -- the writer's thread -------------------------------------------------------------------
    def _drain(self) -> None:
        """Do the work handed over, in order; after a failure only take it off the queue (the engine
        must never wait on a writer that has stopped)."""
        _yield_to_the_engine()
        while (work := self._queue.get()) is not _STOP:
            self._do(work, catch=BaseException)

    def _do(self, work: Callable[[], None], catch: type[BaseException]) -> None:
        if self._error is None:
            try:
                work()
            except catch as e:  # raised on the engine's thread, as a StoreError
                self._error = e

    def _add(self, table: str, **cols) -> None:
        """One row."""
        for k, v in cols.items():
            self.rows[table][k].append(v)

    def _add_columns(self, table: str, n: int, **cols) -> None:
        """n rows of this run: each value a list of n, or one value for every row."""
        rows = self.rows[table]
        rows["run_id"].extend([self.run_id] * n)
        for k, v in cols.items():
            rows[k].extend(v if isinstance(v, list) else [v] * n)

    def _u64_of(self, h: bytes | None) -> int | None:
        if h is None:
            return None
        if (v := self._u64.get(h)) is None:
            v = self._u64[h] = hash_to_u64(h)
        return v

    def _step_rows(self, rec: StepRecord, metrics: list[StepLeak], chunks: list[dict]) -> None:
        """Plan, page tables, blocks and events after the step, as rows."""
        rid, s = self.run_id, rec.step
        reqs = list(rec.work)
        self._add_columns("step_work", len(reqs), step=s, request_id=reqs, start=[rec.work[r][0] for r in reqs],
                          tokens=[rec.work[r][1] for r in reqs], admitted=[r in rec.admitted for r in reqs],
                          preempted=[r in rec.preempted for r in reqs],
                          sampled_token=[rec.sampled.get(r) for r in reqs], finished=[r in rec.finished for r in reqs])
        snap = rec.snapshot
        B = snap.block_size
        for req, slots in rec.writes.items():
            start, n = rec.work[req][0], len(slots)
            blocks = [slot // B for slot in slots]
            self._add_columns("slot_writes", n, step=s, request_id=req, position=list(range(start, start + n)),
                              token=list(rec.tokens[req][:n]), slot=list(slots), block=blocks,
                              lifetime=[snap.lifetimes[b] for b in blocks])
        self._add("steps", run_id=rid, step=s, seconds=rec.seconds, free_blocks=len(snap.free_queue),
                  live_slots=snap.live_slots())
        for req, table in snap.page_tables.items():
            self._add_columns("page_tables", len(table), step=s, request_id=req,
                              logical_block=list(range(len(table))), physical_block=list(table))
        n = len(snap.refcounts)
        self._add_columns("blocks", n, step=s, block=list(range(n)), refcount=list(snap.refcounts),
                          hash=[self._u64_of(h) for h in snap.hashes], lifetime=list(snap.lifetimes),
                          state=[snap.state(b) for b in range(n)])
        for i, e in enumerate(rec.events):
            self._add("block_events", run_id=rid, step=s, seq=i, kind=e.kind, block=e.block, request_id=e.request,
                      refcount=e.refcount, source=e.source, hash=self._u64_of(e.hash),
                      parent_hash=self._u64_of(e.parent_hash),
                      token_ids=list(e.token_ids) if e.kind == "cache" else None, salt=e.salt, adapter=e.adapter,
                      medium=e.medium)
        if snap.host_hashes:
            n = len(snap.host_hashes)
            self._add_columns("host_blocks", n, step=s, block=list(range(n)),
                              hash=[self._u64_of(h) for h in snap.host_hashes],
                              state=["free" if h is None else "cached" for h in snap.host_hashes])
        for t in rec.transfers:
            self._add("kv_transfers", run_id=rid, step=s, request_id=t.request, blocks=t.blocks, bytes=t.bytes,
                      status=t.status, from_blocks=list(t.from_blocks), to_blocks=list(t.to_blocks),
                      kv_of=list(t.kv_of), intact=t.intact)
        for req, lookup in rec.lookups.items():
            self._add("cache_lookups", run_id=rid, step=s, request_id=req, salt=lookup.salt, tokens=lookup.tokens,
                      hit_tokens=lookup.hit_tokens)
        self._metrics += metrics
        self._chunks += chunks
        self._held_cells += sum(len(c["weights"]) for c in chunks if "weights" in c)
        self._pending += 1
        if self._pending >= self.flush_every and time.monotonic() - self._flushed_at >= self._spacing():
            self._write()
        elif self._held_cells >= GROUP_CELLS:
            self._write_attention()

    def _write_attention(self) -> None:
        """The attention rows held so far, as a row group of the open part (hidden until it closes at a
        flush): written as they come, not all at a flush, so the run's end finds little left to write."""
        rows = [c for c in self._chunks if "keys" not in c]
        self._chunks, self._held_cells = [c for c in self._chunks if "keys" in c], 0
        if rows:
            self._parts.add(attention_tables(rows, self.run_id)["attention"])

    def _spacing(self) -> float:
        """Seconds from one flush to the next: flush_seconds, or more while a flush takes more than
        FLUSH_SHARE of them; 0 (a test that reads between flushes) keeps every flush_every steps."""
        return max(self.flush_seconds, self._flush_cpu / FLUSH_SHARE) if self.flush_seconds else 0.0

    def _oracle_table(self) -> pa.Table | None:
        """The oracle's metrics not yet written, one row per (step, request, layer, head), built from
        its arrays (a SmolLM2 step has 270 rows per request: no Python loop per row)."""
        if not self._metrics:
            return None
        parts = []
        for st in self._metrics:
            R, layers, H = st.max_foreign.shape
            n = R * layers * H
            part = {"step": np.full(n, st.step, np.int32),
                    "request_id": np.repeat(np.array(st.requests, dtype=object), layers * H),
                    "layer": np.tile(np.repeat(np.arange(layers, dtype=np.int32), H), R),
                    "head": np.tile(np.arange(H, dtype=np.int32), R * layers),
                    "rows": np.repeat(np.array(st.rows, dtype=np.int32), layers * H)}
            part.update({name: getattr(st, name).flatten().double().numpy()
                         for name in ("max_foreign", "sum_foreign", "leak_rows", "sum_entropy")})
            parts.append(part)
        cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return pa.table({"run_id": pa.array([self.run_id] * len(cols["step"])),
                         **{k: pa.array(v) for k, v in cols.items()}})

    def _write(self, metrics: Iterable[StepLeak] = (), chunks: Iterable[dict] = (), everything: bool = False) -> None:
        """Insert what is buffered (and what is given) in one transaction, its attention rows a row group
        of the open part, closed when due or when `everything` is asked (it is then readable)."""
        began = time.thread_time()
        self._metrics += metrics
        self._chunks += chunks
        tables = {t: schema.arrow_table(t, cols) for t, cols in self.rows.items() if cols}
        if (oracle := self._oracle_table()) is not None:
            tables["leak_metrics"] = oracle
        tables.update(attention_tables(self._chunks, self.run_id))
        self.rows.clear()
        self._metrics, self._chunks, self._held_cells = [], [], 0
        if (rows := tables.pop("attention", None)) is not None:
            self._parts.add(rows)
        close = self._parts is not None and self._parts.due(everything)
        if tables or close:
            self._insert(tables, close)
        self._pending, self._flushed_at = 0, time.monotonic()
        self._flush_cpu = time.thread_time() - began

    def _insert(self, tables: dict[str, pa.Table], close_part: bool = False) -> None:
        """One transaction, closing the open attention part in it if asked (once the run is known to be
        there); with its first part the run joins attention_parts (and the `attention` view reads its folder)."""
        with self.store.write() as con:
            con.execute("BEGIN TRANSACTION")
            if not self.store.has_run(con, self.run_id):
                con.execute("ROLLBACK")  # deleted by someone while it recorded: write no orphan rows
                if self._parts is not None:
                    self._parts.discard()
                    shutil.rmtree(self._parts.folder, ignore_errors=True)
                raise StoreError(f"run {self.run_id} was deleted from {self.store.path} while it was recording; "
                                 "the rest of it was not written")
            for table, rows in tables.items():
                self.store.insert(con, table, rows)
            if close_part:
                self._parts.close()
                if self._parts.closed == 1:
                    con.execute("INSERT INTO attention_parts VALUES (?)", [self.run_id])
                    self.store.refresh_file_views(con)
            con.execute("COMMIT")

    # -- the end of the run (the engine's thread) ----------------------------------------------
    def add_divergences(self, divergences: Iterable[Divergence]) -> None:
        self._submit(partial(self._divergence_rows, list(divergences)))

    def _divergence_rows(self, divergences: list) -> None:
        for d in divergences:
            self._add("divergence", run_id=self.run_id, request_id=d.request,
                      first_divergent_step=d.first_divergent_step, max_logit_diff=d.max_logit_diff, max_kl=d.max_kl,
                      classification=d.classification)

    def add_request(self, r: RequestResult, tenant: str | None, parent: str | None = None) -> None:
        """A finished request and the text of the tokens it holds (each id labelled once per run, here:
        the tokenizer is not used from the writer's thread)."""
        new = sorted({*r.prompt_ids, *r.output_ids} - self._labelled)
        self._labelled.update(new)
        labels = [token_label(self.tokenizer, tok) for tok in new]
        self._submit(partial(self._request_rows, r, tenant, parent, new, labels))

    def _request_rows(self, r: RequestResult, tenant: str | None, parent: str | None, tokens: list[int],
                      labels: list[str]) -> None:
        self._add("requests", run_id=self.run_id, request_id=r.id, tenant=tenant, parent=parent,
                  prompt_ids=r.prompt_ids, output_ids=r.output_ids, text=r.text, arrival_step=r.arrival_step,
                  first_token_step=r.first_token_step, finish_step=r.finish_step, finish_reason=r.finish_reason,
                  cached_tokens=r.cached_tokens)
        self._add_columns("token_text", len(tokens), token_id=tokens, text=labels)

    def add_findings(self, findings: Iterable[Finding]) -> None:
        self._submit(partial(self._finding_rows, list(findings)))

    def _finding_rows(self, findings: list[Finding]) -> None:
        for f in findings:
            self._add("findings", run_id=self.run_id, kind=f.kind, request_id=f.request, step=f.step, layer=f.layer,
                      head=f.head, position=f.position, source_request=f.source_request, mass=f.mass, block=f.block,
                      last_step=f.last_step)

    def complete(self, steps: int, seconds: float, generated: int, max_foreign: float | None, leak_rate: float | None,
                 findings: int, workload: dict | None = None, notes: list[str] | None = None) -> None:
        """Write what is buffered and mark the run complete with its totals (and, for a run whose
        requests arrived as it went, the workload they made); a write that failed marks it failed."""
        self._hand_over_rest()
        self._stop()
        if self._error is not None:
            failure = self._failure()
            self._mark_failed(failure)
            raise failure
        values = [steps, seconds, generated, max_foreign, leak_rate, findings, self.run_id]
        with self.store.write() as con:
            con.execute("UPDATE runs SET status = 'complete', steps = ?, seconds = ?, generated_tokens = ?, "
                        "max_foreign_mass = ?, leak_rate = ?, findings = ?, notes = ? WHERE run_id = ?",
                        values[:-1] + [notes or None, self.run_id])
            if workload is not None:
                con.execute("UPDATE runs SET workload = ? WHERE run_id = ?",
                            [json.dumps(workload, ensure_ascii=False), self.run_id])

    def fail(self, error: BaseException) -> None:
        """Keep what was recorded (the writer writes what it holds) and mark the run failed with the reason."""
        try:
            self._hand_over_rest()
            self._stop()
        finally:
            self._mark_failed(error)

    def _mark_failed(self, error: BaseException) -> None:
        with self.store.write() as con:
            con.execute("UPDATE runs SET status = 'failed', error = ? WHERE run_id = ?",
                        [failure_reason(error), self.run_id])


def _yield_to_the_engine() -> None:
    """Run this thread (and the DuckDB workers it starts) at a low priority: on a machine whose cores
    the model's forward fills, the writer then takes the time the engine leaves (and the engine waits for
    it only when the queue is full). Linux sets a nice value per thread; elsewhere it would be the
    process's, so nothing is changed there."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except OSError:
            pass  # not allowed here: the writer runs at the engine's priority, as before


def failure_reason(error: BaseException) -> str:
    """What a failed run's row says: the error, or that it was stopped (Ctrl-C, or the app session
    that started it was rerun or left: control exceptions that are not errors)."""
    if isinstance(error, Exception):
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    how = {KeyboardInterrupt: "Ctrl-C", SystemExit: "the process was told to stop"}.get(
        type(error), "the app page that started it was rerun, stopped or left")
    return f"stopped before it finished ({how})"
