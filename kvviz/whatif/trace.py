"""A request trace reduced to what a prefix cache sees: per request, in arrival order, the keys of its
full blocks, in numpy arrays (CSR: one offsets array into one int64 array of keys), so that a replay
over 300,000 lookups is array work, not 300,000 Python objects.

Only full blocks are cacheable, as in vLLM, which hashes and caches only full blocks: a prompt's partial
last block never hits and is never stored, so it has no key here (its tokens still count as prompt
tokens). Keys are dense (0 .. distinct_blocks - 1) and chained: two lookups share a key exactly when
their whole prefixes are equal (every earlier id and this one), which is what a chained block hash
means; a Mooncake trace's ids are already chained, so this changes nothing for them, and a trace whose
ids are not cannot make a block reachable through another prefix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import CaptureError, KvvizError
from ..util.jsonio import parse_json


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests in arrival order: per request its times and lengths, and keys[offsets[r]:offsets[r+1]],
    the keys of its full blocks from the first; tenant and conversation, when known, say whose request
    it was (the salting replay keys blocks by them)."""

    timestamp: np.ndarray  # float64, ms from the trace's start, non-decreasing
    input_length: np.ndarray  # int64, prompt tokens
    output_length: np.ndarray  # int64
    offsets: np.ndarray  # int64, requests + 1
    keys: np.ndarray  # int64, dense chained keys of full blocks
    block_size: int = 512
    tenant: np.ndarray | None = None  # int64 per request
    conversation: np.ndarray | None = None  # int64 per request

    @property
    def requests(self) -> int:
        return len(self.input_length)

    @property
    def lookups(self) -> int:
        """Full-block lookups: the denominator of the block hit rate."""
        return len(self.keys)

    @property
    def prompt_tokens(self) -> int:
        """Every prompt token, partial blocks included: the denominator of the token hit rate."""
        return int(self.input_length.sum())

    @cached_property
    def distinct_blocks(self) -> int:
        """Capacity at which nothing is ever evicted: the unbounded cache."""
        return int(self.keys.max()) + 1 if len(self.keys) else 0

    @cached_property
    def request_of(self) -> np.ndarray:
        """The request of each lookup."""
        return np.repeat(np.arange(self.requests), np.diff(self.offsets))

    @cached_property
    def depth(self) -> np.ndarray:
        """Each lookup's block position in its request (0 = the first block)."""
        return np.arange(self.lookups) - self.offsets[self.request_of]

    @cached_property
    def touch_order(self) -> np.ndarray:
        """Per lookup, its place in the order a replay touches blocks (a permutation of range(lookups)):
        requests in turn, each deepest block first, as vLLM frees a finished request's blocks tail first
        into its LRU free queue, so that of one request's blocks the first stays longest."""
        counts = np.diff(self.offsets)[self.request_of]
        return 2 * self.offsets[self.request_of] + counts - 1 - np.arange(self.lookups)

    def rekeyed(self, salt: np.ndarray) -> Trace:
        """The same trace with each request's keys made distinct per value of salt (one per request):
        blocks are shared only between requests with the same salt, as with vLLM's cache_salt."""
        pair = salt[self.request_of].astype(np.int64) * max(self.distinct_blocks, 1) + self.keys
        return replace(self, keys=np.unique(pair, return_inverse=True)[1].astype(np.int64))


