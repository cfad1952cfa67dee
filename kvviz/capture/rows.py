"""Captured messages as block-event rows in Arrow columns: one row per block of every event (one row
for an event without blocks, and one for a batch without events, so every message keeps a row).

Rows are built in three levels so Python touches each message and event once and each block in a
short loop: message fields (step, replica, seq, ts, payload ...) and event fields (kind,
medium, group ...) are kept once and spread over their rows by Arrow `take`; tokens stay one flat
list until they become a list column. The same builder feeds the import (into DuckDB) and the
capture dataset (into Parquet), so both hold the same rows.

`repeat` marks an event that changes nothing in the cache as tracked on its replica, KV group and
medium: a BlockStored of a hash already cached (with kv_cache_report_mode="full" vLLM re-reports
reused blocks: a hit, not a second block), or a BlockRemoved of a hash not cached (removed before,
or cached before the capture began). `salt` is the tenant of the block: vLLM names the salt among
the extra keys of a chain's first block only, so the blocks after it, in the same event or in a
later one continuing a cached chain, carry the salt of the block they follow; a removal, and a hit
that names none, carry the salt of the cached block. A store's `salt_named` says whether its own
event names that salt (a block evicted and stored again under a salt its event names is that
tenant's, for that life), and a removal's whether the store that cached the block did; where it does
not, the salt is the chain's, and the capture cannot tell which tenant stored the block (a server
that leaves the salt out of its hashes lets another tenant continue the chain). Each life is
measured on the publisher's clock (ts) as it ends or is used: a removal's `lifetime_s` (since the
store that cached it) and `idle_s` (since its last use),
a hit's `reuse_gap_s` (since the block's previous use), so the distributions are plain scans.

Two columns are the evidence the KV-event contract linter (lint.py) reads, so it stays a few scans
of columns at any size: `tokens_given`, on every row of a store whose token_ids do not hold
block_size tokens per block (how many it gave; its rows get no token_ids, and the rest of the
capture imports), and `parent_cached`, on the first block an event stores new, whether the block
before it (the event's parent, or a hit reported ahead of it) was cached on its replica, KV group and
medium at that moment.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import CaptureError
from .events import Batch

INT_LIST = pa.list_(pa.int32())
MESSAGE_FIELDS = (("step", pa.int64()), ("replica", pa.string()), ("restart", pa.int32()), ("seq", pa.int64()),
                  ("ts", pa.float64()), ("received", pa.float64()), ("rank", pa.int32()), ("topic", pa.string()),
                  ("payload", pa.binary()))
EVENT_FIELDS = (("event_index", pa.int32()), ("kind", pa.string()), ("block_size", pa.int32()),
                ("lora_id", pa.int64()), ("lora_name", pa.string()), ("medium", pa.string()),
                ("group_idx", pa.int32()), ("spec_kind", pa.string()), ("sliding_window", pa.int32()),
                ("locality", pa.string()), ("session_id", pa.string()), ("lookahead_token_ids", INT_LIST))
BLOCK_FIELDS = (("block_index", pa.int32()), ("block_hash", pa.uint64()), ("parent_hash", pa.uint64()),
                ("salt", pa.string()), ("repeat", pa.bool_()))
LIFE_FIELDS = (("lifetime_s", pa.float64()), ("idle_s", pa.float64()), ("reuse_gap_s", pa.float64()))
TENANT_FIELDS = (("salt_named", pa.bool_()),)
CONTRACT_FIELDS = (("tokens_given", pa.int32()), ("parent_cached", pa.bool_()))
ROW_SCHEMA = pa.schema([*MESSAGE_FIELDS, *EVENT_FIELDS[:2], *BLOCK_FIELDS, ("token_ids", INT_LIST),
                        *EVENT_FIELDS[2:], *LIFE_FIELDS, *TENANT_FIELDS, *CONTRACT_FIELDS])


_GONE = object()
_event_fields = attrgetter(*(name for name, _ in EVENT_FIELDS[1:]))  # an event's tuple, made in C
_NO_EVENT = (None,) * (len(EVENT_FIELDS) - 1)
_UNNAMED = 1 << 31  # an event that names no salt: no block_index reaches it


def _columns(rows: list[tuple], width: int) -> list[tuple]:
    """Tuples as columns (zip in C); no rows is `width` empty columns."""
    return list(zip(*rows, strict=True)) if rows else [()] * width


def _salts(given: list[str | None] | None, n: int, parent: str | None) -> list[str | None]:
    """Each block's tenant: the salt it names, else the block before it's, the first block's else
    its parent's (`parent`). Usually only the first block names one (or none does)."""
    named = given[0] if given else None
    first = parent if named is None else named
    if not given or given.count(None) == n - (named is not None):  # no block after the first names one
        return [first] * n
    salts = [first, *given[1:]]
    for j in range(1, n):
        if salts[j] is None:
            salts[j] = salts[j - 1]
    return salts


