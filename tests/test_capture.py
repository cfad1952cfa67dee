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

from kvviz.capture.capture_file import CaptureWriter, read_capture
from kvviz.capture.events import CaptureError, decode_batch
from kvviz.capture.import_vllm import import_capture
from kvviz.capture.zmq_capture import capture

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
                             {"type": "AllBlocksCleared"}), seq=7)
    stored, removed, cleared = evs
    assert stored.block_hashes == (BIG, int.from_bytes(digest[-8:], "big"))
    assert stored.token_ids == (1, 2, 3, 4) and stored.block_size == 2 and stored.salts == ("tenant-a", None)
    assert (removed.kind, removed.block_hashes, cleared.kind, stored.seq) == ("BlockRemoved", (BIG,),
                                                                             "AllBlocksCleared", 7)


def test_legacy_array_encoding_and_signed_hashes():
    legacy = ["BlockStored", [-5, 9], 3, [1, 2, 3, 4], 2, None, "GPU"]  # a release before lora_name existed
    stored, removed = decode_batch(batch(legacy, ["BlockRemoved", [9], "GPU"]), seq=0)
    assert stored.block_hashes == ((-5) & ((1 << 64) - 1), 9) and stored.parent_hash == 3
    assert stored.medium == "GPU" and stored.lora_name is None and removed.block_hashes == (9,)
    assert decode_batch(msgpack.packb({"ts": 2.0, "events": [legacy], "data_parallel_rank": 1}), 1)[0].rank == 1


def write_capture(path, payloads, start=0):
    w = CaptureWriter(path, "tcp://test")
    for i, p in enumerate(payloads):
        w.add(start + i, b"kv-events", p)
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
    run_id = import_capture(cap, db)
    con = duckdb.connect(str(db), read_only=True)
    tree = con.execute("SELECT block_hash, parent_hash, token_ids FROM kv_events WHERE run_id = ? AND "
                       "kind = 'BlockStored' ORDER BY step, block_index", [run_id]).fetchall()
    assert tree[:3] == [(11, None, [1, 2]), (12, 11, [3, 4]), (21, 12, [5, 6])]
    occupancy = con.execute("SELECT step, cached_blocks FROM kv_cache_blocks WHERE run_id = ? ORDER BY step",
                            [run_id]).fetchall()
    assert occupancy == [(0, 2), (1, 3), (2, 4), (3, 2)]
    f = con.execute("SELECT kind, request_id, source_request, step FROM findings WHERE run_id = ?",
                    [run_id]).fetchall()
    assert f == [("cross_tenant", "tenant-b", "tenant-a", 2)]
    assert con.execute("SELECT status, model, steps FROM runs").fetchone() == ("complete", "vllm capture", 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Publisher(threading.Thread):
    """A stand-in vLLM publisher: PUB frames (topic, seq, payload) and a ROUTER replay endpoint."""

    def __init__(self, pub_port, replay_port, count=40, skip=17):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.count, self.skip, self.sent = count, skip, []

    def payload(self, seq):
        return batch(stored_map([1000 + seq], None, [seq, seq]), ts=float(seq))

    def run(self):
        self.sent = [0, 1, 2]  # already published before the subscriber came: only replay has them
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        deadline, seq = time.monotonic() + 8, 3
        while time.monotonic() < deadline and seq < self.count:
            if dict(poller.poll(20)).get(self.router):
                ident, start = self.router.recv_multipart()
                for s in self.sent:
                    if s >= int.from_bytes(start, "big"):
                        self.router.send_multipart([ident, b"kv-events", s.to_bytes(8, "big"), self.payload(s)])
                self.router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])
            if seq != self.skip:
                self.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), self.payload(seq)])
            self.sent.append(seq)
            seq += 1
            time.sleep(0.05)
        self.pub.close()
        self.router.close()
        self.ctx.term()


def test_capture_over_a_real_zmq_socket_with_replay_and_a_gap(tmp_path):
    pub_port, replay_port = free_port(), free_port()
    pub = Publisher(pub_port, replay_port)
    pub.start()
    out = tmp_path / "cap.jsonl"
    w = capture(f"tcp://127.0.0.1:{pub_port}", str(out), duration=4, replay=f"tcp://127.0.0.1:{replay_port}")
    pub.join(10)
    seqs = [s for s, _ in read_capture(out)]
    assert seqs[:3] == [0, 1, 2], "the replay endpoint's history comes first"
    assert 17 not in seqs and (17, 17) in w.gaps
    assert len(seqs) >= 10
    run_id = import_capture(out, tmp_path / "k.duckdb")
    con = duckdb.connect(str(tmp_path / "k.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM kv_events WHERE run_id = ?", [run_id]).fetchone()[0] == len(seqs)


def bad_line(tmp_path, line):
    p = write_capture(tmp_path / "c.jsonl", [batch(stored_map([1], None, [1, 2]))])
    with open(p, "a") as f:
        f.write(line + "\n")
    return p


BAD = {
    "missing": (lambda t: t / "none.jsonl", "no such file"),
    "a zip": (lambda t: (t / "c.jsonl").write_bytes(b"PK\x03\x04junk") and t / "c.jsonl", "not a capture header"),
    "wrong header": (lambda t: (t / "c.jsonl").write_text('{"format": "other"}\n') and t / "c.jsonl",
                     "not a kvviz vLLM capture"),
    "future version": (lambda t: (t / "c.jsonl").write_text(
        '{"format": "kvviz-vllm-capture", "version": 9}\n') and t / "c.jsonl", "version 9 is not supported"),
    "empty": (lambda t: (t / "c.jsonl").write_text(
        '{"format": "kvviz-vllm-capture", "version": 1}\n') and t / "c.jsonl", "holds no messages"),
    "bad line": (lambda t: bad_line(t, "{not json"), "line 3 is not a captured message"),
    "bad base64": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": "@@@"})), "line 3"),
    "not msgpack": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": base64.b64encode(b"\xc1").decode()})),
                    "not a msgpack event batch"),
    "wrong token count": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": base64.b64encode(
        batch(stored_map([1, 2], None, [1, 2, 3]))).decode()})), "block_size x 2 tokens"),
    "unknown event": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": base64.b64encode(
        batch({"type": "BlockTeleported", "block_hashes": [1]})).decode()})), "unknown event type"),
    "float hash": (lambda t: bad_line(t, json.dumps({"seq": 1, "payload": base64.b64encode(
        batch({"type": "BlockRemoved", "block_hashes": [1.5]})).decode()})), "must be an int"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_captures_are_refused_and_change_nothing(tmp_path, name):
    make, message = BAD[name]
    db = tmp_path / "k.duckdb"
    good = import_capture(write_capture(tmp_path / "good.jsonl", [batch(stored_map([5], None, [1, 2]))]), db)
    with pytest.raises(CaptureError, match=message):
        import_capture(make(tmp_path), db)
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT list(run_id) FROM runs").fetchone()[0] == [good]
    assert con.execute("SELECT count(*) FROM kv_events").fetchone()[0] == 1
