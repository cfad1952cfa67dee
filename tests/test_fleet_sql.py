"""The portable fleet views (kvviz/capture/fleet_sql.py) over a generated two-replica capture dataset:
each view in DuckDB gives the numbers worked out in Python from the same events, and Spark SQL
(local mode, when pyspark and java are installed) gives the same rows as DuckDB."""

from __future__ import annotations

import math
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from decimal import Decimal

import duckdb
import msgpack
import pytest

from kvviz.capture.capture_file import Message
from kvviz.capture.dataset import DatasetWriter
from kvviz.capture.events import decode_batch
from kvviz.capture.fleet_sql import FLEET_VIEWS, register_duckdb

T0 = 1_700_000_030.25  # not on a minute, so minutes split the capture unevenly
BIG = (1 << 64) - 12_345  # hashes above 2^63 occur (Spark reads them as DECIMAL(20,0), DuckDB as UBIGINT)
SALTS = ("tenant-a", "tenant-b", None)


@dataclass(frozen=True)
class Row:
    """What one dataset row should say, worked out while generating (not read back from the dataset)."""
    replica: str
    ts: float
    kind: str | None
    block_hash: int | None = None
    salt: str | None = None
    group: int | None = None
    medium: str | None = None
    repeat: bool | None = None


def stored(hashes, salts, medium="GPU", group=None, size=2):
    ev = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
          "token_ids": list(range(size * len(hashes))), "block_size": size, "lora_id": None, "medium": medium,
          "lora_name": None, "extra_keys": [[s] if s else None for s in salts]}
    if group is not None:
        ev["group_idx"] = group
    return ev


def removed(hashes, medium="GPU", group=None):
    ev = {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}
    if group is not None:
        ev["group_idx"] = group
    return ev


def generate(seed: int = 7, messages: int = 360):
    """[(replica, seq, ts, events)] and the rows they make: stores (some of hashes already cached:
    repeats), removals, empty batches and one AllBlocksCleared per replica, over eight minutes; on
    pod-a a small pool of hashes is stored under both salts (and without one), so tenants share
    blocks there. The cache kept here to decide repeats is this test's own."""
    rng = random.Random(seed)
    live: dict[tuple, set[int]] = defaultdict(set)  # (replica, raw group_idx, medium) -> cached hashes
    pool = {"pod-a": [BIG, *(rng.getrandbits(64) for _ in range(7))], "pod-b": [rng.getrandbits(64) for _ in range(8)]}
    out, rows, seqs = [], [], Counter()
    scripted = {  # a few messages with known content, beside the random ones
        0: ("pod-a", [stored([BIG, pool["pod-a"][1]], ["tenant-a", "tenant-a"])]),
        1: ("pod-a", [stored([BIG], ["tenant-b"])]),  # a repeat, under another salt: cross-tenant
        2: ("pod-b", [stored([pool["pod-b"][0]], ["tenant-a"], group=0),
                      stored([pool["pod-b"][0]], ["tenant-b"], group=1)]),  # two groups: not shared
        3: ("pod-b", []),
        messages // 2: ("pod-a", [{"type": "AllBlocksCleared"}]),
        messages // 2 + 1: ("pod-b", [{"type": "AllBlocksCleared"}]),
        messages - 1: ("pod-b", []),  # two minutes after the rest: a minute without stores
    }
    for i in range(messages):
        ts = T0 + i * 1.0 + rng.random() * 0.5 + (120 if i == messages - 1 else 0)
        if i in scripted:
            replica, events = scripted[i]
        else:
            replica = rng.choice(("pod-a", "pod-b"))
            events = [random_event(rng, replica, pool, live) for _ in range(rng.choice((1, 1, 2)))]
            if rng.random() < 0.03:
                events = []
        out.append((replica, seqs[replica], ts, events))
        seqs[replica] += 1
        if not events:
            rows.append(Row(replica, ts, None))
        for e in events:
            rows.extend(expected_rows(replica, ts, e, live))
    return out, rows


