"""vLLM KV-event captures: both encodings, every hash form, import into a run, a real ZMQ publisher on
loopback (with replay and a gap), and malformed captures refused without changes."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time

import duckdb
import msgpack
import pytest
import zmq

from kvviz.capture.capture_file import CaptureWriter, Message, read_capture
from kvviz.capture.events import CaptureError, decode_batch
from kvviz.capture.import_vllm import import_capture
from kvviz.capture.zmq_capture import Endpoint, FleetCapture
from kvviz.store import RunStore

BIG = (1 << 63) + 12345  # unsigned 64-bit hashes above 2^63 occur


def stored_map(hashes, parent, tokens, size=2, salt=None):
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
          "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None}
    if salt:
        ev["extra_keys"] = [[salt]] + [None] * (len(hashes) - 1)
    return ev


def batch(*events, ts=1.0):
    return msgpack.packb([ts, list(events), None])


def test_current_map_encoding_with_u64_and_bytes_hashes():
    digest = bytes(range(32))
    evs = decode_batch(batch(stored_map([BIG, digest], None, [1, 2, 3, 4], salt="tenant-a"),
                             {"type": "BlockRemoved", "block_hashes": [BIG], "medium": "GPU"},
                             {"type": "AllBlocksCleared"}), "m").events
    stored, removed, cleared = evs
    assert stored.block_hashes == [BIG, int.from_bytes(digest[-8:], "big")]
    assert stored.token_ids == [1, 2, 3, 4] and stored.block_size == 2 and stored.salts == ["tenant-a", None]
    assert (removed.kind, removed.block_hashes, cleared.kind) == ("BlockRemoved", [BIG], "AllBlocksCleared")


def test_legacy_array_encoding_and_signed_hashes():
    legacy = ["BlockStored", [-5, 9], 3, [1, 2, 3, 4], 2, None, "GPU"]  # a release before lora_name existed
    stored, removed = decode_batch(batch(legacy, ["BlockRemoved", [9], "GPU"]), "m").events
    assert stored.block_hashes == [(-5) & ((1 << 64) - 1), 9] and stored.parent_hash == 3
    assert stored.medium == "GPU" and stored.lora_name is None and removed.block_hashes == [9]
    assert decode_batch(msgpack.packb({"ts": 2.0, "events": [legacy], "data_parallel_rank": 1}), "m").rank == 1


def write_capture(path, payloads, start=0):
    w = CaptureWriter(path, {"replica-0": "tcp://test"})
    for i, p in enumerate(payloads):
        w.add(Message("replica-0", 0, start + i, "kv-events", p))
    w.close()
    return path


def test_import_builds_the_prefix_tree_occupancy_and_cross_salt_findings(tmp_path):
    cap = write_capture(tmp_path / "c.jsonl", [
        batch(stored_map([11, 12], None, [1, 2, 3, 4], salt="tenant-a")),
        batch(stored_map([21], 12, [5, 6])),
        batch(stored_map([11], None, [1, 2], salt="tenant-b")),  # same hash, another tenant: shared across salts
        batch({"type": "BlockRemoved", "block_hashes": [21, 12], "medium": "GPU"}),
    ])
    db = tmp_path / "k.duckdb"
    run_id = import_capture(cap, RunStore.open(db))
    con = duckdb.connect(str(db), read_only=True)
    tree = con.execute("SELECT block_hash, parent_hash, token_ids FROM kv_events WHERE run_id = ? AND "
                       "kind = 'BlockStored' ORDER BY step, block_index", [run_id]).fetchall()
    assert tree[:3] == [(11, None, [1, 2]), (12, 11, [3, 4]), (21, 12, [5, 6])]
    occupancy = con.execute("SELECT step, cached_blocks FROM kv_cache_blocks WHERE run_id = ? ORDER BY step",
                            [run_id]).fetchall()
    assert occupancy == [(0, 2), (1, 3), (2, 3), (3, 1)], "hash 11 stored again is the same block (a repeat)"
    repeats = con.execute("SELECT step, block_hash FROM kv_events WHERE run_id = ? AND repeat", [run_id]).fetchall()
    assert repeats == [(2, 11)]
    f = con.execute("SELECT kind, request_id, source_request, step FROM findings WHERE run_id = ?",
                    [run_id]).fetchall()
    assert f == [("cross_tenant", "tenant-b", "tenant-a", 2)]
    assert con.execute("SELECT status, model, steps FROM runs").fetchone() == ("complete", "vllm capture", 4)


def capture(endpoint, out, duration=None, replay=None, topic="", should_stop=lambda: False):
    """One replica captured into a JSONL file; its final state (counts, gaps)."""
    fleet = FleetCapture([Endpoint("replica-0", endpoint, replay)], topic=topic)
    sink = CaptureWriter(out, {"replica-0": endpoint})
    try:
        fleet.run(sink, duration=duration, should_stop=should_stop)
    finally:
        fleet.close()
        sink.close()
    return fleet.states["replica-0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Publisher(threading.Thread):
    """A stand-in publisher with the real framing: PUB frames (topic, seq, payload), and a ROUTER replay
    endpoint that, like vLLM's and SGLang's, takes only a REQ-style request [identity, b"", start seq]
    and answers [b"", topic, seq, payload] per batch ending [b"", b"", -1, b""] (vLLM 0.33), or
    [b"", seq, payload] ending [b"", -1, b""] (SGLang, whose replay carries no topic)."""

    END = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, pub_port, replay_port, count=40, skip=17, engine="vllm"):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.count, self.skip, self.engine, self.sent = count, skip, engine, []

    def topic(self, seq):
        return b"kv-events"

    def payload(self, seq):
        return batch(stored_map([1000 + seq], None, [seq, seq]), ts=float(seq))

    def serve_replay(self):
        frames = self.router.recv_multipart()
        if len(frames) != 3:  # the real publishers log "Invalid replay request" and answer nothing
            return
        ident, _, start = frames
        for s in self.sent:
            if s >= int.from_bytes(start, "big"):
                seq = s.to_bytes(8, "big")
                if self.engine == "vllm":
                    self.router.send_multipart([ident, b"", self.topic(s), seq, self.payload(s)])
                else:
                    self.router.send_multipart([ident, b"", seq, self.payload(s)])
        self.router.send_multipart([ident, b"", b"", self.END, b""] if self.engine == "vllm" else
                                   [ident, b"", self.END, b""])

    def run(self):
        self.sent = [0, 1, 2]  # already published before the subscriber came: only replay has them
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        deadline, seq = time.monotonic() + 8, 3
        while time.monotonic() < deadline and seq < self.count:
            if dict(poller.poll(20)).get(self.router):
                self.serve_replay()
            if seq != self.skip:
                self.pub.send_multipart([self.topic(seq), seq.to_bytes(8, "big"), self.payload(seq)])
            self.sent.append(seq)
            seq += 1
            time.sleep(0.05)
        self.pub.close()
        self.router.close()
        self.ctx.term()


@pytest.mark.slow
def test_capture_over_a_real_zmq_socket_with_replay_and_a_gap(tmp_path):
    pub_port, replay_port = free_port(), free_port()
    pub = Publisher(pub_port, replay_port)
    pub.start()
    out = tmp_path / "cap.jsonl"
    w = capture(f"tcp://127.0.0.1:{pub_port}", str(out), duration=4, replay=f"tcp://127.0.0.1:{replay_port}")
    pub.join(10)
    seqs = [m.seq for _, m in read_capture(out)]
    assert seqs[:3] == [0, 1, 2], "the replay endpoint's history comes first"
    assert len(seqs) == len(set(seqs)), "a batch both replayed and received live is written once"
    assert 17 not in seqs and [17, 17] in w.gaps
    assert len(seqs) >= 10
    run_id = import_capture(out, RunStore.open(tmp_path / "k.duckdb"))
    con = duckdb.connect(str(tmp_path / "k.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM kv_events WHERE run_id = ?", [run_id]).fetchone()[0] == len(seqs)


# SGLang frames, built by hand from the layout its publisher (sglang/srt/disaggregation/kv_events.py) documents:
# the batch is positional, [ts, events] before the rank was added and [ts, events, attn_dp_rank] since; events
# were positional arrays (BlockStored: tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
# then medium once tiers were added, then a {"cache_salt": ...} map when the request was salted; BlockRemoved:
# tag, block_hashes, then medium), and are now maps tagged by "type" with optional fields (medium, cache_salt,
# session_id) left out when None. Hashes are signed 64-bit ints; the radix cache's pages hold 1 token.
U64 = (1 << 64) - 1
H1, H2, H3 = -(1 << 63) + 7, -1, 4242  # SGLang hashes: signed, the full int64 range


def sglang_batch(events, rank=0, ts=2.5):
    return msgpack.packb([ts, events] if rank is None else [ts, events, rank])


def test_sglang_positional_frames_of_every_release_decode():
    oldest = sglang_batch([["BlockStored", [H1, H2], None, [11, 12], 1, None],  # before medium: 6 items
                           ["BlockRemoved", [H2]], ["AllBlocksCleared"]], rank=None)
    b = decode_batch(oldest, "m")
    stored, removed, cleared = b.events
    assert (b.rank, b.ts, stored.kind, removed.kind, cleared.kind) == (None, 2.5, "BlockStored",
                                                                                  "BlockRemoved", "AllBlocksCleared")
    assert stored.block_hashes == [H1 & U64, H2 & U64] and stored.parent_hash is None
    assert stored.token_ids == [11, 12] and stored.block_size == 1 and stored.medium is None
    assert removed.block_hashes == [U64] and stored.salts is None and stored.lora_name is None

    tiered = sglang_batch([["BlockStored", [H3], H2, [13], 1, None, "GPU"],
                           ["BlockStored", [H3 + 1, H3 + 2], H3, [14, 15, 16, 17], 2, None, "CPU_PINNED"],
                           ["BlockRemoved", [H3], "CPU_PINNED"]], rank=1)
    b = decode_batch(tiered, "m")
    gpu, host, removed = b.events
    assert (gpu.parent_hash, gpu.medium, b.rank, host.medium, removed.medium) == (U64, "GPU", 1, "CPU_PINNED",
                                                                                     "CPU_PINNED")
    assert host.block_size == 2 and host.token_ids == [14, 15, 16, 17] and host.parent_hash == H3

    salted = sglang_batch([["BlockStored", [H1, H2], None, [11, 12], 1, None, "GPU", {"cache_salt": "tenant-a"}]])
    (ev,) = decode_batch(salted, "m").events
    assert ev.salts == ["tenant-a", "tenant-a"], "the salt map names every block of the event"
    assert ev.lora_name is None and ev.medium == "GPU", "the 8th item is SGLang's metadata, not vLLM's lora_name"

    bigram = sglang_batch([["BlockStored", [H3], None, [[21, 22], [22, 23]], 2, None, "GPU"]])  # EAGLE bigram keys
    assert decode_batch(bigram, "m").events[0].token_ids == [21, 22]


def test_sglang_tagged_map_frames_decode():
    payload = sglang_batch([
        {"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": None, "token_ids": [31, 32],
         "block_size": 1, "lora_id": None, "medium": "GPU", "cache_salt": "tenant-b", "session_id": "s-1"},
        {"type": "BlockStored", "block_hashes": [H3], "parent_block_hash": H2, "token_ids": [33], "block_size": 1,
         "lora_id": None},  # medium, cache_salt and session_id left out when None
        {"type": "BlockRemoved", "block_hashes": [H3, H2], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [H1]},
        {"type": "AllBlocksCleared"},
    ], rank=3)
    b = decode_batch(payload, "m")
    salted, plain, removed, removed_no_medium, cleared = b.events
    assert salted.salts == ["tenant-b", "tenant-b"] and salted.medium == "GPU" and b.rank == 3
    assert salted.session_id == "s-1"
    assert plain.salts is None and plain.medium is None and plain.parent_hash == H2 & U64
    assert removed.block_hashes == [H3, U64] and removed_no_medium.medium is None
    assert cleared.kind == "AllBlocksCleared" and cleared.block_hashes == []


def sglang_radix_capture(tmp_path):
    """Two requests sharing a 2-token prefix in the radix cache (1-token pages), a salted one, evictions, a
    flush (AllBlocksCleared), in both encodings SGLang has published."""
    a, b, c, d, s1, s2 = -101, -102, -103, 104, -(1 << 63) + 1, 9
    return write_capture(tmp_path / "sglang.jsonl", [
        sglang_batch([["BlockStored", [a, b, c], None, [1, 2, 3], 1, None, "GPU"]]),  # request 1: tokens 1 2 3
        sglang_batch([{"type": "BlockStored", "block_hashes": [d], "parent_block_hash": b, "token_ids": [9],
                       "block_size": 1, "lora_id": None, "medium": "GPU"}]),  # request 2: 1 2 9, shares a, b
        sglang_batch([["BlockStored", [s1, s2], None, [1, 2], 1, None, "GPU", {"cache_salt": "tenant-a"}]]),
        sglang_batch([["BlockRemoved", [c], "GPU"], {"type": "BlockRemoved", "block_hashes": [d],
                                                      "medium": "GPU"}]),  # leaves evicted
        sglang_batch([["AllBlocksCleared"]]),
        sglang_batch([], ts=3.0),  # a step with nothing to report
    ]), (a, b, c, d, s1, s2)


def test_sglang_capture_imports_as_a_run_with_the_radix_prefix_tree(tmp_path):
    cap, (a, b, c, d, s1, s2) = sglang_radix_capture(tmp_path)
    db = tmp_path / "k.duckdb"
    run_id = import_capture(cap, RunStore.open(db))
    con = duckdb.connect(str(db), read_only=True)
    tree = con.execute("SELECT block_hash, parent_hash, token_ids, block_size, salt, medium, rank FROM kv_events "
                       "WHERE run_id = ? AND kind = 'BlockStored' ORDER BY step, block_index", [run_id]).fetchall()
    assert tree == [(a & U64, None, [1], 1, None, "GPU", 0), (b & U64, a & U64, [2], 1, None, "GPU", 0),
                    (c & U64, b & U64, [3], 1, None, "GPU", 0), (d, b & U64, [9], 1, None, "GPU", 0),
                    (s1 & U64, None, [1], 1, "tenant-a", "GPU", 0), (s2, s1 & U64, [2], 1, "tenant-a", "GPU", 0)]
    children = con.execute("SELECT parent_hash, list(block_hash ORDER BY block_hash) FROM kv_events WHERE run_id = ? "
                           "AND kind = 'BlockStored' AND parent_hash = ? GROUP BY parent_hash",
                           [run_id, b & U64]).fetchall()
    assert children == [(b & U64, sorted([c & U64, d]))], "the shared prefix branches after token 2"
    per_step = con.execute("SELECT step, stored, removed, cached_blocks FROM kv_cache_blocks WHERE run_id = ? "
                           "ORDER BY step", [run_id]).fetchall()
    assert per_step == [(0, 3, 0, 3), (1, 1, 0, 4), (2, 2, 0, 6), (3, 0, 2, 4), (4, 0, 0, 0)], "the flush empties it"
    assert con.execute("SELECT step, block_hash FROM kv_events WHERE run_id = ? AND kind = 'AllBlocksCleared'",
                       [run_id]).fetchall() == [(4, None)]
    assert con.execute("SELECT status, steps, findings FROM runs WHERE run_id = ?", [run_id]).fetchone() == (
        "complete", 6, 0), "SGLang salts its hashes, so no chain is shared across salts"


class SGLangPublisher(Publisher):
    """SGLang's frames: an epoch appended to the topic (a snapshot-capable publisher), a snapshot barrier that is
    an empty batch on its own topic, one 1-token radix page stored per batch with signed hashes."""

    BARRIER = 25

    def __init__(self, pub_port, replay_port):
        super().__init__(pub_port, replay_port, engine="sglang")

    def topic(self, seq):
        live = b"kv@pod-0@model\x00sgl-kv-epoch=e1"
        return live + b"\x00sgl-kv-snapshot=b1" if seq == self.BARRIER else live

    def payload(self, seq):
        if seq == self.BARRIER:
            return sglang_batch([], ts=float(seq))
        parent = None if seq == 0 else -(seq - 1) - 1000
        return sglang_batch([["BlockStored", [-seq - 1000], parent, [seq], 1, None, "GPU"]], ts=float(seq))


@pytest.mark.slow
def test_sglang_capture_over_a_real_zmq_socket_with_replay_and_a_gap(tmp_path):
    pub_port, replay_port = free_port(), free_port()
    pub = SGLangPublisher(pub_port, replay_port)
    pub.start()
    out = tmp_path / "cap.jsonl"
    w = capture(f"tcp://127.0.0.1:{pub_port}", str(out), duration=4, replay=f"tcp://127.0.0.1:{replay_port}",
                topic="kv@pod-0@model")
    pub.join(10)
    seqs = [m.seq for _, m in read_capture(out)]
    assert seqs[:3] == [0, 1, 2], "SGLang's replay (seq, payload) frames come first"
    assert len(seqs) == len(set(seqs)) and 17 not in seqs and [17, 17] in w.gaps
    assert SGLangPublisher.BARRIER in seqs and len(seqs) >= 30
    topics = [json.loads(line)["topic"] for line in out.read_text().splitlines()[1:]]
    assert topics[:3] == ["", "", ""] and topics[3].startswith("kv@pod-0@model\x00sgl-kv-epoch=")
    run_id = import_capture(out, RunStore.open(tmp_path / "k.duckdb"))
    con = duckdb.connect(str(tmp_path / "k.duckdb"), read_only=True)
    rows = con.execute("SELECT seq, block_hash, parent_hash, token_ids FROM kv_events WHERE run_id = ? ORDER BY seq",
                       [run_id]).fetchall()
    stored = [s for s in seqs if s != SGLangPublisher.BARRIER]
    assert [r[0] for r in rows] == stored, "one row per stored page; the barrier batch has no events"
    assert rows[1] == (1, (-1001) & U64, (-1000) & U64, [1])


def bad_line(tmp_path, line):
    p = write_capture(tmp_path / "c.jsonl", [batch(stored_map([1], None, [1, 2]))])
    with open(p, "a") as f:
        f.write(line + "\n")
    return p


BAD = {
    "missing": (lambda t: t / "none.jsonl", "no such file"),
    "a zip": (lambda t: (t / "c.jsonl").write_bytes(b"PK\x03\x04junk") and t / "c.jsonl", "line 1: not valid JSON"),
    "wrong header": (lambda t: (t / "c.jsonl").write_text('{"format": "other"}\n') and t / "c.jsonl",
                     "not a kvviz vLLM capture"),
    "future version": (lambda t: (t / "c.jsonl").write_text(
        '{"format": "kvviz-vllm-capture", "version": 9}\n') and t / "c.jsonl", "version 9 is not supported"),
    "empty": (lambda t: (t / "c.jsonl").write_text(
        '{"format": "kvviz-vllm-capture", "version": 1}\n') and t / "c.jsonl", "holds no messages"),
    "bad line": (lambda t: bad_line(t, "{not json"), "line 3: not valid JSON"),
    "bad base64": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": "@@@"})), "line 3"),
    "not msgpack": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": base64.b64encode(b"\xc1").decode()})),
                    "not a msgpack event batch"),
    "cut off": (lambda t: (t / "c.jsonl").write_text('{"format": "kvviz-vllm-capture", "version": 2}\n{"seq": 1, "pay')
                and t / "c.jsonl", "line 2 is cut off"),
    "bad token": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": base64.b64encode(
        batch(stored_map([1], None, [1, "x"]))).decode()})), r"line 3 \(seq 1\) event 0: token_ids must be"),
    "token past int32": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": base64.b64encode(
        batch(stored_map([1], None, [1, 1 << 40]))).decode()})), "token_ids must be a list of ints"),
    "bad group": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": base64.b64encode(
        batch({"type": "BlockRemoved", "block_hashes": [1], "group_idx": "x"})).decode()})), "group_idx must be"),
    "float hash": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": base64.b64encode(
        batch({"type": "BlockRemoved", "block_hashes": [1.5]})).decode()})), "must be an int"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_captures_are_refused_and_change_nothing(tmp_path, name):
    make, message = BAD[name]
    db = tmp_path / "k.duckdb"
    good = import_capture(write_capture(tmp_path / "good.jsonl", [batch(stored_map([5], None, [1, 2]))]),
                          RunStore.open(db))
    with pytest.raises(CaptureError, match=message):
        import_capture(make(tmp_path), RunStore.open(db))
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT list(run_id) FROM runs").fetchone()[0] == [good]
    assert con.execute("SELECT count(*) FROM kv_events").fetchone()[0] == 1
    assert len(list((tmp_path / "captures").iterdir())) == 1, "the refused capture left no files"


def test_a_capture_is_listed_as_running_while_it_imports(tmp_path):
    """A long import shows in the runs list (and to other processes) from its start, not once decoded."""
    from kvviz.analysis.runs import list_runs

    store = RunStore.open(tmp_path / "k.duckdb")
    cap = write_capture(tmp_path / "fleet.jsonl", [batch(stored_map([h], None, [1, 2])) for h in range(1, 50)])
    seen = []

    def progress(done: int, total: int) -> None:
        with store.read() as con:
            seen.append(list_runs(con)[["status", "scenario"]].values.tolist())
        if len(seen) == 1:  # the same bytes imported meanwhile (another process, another session) are refused
            with pytest.raises(CaptureError, match=r"copy.jsonl: is being imported now, as run \w+ \(if no process"):
                import_capture(copy, store, sha256="ab" * 32)

    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(cap.read_bytes())
    run_id = import_capture(cap, store, progress, sha256="ab" * 32)
    assert seen and seen[0] == [["running", "capture fleet.jsonl"]]
    with store.read() as con:
        status, workload = con.execute("SELECT status, workload FROM runs WHERE run_id = ?", [run_id]).fetchone()
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
    assert status == "complete" and json.loads(workload) == {"capture": "fleet.jsonl", "sha256": "ab" * 32, "files": 1,
                                                            "breaches": 1}  # its replica stores and never removes
    with pytest.raises(CaptureError, match=f"was imported before, as run {run_id}"):
        import_capture(copy, store, sha256="ab" * 32)
    assert import_capture(copy, store) != run_id, "without its sha256 (import --again) it is a run of its own"


def test_the_example_capture_is_written_once_per_version_and_an_older_one_is_not_reused(tmp_path, monkeypatch):
    from kvviz.capture import synthetic

    first = synthetic.example_file(tmp_path, events=2000)
    written = first.stat().st_mtime_ns
    assert synthetic.example_file(tmp_path, events=2000) == first and first.stat().st_mtime_ns == written
    assert first.name == synthetic.EXAMPLE_NAME and read_capture(first).replicas.keys() == {
        "replica-0", "replica-1", "replica-2"}
    monkeypatch.setattr(synthetic, "EXAMPLE_VERSION", synthetic.EXAMPLE_VERSION + 1)  # what it writes changed
    newer = synthetic.example_file(tmp_path, events=2000)
    assert newer != first and newer.is_file() and not list(newer.parent.glob("_*")), "no partial file left"
