"""The engine's KV events, as a vLLM 0.33 server would publish them: a run's capture names exactly the
blocks the run cached and evicted, chained by parent hash, with the tenant's salt; the unsalted-prefix
fault shows in the capture as one block under two salts while its control does not; kvviz serve
publishes them live over ZMQ with replay, and capture-vllm follows it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import msgpack
import pytest

from kvviz.capture.emit import KVEventEmitter
from kvviz.engine.events import BlockEvent
from kvviz.engine.hashing import hash_to_u64
from kvviz.models import load_model
from kvviz.serve.local import free_port
from kvviz.store import RunStore
from tests.cli import kvviz
from tests.test_capture import capture
from tests.test_serve import Server

ROOT = Path(__file__).resolve().parent.parent
H = [bytes([i]) * 32 for i in range(1, 6)]


def test_a_requests_blocks_in_a_row_are_one_stored_event_and_evictions_are_removals():
    sent = []
    em = KVEventEmitter(2, lambda seq, topic, payload: sent.append((seq, topic, msgpack.unpackb(payload))),
                        topic="kv", clock=lambda: 12.5)
    events = [BlockEvent("allocate", 0, "A", 1), BlockEvent("cache", 0, "A", 1, hash=H[0], token_ids=(1, 2), salt="t1"),
              BlockEvent("cache", 1, "A", 1, hash=H[1], parent_hash=H[0], token_ids=(3, 4), salt="t1"),
              BlockEvent("evict", 2, "B", 1, hash=H[2]),
              BlockEvent("cache", 3, "B", 1, hash=H[3], parent_hash=H[4], token_ids=(5, 6), salt="t2")]
    em.on_step(type("Rec", (), {"events": events})())
    em.on_step(type("Rec", (), {"events": [BlockEvent("free", 0, "A", 0)]})())  # nothing cached: no batch
    [(seq, topic, (ts, batch, rank))] = sent
    assert (seq, topic, ts, rank) == (0, b"kv", 12.5, None)
    assert batch == [
        {"type": "BlockStored", "block_hashes": [hash_to_u64(H[0]), hash_to_u64(H[1])], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
         "extra_keys": [["t1"], None]},
        {"type": "BlockRemoved", "block_hashes": [hash_to_u64(H[2])], "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [hash_to_u64(H[3])], "parent_block_hash": hash_to_u64(H[4]),
         "token_ids": [5, 6], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}]



def test_a_reset_is_one_all_blocks_cleared_however_many_blocks_it_cleared():
    em = KVEventEmitter(2, lambda *a: None)
    events = [BlockEvent("free", 0, "A", 0), BlockEvent("clear", 0, None, 0, hash=H[0]),
              BlockEvent("clear", 3, None, 0, hash=H[1]), BlockEvent("clear", 1, None, 0, hash=H[2], medium="CPU"),
              BlockEvent("cache", 2, "B", 1, hash=H[3], token_ids=(1, 2))]
    assert [e["type"] for e in em.batch(events)] == ["AllBlocksCleared", "BlockStored"]


def tenants_workload(path: Path) -> Path:
    """Two tenants send the same prompt, with more traffic between them than the pool holds: the second
    stores its blocks after the first's were evicted (salted, they are other blocks; unsalted, the same)."""
    same = list(range(100, 124))
    reqs = [{"id": "A", "prompt_ids": same, "max_new_tokens": 6, "cache_salt": "tenant-1"},
            {"id": "B", "prompt_ids": same, "max_new_tokens": 6, "cache_salt": "tenant-2", "arrival_step": 40}]
    reqs += [{"id": f"C{i}", "prompt_ids": [30 + i] * 20, "max_new_tokens": 4, "arrival_step": 6 + 2 * i}
             for i in range(8)]
    path.write_text(json.dumps({"requests": reqs, "engine": {"block_size": 4, "num_blocks": 16,
                                                               "max_batch_tokens": 64}}))
    return path


def run_and_import(tmp_path: Path, fault: str | None = None) -> tuple[RunStore, str, str]:
    db, events = tmp_path / "k.duckdb", tmp_path / "events.jsonl"
    p = kvviz("run", "--workload", str(tenants_workload(tmp_path / "w.json")), "--model", "tiny-llama", "--db",
              str(db), "--kv-events", str(events), "--json", "--quiet", *(["--fault", fault] if fault else []))
    assert p.returncode in (0, 1), p.stderr
    run_id = json.loads(p.stdout.splitlines()[-1])["run_id"]
    p = kvviz("import", str(events), "--db", str(db))
    assert p.returncode == 0, p.stderr
    return RunStore.open(db), run_id, p.stdout.split()[-1]


