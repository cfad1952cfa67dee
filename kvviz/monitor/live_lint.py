"""The two linter kinds that span the stream, kept across the monitor's slices: a parent stored after
its child (the child in one slice, its parent in a later one) and salts mixed on a replica's medium
(salted chains in one slice, unsalted in another). Each slice is linted alone (capture/lint.py); what
this adds is what a slice cannot see, so that the live counts end where `kvviz lint` of the recorded
capture does.

Children waiting for a parent are few on a healthy stream (a store's parent is cached when it is
stored), so they are kept by key, bounded: past `waiting` of them the oldest is forgotten and counted."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import duckdb
import pyarrow as pa

# Per replica and medium: the chains this slice began with and without a salt (lint.py's CHECKS).
ROOTS = """
SELECT coalesce(replica, 'replica-0') AS replica, coalesce(medium, '(none)') AS medium,
       count(*) FILTER (salt IS NOT NULL) AS salted, count(*) FILTER (salt IS NULL) AS unsalted
FROM kv_events WHERE kind = 'BlockStored' AND NOT coalesce(repeat, false) AND parent_hash IS NULL
GROUP BY ALL
"""
# This slice's children whose parent was not cached and is not stored later within the slice.
WAITING = """
WITH o AS (
    SELECT coalesce(replica, 'replica-0') AS replica, restart, group_idx, medium, step, event_index, parent_hash
    FROM kv_events WHERE parent_cached = false)
SELECT replica, restart, group_idx, medium, parent_hash FROM o
WHERE NOT EXISTS (
    SELECT 1 FROM kv_events s
    WHERE s.kind = 'BlockStored' AND NOT coalesce(s.repeat, false) AND coalesce(s.replica, 'replica-0') = o.replica
      AND s.block_hash = o.parent_hash AND s.restart IS NOT DISTINCT FROM o.restart
      AND s.group_idx IS NOT DISTINCT FROM o.group_idx AND s.medium IS NOT DISTINCT FROM o.medium
      AND (s.step > o.step OR s.step = o.step AND s.event_index > o.event_index))
ORDER BY step, event_index
"""
# The hashes this slice stores anew.
STORED = "SELECT block_hash FROM kv_events WHERE kind = 'BlockStored' AND NOT coalesce(repeat, false)"
# This slice's stores of a parent some earlier slice's child was waiting for (the waiting table's keys).
ARRIVED = """
SELECT DISTINCT w.key
FROM kv_events s JOIN waiting w
  ON coalesce(s.replica, 'replica-0') = w.replica AND s.block_hash = w.parent_hash
 AND s.restart IS NOT DISTINCT FROM w.restart AND s.group_idx IS NOT DISTINCT FROM w.group_idx
 AND s.medium IS NOT DISTINCT FROM w.medium
WHERE s.kind = 'BlockStored' AND NOT coalesce(s.repeat, false)
"""
KEY = pa.schema([("replica", pa.string()), ("restart", pa.int32()), ("group_idx", pa.int32()),
                 ("medium", pa.string()), ("parent_hash", pa.uint64())])


@dataclass
class LiveLint:
    """Add each slice after it is linted; `slice` returns what it adds: (replica, kind) -> count."""
    waiting: int = 100_000
    children: OrderedDict = field(default_factory=OrderedDict)  # KEY -> children waiting for that parent
    parents: Counter = field(default_factory=Counter)  # parent hash -> waiting keys with it
    roots: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (replica, medium) -> [salted, unsalted]
    forgotten: int = 0  # waiting children dropped past the bound: their parents, if stored, are not counted

    def slice(self, con: duckdb.DuckDBPyConnection) -> Counter[tuple[str, str]]:
        """What the slice in `kv_events` (the monitor's view of it) adds across slices."""
        found: Counter[tuple[str, str]] = Counter()
        self._parents(con, found)
        self._salts(con, found)
        return found

    def _parents(self, con: duckdb.DuckDBPyConnection, found: Counter) -> None:
        """Children whose parent this slice stores, then this slice's own children still waiting. A monitor
        started mid-stream keeps the bound full (every parent stored before it is unseen), so a slice is
        matched by its stored hashes first: only the keys whose parent hash it stores are joined exactly."""
        stored = con.execute(STORED).fetchnumpy()["block_hash"].tolist() if self.children else []
        if hits := {h for h in stored if h in self.parents}:
            keys = [k for k in self.children if k[4] in hits]
            table = pa.Table.from_pylist([dict(zip(KEY.names, k, strict=True)) for k in keys], schema=KEY)
            con.register("waiting", table.append_column("key", pa.array(range(len(keys)), type=pa.int64())))
            for (key,) in con.execute(ARRIVED).fetchall():
                found[(keys[key][0], "parent_after_child")] += self._drop(keys[key])
            con.unregister("waiting")
        for key in con.execute(WAITING).fetchall():
            if key not in self.children:
                self.parents[key[4]] += 1
            self.children[key] = self.children.get(key, 0) + 1
            if len(self.children) > self.waiting:
                self.forgotten += self._drop(next(iter(self.children)))

    def _drop(self, key: tuple) -> int:
        """Stop waiting for a key's parent; returns how many children waited for it."""
        self.parents[key[4]] -= 1
        if not self.parents[key[4]]:
            del self.parents[key[4]]
        return self.children.pop(key)

    def _salts(self, con: duckdb.DuckDBPyConnection, found: Counter) -> None:
        """A medium mixed once both kinds of chain began on it: every unsalted chain on it counts, those
        before the first salted one too (as `kvviz lint` of the whole capture counts them)."""
        for replica, medium, salted, unsalted in con.execute(ROOTS).fetchall():
            had = self.roots.setdefault((replica, medium), [0, 0])
            was_mixed = had[0] > 0 and had[1] > 0
            had[0] += salted
            had[1] += unsalted
            if had[0] > 0 and had[1] > 0:
                new = unsalted if was_mixed else had[1]
                if new:
                    found[(replica, "salt_mixed")] += new

    def restarted(self, replica: str) -> None:
        """A publisher's new life: its children from before can no longer meet their parents."""
        for key in [k for k in self.children if k[0] == replica]:
            self._drop(key)
