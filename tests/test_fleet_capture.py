"""Fleet captures: several publishers in one process (each row tagged with its replica), a publisher
restart reported and replayed, an unreachable one reported while the others are captured, the
Parquet dataset (rotation, import, a dataset read part by part) and every bad input refused with
where it is and nothing half-imported."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import msgpack
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from kvviz.capture import import_vllm
from kvviz.capture.capture_file import CaptureWriter, Message
from kvviz.capture.dataset import DatasetWriter
from kvviz.capture.events import CaptureError, decode_batch
from kvviz.capture.rows import EventRows
from kvviz.capture.zmq_capture import Endpoint, FleetCapture
from kvviz.cli.capture import parse_sources
from kvviz.runners.uploads import import_file
from kvviz.store import RunStore
from tests.cli import kvviz, kvviz_process
from tests.test_capture import Publisher, batch, free_port, stored_map

ROOT = Path(__file__).resolve().parent.parent


def full_mode_messages(replica: str, n: int, start_seq: int = 0, restart: int = 0) -> list[Message]:
    """Stores of a growing chain, every third message repeating the chain's first block (a hit reported by
    kv_cache_report_mode=full), a removal every fifth, an empty batch every seventh."""
    out = []
    for i in range(n):
        seq = start_seq + i
        if i % 7 == 6:
            events = []
        elif i % 5 == 4:
            events = [{"type": "BlockRemoved", "block_hashes": [100 + i - 1], "medium": "GPU"}]
        elif i % 3 == 2:
            events = [stored_map([100], None, [7, 7])]
        else:
            events = [stored_map([100 + i], None if i == 0 else 100 + i - 1, [i, i], salt=f"t-{replica}")]
        out.append(Message(replica, restart, seq, "kv", batch(*events, ts=1000.0 + seq), 2000.0 + seq))
    return out


def write_dataset(folder: Path, messages: list[Message], rotate_rows: int = 5) -> DatasetWriter:
    w = DatasetWriter(folder, {m.replica: f"tcp://{m.replica}:5557" for m in messages}, rotate_rows=rotate_rows)
    for m in messages:
        w.add(m, decode_batch(m.payload, "test"))
    w.close()
    return w


def interleaved(*lists: list[Message]) -> list[Message]:
    return [m for group in zip(*lists, strict=True) for m in group]


def test_a_dataset_holds_every_message_rotated_and_imports_equal_to_its_jsonl(tmp_path):
    msgs = interleaved(full_mode_messages("pod-a", 30), full_mode_messages("pod-b", 30))
    w = write_dataset(tmp_path / "ds", msgs)
    parts = sorted(p.relative_to(tmp_path / "ds").as_posix() for p in (tmp_path / "ds").rglob("*.parquet"))
    assert parts[0] == "replica=pod-a/part-00000.parquet" and len(parts) > 4, "rotated every 5 rows"
    assert not list((tmp_path / "ds").rglob("*.inprogress"))
    manifest = json.loads((tmp_path / "ds" / "_kvviz_capture.json").read_text())
    assert manifest["complete"] and manifest["messages"] == w.count == 60
    rows = pq.read_table(tmp_path / "ds" / "replica=pod-a")
    assert rows.num_rows == sum(len(decode_batch(m.payload, "").events) or 1 for m in msgs if m.replica == "pod-a")
    first = next(r for r in rows.to_pylist() if r["step"] == 0)
    assert msgpack.unpackb(first["payload"]) == msgpack.unpackb(msgs[0].payload), "the raw payload is kept"

    jsonl = CaptureWriter(tmp_path / "c.jsonl", {"pod-a": "x", "pod-b": "y"})
    for m in msgs:
        jsonl.add(m)
    jsonl.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    from_ds, from_jsonl = import_file(tmp_path / "ds", store), import_file(tmp_path / "c.jsonl", store)
    cols = "step, replica, seq, ts, kind, block_hash, parent_hash, block_index, token_ids, salt, repeat, medium"
    with store.read() as con:
        def q(run):
            return con.execute(f"SELECT {cols} FROM kv_events WHERE run_id = ? ORDER BY step, event_index, "
                               "block_index", [run]).fetchall()
        assert q(from_ds) == q(from_jsonl) and len(q(from_ds)) > 40
        repeats = con.execute("SELECT replica, kind, count(*) FROM kv_events WHERE run_id = ? AND repeat "
                              "GROUP BY ALL ORDER BY 1, 2", [from_ds]).fetchall()
        live, hits, no_ops = set(), 0, 0  # the cache as a model: what a repeat is, counted by hand
        for m in msgs[::2]:
            for e in decode_batch(m.payload, "").events:
                for h in e.block_hashes:
                    if e.kind == "BlockStored":
                        hits += h in live
                        live.add(h)
                    else:
                        no_ops += h not in live
                        live.discard(h)
        assert hits == 7 and no_ops == 3 and repeats == [
            ("pod-a", "BlockRemoved", no_ops), ("pod-a", "BlockStored", hits),
            ("pod-b", "BlockRemoved", no_ops), ("pod-b", "BlockStored", hits)], "stores of a cached hash: hits"
        occupancy = con.execute("SELECT replica, last(cached_blocks ORDER BY step) FROM kv_cache_blocks "
                                "WHERE run_id = ? GROUP BY ALL ORDER BY 1", [from_ds]).fetchall()
        assert occupancy == [("pod-a", len(live)), ("pod-b", len(live))]
        assert con.execute("SELECT steps FROM runs WHERE run_id = ?", [from_ds]).fetchone()[0] == 60
    one = import_file(tmp_path / "ds" / "replica=pod-b" / "part-00001.parquet", store)
    with store.read() as con:
        got = con.execute("SELECT DISTINCT replica, step FROM kv_events WHERE run_id = ? ORDER BY step",
                          [one]).fetchall()
        steps = [s for (s,) in con.execute("SELECT step FROM steps WHERE run_id = ? ORDER BY step", [one]).fetchall()]
    assert {r for r, _ in got} == {"pod-b"}, "one part alone: its replica from the folder"
    assert steps == list(range(len(steps))) and {s for _, s in got} <= set(steps) and len(steps) > 2, \
        "its messages renumbered from 0"


def test_publisher_restarts_count_and_forget_the_cache(tmp_path):
    before = full_mode_messages("pod-a", 10)
    after = full_mode_messages("pod-a", 10, restart=1)  # the same chain again after a restart: not repeats
    store = RunStore.open(tmp_path / "k.duckdb")
    write_dataset(tmp_path / "ds", before + after)
    run = import_file(tmp_path / "ds", store)
    with store.read() as con:
        per = con.execute("SELECT restart, count(*) FILTER (repeat) FROM kv_events WHERE run_id = ? GROUP BY ALL "
                          "ORDER BY 1", [run]).fetchall()
        assert per[0][1] == per[1][1] > 0, "the run after the restart repeats exactly what the first run did"
        last = con.execute("SELECT restart, last(cached_blocks ORDER BY step) FROM kv_cache_blocks "
                           "WHERE run_id = ? GROUP BY ALL ORDER BY 1", [run]).fetchall()
    assert last[0][1] == last[1][1], "the count starts again from zero after the restart"


def bad_dataset(tmp_path: Path, how: str) -> Path:
    folder = tmp_path / how
    write_dataset(folder, interleaved(full_mode_messages("pod-a", 12), full_mode_messages("pod-b", 12)))
    part = folder / "replica=pod-b" / "part-00001.parquet"
    if how == "corrupt":
        part.write_bytes(part.read_bytes()[:40] + b"\0" * 64 + part.read_bytes()[-200:])
    elif how == "bytes changed inside":  # the structure intact, a page's contents not: only checksums see it
        chunk = pq.ParquetFile(part).metadata.row_group(0).column(pq.read_schema(part).get_field_index("token_ids"))
        data = bytearray(part.read_bytes())
        end = chunk.data_page_offset + chunk.total_compressed_size
        data[end - 6:end - 2] = bytes(b ^ 0xFF for b in data[end - 6:end - 2])
        part.write_bytes(bytes(data))
    elif how == "no magic":
        part.write_bytes(b"XXXX" + part.read_bytes()[4:])
    elif how == "truncated":
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    elif how == "other schema":
        pq.write_table(pq.read_table(part).drop_columns(["salt"]), part)
    elif how == "other types":
        t = pq.read_table(part)
        pq.write_table(t.set_column(t.schema.get_field_index("seq"), "seq", t.column("seq").cast("string")), part)
    elif how == "mixed layout":
        (folder / "loose.parquet").write_bytes(part.read_bytes())
    elif how == "empty":
        for p in folder.rglob("*.parquet"):
            p.unlink()
    return folder


@pytest.mark.parametrize("how,said", [
    ("corrupt", r"replica=pod-b/part-00001\.parquet"), ("truncated", r"part-00001\.parquet: not a readable Parquet"),
    ("bytes changed inside", r"replica=pod-b/part-00001\.parquet: damaged"),
    ("no magic", r"part-00001\.parquet: not a Parquet file \(it does not start with PAR1\)"),
    ("other schema", "lacks salt"), ("other types", r"has other types for seq \(string\)"),
    ("mixed layout", "some files lie in replica=NAME folders"), ("empty", "the capture holds no messages")])
def test_bad_datasets_are_refused_naming_the_file_and_import_nothing(tmp_path, how, said):
    store = RunStore.open(tmp_path / "k.duckdb")
    good = import_file(write_dataset(tmp_path / "good", full_mode_messages("pod-a", 5)).folder, store)
    with pytest.raises(CaptureError, match=said):
        import_file(bad_dataset(tmp_path, how), store)
    with store.read() as con:
        assert con.execute("SELECT list(run_id) FROM runs").fetchone()[0] == [good]
        assert {r for (r,) in con.execute("SELECT DISTINCT run_id FROM kv_events").fetchall()} == {good}
        assert {r for (r,) in con.execute("SELECT DISTINCT run_id FROM steps").fetchall()} == {good}


def test_a_dataset_folder_is_new_or_empty(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(CaptureError, match="not empty"):
        DatasetWriter(tmp_path / "used", {"a": "tcp://a:1"})


@pytest.mark.parametrize("endpoints,replays,said", [
    (["1pod=tcp://a:1"], None, "replica name '1pod' must start with a letter"),
    (["pod/a=tcp://a:1"], None, "must start with a letter and hold only"),
    (["a=tcp://x:1", "a=tcp://y:1"], None, "replica name 'a' is given twice"),
    (["tcp://x:1", "tcp://x:1"], None, "tcp://x:1 is given twice"),
    (["a=tcp://x:1"], ["b=tcp://x:2"], "no --endpoint is named 'b'"),
    (["a=tcp://x:1"], ["tcp://x:2", "tcp://x:3"], "more replay endpoints than --endpoint"),
    (["a="], None, "no address after a="),
])
def test_bad_endpoint_lists_are_refused(endpoints, replays, said):
    with pytest.raises(CaptureError, match=said):
        parse_sources(endpoints, replays)


def test_endpoints_pair_with_replays_by_name_or_order():
    got = parse_sources(["tcp://x:1", "b=tcp://y:1"], ["b=tcp://y:2"])
    assert got == [Endpoint("replica-0", "tcp://x:1"), Endpoint("b", "tcp://y:1", "tcp://y:2")]
    assert parse_sources(["tcp://x:1"], ["tcp://x:2"]) == [Endpoint("replica-0", "tcp://x:1", "tcp://x:2")]


class RestartingPublisher(Publisher):
    """Publishes seq 0..n, then 'restarts' (the sequence starts again at 0), with a replay endpoint that
    answers from what the current run of the publisher has sent."""

    def run(self):
        import zmq
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        for epoch, count in enumerate((12, 15)):
            self.sent = []
            for seq in range(count):
                if dict(poller.poll(10)).get(self.router):
                    self.serve_replay()
                if not (epoch == 1 and seq < 3):  # the first three of the new run go out before we reconnect
                    self.pub.send_multipart([self.topic(seq), seq.to_bytes(8, "big"), self.payload(seq)])
                self.sent.append(seq)
                time.sleep(0.04)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # answer the replay the restart asks for
            if dict(poller.poll(20)).get(self.router):
                self.serve_replay()
        self.pub.close()
        self.router.close()
        self.ctx.term()


@pytest.mark.slow
def test_two_publishers_a_restart_and_an_unreachable_one_in_one_capture(tmp_path):
    ports = [free_port() for _ in range(4)]
    plain = Publisher(ports[0], ports[1], count=30, skip=17)
    restarting = RestartingPublisher(ports[2], ports[3])
    sources = [Endpoint("pod-a", f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"),
               Endpoint("pod-b", f"tcp://127.0.0.1:{ports[2]}", f"tcp://127.0.0.1:{ports[3]}"),
               Endpoint("pod-gone", f"tcp://127.0.0.1:{free_port()}")]
    said: list[str] = []
    fleet = FleetCapture(sources, say=said.append)
    sink = DatasetWriter(tmp_path / "ds", {s.name: s.endpoint for s in sources}, rotate_rows=10)
    plain.start()
    restarting.start()
    try:
        fleet.run(sink, duration=5.5)
    finally:
        fleet.close()
        sink.close()
    plain.join(5)
    restarting.join(5)
    a, b, gone = (fleet.states[n] for n in ("pod-a", "pod-b", "pod-gone"))
    assert [17, 17] in a.gaps and a.restarts == 0 and a.count >= 25
    assert b.restarts == 1 and not b.gaps, "the restart's first three messages came back through the replay"
    assert gone.count == 0 and any("pod-gone: cannot reach" in s for s in said)
    assert any("pod-b: the publisher restarted" in s for s in said)
    store = RunStore.open(tmp_path / "k.duckdb")
    run = import_file(tmp_path / "ds", store)
    with store.read() as con:
        per = dict(con.execute("SELECT replica || '/' || restart, list(DISTINCT seq ORDER BY seq) FROM kv_events "
                               "WHERE run_id = ? GROUP BY ALL", [run]).fetchall())
    assert per["pod-b/0"] == list(range(12)) and per["pod-b/1"] == list(range(15))
    assert 17 not in per["pod-a/0"] and per["pod-a/0"][:3] == [0, 1, 2]


def test_capture_cli_refuses_bad_input_before_writing(tmp_path):
    p = kvviz("capture-vllm", "--endpoint", "a=tcp://127.0.0.1:1", "--endpoint", "a=tcp://127.0.0.1:2",
              "--out", str(tmp_path / "ds"))
    assert p.returncode == 2 and "replica name 'a' is given twice" in p.stderr and not (tmp_path / "ds").exists()
    p = kvviz("capture-vllm", "--endpoint", "tcp//nowhere", "--out", str(tmp_path / "ds"))
    assert p.returncode == 2 and "--endpoint 'tcp//nowhere'" in p.stderr and not (tmp_path / "ds").exists()
    p = kvviz("capture-vllm", "--endpoint", "tcp://127.0.0.1:1", "--out", str(tmp_path / "ds"), "--rotate-rows", "0")
    assert p.returncode == 2 and "--rotate-rows must be at least 1" in p.stderr


@pytest.mark.slow
def test_capture_cli_writes_a_dataset_and_reports_each_replica(tmp_path):
    ports = [free_port() for _ in range(2)]
    pub = Publisher(ports[0], ports[1], count=40, skip=17)
    pub.start()
    p = kvviz_process("capture-vllm", "--endpoint", f"pod-a=tcp://127.0.0.1:{ports[0]}", "--replay",
              f"pod-a=tcp://127.0.0.1:{ports[1]}", "--endpoint", f"tcp://127.0.0.1:{free_port()}",
              "--out", str(tmp_path / "ds"), "--duration", "4")
    pub.join(5)
    assert p.returncode == 0, p.stderr
    assert "pod-a: lost messages 17..17" in p.stderr and "replica-1: cannot reach" in p.stderr
    assert "from 2 replicas" in p.stdout
    con = duckdb.connect()
    got = con.execute(f"SELECT replica, count(DISTINCT seq) FROM read_parquet('{tmp_path}/ds/**/*.parquet', "
                      "hive_partitioning = true) GROUP BY ALL").fetchall()
    assert got[0][0] == "pod-a" and got[0][1] >= 20 and len(got) == 1


def test_occupancy_per_replica_in_intervals_ends_at_each_replicas_last_count(tmp_path):
    from kvviz.analysis import capture_time, captures

    msgs = interleaved(full_mode_messages("pod-a", 30), full_mode_messages("pod-b", 30))
    store = RunStore.open(tmp_path / "k.duckdb")
    run = import_file(write_dataset(tmp_path / "ds", msgs).folder, store)
    with store.read() as con:
        span = capture_time.span(con, run)
        occupancy = capture_time.occupancy(con, run, span.start, span.end, 5.0, "replica")
        last = dict(con.execute("SELECT replica, arg_max(cached_blocks, step) FROM kv_cache_blocks WHERE run_id = ? "
                                "GROUP BY replica", [run]).fetchall())
        assert captures.replicas(con, run) == ["pod-a", "pod-b"]
        tree = captures.prefix_tree(con, run, replica="pod-b")
        assert captures.stored_blocks(con, run, "pod-b") == len(tree) < captures.stored_blocks(con, run)
    assert occupancy.interval_start.nunique() == 6, "30 seconds in intervals of 5"
    for replica in ("pod-a", "pod-b"):
        assert occupancy[occupancy.series == replica].cached.iloc[-1] == last[replica] > 0


def test_a_version_4_capture_is_upgraded_with_its_rows_on_replica_0(tmp_path):
    from kvviz.store.schema import SCHEMA_VERSION, TABLES

    db = tmp_path / "v4.duckdb"
    cap = DatasetWriter(tmp_path / "c", {"replica-0": "x"})  # copied in: version 4 kept captures in its table
    for m in full_mode_messages("replica-0", 8):
        cap.add(m, decode_batch(m.payload, "test"))
    cap.close()
    run = import_file(tmp_path / "c", RunStore.open(db))
    con = duckdb.connect(str(db))  # made into what version 4 wrote: a table kv_events without today's columns
    con.execute("DROP VIEW kv_cache_blocks")
    con.execute("DROP VIEW kv_events")
    con.execute("DROP TABLE capture_sources")
    con.execute("ALTER TABLE kv_event_rows RENAME TO kv_events")
    for c in TABLES["kv_event_rows"].columns:
        if c.added_in == "5":
            con.execute(f"ALTER TABLE kv_events DROP COLUMN {c.name}")
    con.execute("ALTER TABLE timing_audits DROP COLUMN target")  # version 4 files from before it was added
    con.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    con.close()
    with RunStore.open(db).read() as con:
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == SCHEMA_VERSION
        assert con.execute("SELECT count(*) FROM timing_audits WHERE target IS NULL").fetchone()[0] == 0
        assert con.execute("SELECT DISTINCT replica, restart FROM kv_events WHERE run_id = ?", [run]).fetchall() == [
            ("replica-0", 0)]
        assert con.execute("SELECT count(*) FROM kv_events WHERE repeat IS NOT NULL").fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM kv_cache_blocks WHERE run_id = ?", [run]).fetchone()[0] > 0


def event_rows(con, run: str, table: str = "kv_events") -> list[tuple]:
    """A capture run's events in order, the columns an import must keep."""
    cols = "step, replica, restart, seq, kind, block_hash, parent_hash, token_ids, salt, salt_named, repeat"
    return con.execute(f"SELECT {cols} FROM {table} WHERE run_id = ? ORDER BY step, event_index, block_index",
                       [run]).fetchall()