def test_a_runs_capture_names_exactly_the_blocks_it_cached_and_evicted(tmp_path):
    store, run_id, capture_id = run_and_import(tmp_path)
    with store.read() as con:
        def q(sql: str, rid: str):
            return con.execute(sql, [rid]).fetchall()

        stored = q("SELECT block_hash, parent_hash, salt, block_index FROM kv_events WHERE run_id = ? AND "
                   "kind = 'BlockStored' ORDER BY seq, block_index", capture_id)
        removed = q("SELECT block_hash FROM kv_events WHERE run_id = ? AND kind = 'BlockRemoved'", capture_id)
        seqs = [s for (s,) in q("SELECT DISTINCT seq FROM kv_events WHERE run_id = ? ORDER BY seq", capture_id)]
        truth = {h for (h,) in q("SELECT DISTINCT hash FROM blocks WHERE run_id = ? AND hash IS NOT NULL", run_id)}
        cached, evicted = (q(f"SELECT count(*) FROM block_events WHERE run_id = ? AND kind = '{k}'", run_id)[0][0]
                           for k in ("cache", "evict"))
        cross = q("SELECT count(*) FROM findings WHERE run_id = ? AND kind = 'cross_tenant'", capture_id)[0][0]
    assert {h for h, *_ in stored} == truth and len(stored) == cached  # every cached block, once each
    assert len(removed) == evicted > 0 and {h for (h,) in removed} <= truth
    assert seqs == list(range(len(seqs)))  # one batch per step with events, numbered from 0 without gaps
    seen = set()
    for h, parent, _, _ in stored:  # a forest of hash chains: every parent was stored before its child
        assert parent is None or parent in seen
        seen.add(h)
    assert {salt for *_, salt, i in stored if salt} == {"tenant-1", "tenant-2"}
    assert cross == 0  # salted: the same prompt is two different chains


def test_the_unsalted_prefix_fault_shows_in_the_capture(tmp_path):
    store, _, capture_id = run_and_import(tmp_path, "unsalted_prefix")
    with store.read() as con:
        cross = con.execute("SELECT count(*) FROM findings WHERE run_id = ? AND kind = 'cross_tenant'",
                            [capture_id]).fetchone()[0]
    assert cross > 0  # one block hash stored under both tenants' salts: the cache was shared


def test_a_bad_events_path_is_refused_before_the_model_loads(tmp_path):
    p = kvviz("run", "--scenario", "passphrase", "--model", "tiny-llama", "--kv-events", "/no/such/dir/e.jsonl",
              "--db", str(tmp_path / "k.duckdb"))
    assert p.returncode == 2 and "--kv-events /no/such/dir/e.jsonl: no folder /no/such/dir" in p.stderr


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


def test_serve_publishes_live_events_with_replay_and_capture_follows_them(tiny, tmp_path):
    from kvviz.capture.publisher import ZmqPublisher

    ports = free_port(), free_port()
    publisher = ZmqPublisher(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
    emitter = KVEventEmitter(4, publisher.send)
    s = Server(tiny, on_step=emitter.on_step)
    try:
        before = s.client.completions.create(model="tiny", prompt="sent before anyone listened " * 3,
                                             max_tokens=2, temperature=0)
        out = tmp_path / "live.jsonl"
        done = threading.Event()
        follower = threading.Thread(target=capture, kwargs=dict(
            endpoint=f"tcp://127.0.0.1:{ports[0]}", out=str(out), replay=f"tcp://127.0.0.1:{ports[1]}",
            should_stop=done.is_set))
        follower.start()
        time.sleep(0.5)  # the subscriber has joined
        s.client.completions.create(model="tiny", prompt="sent while the capture runs " * 3, max_tokens=2,
                                    temperature=0)
        time.sleep(0.5)
        done.set()
        follower.join(10)
    finally:
        s.close()
        publisher.close()
    assert before.usage.prompt_tokens > 8
    db = tmp_path / "k.duckdb"
    p = kvviz("import", str(out), "--db", str(db))
    assert p.returncode == 0, p.stderr
    with RunStore.open(db).read() as con:
        seqs = [s for (s,) in con.execute("SELECT DISTINCT seq FROM kv_events ORDER BY seq").fetchall()]
        stored = con.execute("SELECT count(*) FROM kv_events WHERE kind = 'BlockStored'").fetchone()[0]
    assert seqs == list(range(emitter.seq)) and stored > 0  # the history (replayed) and the live batches, once


def test_serve_refuses_bad_event_endpoints():
    p = kvviz("serve", "--model", "tiny-llama", "--kv-replay", "tcp://*:5558")
    assert p.returncode == 2 and "--kv-replay needs --kv-events" in p.stderr
    p = kvviz("serve", "--model", "tiny-llama", "--kv-events", "tcp//nowhere")
    assert p.returncode == 2 and "--kv-events 'tcp//nowhere'" in p.stderr
