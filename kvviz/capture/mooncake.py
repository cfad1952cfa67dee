"""A Mooncake trace (the FAST'25 release: one JSON object a line, `timestamp` in ms, `input_length`,
`output_length` and `hash_ids`, chained prefix-block ids, one per 512 tokens) imported as a capture
run: a capture dataset in the documented layout under the store's captures folder, registered in place,
so the capture views, SQL and explain read it as they read a vLLM capture.

The trace is what a prefix cache was asked, not what one did: it holds no tokens, salts, evictions or
capacity. So the import is the unbounded cache's capture: one replica, `mooncake`; one message per
request, in file order (step = the request's place, ts = its timestamp in seconds); a request's full
blocks stored in order (the partial last block is no block: vLLM caches full blocks only), each a
`repeat` (a hit, as vLLM reports one under kv_cache_report_mode="full") where an earlier request stored
its id, and nothing ever removed. A request's blocks are one BlockStored event, the whole chain (its
hits, then the blocks it stored new), as the full report mode publishes it: the what-if replay takes
each event for one request's lookup, and explain takes the blocks after the event's hits for one
segment. A request without a full block keeps its message as one row without a kind, as the dataset
keeps every message.

Rows are built with numpy over all blocks at once (no Python work per block): the conversation
trace's 276,491 blocks import in well under a second of it.
"""

from __future__ import annotations

import json
import shutil
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import KvvizError
from ..store import RunStore
from ..whatif import read_mooncake
from .dataset import FILE_SCHEMA, write_manifest
from .events import CaptureError
from .import_vllm import TRACE_MODEL, _begin, _discard, _import
from .jsonl_dataset import Progress

REPLICA = "mooncake"  # the one replica: a trace is one cache's requests (a name, not replica-0, says whose)
BLOCK_SIZE = 512  # tokens a hash id stands for in Mooncake's release
FORMAT = "mooncake"  # what the run's workload says the capture was
PART_ROWS = 1_000_000  # rows a part holds, as the capture writes them (--rotate-rows)
GROUP_ROWS = 100_000  # rows a row group holds
CAPTURE_FIELDS = ("format", "payload", "seq", "replica", "restart", "topic", "received")  # a JSONL capture's
SNIFF_BYTES = 16 << 20  # a first line longer than this is no Mooncake request


def is_mooncake(path: str | Path) -> bool:
    """Is the file a Mooncake trace, by content: its first non-empty line a JSON object with `hash_ids`
    or `input_length` and none of a kvviz JSONL capture's fields (so that a trace whose first line
    lacks a field is still read as a trace, and refused naming it)."""
    with open(path, "rb") as f:
        while line := f.readline(SNIFF_BYTES):
            if line.strip():
                break
        else:
            return False
    if len(line) >= SNIFF_BYTES and not line.endswith(b"\n"):
        return False
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # not JSON (or not UTF-8): not a trace
        return False
    return (isinstance(row, dict) and ("hash_ids" in row or "input_length" in row)
            and not any(k in row for k in CAPTURE_FIELDS))


def import_mooncake(path: str | Path, store: RunStore, progress: Progress | None = None,
                    sha256: str | None = None) -> str:
    """Import a Mooncake trace as a new capture run and return its id: its dataset is written under
    store.captures_dir/RUN_ID and registered in place. `sha256`, the file's, is kept in the run's
    workload, where a later import of the same bytes finds it. A trace refused at any line (CaptureError
    naming the line and field, from kvviz.whatif.read_mooncake) leaves no run and no file."""
    path = Path(path)
    total = max(path.stat().st_size, 1)
    if progress is not None:
        progress(0, total)
    try:
        trace = read_mooncake(path, block_size=BLOCK_SIZE)
    except CaptureError:
        raise
    except KvvizError as e:  # the reader's refusals are the upload's: said as they are
        raise CaptureError(str(e)) from None
    ids = _hash_ids(path, trace.requests)
    said = {"capture": path.name, "format": FORMAT, "block_size": BLOCK_SIZE, "requests": trace.requests,
            "blocks": trace.lookups, "prompt_tokens": trace.prompt_tokens} | ({"sha256": sha256} if sha256 else {})
    run_id = _begin(store, path, said, TRACE_MODEL)  # listed as running while its dataset is written
    folder = store.captures_dir / run_id
    try:
        table = trace_rows(trace.timestamp, trace.input_length, ids)
        files = write_parts(table, folder / f"replica={REPLICA}")
        write_manifest(folder, {REPLICA: ""}, trace.requests, complete=True)
        if progress is not None:
            progress(total, total)
        return _import(path, store, (), said | {"files": files}, steps=trace.requests,
                       source=str(folder.resolve()), run_id=run_id)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        with store.write() as con:
            _discard(store, con, run_id)
        raise


