"""The block cache a KV-event stream implies, replayed a chunk of rows at a time in arrays.

Whether a store is a hit, which tenant a block belongs to and how long it lived depend on every
earlier event of its replica, KV group and medium. Replaying that one block at a time in Python was
most of a capture's import; here each (key, hash) is its own short history, so sorting a chunk's
operations by (key, hash, epoch, time) turns every question into a look at the operation before:
a store after a store is a hit, a removal after a store ends a life, and a parent lookup (a probe)
sees whatever the operation before it left. A replica's epoch counts its clears and restarts, which
empty its cache. What is cached when a chunk ends is carried into the next as lives that began
before it, so the answer is the same however the stream is cut.

A tenant salt the event does not name is its parent's: the salt of the life the probe found, which
may itself be inherited; those references point back in time and are resolved by pointer jumping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

NO_SALT = -1  # a salt code: none
NAMED_SALT = "_named_salt"  # the stateless rows' column: the salt a store's event names for the block
STATE_FIELDS = {"repeat": pa.bool_(), "salt": pa.string(), "lifetime_s": pa.float64(), "idle_s": pa.float64(),
                "reuse_gap_s": pa.float64(), "salt_named": pa.bool_(), "parent_cached": pa.bool_()}
STATE_SCHEMA = pa.schema(list(STATE_FIELDS.items()))
REPLAYED = ("step", "replica", "restart", "event_index", "kind", "block_index", "block_hash", "parent_hash", "ts",
            "medium", "group_idx", NAMED_SALT)  # the columns the state is worked out from


def fill(rows: pa.Table, state: pa.Table) -> pa.Table:
    """Stateless rows with their state in place of NAMED_SALT."""
    rows = rows.drop_columns([NAMED_SALT])
    for field, column in zip(state.schema, state.columns, strict=True):
        rows = rows.append_column(field, column)
    return rows


@dataclass(frozen=True)
class Ops:
    """A chunk's block operations in the order they happened (one per block of a store or removal).
    `salt` is the code of the salt the event names for the block (NO_SALT: none), `inherit` the probe
    of the event's parent whose salt it takes where it names none (-1: no parent)."""
    key: np.ndarray  # int64: the (replica, group, medium) code
    epoch: np.ndarray  # int64: the replica's clears and restarts before it, in this chunk
    hash: np.ndarray  # uint64
    ts: np.ndarray  # float64: the publisher's clock
    store: np.ndarray  # bool: a store (else a removal)
    salt: np.ndarray  # int64
    named: np.ndarray  # bool: the event names the block's salt
    inherit: np.ndarray  # int64


@dataclass(frozen=True)
class Probes:
    """Lookups of an event's parent, each just before the operation `at` (its event's first block)."""
    key: np.ndarray
    epoch: np.ndarray
    hash: np.ndarray
    at: np.ndarray  # int64


@dataclass(frozen=True)
class Replayed:
    """Per operation: a store of a cached block (a hit) or a removal of one not cached (`repeat`);
    the block's salt; a removal's lifetime and idle time and a hit's reuse gap (`has_life`: a
    removal of a cached block, `has_gap`: a hit); whether its life's store named its salt. Per probe:
    whether the parent was cached."""
    repeat: np.ndarray
    salt: np.ndarray
    lifetime: np.ndarray
    idle: np.ndarray
    has_life: np.ndarray
    gap: np.ndarray
    has_gap: np.ndarray
    life_named: np.ndarray  # bool, where has_life
    probe_cached: np.ndarray


@dataclass(frozen=True)
class _Lives:
    """Blocks cached when a chunk ended: per (key, hash) its salt, when it was cached and last used,
    and whether its store named its salt."""
    key: np.ndarray
    hash: np.ndarray
    salt: np.ndarray
    born: np.ndarray
    used: np.ndarray
    named: np.ndarray

    @classmethod
    def empty(cls) -> _Lives:
        return cls(*(np.empty(0, t) for t in (np.int64, np.uint64, np.int64, np.float64, np.float64, bool)))

    def pick(self, which: np.ndarray) -> _Lives:
        return _Lives(*(a[which] for a in (self.key, self.hash, self.salt, self.born, self.used, self.named)))

    @classmethod
    def join(cls, a: _Lives, b: _Lives) -> _Lives:
        return cls(*(np.concatenate(pair) for pair in zip(
            (a.key, a.hash, a.salt, a.born, a.used, a.named), (b.key, b.hash, b.salt, b.born, b.used, b.named),
            strict=True)))


