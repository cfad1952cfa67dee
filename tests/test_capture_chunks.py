"""One replica's capture decoded in chunks by several processes, the cache state carried from chunk to
chunk (capture/cache_state.py): the rows, runs, findings and breaches of one process however the stream
is cut, on a stream whose events mostly breach the contract; a line that cannot be decoded is named by
its number from anywhere in the file, and nothing is left of the import."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgpack
import pyarrow as pa
import pytest

from kvviz.capture import jsonl_dataset
from kvviz.capture.capture_file import CaptureWriter, Message
from kvviz.capture.events import CaptureError, decode_batch
from kvviz.capture.import_vllm import import_capture
from kvviz.capture.rows import EventRows
from kvviz.capture.synthetic import fleet_messages
from kvviz.store import RunStore

ROWS = "SELECT * EXCLUDE (run_id) FROM kv_events WHERE run_id = ? ORDER BY step, event_index, block_index"


def breaching(events: int = 4000, seed: int = 0) -> list[Message]:
    """One replica whose stream does most of what a stream can: a publisher restart, clears, other media
    and KV groups, salts named after a chain's first block, hits reported again; and breaches most of
    the contract: wrong token counts, removals of blocks never stored, repeated stores of cached blocks."""
    rng, out = random.Random(seed), []
    for i, m in enumerate(fleet_messages(events, replicas=1, capacity=32, seed=seed, turns=0.3, unsalted=0.1)):
        ts, batch, rank = msgpack.unpackb(m.payload)
        for e in batch:
            x = rng.random()
            if e["type"] == "BlockStored" and x < 0.5:
                e["token_ids"] = e["token_ids"][:-1]
            elif e["type"] == "BlockStored" and x < 0.6 and len(e["block_hashes"]) > 1:
                e["extra_keys"] = [None, [f"late-{rng.randrange(3)}"]] + [None] * (len(e["block_hashes"]) - 2)
            elif x < 0.7:
                e["medium"] = rng.choice(("CPU", None))
            elif x < 0.8:
                e["group_idx"] = rng.choice((0, 1))
        batch.append({"type": "BlockRemoved", "block_hashes": [rng.getrandbits(64)], "medium": "GPU"})
        if rng.random() < 0.05:
            batch.append(dict(next(e for e in batch if e["type"] == "BlockStored")))  # stored again while cached
        if rng.random() < 0.005:
            batch.append({"type": "AllBlocksCleared"})
        out.append(Message(m.replica, int(i > events // 20), m.seq, m.topic, msgpack.packb([ts, batch, rank]),
                           m.received))
    return out


def write(path: Path, messages: list[Message]) -> Path:
    w = CaptureWriter(path, {"replica-0": "tcp://a"})
    for m in messages:
        w.add(m)
    w.close()
    return path


def test_rows_are_the_same_however_the_stream_is_cut():
    messages = breaching(1500)

    def rows(every: int | None) -> pa.Table:
        builder, tables = EventRows(), []
        for i, m in enumerate(messages):
            builder.add(decode_batch(m.payload, "t"), step=i, replica=m.replica, restart=m.restart, seq=m.seq,
                        where="t", payload=m.payload)
            if every and len(builder) >= every:
                tables.append(builder.take())
        return pa.concat_tables([*tables, builder.take()])

    whole = rows(None)
    assert whole.column("repeat").to_pylist().count(True) > 100, "hits and removals of blocks not cached"
    for every in (1, 7, 500):
        assert rows(every).equals(whole), f"cut every {every} rows"


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of about 16 KiB, so a small capture is split into many; each helper's rows become Arrow
    columns every 50 rows and are sent at 120, so a chunk is several parts and several sends."""
    monkeypatch.setattr(jsonl_dataset, "MIN_CHUNK_BYTES", 1 << 14)
    monkeypatch.setattr(jsonl_dataset, "CHUNK_BYTES", 1 << 14)
    monkeypatch.setattr(jsonl_dataset, "ARROW_ROWS", 50)
    monkeypatch.setattr(jsonl_dataset, "CHUNK_ROWS", 120)


def imported(store: RunStore, run: str) -> tuple:
    with store.read() as con:
        return (con.execute(ROWS, [run]).fetchall(),
                con.execute("SELECT steps, findings, status, workload->>'breaches' FROM runs WHERE run_id = ?",
                            [run]).fetchone(),
                con.execute("SELECT kind, replica, count, first_step, first_seq, first_ts, detail FROM "
                            "capture_breaches WHERE run_id = ? ORDER BY kind", [run]).fetchall(),
                con.execute("SELECT kind, request_id, step, position, source_request FROM findings WHERE run_id = ? "
                            "ORDER BY ALL", [run]).fetchall())


@pytest.mark.slow
def test_a_breaching_capture_split_into_chunks_imports_as_one_process_does(tmp_path, small_chunks):
    cap = write(tmp_path / "c.jsonl", breaching())
    store = RunStore.open(tmp_path / "k.duckdb")
    one = imported(store, import_capture(cap, store, workers=1))
    _, (messages, _, status, kinds), breaches, _ = one
    counted = {kind: count for kind, _, count, *_ in breaches}
    assert status == "complete" and int(kinds) >= 4
    assert counted["remove_unstored"] >= messages and counted["token_count"] > messages / 3, \
        "most events breach the contract, and the capture is imported with them counted"
    for workers in (2, 3):
        assert imported(store, import_capture(cap, store, workers=workers)) == one, f"{workers} processes"


@pytest.mark.slow
def test_a_bad_line_deep_in_a_split_capture_is_named_and_nothing_is_left(tmp_path, small_chunks):
    messages = breaching(3000)
    messages[-50] = Message("replica-0", 1, messages[-50].seq, "kv-events", b"\xc1", None)
    cap = write(tmp_path / "c.jsonl", messages)
    store = RunStore.open(tmp_path / "k.duckdb")
    line = len(messages) - 50 + 2
    with pytest.raises(CaptureError, match=rf"^{cap}: line {line} \(seq {messages[-50].seq}\): not a msgpack"):
        import_capture(cap, store, workers=2)
    with store.read() as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 0
    assert not any(store.captures_dir.iterdir())


@pytest.mark.slow
def test_lines_that_leave_restarts_to_the_lines_before_are_read_in_one_process(tmp_path, small_chunks):
    """A capture whose lines say no restart (seq going back counts one) gets the rows one process reads."""
    cap = write(tmp_path / "c.jsonl", breaching(2000))
    lines = cap.read_text().splitlines()
    said = [json.loads(line) for line in lines[1:]]
    for i, rec in enumerate(said):
        del rec["restart"]
        rec["seq"] = i % (len(said) // 3 + 1)  # goes back twice: two restarts
    cap.write_text("\n".join([lines[0], *map(json.dumps, said)]) + "\n")
    store = RunStore.open(tmp_path / "k.duckdb")
    one = imported(store, import_capture(cap, store, workers=1))
    with store.read() as con:
        assert con.execute("SELECT list(DISTINCT restart ORDER BY restart) FROM kv_events").fetchone()[0] == [0, 1, 2]
    assert imported(store, import_capture(cap, store, workers=2)) == one