def _hash_ids(path: Path, requests: int) -> list[list[int]]:
    """Each request's hash_ids as the file gives them (read_mooncake has checked every line and keeps
    only dense keys, not the ids: the dataset's block hashes are the trace's own ids)."""
    with open(path, "rb") as f:
        ids = [json.loads(line)["hash_ids"] for line in f if line.strip()]
    if len(ids) != requests:
        raise CaptureError(f"{path}: the file changed while it was read; import it again")
    return ids


def trace_rows(timestamp_ms: np.ndarray, input_length: np.ndarray, hash_ids: list[list[int]],
               block_size: int = BLOCK_SIZE) -> pa.Table:
    """The dataset's rows (FILE_SCHEMA: the capture dataset's columns less the replica) of requests in
    arrival order, each with its prompt length and block ids (one per block_size tokens, the last
    possibly partial), all at once in numpy."""
    n = len(hash_ids)
    counts = np.fromiter(map(len, hash_ids), np.int64, n)
    flat = np.fromiter(chain.from_iterable(hash_ids), np.int64, int(counts.sum()))
    full = np.minimum(counts, np.asarray(input_length, np.int64) // block_size)  # the partial last block is none
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(full, out=offsets[1:])
    blocks = int(offsets[-1])
    request_of = np.repeat(np.arange(n), full)  # per block
    depth = np.arange(blocks) - offsets[:-1][request_of]  # its place in its request
    hashes = flat[np.repeat(np.cumsum(counts) - counts, full) + depth].view(np.uint64)
    seconds = np.asarray(timestamp_ms, np.float64) / 1000.0

    # a hit: an earlier request (or an earlier block of this one) stored the id; the cache is unbounded
    repeat = np.ones(blocks, bool)
    by_hash = np.argsort(hashes, kind="stable")  # each id's uses in file order
    first = np.ones(blocks, bool)
    first[1:] = hashes[by_hash[1:]] != hashes[by_hash[:-1]]
    repeat[by_hash[first]] = False
    gap = np.full(blocks, np.nan)  # a hit's seconds since the id's previous store or hit
    again = by_hash[1:][~first[1:]]
    gap[again] = seconds[request_of[again]] - seconds[request_of[by_hash[:-1][~first[1:]]]]

    parent = np.zeros(blocks, np.uint64)
    parent[1:] = hashes[:-1]
    has_parent = depth > 0

    # every row: a request's blocks, or one row without a kind for a request without a full block
    per_request = np.maximum(full, 1)
    rows = int(per_request.sum())
    row_request = np.repeat(np.arange(n), per_request)
    is_block = np.ones(rows, bool)
    is_block[(np.cumsum(per_request) - 1)[full == 0]] = False
    block_of = np.cumsum(is_block) - 1  # the block each block row holds
    at = np.where(is_block, block_of, 0)
    no_block = ~is_block

    def per_block(values: np.ndarray, typ: pa.DataType, null: np.ndarray | None = None) -> pa.Array:
        if not blocks:  # no request has a full block: every row is a message alone
            return pa.nulls(rows, typ)
        return pa.array(values[at], typ, mask=no_block if null is None else no_block | null[at])

    def nulls(typ: pa.DataType) -> pa.Array:
        return pa.nulls(rows, typ)

    stored = pa.array(is_block)
    step = pa.array(row_request, pa.int64())
    ts = pa.array(seconds[row_request], pa.float64())
    columns = {
        "step": step,
        "restart": pa.array(np.zeros(rows, np.int32)),
        "seq": step,
        "ts": ts,
        "received": ts,
        "event_index": pa.array(np.zeros(rows, np.int32)),
        "kind": pc.if_else(stored, pa.scalar("BlockStored"), pa.scalar(None, pa.string())),
        "block_index": per_block(depth.astype(np.int32), pa.int32()),
        "block_hash": per_block(hashes, pa.uint64()),
        "parent_hash": per_block(parent, pa.uint64(), ~has_parent),
        "repeat": per_block(repeat, pa.bool_()),
        "block_size": pc.if_else(stored, pa.scalar(block_size, pa.int32()), pa.scalar(None, pa.int32())),
        "medium": pc.if_else(stored, pa.scalar("GPU"), pa.scalar(None, pa.string())),
        "reuse_gap_s": per_block(gap, pa.float64(), ~repeat),
        "salt_named": per_block(np.zeros(blocks, bool), pa.bool_()),  # a store naming no salt, as rows.py says it
    }
    return pa.table([columns.get(f.name, nulls(f.type)) for f in FILE_SCHEMA], schema=FILE_SCHEMA)


def write_parts(table: pa.Table, folder: Path, part_rows: int | None = None) -> int:
    """One replica's rows as the capture writes them (zstd, page checksums, a part every part_rows
    rows, by default PART_ROWS, row groups of at most GROUP_ROWS); returns how many parts."""
    folder.mkdir(parents=True)
    parts, part_rows = 0, part_rows or PART_ROWS
    for start in range(0, table.num_rows, part_rows):
        pq.write_table(table.slice(start, part_rows), folder / f"part-{parts:05d}.parquet", compression="zstd",
                       row_group_size=GROUP_ROWS, write_page_checksum=True)
        parts += 1
    return parts
