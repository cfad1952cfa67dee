"""A JSONL capture written as a capture dataset, its decoding split over one process per core.

The file is cut into chunks of whole lines. Helper processes decode them in turn (chunk i by helper
i mod n) into rows without what the cache state decides (rows.py's `stateless`) and stream them here
as Arrow IPC; this process fills that state in, chunk by chunk in file order (cache_state.py: a few
array operations a chunk), numbers the steps and writes the dataset. So one replica's stream splits
as well as a fleet's, the rows are those one process writes, and the error is one process's: chunks
are taken in file order and each helper stops at its first bad line, so the first error met is the
earliest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..util.gcpause import paused_gc
from .cache_state import REPLAYED, STATE_SCHEMA, CacheState, fill
from .capture_file import CaptureReader, Message, Unsplittable
from .dataset import FILE_SCHEMA, PARQUET, DatasetWriter, check_name, write_manifest
from .events import Batch, CaptureError, decode_batch
from .rows import STATELESS_SCHEMA, EventRows

Progress = Callable[[int, int], None]  # (bytes read, bytes in all)
SPLIT_FROM_BYTES = 32 << 20  # a smaller capture is written faster than a second process starts
CHUNK_BYTES = 16 << 20  # a helper's turn (a quarter of its share, in a smaller capture)
MIN_CHUNK_BYTES = 64 << 10
CHUNK_ROWS = 250_000  # rows a helper sends at once, at most (its memory)
ARROW_ROWS = 5_000  # rows a helper keeps as Python objects before they become Arrow columns
CHECK_EVERY = 1024  # messages between reports of progress
GROUP_ROWS = 100_000  # a Parquet row group's, at most
REPLIES = "_state"  # the folder (skipped as the dataset is read) where each chunk's state comes back


@dataclass(frozen=True)
class Written:
    """What was written: the capture's message count and, per replica, its first step."""
    messages: int
    first: dict[str, int]