def _first_named(given: list[str | None] | None) -> int:
    """The first block of an event that names a salt (the blocks from it on are named by the event)."""
    if not given:
        return _UNNAMED
    if given[0] is not None:
        return 0
    return next((j for j, s in enumerate(given) if s is not None), _UNNAMED)


def _spread(values: pa.Array, rows: np.ndarray) -> pa.Array:
    """A value per message (or event) as a value per row; most optional fields are all null."""
    if values.null_count == len(values):
        return pa.nulls(len(rows), values.type)
    return values.take(rows)


def _first_rows_only(per_message: pa.Array, first: np.ndarray) -> pa.Array:
    """The raw payload on each message's first row, null on its others: the payloads' bytes are
    shared, not copied (only the offsets are per row)."""
    _, offsets_in, data = per_message.cast(pa.binary()).buffers()  # all-null comes typed null
    ends = np.frombuffer(offsets_in, dtype=np.int32)[1:len(per_message) + 1]
    offsets = np.zeros(len(first) + 1, dtype=np.int32)
    offsets[1:][first] = ends  # a message's first row ends where its payload does
    np.maximum.accumulate(offsets, out=offsets)  # and its other rows are empty
    valid = first & np.asarray(per_message.is_valid())[np.cumsum(first) - 1]
    return pa.Array.from_buffers(pa.binary(), len(first), [pa.array(valid).buffers()[1], pa.py_buffer(offsets),
                                                          data or pa.py_buffer(b"")])