def trace_from_blocks(hash_ids: Sequence[Sequence[int]], input_length: Sequence[int], *,
                      output_length: Sequence[int] | None = None, timestamp: Sequence[float] | None = None,
                      block_size: int = 512) -> Trace:
    """A Trace from each request's block ids (one per block_size tokens, the last block possibly
    partial) and prompt length; what tests and read_mooncake build from. Assumes valid input."""
    counts = np.fromiter((len(h) for h in hash_ids), np.int64, len(hash_ids))
    ids = np.fromiter((x for h in hash_ids for x in h), np.int64, int(counts.sum()))
    n = len(counts)
    inp = np.asarray(input_length, np.int64).reshape(n)
    full = np.minimum(counts, inp // block_size)  # the partial last block has no key
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(full, out=offsets[1:])
    starts = np.repeat(np.cumsum(counts) - counts, full)
    keep = starts + (np.arange(len(starts)) - np.repeat(offsets[:-1], full))
    return Trace(timestamp=np.zeros(n) if timestamp is None else np.asarray(timestamp, np.float64).reshape(n),
                 input_length=inp,
                 output_length=np.zeros(n, np.int64) if output_length is None else np.asarray(output_length, np.int64),
                 offsets=offsets, keys=_chain(ids[keep], offsets), block_size=block_size)


def _chain(ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Dense keys, equal exactly where the ids of the whole prefix are equal: built depth by depth,
    each key the dense number of the pair (parent's key, own id)."""
    keys = np.empty(len(ids), np.int64)
    if not len(ids):
        return keys
    dense = np.unique(ids, return_inverse=True)[1].astype(np.int64)
    counts = np.diff(offsets)
    depth = np.arange(len(ids)) - np.repeat(offsets[:-1], counts)
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(int(depth.max()) + 2))
    width, made = int(dense.max()) + 1, 0
    for d in range(len(bounds) - 1):
        at = order[bounds[d]:bounds[d + 1]]
        parent = keys[at - 1] + 1 if d else 0
        uniq, inv = np.unique(parent * width + dense[at], return_inverse=True)
        keys[at] = made + inv
        made += len(uniq)
    return keys


def read_mooncake(path: str | Path, *, block_size: int = 512) -> Trace:
    """A Mooncake FAST'25 trace (one JSON object a line: timestamp in ms, input_length, output_length,
    hash_ids, one id per block_size tokens), refused whole with a CaptureError naming the line and
    field when any line is not JSON, lacks a field, has a negative length, goes back in time or has
    more hash_ids than its input needs. Blank lines are skipped."""
    if block_size < 1:
        raise KvvizError(f"block_size must be at least 1, got {block_size}")
    stamps: list[float] = []
    lengths: list[tuple[int, int]] = []
    blocks: list[list[int]] = []
    numbers: list[int] = []  # each request's line
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}: line {n}"
            row = parse_json(line, where, CaptureError, one_line=True)
            if not isinstance(row, dict):
                raise CaptureError(f"{where}: not a JSON object")
            stamp = _field(row, "timestamp", where, (int, float))
            if not math.isfinite(stamp):
                raise CaptureError(f"{where}: timestamp {stamp} is not a finite number")
            if stamps and stamp < stamps[-1]:
                raise CaptureError(f"{where}: timestamp {stamp} goes back from {stamps[-1]}, the request before's")
            inp, out = (_field(row, k, where, int) for k in ("input_length", "output_length"))
            for k, v in (("input_length", inp), ("output_length", out)):
                if v < 0:
                    raise CaptureError(f"{where}: {k} is {v}, a length cannot be negative")
            ids = _field(row, "hash_ids", where, list)
            if not all(type(x) is int for x in ids):
                raise CaptureError(f"{where}: hash_ids must hold only integers")
            if len(ids) > (need := -(-inp // block_size)):
                raise CaptureError(f"{where}: hash_ids has {len(ids)} blocks, more than the {need} that "
                                   f"input_length {inp} needs at {block_size} tokens a block")
            stamps.append(stamp)
            lengths.append((inp, out))
            blocks.append(ids)
            numbers.append(n)
    if not blocks:
        raise CaptureError(f"{path}: no requests in the trace")
    inp, out = np.array(lengths, np.int64).T
    try:
        return trace_from_blocks(blocks, inp, output_length=out, timestamp=stamps, block_size=block_size)
    except OverflowError:
        at = next(i for i, ids in enumerate(blocks) if any(not -(1 << 63) <= x < 1 << 63 for x in ids))
        raise CaptureError(f"{path}: line {numbers[at]}: hash_ids holds an id that does not fit in 64 bits") from None


def _field(row: dict, name: str, where: str, kind: type | tuple[type, ...]) -> object:
    """row[name], refused when missing or of another type (a bool is not a number here)."""
    if name not in row:
        raise CaptureError(f"{where}: {name} is missing")
    v = row[name]
    if isinstance(v, bool) or not isinstance(v, kind):
        what = "a list" if kind is list else "an integer" if kind is int else "a number"
        raise CaptureError(f"{where}: {name} must be {what}, got {v!r:.40}")
    return v