def write_dataset(path: Path, folder: Path, progress: Progress | None = None, workers: int | None = None) -> Written:
    """Decode the capture at `path` into a dataset at `folder` (which the caller removes on failure);
    CaptureError names the first bad line, as a one-process import would."""
    reader = CaptureReader(path)
    n = workers or _workers(path)
    size = path.stat().st_size
    split = n > 1 and reader.version > 1  # version 1 leaves restarts to be counted from the lines before
    chunks = _chunks(path, reader.body, max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, size // (4 * n)))) if split else []
    got = None
    if len(chunks) > 1:
        try:
            got = _write_split(path, folder, chunks, n, progress)
        except Unsplittable:  # a line leaves its restarts to the lines before it: read in one process
            for part in folder.iterdir():
                shutil.rmtree(part)
    if got is None:
        got = _write_one(reader, folder, progress)
    write_manifest(folder, {name: "" for name in sorted(got.first, key=got.first.get)}, got.messages, complete=True)
    return got


def _workers(path: Path) -> int:
    """One helper per core this process may use; none for a small capture, and off Linux."""
    if path.stat().st_size < SPLIT_FROM_BYTES or not hasattr(os, "sched_getaffinity"):
        return 1
    return len(os.sched_getaffinity(0))


def _chunks(path: Path, body: int, size: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges of whole lines from `body` to the file's end, about `size` bytes each but
    the first three and the last few: those ramp up from size / 8 and down to it, so that the first state
    is worked out soon after the helpers start and the last chunk keeps one core busy only briefly."""
    end, out = path.stat().st_size, []
    with open(path, "rb") as f:
        start = body
        while start < end:
            left = end - start
            want = (size >> (3 - len(out)) if len(out) < 3 else size if left > 2 * size
                    else left if left <= size >> 3 else left // 2)
            f.seek(min(start + max(want, MIN_CHUNK_BYTES), end))
            f.readline()  # on to the next line's start
            stop = min(max(f.tell(), start + 1), end)
            out.append((start, stop))
            start = stop
    return out


class _Said:
    """A message's `where` with its seq, made text only when an error says it."""
    __slots__ = ("seq", "where")

    def __init__(self, where: object, seq: int):
        self.where, self.seq = where, seq

    def __str__(self) -> str:
        return f"{self.where} (seq {self.seq})"


def _messages(reader: CaptureReader, start: int, end: int | None,
              named: set[str]) -> Iterator[tuple[_Said, Message, Batch]]:
    """The messages of a byte range with their decoded batches; a bad one is CaptureError. `named`: the
    replica names checked already (naming a line in the middle of a file counts the lines before it)."""
    for where, m in reader.between(start, end):
        if m.replica not in named:
            check_name(m.replica, f"{where}:")
            named.add(m.replica)
        said = _Said(where, m.seq)
        yield said, m, decode_batch(m.payload, said)


def _write_one(reader: CaptureReader, folder: Path, progress: Progress | None) -> Written:
    """The whole capture in this process."""
    writer = DatasetWriter(folder, {}, share=True)
    total = max(reader.path.stat().st_size, 1)
    with paused_gc():
        for where, m, batch in _messages(reader, reader.body, None, set()):
            if progress is not None and writer.count % CHECK_EVERY == 0:
                progress(min(reader.bytes_read, total), total)
            writer.add(m, batch, where)
        writer.close()
    if progress is not None:
        progress(total, total)
    return Written(writer.count, writer.first)


def _write_split(path: Path, folder: Path, chunks: list[tuple[int, int]], n: int,
                 progress: Progress | None) -> Written:
    """Helpers decode the chunks in turn and send what the cache state is worked out from; here it is
    worked out in file order and sent back (a file per chunk), with the chunk's first step."""
    replies = folder / REPLIES
    replies.mkdir(parents=True)
    helpers = [_Helper(path, folder, chunks, index, n) for index in range(n)]
    cache, messages, first = CacheState(), 0, {}
    total = max(path.stat().st_size, 1)
    try:
        with paused_gc():
            for c, (_, end) in enumerate(chunks):
                states = []
                for rows, so_far in helpers[c % n].chunk():
                    count = so_far
                    if rows.num_rows:
                        states.append(cache.state(rows))
                        steps = pc.min_max(rows.column("step"))
                        for name in pc.unique(rows.column("replica")).to_pylist():
                            first.setdefault(name, messages + steps["min"].as_py())
                _reply(replies / f"{c}.arrow", states, messages)
                messages += count
                if progress is not None:
                    progress(end, total)
            for helper in helpers:
                helper.finish()
    finally:
        for helper in helpers:
            helper.close()
    shutil.rmtree(replies)
    return Written(messages, first)


def _reply(path: Path, states: list[pa.Table], first_step: int) -> None:
    """A chunk's state, batch by batch, and its first step; renamed into place once whole."""
    partial = path.with_suffix(".partial")
    with pa.ipc.new_file(partial, STATE_SCHEMA, metadata={"first_step": str(first_step)}) as out:
        for state in states:
            out.write_table(state)
    partial.rename(path)


class _Helper:
    """A helper run as `python -m` this module. Not multiprocessing: spawning runs the caller's own
    script again in the child (a user's script without a main guard would import twice), and forking
    is unsafe from the app's threads."""

    def __init__(self, path: Path, folder: Path, chunks: list[tuple[int, int]], index: int, helpers: int):
        root = str(Path(__file__).parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        self.number, self.errors, self._stream = index + 1, tempfile.TemporaryFile(), None
        self.proc = subprocess.Popen([sys.executable, "-m", __spec__.name, str(path), str(folder), json.dumps(chunks),
                                      str(index), str(helpers), str(ARROW_ROWS), str(CHUNK_ROWS)],
                                     stdout=subprocess.PIPE, stderr=self.errors, env=env)

    def chunk(self) -> Iterator[tuple[pa.Table, int]]:
        """Its next chunk's REPLAYED columns, a batch at a time, each with the messages so far in the chunk."""
        while True:
            try:
                if self._stream is None:
                    self._stream = pa.ipc.open_stream(self.proc.stdout)
                batch, said = self._stream.read_next_batch_with_custom_metadata()
            except (pa.ArrowException, StopIteration, OSError):
                raise self._died() from None
            said = {k.decode(): v.decode() for k, v in (said or {}).items()}
            if "unsplittable" in said:
                raise Unsplittable(said["unsplittable"])
            if "error" in said:
                raise CaptureError(said["error"])
            yield pa.Table.from_batches([batch]), int(said["messages"])
            if "last" in said:
                return

    def finish(self) -> None:
        """Wait for it to write its last chunk."""
        self.proc.stdout.read()
        if self.proc.wait():
            raise self._died()

    def _died(self) -> RuntimeError:
        self.proc.wait()
        self.errors.seek(0)
        said = self.errors.read().decode(errors="replace").strip()[-2000:]
        return RuntimeError(f"the import's process {self.number} failed (exit code {self.proc.returncode}): {said}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.errors.close()


def _help(path: Path, folder: Path, chunks: list[tuple[int, int]], index: int, helpers: int, arrow_rows: int,
          send_rows: int) -> None:
    """In a helper: for each of its chunks, what the state is worked out from to stdout (the chunk's last
    batch saying so; the first bad line ends the stream with what is wrong), then, once the state is back,
    the chunk's rows into the dataset, while the next chunk is decoded. The decoded messages become Arrow
    columns every `arrow_rows` rows, which are sent every `send_rows`."""
    reader, rows, named, parent = CaptureReader(path), EventRows(), set(), os.getppid()
    pending: list[tuple[int, list[pa.Table]]] = []
    with paused_gc(), pa.ipc.new_stream(sys.stdout.buffer, pa.schema([STATELESS_SCHEMA.field(name)
                                                                       for name in REPLAYED])) as out:
        for c in range(index, len(chunks), helpers):
            tables, parts, count = [], [], 0
            try:
                for where, m, batch in _messages(reader, *chunks[c], named):
                    rows.add(batch, step=count, replica=m.replica, restart=m.restart, seq=m.seq, where=where,
                             received=m.received, topic=m.topic, payload=m.payload)
                    count += 1
                    if len(rows) >= arrow_rows:  # freed soon, the decoded objects' memory is reused, not mapped
                        parts.append(rows.stateless())  # anew (page faults: docs/benchmarks.md, issue 46)
                        if sum(p.num_rows for p in parts) >= send_rows:
                            tables.append(_send(out, pa.concat_tables(parts), {"messages": str(count)}))
                            parts = []
                parts.append(rows.stateless())
                tables.append(_send(out, pa.concat_tables(parts), {"messages": str(count), "last": ""}))
            except (CaptureError, Unsplittable) as e:
                said = "error" if isinstance(e, CaptureError) else "unsplittable"
                _send(out, STATELESS_SCHEMA.empty_table(), {said: str(e)})
                return
            if pending:
                _write_chunk(folder, *pending.pop(), parent)
            pending.append((c, tables))
    if pending:
        _write_chunk(folder, *pending.pop(), parent)


def _send(out: pa.ipc.RecordBatchStreamWriter, rows: pa.Table, said: dict[str, str]) -> pa.Table:
    """The REPLAYED columns of `rows` down the stream, saying `said`; returns the rows."""
    part = rows.select(list(REPLAYED)).combine_chunks()
    out.write_batch(part.to_batches()[0] if part.num_rows else pa.RecordBatch.from_pylist([], schema=part.schema),
                    custom_metadata=said)
    return rows


def _write_chunk(folder: Path, c: int, tables: list[pa.Table], parent: int) -> None:
    """A chunk's rows, their state back from the process that worked it out (`parent`), as each replica's
    part `c`."""
    reply = folder / REPLIES / f"{c}.arrow"
    while not reply.exists():
        if os.getppid() != parent:  # the import's process is gone
            sys.exit(1)
        time.sleep(0.001)
    with pa.ipc.open_file(reply) as states:
        first_step = int(states.metadata[b"first_step"])
        filled = [fill(rows, states.get_batch(i)) for i, rows in enumerate(t for t in tables if t.num_rows)]
    if not filled:
        return
    table = pa.concat_tables(filled)
    table = table.set_column(0, "step", pc.add(table.column("step"), first_step))
    names = pc.unique(table.column("replica")).to_pylist()
    for name in names:
        mine = table if len(names) == 1 else table.filter(pc.equal(table.column("replica"), name))
        (folder / f"replica={name}").mkdir(exist_ok=True)
        pq.write_table(mine.select(FILE_SCHEMA.names), folder / f"replica={name}" / f"part-{c:05d}.parquet",
                       row_group_size=GROUP_ROWS, **PARQUET)


if __name__ == "__main__":
    _help(Path(sys.argv[1]), Path(sys.argv[2]), [tuple(c) for c in json.loads(sys.argv[3])],
          *map(int, sys.argv[4:8]))