def random_event(rng, replica, pool, live):
    medium = "CPU" if replica == "pod-b" and rng.random() < 0.3 else "GPU"
    group = rng.choice((None, None, 0)) if replica == "pod-a" else None
    cached = sorted(live[(replica, group, medium)])
    if cached and rng.random() < 0.3:
        return removed(rng.sample(cached, min(len(cached), rng.choice((1, 2)))), medium, group)
    n = rng.choice((1, 2, 3))
    hashes = [rng.choice(pool[replica]) if rng.random() < 0.4 else rng.getrandbits(64) for _ in range(n)]
    hashes = list(dict.fromkeys(hashes))  # one event does not store a hash twice
    if replica == "pod-a":
        salt = rng.choice(SALTS)
        salts = [salt] * len(hashes)
    else:  # pod-b: one tenant, so no hash is shared across salts there except scripted
        salts = ["tenant-a"] * len(hashes)
    return stored(hashes, salts, medium, group)


def expected_rows(replica, ts, e, live):
    if e["type"] == "AllBlocksCleared":
        for key in [k for k in live if k[0] == replica]:
            live[key].clear()
        return [Row(replica, ts, "AllBlocksCleared")]
    key = (replica, e.get("group_idx"), e["medium"])
    rows = []
    if e["type"] == "BlockStored":
        for h, keys in zip(e["block_hashes"], e["extra_keys"], strict=True):
            rows.append(Row(replica, ts, "BlockStored", h, keys[0] if keys else None, e.get("group_idx"),
                            e["medium"], h in live[key]))
            live[key].add(h)
    else:
        for h in e["block_hashes"]:
            rows.append(Row(replica, ts, "BlockRemoved", h, None, e.get("group_idx"), e["medium"], h not in live[key]))
            live[key].discard(h)
    return rows


def minute(ts: float) -> int:
    return int(math.floor(ts / 60) * 60)


def expect_hit_rate(rows):
    counts = defaultdict(lambda: [0, 0, 0])
    for r in rows:
        c = counts[(r.replica, minute(r.ts))]
        if r.kind == "BlockStored":
            c[1 if r.repeat else 0] += 1
        elif r.kind == "BlockRemoved" and not r.repeat:
            c[2] += 1
    return sorted((rep, start, s, rp, rm, rp / (s + rp) if s + rp else None)
                  for (rep, start), (s, rp, rm) in counts.items())


def expect_cross_tenant(rows):
    by_hash = defaultdict(list)
    for r in rows:
        if r.kind == "BlockStored":
            by_hash[(r.replica, r.group or 0, r.block_hash)].append(r)
    out = []
    for (rep, group, h), rs in by_hash.items():
        salts = {r.salt for r in rs if r.salt}  # each event here names its salt, or none: no tenant
        if len(salts) > 1:
            out.append((rep, group, h, len(salts), min(salts), max(salts),
                        min(r.ts for r in rs if r.salt in salts)))
    return sorted(out)


def expect_occupancy(rows):
    counts = defaultdict(lambda: [0, 0])
    for r in rows:
        if r.kind == "BlockStored" and not r.repeat:
            counts[(r.replica, r.medium, minute(r.ts))][0] += 1
        elif r.kind == "BlockRemoved" and not r.repeat:
            counts[(r.replica, r.medium, minute(r.ts))][1] += 1
    out, running = [], Counter()
    for (rep, medium, start), (s, rm) in sorted(counts.items()):
        running[(rep, medium)] += s - rm
        out.append((rep, medium, start, s, rm, s - rm, running[(rep, medium)]))
    return out


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """The dataset folder (several parts and row groups per replica, a part still in progress) and
    the rows it should hold."""
    messages, rows = generate()
    folder = tmp_path_factory.mktemp("fleet") / "capture"
    w = DatasetWriter(folder, {"pod-a": "tcp://a:5557", "pod-b": "tcp://b:5557"}, rotate_rows=120, group_rows=40)
    for replica, seq, ts, events in messages:
        payload = msgpack.packb([ts, events, None])
        w.add(Message(replica, 0, seq, "kv-events", payload, received=ts + 0.01),
              decode_batch(payload, f"{replica} seq {seq}"))
    w.close()
    # a capture still running has a part being written: no reader may take it for a finished part
    (folder / "replica=pod-a" / "_part-09999.parquet.inprogress").write_bytes(b"PAR1 half a part")
    return folder, rows