def test_a_dataset_registered_in_place_reads_like_its_copy_and_nothing_else_opens_up(tmp_path):
    from kvviz.analysis.runs import delete_run
    from kvviz.errors import SqlError
    from kvviz.store.sql import run_query

    msgs = interleaved(full_mode_messages("pod-a", 30), full_mode_messages("pod-b", 30))
    folder = write_dataset(tmp_path / "ds", msgs).folder
    store = RunStore.open(tmp_path / "k.duckdb")
    copied, in_place = import_file(folder, store), import_file(folder, store, in_place=True)
    with store.read() as con:
        assert event_rows(con, in_place) == event_rows(con, copied) and len(event_rows(con, in_place)) > 40
        assert event_rows(con, in_place, "kv_event_rows") == [], "nothing was copied"
        for table in ("steps", "findings"):
            assert con.execute(f"SELECT count(*) FROM {table} WHERE run_id = ?", [in_place]).fetchone() == \
                con.execute(f"SELECT count(*) FROM {table} WHERE run_id = ?", [copied]).fetchone()
        assert con.execute("SELECT status FROM runs WHERE run_id = ?", [in_place]).fetchone()[0] == "complete"
    (tmp_path / "secret.csv").write_text("a\n1\n")
    with store.read() as con:  # the reader may read the registered folder, and nothing else
        with pytest.raises(SqlError, match="disabled by configuration"):
            run_query(con, f"SELECT * FROM read_csv('{tmp_path / 'secret.csv'}')")
        with pytest.raises(SqlError, match="disabled by configuration"):
            run_query(con, f"SELECT * FROM read_csv('{folder}/../secret.csv')")
        assert run_query(con, f"SELECT count(*) FROM kv_events WHERE run_id = '{in_place}'").rows[0][0] > 40
        with pytest.raises(SqlError):
            run_query(con, "SET allowed_directories = ['/']")

    delete_run(store, in_place)
    assert folder.is_dir() and list(folder.rglob("*.parquet")), "deleting the run leaves the files"
    with store.read() as con:
        assert con.execute("SELECT count(*) FROM kv_events WHERE run_id = ?", [in_place]).fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM capture_sources").fetchone()[0] == 0