_CARRIED, _STORE, _REMOVE, _PROBE = 0, 1, 2, 3


class CacheState:
    """The cache carried from chunk to chunk of one stream of rows."""

    def __init__(self) -> None:
        self._lives = _Lives.empty()
        self._restart: dict[str, int] = {}  # replica -> its publisher's restarts so far
        self._keys: dict[tuple, int] = {}  # (replica, group, medium) -> its code
        self._key_replicas: list[str] = []  # per code
        self._salt_codes: dict[str, int] = {}
        self._salt_names: list[str] = []  # per code

    def state(self, rows: pa.Table) -> pa.Table:
        """STATE_FIELDS for the stateless rows (rows.py; REPLAYED's columns suffice) of the chunk after the
        last."""
        n = rows.num_rows
        if not n:
            return STATE_SCHEMA.empty_table()
        block_index = _column(rows, "block_index")
        has_hash = _mask(block_index.is_valid())
        index = pc.fill_null(block_index, 0).to_numpy(zero_copy_only=False)
        event_start = np.flatnonzero(~has_hash | (index == 0))
        event_of_row = np.cumsum(~has_hash | (index == 0)) - 1
        kind = _column(rows, "kind").take(pa.array(event_start))
        stored = _mask(pc.equal(kind, "BlockStored")) & has_hash[event_start]  # per event
        removed = _mask(pc.equal(kind, "BlockRemoved")) & has_hash[event_start]
        cleared = _mask(pc.equal(kind, "AllBlocksCleared"))
        stored_row, removed_row = stored[event_of_row], removed[event_of_row]
        hashes = pc.fill_null(_column(rows, "block_hash"), 0).to_numpy(zero_copy_only=False)
        parents = _column(rows, "parent_hash").take(pa.array(event_start))
        has_parent = _mask(parents.is_valid()) & stored
        salt, named = self._named(_column(rows, NAMED_SALT))
        key, epoch, last_epoch = self._keys_and_epochs(rows, event_start, cleared)
        is_op = stored_row | removed_row
        op_rows = np.flatnonzero(is_op)
        op_of_row = np.cumsum(is_op) - 1
        probe_events = np.flatnonzero(has_parent)
        probe_of_event = np.full(len(event_start), -1)
        probe_of_event[probe_events] = np.arange(len(probe_events))
        op_event = event_of_row[op_rows]
        ts = _column(rows, "ts").take(pa.array(event_start)).to_numpy(zero_copy_only=False)
        got = self.replay(
            Ops(key[op_event], epoch[op_event], hashes[op_rows], ts[op_event], stored_row[op_rows], salt[op_rows],
                named[op_rows], probe_of_event[op_event]),
            Probes(key[probe_events], epoch[probe_events], pc.fill_null(parents, 0).to_numpy()[probe_events],
                   op_of_row[event_start[probe_events]]), last_epoch)

        def per_row(values: np.ndarray, valid: np.ndarray, typ: pa.DataType) -> pa.Array:
            out = np.zeros(n, values.dtype)
            out[op_rows] = values
            shown = np.zeros(n, bool)
            shown[op_rows] = valid
            return pa.array(out, type=typ, mask=~shown)

        cols = {"repeat": per_row(got.repeat, np.ones(len(op_rows), bool), pa.bool_()),
                "salt": pa.array(self._salt_names, pa.string()).take(per_row(got.salt, got.salt != NO_SALT,
                                                                              pa.int64())),
                "lifetime_s": per_row(got.lifetime, got.has_life, pa.float64()),
                "idle_s": per_row(got.idle, got.has_life, pa.float64()),
                "reuse_gap_s": per_row(got.gap, got.has_gap, pa.float64()),
                "salt_named": pc.if_else(pa.array(stored_row), pa.array(named),
                                         per_row(got.life_named, got.has_life, pa.bool_()))}
        new = stored_row.copy()
        new[op_rows] &= ~got.repeat
        new_rows = np.flatnonzero(new)
        first_new = np.full(len(event_start), -1)
        firsts = np.ones(len(new_rows), bool)
        firsts[1:] = event_of_row[new_rows][1:] != event_of_row[new_rows][:-1]
        first_new[event_of_row[new_rows[firsts]]] = index[new_rows[firsts]]
        parent_cached = np.zeros(len(event_start), bool)
        parent_cached[probe_events] = got.probe_cached
        cached = np.where((first_new > 0) | parent_cached, 1, np.where(has_parent, 0, -1))[event_of_row]
        at_first_new = (index == first_new[event_of_row]) & stored_row
        cols["parent_cached"] = pa.array(cached == 1, mask=~at_first_new | (cached < 0))
        return pa.table(cols, schema=STATE_SCHEMA)

    def _named(self, salts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Each row's named salt as a code (NO_SALT: none), and whether there is one."""
        encoded = salts.dictionary_encode()
        codes = np.asarray([self._code(self._salt_codes, self._salt_names, name)
                            for name in encoded.dictionary.to_pylist()] + [NO_SALT], dtype=np.int64)
        at = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False)
        return codes[at], at >= 0

    def _keys_and_epochs(self, rows: pa.Table, event_start: np.ndarray,
                         cleared: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per event, its cache's code (replica, KV group, medium) and its replica's epoch (the clears
        and restarts before it in this chunk); per code, the epoch its replica ends the chunk in."""
        first = pa.array(event_start)
        replica_code, replica_names = _codes(_column(rows, "replica").take(first))
        medium, media = _codes(_column(rows, "medium").take(first))
        group = _column(rows, "group_idx").take(first)
        grouped = _mask(group.is_valid())
        groups, group_code = np.unique(np.where(grouped, pc.fill_null(group, 0).to_numpy(), 0), return_inverse=True)
        group_code = np.where(grouped, group_code.reshape(-1), -1)
        combined = (replica_code * (len(media) + 1) + medium + 1) * (len(groups) + 1) + group_code + 1
        combos, inverse = np.unique(combined, return_inverse=True)
        to_key = np.asarray([self._key(replica_names[c // ((len(media) + 1) * (len(groups) + 1))],
                                       _at(groups, c % (len(groups) + 1) - 1),
                                       _at(media, c // (len(groups) + 1) % (len(media) + 1) - 1))
                             for c in combos.tolist()], dtype=np.int64)
        key = to_key[inverse.reshape(-1)]
        restarted = self._restarted(_column(rows, "restart").take(first).to_numpy(zero_copy_only=False), replica_code,
                                    replica_names)
        restarted &= pc.equal(_column(rows, "event_index").take(first), 0).to_numpy(zero_copy_only=False)
        resets = restarted.astype(np.int64) + cleared
        epoch = _cumsum_by(replica_code, resets)
        ends = dict(zip(replica_names, np.bincount(replica_code, weights=resets, minlength=len(replica_names)),
                        strict=True))
        last_epoch = np.asarray([ends.get(r, 0) for r in self._key_replicas], dtype=np.int64)
        return key, epoch - cleared, last_epoch

    def _restarted(self, restarts: np.ndarray, replica_code: np.ndarray, replica_names: list[str]) -> np.ndarray:
        """Per event, whether its replica's publisher restarted since the replica's event before it (or
        since the chunk before, for its first)."""
        order = np.argsort(replica_code, kind="stable")
        code, restart = replica_code[order], restarts[order]
        firsts = np.flatnonzero(np.concatenate(([True], code[1:] != code[:-1])))
        before = np.concatenate(([0], restart[:-1]))
        before[firsts] = [self._restart.get(replica_names[r], restart[i]) for r, i in zip(code[firsts].tolist(),
                                                                                            firsts.tolist(),
                                                                                            strict=True)]
        lasts = np.concatenate((firsts[1:], [len(code)])) - 1
        self._restart.update(zip([replica_names[r] for r in code[lasts].tolist()], restart[lasts].tolist(),
                                 strict=True))
        out = np.empty(len(order), bool)
        out[order] = restart != before
        return out

    def _key(self, replica: str, group: int | None, medium: str | None) -> int:
        code = self._keys.get((replica, group, medium))
        if code is None:
            code = self._keys[(replica, group, medium)] = len(self._key_replicas)
            self._key_replicas.append(replica)
        return code

    @staticmethod
    def _code(codes: dict[str, int], names: list[str], name: str) -> int:
        code = codes.get(name)
        if code is None:
            code = codes[name] = len(names)
            names.append(name)
        return code

    def replay(self, ops: Ops, probes: Probes, last_epoch: np.ndarray) -> Replayed:
        """Replay a chunk; `last_epoch[key]` is the epoch each key's replica ends the chunk in (what was
        cached in an earlier epoch is gone)."""
        lives = self._lives
        here = np.sort(np.concatenate((ops.hash, probes.hash)))
        touched = here[np.minimum(np.searchsorted(here, lives.hash), len(here) - 1)] == lives.hash if len(here) else (
            np.zeros(len(lives.hash), bool))
        if not touched.all():
            kept = lives.pick(~touched)
            untouched = kept.pick(last_epoch[kept.key] == 0)  # carried on as they are, unless cleared
            lives = lives.pick(touched)
        else:
            untouched = _Lives.empty()
        c, k, q = len(lives.key), len(ops.key), len(probes.key)
        kind = np.concatenate((np.full(c, _CARRIED), np.where(ops.store, _STORE, _REMOVE), np.full(q, _PROBE)))
        key = np.concatenate((lives.key, ops.key, probes.key))
        epoch = np.concatenate((np.zeros(c, np.int64), ops.epoch, probes.epoch))
        hashes = np.concatenate((lives.hash, ops.hash, probes.hash))
        when = np.concatenate((np.full(c, -1), 2 * np.arange(k) + 1, 2 * probes.at))  # a probe precedes its op
        order = _grouped(hashes, key * (int(epoch.max(initial=0)) + 1) + epoch, when)
        key, epoch, hashes, kind = key[order], epoch[order], hashes[order], kind[order]
        ts = np.concatenate((lives.born, ops.ts, np.zeros(q)))[order]  # when each life began, if it did here
        used = np.concatenate((lives.used, ops.ts, np.zeros(q)))[order]  # when it was last used, after it
        named = np.concatenate((lives.named, ops.named, np.zeros(q, bool)))[order]
        at = np.arange(len(order))
        inverse = np.empty_like(order)
        inverse[order] = at

        starts = np.ones(len(order), bool)
        starts[1:] = (key[1:] != key[:-1]) | (hashes[1:] != hashes[:-1]) | (epoch[1:] != epoch[:-1])
        start = np.maximum.accumulate(np.where(starts, at, 0))
        last_real = np.maximum.accumulate(np.where(kind != _PROBE, at, -1))
        before = np.concatenate(([-1], last_real[:-1]))  # the operation before each, on its (key, hash, epoch)
        before[before < start] = -1
        cached = (before >= 0) & (kind[np.maximum(before, 0)] <= _STORE)
        begins = (kind == _CARRIED) | ((kind == _STORE) & ~cached)
        life = np.maximum.accumulate(np.where(begins, at, -1))  # the life each belongs to, where cached

        probe_at = inverse[c + k:]
        probe_cached = cached[probe_at]
        salt = np.concatenate((lives.salt, ops.salt, np.full(q, NO_SALT)))[order]
        refer = np.full(len(order), -1)
        op_at = inverse[c:c + k]
        parent = ops.inherit
        inherits = (ops.salt == NO_SALT) & (parent >= 0)
        inherits[inherits] = probe_cached[parent[inherits]]
        refer[op_at[inherits]] = life[probe_at[parent[inherits]]]
        _resolve(salt, refer)

        kind_op, cached_op, before_op, life_op = kind[op_at], cached[op_at], before[op_at], life[op_at]
        hit = (kind_op == _STORE) & cached_op
        ends = (kind_op == _REMOVE) & cached_op
        salt_op = salt[op_at]
        out_salt = np.where(hit & (salt_op == NO_SALT), salt[life_op], salt_op)
        out_salt = np.where(kind_op == _REMOVE, np.where(ends, salt[life_op], NO_SALT), out_salt)
        ts_op = ops.ts
        last_used = used[np.maximum(before_op, 0)]
        self._lives = _Lives.join(untouched, _carry(key, hashes, epoch, kind, starts, start, last_real, life, salt,
                                                    ts, used, named, last_epoch))
        return Replayed(repeat=np.where(kind_op == _STORE, cached_op, ~cached_op), salt=out_salt,
                        lifetime=ts_op - ts[life_op], idle=ts_op - last_used, has_life=ends,
                        gap=ts_op - last_used, has_gap=hit, life_named=named[life_op], probe_cached=probe_cached)


def _carry(key: np.ndarray, hashes: np.ndarray, epoch: np.ndarray, kind: np.ndarray, starts: np.ndarray,
           start: np.ndarray, last_real: np.ndarray, life: np.ndarray, salt: np.ndarray, born: np.ndarray,
           used: np.ndarray, named: np.ndarray, last_epoch: np.ndarray) -> _Lives:
    """What is cached when the chunk ends: each (key, hash)'s last operation, in its replica's last
    epoch, a store or a carried life."""
    ends = np.flatnonzero(np.concatenate((starts[1:], [True]))) if len(key) else np.empty(0, np.int64)
    last = last_real[ends]
    keep = (last >= start[ends]) & (kind[np.maximum(last, 0)] <= _STORE) & (epoch[ends] == last_epoch[key[ends]])
    ends, last = ends[keep], last[keep]
    began = life[last]
    return _Lives(key[ends], hashes[ends], salt[began], born[began], used[last], named[began])


def _at(values: np.ndarray | list, i: int) -> object:
    """values[i] as Python's, None for -1."""
    return None if i < 0 else values[i].item() if isinstance(values, np.ndarray) else values[i]


