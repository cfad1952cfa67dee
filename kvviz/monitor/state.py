"""The fleet's state from its KV events alone, in bounded memory: a capture sink (FleetCapture and
the replay both hand it each message with its decoded batch) that keeps running totals and
publishes a Snapshot for scrapes and the app.

Each message's events go through the capture's own row builder (capture/rows.py: which store is a
hit, which tenant a block belongs to, whether its parent was cached), the same rows an import
writes; every `fold_s` seconds (or `fold_messages` messages) the rows so far are aggregated in
DuckDB with the capture views' definitions (capture/measures.py) and linted by the capture linter
(capture/lint.py), then dropped. What stays between folds is the row builder's cache of the blocks
cached now (as large as the fleet's caches), the running totals, the tenant table (bounded) and the
remembered first tenants of recent hashes (bounded)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import duckdb
import pyarrow as pa

from ..capture import events as capture_events
from ..capture.capture_file import Message
from ..capture.lint import ADVISORY, Source, lint_run
from ..capture.measures import HIT_TOKENS, MISS_TOKENS, UNTOLD_SEGMENT
from ..capture.rows import EventRows
from ..capture.tenants import TOLD
from ..capture.zmq_capture import ReplicaState, Sink
from ..errors import CaptureError
from ..store import working_db
from .cross_tenant import NAMED, SALTS, FirstTenants
from .live_lint import LiveLint
from .stream import Lag, Losses
from .tenants import TenantBook

log = logging.getLogger("kvviz.monitor")
NO_MEDIUM = "none"

# Per replica, medium and tenant: the chunk's stores, hits, removals, tokens and untold segments.
TOTALS = f"""
SELECT coalesce(replica, 'replica-0') AS replica, coalesce(medium, '{NO_MEDIUM}') AS medium, salt,
       count(*) FILTER (kind = 'BlockStored' AND NOT coalesce(repeat, false)) AS stored,
       count(*) FILTER (kind = 'BlockStored' AND repeat) AS hits,
       count(*) FILTER (kind = 'BlockRemoved' AND NOT coalesce(repeat, false)) AS removed,
       {HIT_TOKENS} AS hit_tokens, {MISS_TOKENS} AS miss_tokens,
       count(*) FILTER ({UNTOLD_SEGMENT} AND salt IS NOT NULL) AS untold,
       count(*) FILTER (kind = 'AllBlocksCleared') AS clears
FROM kv_events GROUP BY ALL
"""
# Per replica and medium: the change in blocks cached, counted after the replica's last clear in the chunk.
HELD = f"""
WITH ev AS (SELECT coalesce(replica, 'replica-0') AS replica, coalesce(medium, '{NO_MEDIUM}') AS medium, kind,
                   coalesce(repeat, false) AS rep, [step, coalesce(event_index, 0)] AS pos FROM kv_events),
cl AS (SELECT replica, max(pos) AS pos FROM ev WHERE kind = 'AllBlocksCleared' GROUP BY replica)
SELECT ev.replica, ev.medium, any_value(cl.pos IS NOT NULL) AS cleared,
       count(*) FILTER (kind = 'BlockStored' AND NOT rep AND (cl.pos IS NULL OR ev.pos > cl.pos))
       - count(*) FILTER (kind = 'BlockRemoved' AND NOT rep AND (cl.pos IS NULL OR ev.pos > cl.pos)) AS delta
FROM ev LEFT JOIN cl USING (replica) WHERE kind IN ('BlockStored', 'BlockRemoved', 'AllBlocksCleared')
GROUP BY ALL
"""


@dataclass(frozen=True)
class ReplicaFigures:
    """One replica's figures at a fold, everything cumulative but `connected`, `lag_last_s` and held."""
    messages: int
    invalid: int
    lost: int
    restarts: int
    connected: bool
    lag_count: int
    lag_sum_s: float
    lag_last_s: float | None
    last_ts: float | None  # the publisher's clock on its latest batch
    clears: int
    cross_tenant_blocks: int  # block hashes two named tenants stored or hit (the capture views' findings)
    salt_shared_blocks: int  # block hashes stored or hit under two salts, named or inferred
    untold_segments: int
    salted_stores: int
    capacity_blocks: int | None


