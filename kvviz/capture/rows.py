"""Captured messages as block-event rows in Arrow columns: one row per block of every event (one row
for an event without blocks, and one for a batch without events, so every message keeps a row).

Python touches each message and event once and no block: message fields (step, replica, seq, ts,
payload ...) and event fields (kind, medium, group ...) are kept once and spread over their rows by
Arrow `take`, and an event's hashes and tokens become columns in C. What depends on the events before
(the columns below that follow the cache) is worked out from those columns by cache_state.py, in
this process or, for a capture decoded by several, in the one that takes the chunks in order. The
same builder feeds the import and the capture dataset (into Parquet), so both hold the same rows.

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

from itertools import chain, compress, repeat
from operator import attrgetter, is_not

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import CaptureError
from . import vllm_layout
from .cache_state import NAMED_SALT, STATE_FIELDS, CacheState, fill
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
STATELESS_SCHEMA = pa.schema([*(f for f in ROW_SCHEMA if f.name not in STATE_FIELDS), (NAMED_SALT, pa.string())])


_event_fields = attrgetter(*(name for name, _ in EVENT_FIELDS[1:]))  # an event's tuple, made in C
_block_fields = attrgetter("block_hashes", "parent_hash", "salts", "token_ids")
_NO_EVENT = (None,) * (len(EVENT_FIELDS) - 1)
_NO_BLOCKS = ([], None, None, [])


def _columns(rows: list[tuple], width: int) -> list[tuple]:
    """Tuples as columns (zip in C); no rows is `width` empty columns."""
    return list(zip(*rows, strict=True)) if rows else [()] * width


def _mask(values: pa.Array) -> np.ndarray:
    """True where a nullable Arrow boolean is true."""
    return pc.fill_null(values, False).to_numpy(zero_copy_only=False)


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
    The cache state that decides repeats lives across takes (cache_state.py); `stateless()` returns
    the rows without it, for a CacheState elsewhere (another process) to fill in order."""

    def __init__(self) -> None:
        self._cache = CacheState()
        self._clear()

    def _clear(self) -> None:
        self._messages: list[tuple] = []  # MESSAGE_FIELDS, one tuple per message
        self._where: list[str] = []
        self._events: list[tuple] = []  # EVENT_FIELDS but the index, one tuple per event
        self._event_index: list[int] = []
        self._event_msg: list[int] = []  # the message of each event
        self._blocks: list[tuple] = []  # per event: hashes, parent, salts named per block, tokens
        self._unchecked = False  # a batch the general decoder gave: its tokens are not known to be int32
        self.rows = 0

    def __len__(self) -> int:
        return self.rows

    def add(self, batch: Batch, *, step: int, replica: str, restart: int, seq: int, where: str,
            received: float | None = None, topic: str | None = None, payload: bytes | None = None) -> None:
        """One decoded message; `where` names it in errors (a file and line, a replica and seq)."""
        m = len(self._where)
        self._unchecked = self._unchecked or batch.__class__ is not vllm_layout.Batch
        self._messages.append((step, replica, restart, seq, batch.ts, received, batch.rank, topic, payload))
        self._where.append(where)
        events = batch.events
        if not events:  # a batch with nothing in it still happened: one row without a kind
            self._events.append(_NO_EVENT)
            self._event_index.append(0)
            self._event_msg.append(m)
            self._blocks.append(_NO_BLOCKS)
            self.rows += 1
            return
        blocks = list(map(_block_fields, events))
        self._events.extend(map(_event_fields, events))
        self._event_index.extend(range(len(events)))
        self._event_msg.extend(repeat(m, len(events)))
        self._blocks.extend(blocks)
        hashes = [b[0] for b in blocks]
        self.rows += sum(map(len, hashes)) + hashes.count([])

    def take(self) -> pa.Table:
        """The rows added since the last take, as a table of ROW_SCHEMA. A token that is not a 32-bit
        int is a CaptureError naming its message."""
        rows = self.stateless()
        return fill(rows, self._cache.state(rows)).select(ROW_SCHEMA.names)

    def stateless(self) -> pa.Table:
        """The rows added since the last take, less what the cache state decides (STATE_FIELDS), with
        NAMED_SALT: per stored block, the salt its event names for it or for a block before it."""
        if not self.rows:
            return STATELESS_SCHEMA.empty_table()
        hash_lists, parents, named_salts, token_lists = _columns(self._blocks, 4)
        sizes = np.fromiter(map(len, hash_lists), np.int64, len(hash_lists))
        counts = np.maximum(sizes, 1)
        event_of_row = np.repeat(np.arange(len(counts)), counts)
        event_start = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
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

        blocks = sizes > 0
        stored = _mask(pc.equal(event_cols["kind"], "BlockStored")) & blocks  # per event
        has_hash = np.repeat(blocks, counts)
        hashes = np.zeros(len(event_of_row), np.uint64)
        hashes[has_hash] = np.fromiter(chain.from_iterable(hash_lists), np.uint64, int(sizes.sum()))
        cols["block_hash"] = pa.array(hashes, mask=~has_hash)
        block_index = (np.arange(len(event_of_row)) - event_start[event_of_row]).astype(np.int32)
        cols["block_index"] = pa.array(block_index, mask=~has_hash)
        stored_row = stored[event_of_row]
        parent = pa.array(parents, type=pa.uint64())
        no_parent = ~_mask(parent.is_valid())[event_of_row] & (block_index == 0)
        parent_hash = np.where(block_index == 0, pc.fill_null(parent, 0).to_numpy()[event_of_row],
                               np.concatenate((np.zeros(1, np.uint64), hashes[:-1])))
        cols["parent_hash"] = pa.array(parent_hash, mask=~stored_row | no_parent)
        cols[NAMED_SALT] = _named_salts(named_salts, stored, event_start, counts, event_of_row)

        given = np.fromiter(map(len, token_lists), np.int64, len(token_lists))
        size = event_cols["block_size"]
        fits = stored & _mask(pc.equal(pc.multiply(size.cast(pa.int64()), pa.array(sizes)), pa.array(given)))
        unfit = (stored & ~fits)[event_of_row]
        cols["tokens_given"] = pa.array(given[event_of_row].astype(np.int32), mask=~unfit)
        cols["token_ids"] = self._token_column(token_lists, fits, stored_row & ~unfit, size, event_of_row, event_cols)
        table = pa.table({name: cols[name] for name in STATELESS_SCHEMA.names}, schema=STATELESS_SCHEMA)
        self._clear()
        return table

    def _token_column(self, token_lists: tuple, fits: np.ndarray, shown: np.ndarray, size: pa.Array,
                      event_of_row: np.ndarray, event_cols: dict[str, pa.Array]) -> pa.Array:
        """Each stored row's block of tokens (`shown`); null where a store's tokens do not fit its blocks."""
        lengths = np.where(shown, pc.fill_null(size, 0).to_numpy(zero_copy_only=False)[event_of_row], 0)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        tokens = chain.from_iterable(compress(token_lists, fits.tolist()))
        if not self._unchecked:  # msgspec checked every token is an int32 (vllm_layout): numpy reads them faster
            values = pa.array(np.fromiter(tokens, np.int32, int(offsets[-1])))
        else:
            try:
                values = pa.array(tokens, type=pa.int32(), size=int(offsets[-1]))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
                raise CaptureError(self._bad_tokens(token_lists, fits, event_cols)) from None
        return pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(~shown))

    def _bad_tokens(self, token_lists: tuple, fits: np.ndarray, event_cols: dict[str, pa.Array]) -> str:
        """Where the first token that is not a 32-bit int is (only on the error path, so it may be slow)."""
        for e in np.flatnonzero(fits):
            chunk = token_lists[e]
            bad = next((t for t in chunk if not isinstance(t, int) or isinstance(t, bool)
                        or not -(1 << 31) <= t < (1 << 31)), None)
            if bad is not None or any(isinstance(t, bool) for t in chunk):
                where = self._where[self._event_msg[e]]
                return (f"{where} event {event_cols['event_index'][e].as_py()}: token_ids must be a list of ints "
                        f"(or SGLang [token, next] pairs), found {bad!r:.40}")
        return "token_ids must be a list of ints"


def _named_salts(named_salts: tuple, stored: np.ndarray, event_start: np.ndarray, counts: np.ndarray,
                 event_of_row: np.ndarray) -> pa.Array:
    """Each stored block's salt as its event names it: vLLM names a chain's salt on its first block,
    so a block the event names none for carries the one before it's (null: the event names none yet)."""
    naming = stored & np.fromiter(map(is_not, named_salts, repeat(None)), bool, len(named_salts))
    given = np.full(len(event_of_row), -1)
    names = pa.array(list(chain.from_iterable(compress(named_salts, naming))), pa.string())
    rows = np.repeat(event_start[naming], counts[naming]) + _within(counts[naming])
    given[rows[_mask(names.is_valid())]] = np.flatnonzero(_mask(names.is_valid()))
    at = np.arange(len(given))
    last = np.maximum.accumulate(np.where(given >= 0, at, -1))
    named = last >= event_start[event_of_row]
    return names.take(pa.array(given[np.maximum(last, 0)], mask=~named))


def _within(counts: np.ndarray) -> np.ndarray:
    """0, 1, .. count - 1 for each count, concatenated."""
    starts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum())) - np.repeat(starts, counts)