def test_a_jsonl_capture_becomes_a_dataset_of_the_store_that_goes_with_its_run(tmp_path):
    from kvviz.analysis.runs import delete_run

    msgs = interleaved(full_mode_messages("pod-a", 30), full_mode_messages("pod-b", 30))
    jsonl = CaptureWriter(tmp_path / "c.jsonl", {"pod-a": "tcp://a", "pod-b": "tcp://b"})
    for m in msgs:
        jsonl.add(m)
    jsonl.close()
    store = RunStore.open(tmp_path / "runs" / "k.duckdb")
    copied, decoded = import_file(write_dataset(tmp_path / "ds", msgs).folder, store), import_file(jsonl.f.name, store)
    (owned,) = store.captures_dir.iterdir()
    assert sorted(p.name for p in owned.iterdir()) == ["_kvviz_capture.json", "replica=pod-a", "replica=pod-b"]
    assert json.loads((owned / "_kvviz_capture.json").read_text())["complete"]
    with store.read() as con:
        assert event_rows(con, decoded) == event_rows(con, copied) and len(event_rows(con, decoded)) > 40
        assert event_rows(con, decoded, "kv_event_rows") == [], "nothing was copied into the database"
        assert con.execute("SELECT path FROM capture_sources WHERE run_id = ?", [decoded]).fetchone()[0] == \
            str(owned.resolve())
    delete_run(store, decoded)
    assert not owned.exists(), "deleting the run deletes the dataset the store made for it"
    with store.read() as con:
        assert len(event_rows(con, copied)) > 40 and con.execute("SELECT count(*) FROM runs").fetchone()[0] == 1