@dataclass(frozen=True)
class Snapshot:
    """What a scrape or the Live page reads: immutable, replaced whole at each fold."""
    taken: float  # time.time() of the fold
    replicas: dict[str, ReplicaFigures]
    media: dict[tuple[str, str], tuple[int, ...]]  # (replica, medium) -> MEDIA_FIELDS
    breaches: dict[tuple[str, str], int]  # (replica, kind) -> count
    tenants: dict[str, tuple[int, ...]]  # label -> tenants.FIELDS
    tenants_seen: int
    tenants_untracked_stores: int
    hashes_forgotten: int
    children_forgotten: int  # stores waiting for a parent past the live linter's bound
    dropped_slices: int  # slices of the stream a fold could not aggregate (logged)
    folds: int


MEDIA_FIELDS = ("held", "stored", "hits", "removed", "hit_tokens", "miss_tokens")


@dataclass
class _Replica:
    lag: Lag = field(default_factory=Lag)
    losses: Losses = field(default_factory=Losses)
    last_ts: float | None = None
    clears: int = 0
    cross_tenant: int = 0
    salt_shared: int = 0
    untold: int = 0
    salted: int = 0


class MonitorState:
    """Add messages from one thread (the capture's); read `snapshot` from any."""

    def __init__(self, capacity: dict[str, int] | None = None, tenants: int = 20, tracked_tenants: int = 100_000,
                 remembered_hashes: int = 400_000, fold_s: float = 0.5, fold_messages: int = 20_000,
                 record: Sink | None = None):
        self.capacity = capacity or {}  # replica -> blocks ("*": every replica)
        self.fold_s, self.fold_messages, self.record = fold_s, fold_messages, record
        self.rows = EventRows()
        self.streams: dict[str, ReplicaState] = {}  # the capture's per-replica bookkeeping
        self.replica: defaultdict[str, _Replica] = defaultdict(_Replica)
        self.media: defaultdict[tuple[str, str], list[int]] = defaultdict(lambda: [0] * len(MEDIA_FIELDS))
        self.breaches: Counter[tuple[str, str]] = Counter()
        self.tenants = TenantBook(labelled=tenants, tracked=tracked_tenants)
        self.first = FirstTenants(remembered=remembered_hashes)
        self.lint = LiveLint()
        self.db = working_db()
        self.steps, self.pending, self.dropped, self.folds = 0, 0, 0, 0
        self.restart_of: dict[str, int] = {}
        self.reset: set[str] = set()  # replicas whose publisher restarted: their cache is empty
        self.said_full = self.said_labels = False  # the tenant table's bounds, said once each
        self.last_fold = time.monotonic()
        self._lock = threading.Lock()  # folds happen on the capture's thread or on flush() from another
        self.snapshot = self._snap()

    def add(self, m: Message, batch: capture_events.Batch) -> None:
        """One decoded message. A batch the row builder would refuse later (a token that is no 32-bit int,
        which only the general decoder lets through) is a CaptureError now: the capture counts it."""
        if isinstance(batch, capture_events.Batch):
            _check_tokens(batch, f"{m.replica} seq {m.seq}")
        with self._lock:
            if self.restart_of.setdefault(m.replica, m.restart) != m.restart:
                self._fold()  # what came before the restart is folded before the new life begins
                self.restart_of[m.replica] = m.restart
                self.lint.restarted(m.replica)
                self.reset.add(m.replica)
            self.rows.add(batch, step=self.steps, replica=m.replica, restart=m.restart, seq=m.seq,
                          where=f"{m.replica} seq {m.seq}")
            self.steps += 1
            self.pending += 1
            r = self.replica[m.replica]
            r.last_ts = batch.ts
            if m.received is not None:
                r.lag.add(m.received - batch.ts)
            if self.pending >= self.fold_messages:
                self._fold()
        if self.record is not None:
            self.record.add(m, batch)

    def tick(self, streams: dict[str, ReplicaState]) -> None:
        """The capture's progress callback: its per-replica bookkeeping, and a fold when one is due."""
        self.streams = streams
        if time.monotonic() - self.last_fold >= self.fold_s:
            self.flush()

    def flush(self) -> None:
        """Fold what has arrived and publish a new snapshot."""
        with self._lock:
            self._fold()

    def _fold(self) -> None:
        self.last_fold = time.monotonic()
        self._empty(self.reset)
        self.reset.clear()
        if self.pending:
            self.pending = 0
            try:
                table = self.rows.take()
            except CaptureError as e:  # the rows so far are lost; the stream goes on
                self.dropped += 1
                log.warning("a slice of the stream could not be aggregated: %s", e)
            else:
                self._aggregate(table)
        self.folds += 1
        self.snapshot = self._snap()

    def _aggregate(self, table: pa.Table) -> None:
        con = self.db.cursor()  # a connection per slice: the linter's queries leave nothing open after it
        try:
            self._aggregate_on(con, table)
        finally:
            con.close()

    def _aggregate_on(self, con: duckdb.DuckDBPyConnection, table: pa.Table) -> None:
        con.register("monitor_rows", table)
        con.execute("CREATE OR REPLACE TEMP VIEW kv_events AS SELECT 'live' AS run_id, * FROM monitor_rows")
        seen = defaultdict(lambda: [0] * 4)
        for replica, medium, salt, stored, hits, removed, hit_t, miss_t, untold, clears in con.execute(
                TOTALS).fetchall():
            values = self.media[(replica, medium)] if stored or hits or removed else None
            if values is not None:
                for i, v in enumerate((stored, hits, removed, hit_t, miss_t), start=1):
                    values[i] += int(v)
            r = self.replica[replica]
            r.clears += clears
            r.untold += untold
            if salt is not None:
                r.salted += stored
                tally = seen[salt]
                for i, v in enumerate((stored, hits, hit_t, miss_t)):
                    tally[i] += int(v)
        for salt, tally in seen.items():
            if not self.tenants.add(salt, tuple(tally)) and not self.said_full:
                self.said_full = True
                log.warning("more than %d tenants: later ones are counted in tenant=\"other\" only "
                            "(kvviz_tenant_untracked_blocks_total)", self.tenants.tracked)
        self.tenants.refresh()
        if len(self.tenants.tallies) > self.tenants.labelled and not self.said_labels:
            self.said_labels = True
            log.info("more than %d tenants: the busiest have a tenant label, the rest are counted as \"other\"",
                     self.tenants.labelled)
        held = con.execute(HELD).fetchall()
        self._empty({replica for replica, _, cleared, _ in held if cleared})
        for replica, medium, _, delta in held:
            if medium != NO_MEDIUM or delta:
                self.media[(replica, medium)][0] += int(delta)
        self._cross_tenant(con)
        for b in lint_run(con, "live", Source(files=(), hive=False)):
            if b.kind not in ADVISORY and b.kind != "salt_mixed":  # salts are counted across slices
                self.breaches[(b.replica, b.kind)] += b.count
        self.breaches.update(self.lint.slice(con))

    def _empty(self, replicas: set[str]) -> None:
        """The replicas' caches are empty (a clear, or a publisher that restarted)."""
        for (replica, _), values in self.media.items():
            if replica in replicas:
                values[0] = 0

    def _cross_tenant(self, con: duckdb.DuckDBPyConnection) -> None:
        see = self.first.see
        for replica, group, block_hash, salt, tenant in con.execute(
                f"WITH {TOLD} SELECT replica, grp, block_hash, salt, tenant FROM stores WHERE salt IS NOT NULL "
                "ORDER BY step, event_index, block_index", {"run": "live"}).fetchall():
            if found := see(replica, group, block_hash, salt, tenant):
                r = self.replica[replica]
                r.salt_shared += bool(found & SALTS)
                r.cross_tenant += bool(found & NAMED)

    def _snap(self) -> Snapshot:
        replicas = {}
        for name in sorted(set(self.streams) | set(self.replica)):
            st, r = self.streams.get(name), self.replica[name]
            if st is not None:
                r.losses.update(st)
            replicas[name] = ReplicaFigures(
                messages=st.count if st else 0, invalid=st.invalid if st else 0, lost=r.losses.counted,
                restarts=st.restarts if st else 0, connected=bool(st and st.connected), lag_count=r.lag.count,
                lag_sum_s=r.lag.total, lag_last_s=r.lag.last, last_ts=r.last_ts, clears=r.clears,
                cross_tenant_blocks=r.cross_tenant, salt_shared_blocks=r.salt_shared,
                untold_segments=r.untold, salted_stores=r.salted,
                capacity_blocks=self.capacity.get(name, self.capacity.get("*")))
        return Snapshot(taken=time.time(), replicas=replicas, media={k: tuple(v) for k, v in self.media.items()},
                        breaches=dict(self.breaches), tenants=self.tenants.series(),
                        tenants_seen=len(self.tenants.tallies), tenants_untracked_stores=self.tenants.untracked_stores,
                        hashes_forgotten=self.first.forgotten, children_forgotten=self.lint.forgotten,
                        dropped_slices=self.dropped, folds=self.folds)


def _check_tokens(batch: capture_events.Batch, where: str) -> None:
    for i, e in enumerate(batch.events):
        if e.kind == "BlockStored" and e.token_ids:
            try:
                pa.array(e.token_ids, type=pa.int32())
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
                raise CaptureError(f"{where} event {i}: token_ids must be a list of 32-bit ints") from None