def duck_rows(folder, name):
    con = duckdb.connect()
    register_duckdb(con, str(folder))
    cur = con.execute(FLEET_VIEWS[name])
    return [d[0] for d in cur.description], cur.fetchall()


def test_generated_capture_covers_the_cases(capture):
    folder, rows = capture
    assert len(list((folder / "replica=pod-a").glob("part-*.parquet"))) > 1
    stores = [r for r in rows if r.kind == "BlockStored"]
    assert sum(r.repeat for r in stores) > 20 and sum(not r.repeat for r in stores) > 100
    assert sum(r.kind == "BlockRemoved" for r in rows) > 50
    assert len({minute(r.ts) for r in rows}) >= 6
    assert any(r.block_hash >= 1 << 63 for r in stores)
    con = duckdb.connect()
    register_duckdb(con, str(folder))
    n, replicas, top = con.execute("SELECT count(*), count(DISTINCT replica), max(block_hash) "
                                   "FROM capture_events").fetchone()
    assert (n, replicas) == (len(rows), 2)
    assert top == max(r.block_hash for r in stores if r.block_hash is not None)


def test_hit_rate_per_interval_in_duckdb(capture):
    folder, rows = capture
    cols, got = duck_rows(folder, "hit_rate_per_interval")
    assert cols == ["replica", "interval_start", "stored_blocks", "repeated_blocks", "removed_blocks", "hit_ratio"]
    want = expect_hit_rate(rows)
    assert len(got) == len(want) >= 12
    assert got == [pytest.approx(w) if w[-1] is not None else w for w in want]
    assert any(r[-1] is None for r in got) and any(0 < r[-1] < 1 for r in got if r[-1] is not None)


def test_cross_tenant_reuse_in_duckdb(capture):
    folder, rows = capture
    cols, got = duck_rows(folder, "cross_tenant_reuse")
    assert cols == ["replica", "group_idx", "block_hash", "salts", "min_salt", "max_salt", "first_ts"]
    want = expect_cross_tenant(rows)
    assert sorted(got) == want
    assert ("pod-a", 0, BIG) in {r[:3] for r in got}  # scripted: tenant-a then tenant-b
    assert not [r for r in got if r[0] == "pod-b"]  # the same hash in two groups is two blocks
    assert len(got) >= 4 and all(r[3] == 2 for r in got), "a block without a salt names no third tenant"


def test_occupancy_per_interval_in_duckdb(capture):
    folder, rows = capture
    cols, got = duck_rows(folder, "occupancy_per_interval")
    assert cols == ["replica", "medium", "interval_start", "stored_blocks", "removed_blocks", "net_change",
                    "cached_blocks"]
    want = expect_occupancy(rows)
    assert got == want
    assert {(r[0], r[1]) for r in got} == {("pod-a", "GPU"), ("pod-b", "GPU"), ("pod-b", "CPU")}
    assert any(r[5] < 0 for r in got)


def normalise(rows):
    def value(v):
        if isinstance(v, Decimal):
            assert v == v.to_integral_value()
            return int(v)
        if isinstance(v, float):
            return round(v, 9)
        return v
    return sorted((tuple(value(v) for v in row) for row in rows), key=lambda r: [(v is None, v) for v in r])


@pytest.mark.spark
def test_views_give_the_same_rows_in_spark(capture, spark):
    folder, _ = capture
    started = time.monotonic()
    df = spark.read.parquet(str(folder))
    types = dict(df.dtypes)
    assert types["block_hash"] == "decimal(20,0)" and types["replica"] == "string"
    df.createOrReplaceTempView("capture_events")
    for name, sql in FLEET_VIEWS.items():
        result = spark.sql(sql)
        cols, want = duck_rows(folder, name)
        assert result.columns == cols, name
        got = normalise(tuple(r) for r in result.collect())
        assert got == normalise(want), name
        assert got, name
    assert time.monotonic() - started < 300