def test_a_dataset_moved_after_registration_marks_its_run_and_spares_the_others(tmp_path):
    msgs = full_mode_messages("pod-a", 12)
    store = RunStore.open(tmp_path / "k.duckdb")
    copied = import_file(write_dataset(tmp_path / "a", msgs).folder, store)
    moved = import_file(write_dataset(tmp_path / "b", msgs).folder, store, in_place=True)
    (tmp_path / "b").rename(tmp_path / "b-elsewhere")
    with store.read() as con:
        assert con.execute("SELECT status, error FROM runs WHERE run_id = ?", [moved]).fetchone() == (
            "failed", f"its capture dataset is no longer at {tmp_path / 'b'} (import it again)")
        assert con.execute("SELECT count(*) FROM kv_events WHERE run_id = ?", [copied]).fetchone()[0] > 5
        assert con.execute("SELECT count(*) FROM kv_events WHERE run_id = ?", [moved]).fetchone()[0] == 0


@pytest.mark.parametrize("how,said", [
    ("a part", "--in-place takes a whole capture dataset folder"),
    ("still writing", "the capture is still being written"),
    ("a jsonl", "a file is always copied in")])
def test_in_place_refuses_what_it_cannot_keep_reading(tmp_path, how, said):
    msgs = full_mode_messages("pod-a", 12)
    folder = write_dataset(tmp_path / "ds", msgs).folder
    target = folder
    if how == "a part":
        target = next(folder.rglob("*.parquet"))
    elif how == "still writing":
        manifest = folder / "_kvviz_capture.json"
        manifest.write_text(manifest.read_text().replace('"complete": true', '"complete": false'))
    elif how == "a jsonl":
        target = tmp_path / "c.jsonl"
        w = CaptureWriter(target, {"pod-a": "x"})
        w.add(msgs[0])
        w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    with pytest.raises(CaptureError, match=said):
        import_file(target, store, in_place=True)
    assert not store.exists() or store.read().__enter__().execute("SELECT count(*) FROM runs").fetchone()[0] == 0