class EventRows:
    """Append decoded batches; `take()` returns the rows so far as one Arrow table and starts again.
    The cache state that decides repeats lives across takes."""

    def __init__(self) -> None:
        self._live: dict[tuple, dict[int, list]] = {}  # (replica, group, medium) -> hash -> [salt, cached, used, named]
        self._restart: dict[str, int] = {}
        self._clear()

    def _clear(self) -> None:
        self._messages: list[tuple] = []  # MESSAGE_FIELDS, one tuple per message
        self._where: list[str] = []
        self._events: list[tuple] = []  # EVENT_FIELDS but the index, one tuple per event
        self._event_index: list[int] = []
        self._event_msg: list[int] = []  # the message of each event
        self._event_rows: list[int] = []  # the rows of each event
        self._named_from: list[int] = []  # the first block each event names a salt for (_UNNAMED: none)
        self._first_new: list[int] = []  # the first block each event stores new (_UNNAMED: none)
        self._parent_cached: list[int] = []  # per event, that block's parent was cached: 1, 0; -1 no parent
        self._given: list[tuple[int, int]] = []  # (event, tokens it gave): stores whose tokens do not fit
        self._hashes: list[int | None] = []  # one per row (so are the four after it)
        self._repeats: list[bool | None] = []
        self._salts: list[str | None] = []
        self._lifetimes: list[float | None] = []  # removals
        self._idles: list[float | None] = []
        self._gaps: list[float | None] = []  # hits
        self._removed_named: list[int] = []  # per BlockRemoved row: its life's store named its salt (1, 0; -1 no life)
        self._parents: list[int | None] = []  # one per BlockStored row
        self._tokens: list = []
        self.rows = 0

    def __len__(self) -> int:
        return self.rows

    def forget(self, replica: str) -> None:
        """A replica's publisher restarted: what it had cached is gone."""
        for key in [k for k in self._live if k[0] == replica]:
            del self._live[key]

    def add(self, batch: Batch, *, step: int, replica: str, restart: int, seq: int, where: str,
            received: float | None = None, topic: str | None = None, payload: bytes | None = None) -> None:
        """One decoded message; `where` names it in errors (a file and line, a replica and seq)."""
        if self._restart.setdefault(replica, restart) != restart:
            self._restart[replica] = restart
            self.forget(replica)
        m = len(self._where)
        self._messages.append((step, replica, restart, seq, batch.ts, received, batch.rank, topic, payload))
        self._where.append(where)
        events, event_rows, hashes_out = batch.events, self._event_rows, self._hashes
        if not events:  # a batch with nothing in it still happened: one row without a kind
            self._events.append(_NO_EVENT)
            self._event_index.append(0)
            self._event_msg.append(m)
            self._named_from.append(_UNNAMED)
            self._first_new.append(_UNNAMED)
            self._parent_cached.append(-1)
            event_rows.append(1)
            hashes_out.append(None)
            for column in (self._repeats, self._salts, self._lifetimes, self._idles, self._gaps):
                column.append(None)
            self.rows += 1
            return
        self._events.extend(map(_event_fields, events))
        self._event_index.extend(range(len(events)))
        self._event_msg.extend(repeat(m, len(events)))
        repeats, salts, lifetimes, idles, gaps = self._repeats, self._salts, self._lifetimes, self._idles, self._gaps
        named_from, removed_named, rows, ts = self._named_from, self._removed_named, 0, batch.ts
        first_new, parent_cached = self._first_new, self._parent_cached
        live, group, medium = None, None, None  # the cache of the last event's KV group and medium
        for e in events:
            hashes, kind = e.block_hashes, e.kind
            n = len(hashes) or 1
            event_rows.append(n)
            rows += n
            if kind != "BlockStored" or not hashes:
                named_from.append(_UNNAMED)
                first_new.append(_UNNAMED)
                parent_cached.append(-1)
            if not hashes:
                hashes_out.append(None)
                for column in (repeats, salts, lifetimes, idles, gaps):
                    column.append(None)
                if kind == "AllBlocksCleared":
                    self.forget(replica)
                    live = None
                continue
            hashes_out.extend(hashes)
            if live is None or e.group_idx != group or e.medium != medium:
                group, medium = e.group_idx, e.medium
                live = self._live.setdefault((replica, group, medium), {})
            if kind == "BlockRemoved":
                for h in hashes:
                    life = live.pop(h, None)
                    if life is None:  # not cached: removed before, or cached before the capture began
                        repeats.append(True)
                        salts.append(None)
                        lifetimes.append(None)
                        idles.append(None)
                        removed_named.append(-1)
                    else:
                        repeats.append(False)
                        salts.append(life[0])
                        lifetimes.append(ts - life[1])
                        idles.append(ts - life[2])
                        removed_named.append(life[3])
                    gaps.append(None)
            elif kind == "BlockStored":
                self._parents.append(e.parent_hash)
                self._parents.extend(hashes[:-1])
                parent, given = live.get(e.parent_hash), e.salts
                first_named = _first_named(given)
                named_from.append(first_named)
                named = _salts(given, n, None if parent is None else parent[0])
                new = -1
                for j, (h, salt) in enumerate(zip(hashes, named, strict=True)):
                    life = live.get(h)
                    if life is None:  # its tenant, when it was cached and last used, whether its store named it
                        if new < 0:
                            new = j
                        live[h] = [salt, ts, ts, int(j >= first_named)]
                        repeats.append(False)
                        gaps.append(None)
                        salts.append(salt)
                    else:  # a hit, reported again (kv_cache_report_mode=full): the hash holds the salt, so
                        repeats.append(True)  # one naming none is the cached block's tenant
                        gaps.append(ts - life[2])
                        life[2] = ts
                        salts.append(life[0] if salt is None else salt)
                lifetimes.extend(repeat(None, n))
                idles.extend(repeat(None, n))
                first_new.append(_UNNAMED if new < 0 else new)  # after hits, its parent is a hit: cached
                parent_cached.append(1 if new > 0 or parent is not None else -1 if e.parent_hash is None else 0)
                tokens, size = e.token_ids, e.block_size
                if size is not None and len(tokens) == size * n:
                    self._tokens.extend(tokens)
                else:  # a breach of the contract: the blocks are kept, without tokens
                    self._given.append((len(event_rows) - 1, len(tokens)))
            else:
                for column in (repeats, salts, lifetimes, idles, gaps):
                    column.extend(repeat(None, n))
        self.rows += rows

    def take(self) -> pa.Table:
        """The rows added since the last take, as a table of ROW_SCHEMA. A token that is not a 32-bit
        int is a CaptureError naming its message."""
        counts = np.asarray(self._event_rows, dtype=np.int64)
        event_of_row = np.repeat(np.arange(len(counts)), counts)
        event_start = np.concatenate(([0], np.cumsum(counts)[:-1]))
        message_of_row = np.asarray(self._event_msg, dtype=np.int64)[event_of_row]
        first_of_message = np.ones(len(event_of_row), dtype=bool)
        first_of_message[1:] = message_of_row[1:] != message_of_row[:-1]
        cols: dict[str, pa.Array] = {}
        message_cols = [pa.array(values, type=typ) for (_, typ), values in
                        zip(MESSAGE_FIELDS, _columns(self._messages, len(MESSAGE_FIELDS)), strict=True)]
        for (name, _), values in zip(MESSAGE_FIELDS[:-1], message_cols, strict=False):
            cols[name] = _spread(values, message_of_row)
        cols["payload"] = _first_rows_only(message_cols[-1], first_of_message)
        event_cols = {name: pa.array(values, type=typ) for (name, typ), values in
                      zip(EVENT_FIELDS, [self._event_index, *_columns(self._events, len(EVENT_FIELDS) - 1)],
                          strict=True)}
        for name, _ in EVENT_FIELDS:
            cols[name] = _spread(event_cols[name], event_of_row)
        stored = pc.fill_null(pc.equal(cols["kind"], "BlockStored"), False)
        cols["block_hash"] = pa.array(self._hashes, type=pa.uint64())
        no_hash = pc.is_null(cols["block_hash"]).to_numpy(zero_copy_only=False)
        block_index = (np.arange(len(event_of_row)) - event_start[event_of_row]).astype(np.int32)
        cols["block_index"] = pa.array(block_index, mask=no_hash)
        stored_np = stored.to_numpy(zero_copy_only=False)
        named = block_index >= np.asarray(self._named_from, dtype=np.int64)[event_of_row]
        removed = pc.fill_null(pc.equal(cols["kind"], "BlockRemoved"), False).to_numpy(zero_copy_only=False) & ~no_hash
        life_named = np.full(len(named), -1, dtype=np.int8)  # a removal's: whether the store of its life named it
        life_named[removed] = np.asarray(self._removed_named, dtype=np.int8)
        cols["salt_named"] = pa.array(np.where(stored_np, named, life_named == 1),
                                      mask=~((stored_np & ~no_hash) | (life_named >= 0)))
        nth_stored = pa.array(np.cumsum(stored_np) - 1, mask=~stored_np)  # the row's place among stored rows
        cols["parent_hash"] = pa.array(self._parents, type=pa.uint64()).take(nth_stored)
        for name, typ, values in (("salt", pa.string(), self._salts), ("repeat", pa.bool_(), self._repeats),
                                  ("lifetime_s", pa.float64(), self._lifetimes), ("idle_s", pa.float64(), self._idles),
                                  ("reuse_gap_s", pa.float64(), self._gaps)):
            cols[name] = pa.array(values, type=typ)
        given = np.full(len(counts), -1, dtype=np.int64)
        for e, n in self._given:
            given[e] = n
        given_rows = given[event_of_row]
        unfit = given_rows >= 0
        cols["tokens_given"] = pa.array(given_rows.astype(np.int32), mask=~unfit)
        first_new = block_index == np.asarray(self._first_new, dtype=np.int64)[event_of_row]
        cached = np.asarray(self._parent_cached, dtype=np.int8)[event_of_row]
        cols["parent_cached"] = pa.array(cached == 1, mask=~first_new | (cached < 0))
        cols["token_ids"] = self._token_column(stored, cols["block_size"], event_cols, unfit)
        table = pa.table({name: cols[name] for name in ROW_SCHEMA.names}, schema=ROW_SCHEMA)
        self._clear()
        return table

    def _token_column(self, stored: pa.Array, block_size: pa.Array, event_cols: dict[str, pa.Array],
                      unfit: np.ndarray) -> pa.Array:
        """Each stored row's block of tokens; null where a store's tokens do not fit its blocks (`unfit`)."""
        lengths = pc.fill_null(pc.if_else(stored, block_size, 0), 0).to_numpy(zero_copy_only=False).astype(np.int32)
        lengths[unfit] = 0
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        try:
            values = pa.array(self._tokens, type=pa.int32())
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            raise CaptureError(self._bad_tokens(event_cols)) from None
        return pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(~stored.to_numpy(zero_copy_only=False)
                                                                                   | unfit))

    def _bad_tokens(self, event_cols: dict[str, pa.Array]) -> str:
        """Where the first token that is not a 32-bit int is (only on the error path, so it may be slow)."""
        start, unfit = 0, {e for e, _ in self._given}
        kinds, sizes = event_cols["kind"].to_pylist(), event_cols["block_size"].to_pylist()
        for e, (kind, size, rows) in enumerate(zip(kinds, sizes, self._event_rows, strict=True)):
            if kind != "BlockStored" or e in unfit:
                continue
            chunk = self._tokens[start:start + size * rows]
            start += size * rows
            bad = next((t for t in chunk if not isinstance(t, int) or isinstance(t, bool)
                        or not -(1 << 31) <= t < (1 << 31)), None)
            if bad is not None or any(isinstance(t, bool) for t in chunk):
                where = self._where[self._event_msg[e]]
                return (f"{where} event {event_cols['event_index'][e].as_py()}: token_ids must be a list of ints "
                        f"(or SGLang [token, next] pairs), found {bad!r:.40}")
        return "token_ids must be a list of ints"
