"""Records a run step by step: buffered in columns, inserted in bulk as Arrow tables.

The run row is written as `running` before the first step and finished as `complete` or `failed`;
buffers are flushed every few steps (and seconds) in their own transaction, written by a background
thread while the engine goes on, so a run killed midway leaves a database that opens, with the run
shown as running and its steps so far readable. The file is held only while a flush writes: between
flushes another process can open it to read.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .. import __version__
from ..engine import RequestResult, StepRecord
from ..engine.hashing import hash_to_u64
from ..errors import StoreError
from . import schema
from .attention import AttentionRecorder
from .run_store import RunStore
from .token_text import token_label

if TYPE_CHECKING:
    from ..checked_run import CheckedRun
    from ..oracle import ProvenanceOracle
    from ..oracle.provenance import Finding


class RunRecorder:
    def __init__(self, store: RunStore, run_id: str, *, model, workload, scenario: str | None = None,
                 fault: str | None = None, fault_scope: dict | None = None, oracle: ProvenanceOracle | None = None,
                 attention: AttentionRecorder | None = None, flush_every: int = 8, flush_seconds: float = 2.0,
                 background: bool = True):
        self.store, self.tokenizer = store, model.tokenizer
        # Writes go to one background thread, in order, so the engine computes while DuckDB inserts and
        # checkpoints; finish() and fail() wait for them.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvviz-recorder") if background else None
        self._writes: list[Future] = []
        self.run_id, self.oracle, self.attention, self.flush_every = run_id, oracle, attention, flush_every
        self.flush_seconds, self._flushed_at = flush_seconds, time.monotonic()
        self.rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self._oracle_steps = self._pending = 0
        self._labelled: set[int] = set()  # token ids whose text is recorded
        self.drain_oracle = False  # a server: drop the oracle's steps once written (it runs for days)
        scope = None if fault_scope is None else json.dumps(fault_scope)
        row = [run_id, datetime.now(UTC).replace(tzinfo=None), model.name, model.fingerprint, scenario, fault, scope,
               workload.seed, json.dumps(workload.engine.to_dict()), json.dumps(workload.to_dict(), ensure_ascii=False),
               __version__, workload.engine.backend]
        with self.store.write() as con:
            con.execute("INSERT INTO runs (run_id, created_at, status, model, model_fingerprint, scenario, fault, "
                        "fault_scope, seed, engine, workload, kvviz_version, backend) "
                        "VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)

    def _add(self, table: str, **cols) -> None:
        for k, v in cols.items():
            self.rows[table][k].append(v)

    def on_step(self, rec: StepRecord) -> None:
        """The engine's per-step callback: plan, page tables, blocks and events after the step."""
        rid, s = self.run_id, rec.step
        for req, (start, n) in rec.work.items():
            self._add("step_work", run_id=rid, step=s, request_id=req, start=start, tokens=n,
                      admitted=req in rec.admitted, preempted=req in rec.preempted,
                      sampled_token=rec.sampled.get(req), finished=req in rec.finished)
        snap = rec.snapshot
        B = snap.block_size
        for req, slots in rec.writes.items():
            start = rec.work[req][0]
            for k, slot in enumerate(slots):
                self._add("slot_writes", run_id=rid, step=s, request_id=req, position=start + k,
                          token=rec.tokens[req][k], slot=slot, block=slot // B,
                          lifetime=snap.lifetimes[slot // B])
        self._add("steps", run_id=rid, step=s, seconds=rec.seconds, free_blocks=len(snap.free_queue),
                  live_slots=snap.live_slots())
        for req, table in snap.page_tables.items():
            for i, b in enumerate(table):
                self._add("page_tables", run_id=rid, step=s, request_id=req, logical_block=i, physical_block=b)
        for b, (ref, h, life) in enumerate(zip(snap.refcounts, snap.hashes, snap.lifetimes, strict=True)):
            self._add("blocks", run_id=rid, step=s, block=b, refcount=ref, hash=None if h is None else hash_to_u64(h),
                      lifetime=life, state=snap.state(b))
        for i, e in enumerate(rec.events):
            self._add("block_events", run_id=rid, step=s, seq=i, kind=e.kind, block=e.block, request_id=e.request,
                      refcount=e.refcount, source=e.source, hash=None if e.hash is None else hash_to_u64(e.hash),
                      parent_hash=None if e.parent_hash is None else hash_to_u64(e.parent_hash),
                      token_ids=list(e.token_ids) if e.kind == "cache" else None, salt=e.salt, adapter=e.adapter,
                      medium=e.medium)
        for b, h in enumerate(snap.host_hashes):
            self._add("host_blocks", run_id=rid, step=s, block=b, hash=None if h is None else hash_to_u64(h),
                      state="free" if h is None else "cached")
        for t in rec.transfers:
            self._add("kv_transfers", run_id=rid, step=s, request_id=t.request, blocks=t.blocks, bytes=t.bytes,
                      status=t.status, from_blocks=list(t.from_blocks), to_blocks=list(t.to_blocks),
                      kv_of=list(t.kv_of), intact=t.intact)
        for req, lookup in rec.lookups.items():
            self._add("cache_lookups", run_id=rid, step=s, request_id=req, salt=lookup.salt, tokens=lookup.tokens,
                      hit_tokens=lookup.hit_tokens)
        self._pending += 1
        # Each flush opens, writes and closes (checkpoints) the file: at most one every flush_seconds.
        if self._pending >= self.flush_every and time.monotonic() - self._flushed_at >= self.flush_seconds:
            self.flush()

    def _oracle_table(self) -> pa.Table | None:
        """The oracle's metrics since the last flush, one row per (step, request, layer, head), built
        from its arrays (a SmolLM2 step has 270 rows per request: no Python loop per row)."""
        new = self.oracle.steps[self._oracle_steps:] if self.oracle is not None else []
        self._oracle_steps += len(new)
        if self.drain_oracle and new:
            del self.oracle.steps[:self._oracle_steps]
            self._oracle_steps = 0
        if not new:
            return None
        parts = []
        for st in new:
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

    def flush(self) -> None:
        """Insert everything buffered, in one transaction."""
        tables = {t: schema.arrow_table(t, cols) for t, cols in self.rows.items() if cols}
        metrics = self._oracle_table()
        if metrics is not None:
            tables["leak_metrics"] = metrics
        attention = self.attention.take(self.run_id) if self.attention is not None else None
        if attention is not None:
            tables["attention"] = attention
        self.rows.clear()
        self._pending, self._flushed_at = 0, time.monotonic()
        if not tables:
            return
        if self._writer is None:
            self._insert(tables)
        else:
            for done in [f for f in self._writes if f.done()]:
                done.result()  # a write that failed raises here, on the engine's thread
            self._writes = [f for f in self._writes if not f.done()]
            self._writes.append(self._writer.submit(self._insert, tables))

    def _insert(self, tables: dict[str, pa.Table]) -> None:
        with self.store.write() as con:
            con.execute("BEGIN TRANSACTION")
            if not self.store.has_run(con, self.run_id):
                con.execute("ROLLBACK")  # deleted by someone while it recorded: write no orphan rows
                raise StoreError(f"run {self.run_id} was deleted from {self.store.path} while it was recording; "
                                 "the rest of it was not written")
            for table, rows in tables.items():
                self.store.insert(con, table, rows)
            con.execute("COMMIT")

    def wait(self) -> None:
        """Wait for every write in flight (raising the first that failed) and stop the writer thread."""
        try:
            for f in self._writes:
                f.result()
        finally:
            self._writes = []
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    def finish(self, run: CheckedRun, seconds: float | None = None) -> None:
        res, summary = run.result, run.summary()
        specs = {s.id: s for s in run.workload.requests}
        for r in res.requests:
            self.add_request(r, specs[r.id].cache_salt, specs[r.id].parent)
        self.add_findings(run.findings)
        for d in run.divergences:
            self._add("divergence", run_id=self.run_id, request_id=d.request,
                      first_divergent_step=d.first_divergent_step, max_logit_diff=d.max_logit_diff, max_kl=d.max_kl,
                      classification=d.classification)
        st = res.stats
        self.complete(st.steps, seconds if seconds is not None else st.seconds, st.generated_tokens,
                      summary["leak"]["max_foreign_mass"], summary["leak"]["leak_rate"], len(run.findings))

    def add_request(self, r: RequestResult, tenant: str | None, parent: str | None = None) -> None:
        """A finished request and the text of the tokens it holds (each id labelled once per run)."""
        self._add("requests", run_id=self.run_id, request_id=r.id, tenant=tenant, parent=parent,
                  prompt_ids=r.prompt_ids, output_ids=r.output_ids, text=r.text, arrival_step=r.arrival_step,
                  first_token_step=r.first_token_step, finish_step=r.finish_step, finish_reason=r.finish_reason,
                  cached_tokens=r.cached_tokens)
        for tok in sorted({*r.prompt_ids, *r.output_ids} - self._labelled):
            self._add("token_text", run_id=self.run_id, token_id=tok, text=token_label(self.tokenizer, tok))
            self._labelled.add(tok)

    def add_findings(self, findings: Iterable[Finding]) -> None:
        for f in findings:
            self._add("findings", run_id=self.run_id, kind=f.kind, request_id=f.request, step=f.step, layer=f.layer,
                      head=f.head, position=f.position, source_request=f.source_request, mass=f.mass, block=f.block,
                      last_step=f.last_step)

    def complete(self, steps: int, seconds: float, generated: int, max_foreign: float | None, leak_rate: float | None,
                 findings: int, workload: dict | None = None) -> None:
        """Write what is buffered and mark the run complete with its totals (and, for a run whose
        requests arrived as it went, the workload they made)."""
        self.flush()
        self.wait()
        values = [steps, seconds, generated, max_foreign, leak_rate, findings, self.run_id]
        with self.store.write() as con:
            con.execute("UPDATE runs SET status = 'complete', steps = ?, seconds = ?, generated_tokens = ?, "
                        "max_foreign_mass = ?, leak_rate = ?, findings = ? WHERE run_id = ?", values)
            if workload is not None:
                con.execute("UPDATE runs SET workload = ? WHERE run_id = ?",
                            [json.dumps(workload, ensure_ascii=False), self.run_id])

    def fail(self, error: BaseException) -> None:
        """Keep what was recorded and mark the run failed with the reason."""
        try:
            self.flush()
        finally:
            try:
                self.wait()
            finally:
                with self.store.write() as con:
                    con.execute("UPDATE runs SET status = 'failed', error = ? WHERE run_id = ?",
                                [failure_reason(error), self.run_id])


def failure_reason(error: BaseException) -> str:
    """What a failed run's row says: the error, or that it was stopped (Ctrl-C, or the app session
    that started it was rerun or left: control exceptions that are not errors)."""
    if isinstance(error, Exception):
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    how = {KeyboardInterrupt: "Ctrl-C", SystemExit: "the process was told to stop"}.get(
        type(error), "the app page that started it was rerun, stopped or left")
    return f"stopped before it finished ({how})"