def test_occupancy_per_tier_and_kv_group_and_one_groups_tree(tmp_path):
    """A block offloaded from GPU to CPU moves tier (stored on CPU, removed from GPU); the same hash in two KV
    groups is two blocks; a clear empties every tier and group of its replica. Counts worked out by hand."""
    from kvviz.analysis import capture_time, captures

    def store(h, medium="GPU", group=None):
        ev = stored_map([h], None, [h, h]) | {"medium": medium}
        return ev if group is None else ev | {"group_idx": group}

    def remove(h, medium="GPU", group=None):
        ev = {"type": "BlockRemoved", "block_hashes": [h], "medium": medium}
        return ev if group is None else ev | {"group_idx": group}

    steps = [[store(1, group=0), store(2, group=0), store(1, group=1)],  # hash 1 in two groups: two blocks
             [store(2, "CPU", 0), remove(2, "GPU", 0)],  # 2 offloaded to the CPU tier
             [store(3, group=1)],
             [{"type": "AllBlocksCleared"}],
             [store(4, group=0)]]
    msgs = [Message("pod-a", 0, i, "kv", batch(*evs, ts=float(i))) for i, evs in enumerate(steps)]
    store_ = RunStore.open(tmp_path / "k.duckdb")
    run = import_file(write_dataset(tmp_path / "ds", msgs).folder, store_)
    with store_.read() as con:
        got = con.execute("SELECT step, medium, group_idx, cached_blocks FROM kv_cache_occupancy WHERE run_id = ? "
                          "ORDER BY step, medium, group_idx", [run]).fetchall()
        tiers = capture_time.occupancy(con, run, 0.0, 4.0, 1.0, "tier")
        assert captures.groups(con, run) == [0, 1]
        tree = captures.prefix_tree(con, run, group=1)
        media = dict(zip(captures.prefix_tree(con, run, group=0).block_hash, captures.prefix_tree(
            con, run, group=0).media, strict=True))
    assert got == [(0, "GPU", 0, 2), (0, "GPU", 1, 1), (1, "CPU", 0, 1), (1, "GPU", 0, 1), (2, "GPU", 1, 2),
                   (3, "CPU", 0, 0), (3, "GPU", 0, 0), (3, "GPU", 1, 0), (4, "GPU", 0, 1)]
    tiers = tiers.pivot(index="interval_start", columns="series", values="cached")
    assert list(tiers.GPU) == [3, 2, 3, 0, 1] and list(tiers.CPU) == [0, 1, 1, 0, 0], "an offload moves a block"
    assert sorted(tree.block_hash) == [1, 3], "group 1's own tree"
    assert media[2] == "CPU, GPU" and media[1] == "GPU"