def _column(rows: pa.Table, name: str) -> pa.Array:
    return rows.column(name).combine_chunks()


def _mask(values: pa.Array) -> np.ndarray:
    return pc.fill_null(values, False).to_numpy(zero_copy_only=False)


def _codes(values: pa.Array) -> tuple[np.ndarray, list]:
    """Each value's place among the distinct values (-1 for null), and the distinct values."""
    encoded = values.dictionary_encode()
    return pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False), encoded.dictionary.to_pylist()


def _cumsum_by(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The running sum of `values` within each group, in order."""
    if len(group) and (group == group[0]).all():
        return np.cumsum(values)
    order = np.argsort(group, kind="stable")
    sums = np.cumsum(values[order])
    firsts = np.ones(len(order), bool)
    firsts[1:] = group[order][1:] != group[order][:-1]
    out = np.empty_like(sums)
    out[order] = sums - np.maximum.accumulate(np.where(firsts, sums - values[order], 0))
    return out


def _grouped(hashes: np.ndarray, group: np.ndarray, when: np.ndarray) -> np.ndarray:
    """The order that sorts by (group, hash) and keeps each's elements in time order: one sort of
    distinct 64-bit keys (hash rank, group, time rank), where several sorts would take twice as long."""
    _, rank = np.unique(hashes, return_inverse=True)
    time = np.empty(len(when), np.int64)
    time[np.argsort(when, kind="stable")] = np.arange(len(when))
    groups = int(group.max(initial=0)) + 1
    bits = max(1, len(when)).bit_length()
    if (len(hashes) * groups) >> (62 - bits):  # no room in 63 bits: sort by each key in turn
        return np.lexsort((time, rank, group))
    return np.argsort(((group * len(hashes) + rank.reshape(-1)) << bits) | time)


def _resolve(value: np.ndarray, refer: np.ndarray) -> None:
    """Where `refer` points at another element (always one earlier in time), take its value, following
    references until none is left (pointer jumping: a chain of n links takes log n rounds)."""
    pending = np.flatnonzero(refer >= 0)
    while len(pending):
        target = refer[pending]
        onward, found = refer[target], value[target]
        done = onward < 0
        value[pending[done]] = found[done]
        refer[pending[done]] = -1
        refer[pending[~done]] = onward[~done]
        pending = pending[~done]