def test_a_long_import_lets_other_readers_in_between_its_turns(tmp_path):
    """While an import waits for its next chunk, another session of the app (a reader in this process)
    and another process read the store and see the run as running with the rows so far; the import
    then finishes complete. With a writer held for the whole import both would wait it out."""
    db = tmp_path / "k.duckdb"
    store = RunStore.open(db)
    rows = EventRows()
    for step, m in enumerate(full_mode_messages("pod-a", 40)):
        rows.add(decode_batch(m.payload, "t"), step=step, replica=m.replica, restart=0, seq=m.seq, where="t")
    table = rows.take()
    halves = [table.slice(0, 20), table.slice(20)]
    first_in, go_on, seen = threading.Event(), threading.Event(), {}

    def chunks() -> Iterator[pa.Table]:
        yield halves[0]
        first_in.set()
        assert go_on.wait(60), "the readers never got in"
        yield halves[1]

    def read_meanwhile() -> None:
        first_in.wait(60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the first chunk's insert may still be finishing
            with store.read() as con:
                seen["here"] = con.execute("SELECT r.status, count(e.run_id) FROM runs r LEFT JOIN kv_events e "
                                           "USING (run_id) GROUP BY ALL").fetchall()
            if seen["here"][0][1]:
                break
        seen["there"] = subprocess.run(
            [sys.executable, "-m", "kvviz", "sql", "--db", str(db), "--format", "csv",
             "SELECT status, (SELECT count(*) FROM kv_events) AS n FROM runs"],
            capture_output=True, text=True, timeout=120, cwd=ROOT)
        go_on.set()

    reader = threading.Thread(target=read_meanwhile)
    reader.start()
    run_id = import_vllm._import(tmp_path / "c.jsonl", store, chunks(), {"capture": "c.jsonl"}, hold_s=0.0)
    reader.join()
    first = halves[0].filter(pc.is_valid(halves[0].column("kind"))).num_rows
    assert seen["here"] == [("running", first)]
    assert seen["there"].returncode == 0, seen["there"].stderr
    assert seen["there"].stdout.split() == ["status,n", f"running,{first}"]
    with store.read() as con:
        assert con.execute("SELECT status, steps FROM runs WHERE run_id = ?", [run_id]).fetchall() == [("complete", 40)]
