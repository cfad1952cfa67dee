"""explain's SQL (kvviz/capture/explain_sql.py) says what the replay it replaced (tests/explain_replay.py)
says, lookup by lookup, over random histories: captures (salts named on a chain's first block or on
every block, hashes with and without the salt, hashes reused for other content, parents stored after
their children, groups, tiers, sessions, clears, publisher restarts), and engine runs (lookups of
prompts with preemptions and adapters). A capture that contradicts itself is explained where it can
be and each contradiction is counted and said; Spark SQL gives the same rows as DuckDB."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

import duckdb
import msgpack
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvviz.analysis.explain import Contradictions, contradictions
from kvviz.capture import explain_sql
from kvviz.capture.capture_file import CaptureWriter, Message
from kvviz.capture.dataset import DatasetWriter
from kvviz.capture.events import CaptureError, decode_batch
from kvviz.capture.fleet_sql import register_duckdb
from kvviz.capture.rows import EventRows
from kvviz.store import RunStore, schema
from tests.cli import kvviz
from tests.explain_replay import agreed
from tests.test_capture import batch, stored_map

BLOCK = st.tuples(st.integers(1, 3), st.integers(1, 3))  # block size 2, three tokens: siblings share and diverge
POOL = (1, 2, 3)  # hashes a contradictory server reuses for other content
PENDING = 9001  # a hash named as a parent before any block is stored under it
NEVER = 77_777  # a parent stored before the capture began
GROUP = st.sampled_from([None, None, None, 1])
MEDIUM = st.sampled_from(["GPU", "GPU", "GPU", "CPU"])
STORE = st.fixed_dictionaries(
    {
        "op": st.just("store"),
        "parent": st.one_of(st.none(), st.integers(0, 63), st.sampled_from(["pending", "never"])),
        "blocks": st.lists(BLOCK, min_size=1, max_size=3),
        "salt": st.sampled_from([None, "a", "b"]),
        "named": st.sampled_from(["first", "first", "every"]),  # vLLM names it in a chain's first block, SGLang on all
        "hashing": st.sampled_from(["salted", "salted", "unsalted", "reused", "pending"]),
        "group": GROUP,
        "medium": MEDIUM,
        "session": st.sampled_from([None, None, "s"]),
    }
)
REMOVE = st.fixed_dictionaries(
    {
        "op": st.just("remove"),
        "which": st.lists(st.integers(0, 63), min_size=1, max_size=2),
        "group": GROUP,
        "medium": MEDIUM,
    }
)
AGAIN = st.fixed_dictionaries(
    {  # an earlier store sent again: evicted before, a tier's copy, or another tenant's
        "op": st.just("again"),
        "which": st.integers(0, 63),
        "evict": st.booleans(),
        "medium": MEDIUM,
        "salt": st.sampled_from([None, None, "a", "b"]),
    }
)
BREAK = st.sampled_from(
    [{"op": "message"}, {"op": "message"}, {"op": "message"}, {"op": "clear"}, {"op": "restart"}, {"op": "seq_back"}]
)
HISTORY = st.lists(st.one_of(STORE, STORE, AGAIN, REMOVE, BREAK, BREAK), min_size=6, max_size=30)
REASONS = {"cold", "evicted", "capacity", "reset", "namespace", "diverged", "unexplained"}


def content_hash(parent: int | None, block: tuple, salt: str | None) -> int:
    """A chained block hash, as servers make them (the salt left out by one that does not salt)."""
    return int.from_bytes(hashlib.blake2b(repr((parent, block, salt)).encode(), digest_size=8).digest(), "big")


def messages(ops: list[dict]) -> list[tuple[int, int, list[dict]]]:
    """A history's ops as (restart, seq, events) per message."""
    stored: list[int] = []  # every hash stored so far, evicted or not
    sent: list[dict] = []  # every store event so far
    out, events, restart, seq = [], [], 0, 0

    def send() -> None:
        nonlocal events, seq
        out.append((restart, seq, events))
        events, seq = [], seq + 1

    for op in ops:
        kind = op["op"]
        if kind == "message":
            send()
        elif kind == "restart":
            send()
            restart, seq = restart + 1, 0
        elif kind == "seq_back":
            send()
            seq = max(seq - 2, 0)
        elif kind == "clear":
            events.append({"type": "AllBlocksCleared"})
        elif kind == "remove":
            hashes = [stored[i % len(stored)] if stored else POOL[i % 3] for i in op["which"]]
            events.append(
                {"type": "BlockRemoved", "block_hashes": list(dict.fromkeys(hashes)), "medium": op["medium"]}
                | ({"group_idx": op["group"]} if op["group"] is not None else {})
            )
        elif kind == "again" and sent:
            again = sent[op["which"] % len(sent)] | {"medium": op["medium"]}
            if op["salt"] is not None:  # the same tokens, named and hashed under this salt
                h, hashes, tokens = again["parent_block_hash"], [], again["token_ids"]
                for j in range(0, len(tokens), 2):
                    h = content_hash(h, tuple(tokens[j : j + 2]), op["salt"])
                    hashes.append(h)
                again |= {"block_hashes": hashes, "cache_salt": op["salt"]}
                stored += hashes
            if op["evict"]:
                group = {"group_idx": again["group_idx"]} if "group_idx" in again else {}
                events.append(
                    {"type": "BlockRemoved", "block_hashes": again["block_hashes"][:1], "medium": op["medium"]} | group
                )
            events.append(again)
        elif kind == "store":
            sent.append(stored_event(op, stored))
            events.append(sent[-1])
    send()
    return out


def stored_event(op: dict, stored: list[int]) -> dict:
    p, salt, hashing = op["parent"], op["salt"], op["hashing"]
    parent = (
        PENDING
        if p == "pending"
        else NEVER
        if p == "never"
        else None
        if p is None or not stored
        else stored[p % len(stored)]
    )
    hashes, h = [], parent
    for j, block in enumerate(op["blocks"]):
        if j == 0 and hashing == "reused":
            h = POOL[len(stored) % 3]
        elif j == 0 and hashing == "pending":
            h = PENDING
        else:
            h = content_hash(h, block, None if hashing == "unsalted" else salt)
        hashes.append(h)
    stored += hashes
    ev = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": [t for b in op["blocks"] for t in b],
        "block_size": 2,
        "lora_id": None,
        "medium": op["medium"],
        "lora_name": None,
    }
    if salt and op["named"] == "every":
        ev["cache_salt"] = salt
    elif salt and parent is None:
        ev["extra_keys"] = [[salt]] + [None] * (len(hashes) - 1)
    if op["session"]:
        ev["session_id"] = op["session"]
    if op["group"] is not None:
        ev["group_idx"] = op["group"]
    return ev


@pytest.fixture(scope="module")
def con():
    """One store in memory for every example: each is a run, deleted after."""
    c = duckdb.connect()
    c.execute(schema.ddl())
    yield c
    c.close()


def add_capture(con, histories: list[list[dict]]) -> str:
    """The histories as one capture, each its own replica, their messages interleaved; rows made as an
    import makes them (repeats, salts, salt_named)."""
    run_id = f"cap-{random.getrandbits(48):x}"
    rows, per, step = EventRows(), [messages(ops) for ops in histories], 0
    for i in range(max(map(len, per))):
        for n, sent in enumerate(per):
            if i < len(sent):
                restart, seq, events = sent[i]
                rows.add(
                    decode_batch(msgpack.packb([float(step), events, None]), "test"),
                    step=step,
                    replica=f"h{n}",
                    restart=restart,
                    seq=seq,
                    where="test",
                )
                step += 1
    table = rows.take().drop_columns(["payload", "topic"])
    RunStore.insert(con, "kv_event_rows", table.append_column("run_id", pa.array([run_id] * len(table))))
    con.execute("INSERT INTO runs (run_id, status, engine) VALUES (?, 'complete', '{}')", [run_id])
    return run_id


def forget(con, run_id: str) -> None:
    for table in ("kv_event_rows", "block_events", "cache_lookups", "requests", "runs"):
        con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])


@pytest.mark.slow
def test_sql_and_replay_agree_on_every_lookup_of_random_captures(con):
    """At least 300 random histories (a dozen or more replicas per example): every lookup's reason,
    hit, stop and evidence agree, and between them the histories give every reason."""
    seen, histories = Counter(), [0]

    @settings(
        max_examples=25,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(HISTORY, min_size=12, max_size=16))
    def check(hs):
        run_id = add_capture(con, hs)
        try:
            said = agreed(con, run_id)
        finally:
            forget(con, run_id)
        seen.update(e.reason for e in said)
        seen.update("crossed" for e in said if "hits_cached_under" in e.evidence)
        seen.update("tenant unknown" for e in said if "tenant" in e.evidence)
        histories[0] += len(hs)

    check()
    assert histories[0] >= 300
    assert REASONS | {"crossed", "tenant unknown"} <= set(seen), seen


ENGINE_CACHE = st.fixed_dictionaries(
    {
        "op": st.just("cache"),
        "request": st.integers(0, 3),
        "blocks": st.integers(2, 8),
        "hashing": st.sampled_from(["salted"] * 4 + ["unsalted", "reused"]),
    }
)
ENGINE_LOOKUP = st.fixed_dictionaries(
    {
        "op": st.just("lookup"),
        "request": st.integers(0, 3),
        "hit": st.one_of(st.none(), st.none(), st.none(), st.integers(0, 6)),
    }
)  # None: as cached
ENGINE_EVICT = st.fixed_dictionaries(
    {
        "op": st.just("evict"),
        "which": st.integers(0, 7),  # of the last cached
        "then": st.one_of(st.none(), st.integers(0, 3)),
    }
)  # a lookup in its step
ENGINE_KINDS = {
    "cache": ENGINE_CACHE,
    "lookup": ENGINE_LOOKUP,
    "evict": ENGINE_EVICT,
    "step": st.just({"op": "step"}),
    "preempt": st.fixed_dictionaries({"op": st.just("preempt"), "request": st.integers(0, 3)}),
    "reset": st.just({"op": "reset"}),
}
# a preemption now and then: every later lookup of the request is a re-admission
ENGINE_OP = st.sampled_from(
    ["cache"] * 4 + ["lookup"] * 4 + ["evict"] * 2 + ["step"] * 3 + ["preempt", "reset"]
).flatmap(ENGINE_KINDS.get)
ENGINE_REQUEST = st.fixed_dictionaries(
    {
        "cut": st.sampled_from([5, 3, 7, 9, 12, 0]),
        "own": st.lists(st.integers(1, 3), max_size=5),
        "twin": st.booleans(),  # the prompt of the request before it
        "salt": st.sampled_from([None, None, None, "a"]),
        "adapter": st.sampled_from([None, None, None, None, "x"]),
    }
)


def add_engine_run(con, base: list[int], requests: list[dict], ops: list[dict]) -> str:
    """An engine run's tables (block_events, cache_lookups, requests, runs) from random ops: requests
    whose prompts share a prefix (`base`, each leaving it somewhere), their blocks cached as chains under
    their salt and adapter (or without them in the hash, or under a hash reused for other content),
    evicted (two copies of a hash may be cached at once), the cache reset, requests preempted and looked
    up, finding what is cached or a random number of blocks (at
    most once a step each; the last step looks up the first request, so every run has a lookup)."""
    run_id = f"eng-{random.getrandbits(48):x}"
    prompts: list[list[int]] = []
    for r in requests:
        own = ([base[r["cut"]] % 3 + 1] if r["cut"] < len(base) else []) + r["own"]  # it leaves base at the cut
        prompts.append(prompts[-1] if r["twin"] and prompts else base[: r["cut"]] + own or [1])
    events, lookups, cached, step, looked, alive = [], [], [], 0, set(), set()

    def salted(r: dict, parent: int | None, block: tuple) -> int:
        return content_hash(parent, block, f"{r['salt']}/{r['adapter']}")

    def served(i: int) -> int:
        """The blocks of request i's prompt the cache holds, from the first, as the engine finds them."""
        j, parent, prompt = 0, None, prompts[i]
        while j < (len(prompt) - 1) // 2 and salted(requests[i], parent, tuple(prompt[2 * j : 2 * j + 2])) in alive:
            parent, j = salted(requests[i], parent, tuple(prompt[2 * j : 2 * j + 2])), j + 1
        return j

    todo = [*ops, {"op": "step"}, {"op": "lookup", "request": 0, "hit": 0}]
    while todo:
        op = todo.pop(0)
        kind = op["op"]
        if kind == "step":
            step += 1
        elif kind == "cache":
            r, prompt, parent = requests[op["request"]], prompts[op["request"]], None
            for j in range(min(op["blocks"], len(prompt) // 2)):
                block = tuple(prompt[2 * j : 2 * j + 2])
                h = (
                    POOL[len(cached) % 3]
                    if op["hashing"] == "reused" and j == 0
                    else content_hash(parent, block, None)
                    if op["hashing"] == "unsalted"
                    else salted(r, parent, block)
                )
                cached.append(h)
                alive.add(h)
                events.append((step, "cache", f"r{op['request']}", h, parent, list(block), r["salt"], r["adapter"]))
                parent = h
        elif kind == "evict" and cached:
            h = cached[-1 - op["which"] % len(cached)]
            events.append((step, "evict", None, h, None, None, None, None))
            alive.discard(h)
            if op["then"] is not None:
                todo.insert(0, {"op": "lookup", "request": op["then"], "hit": None})
        elif kind == "preempt":
            events.append((step, "preempt", f"r{op['request']}", None, None, None, None, None))
        elif kind == "reset":  # the prefix cache reset: a clear for each block that held a hash
            events += [(step, "clear", None, h, None, None, None, None) for h in sorted(alive)]
            alive.clear()
        elif kind == "lookup" and (step, op["request"]) not in looked:
            looked.add((step, op["request"]))
            n, hit = len(prompts[op["request"]]), served(op["request"]) if op["hit"] is None else op["hit"]
            lookups.append((step, f"r{op['request']}", requests[op["request"]]["salt"], n, min(2 * hit, n - 1)))
    columns = ("step", "kind", "request_id", "hash", "parent_hash", "token_ids", "salt", "adapter")
    rows = {c: [e[i] for e in events] for i, c in enumerate(columns)}
    rows |= {"seq": list(range(len(events))), "medium": ["GPU"] * len(events), "run_id": [run_id] * len(events)}
    RunStore.insert(con, "block_events", schema.arrow_table("block_events", rows))
    rows = {c: [x[i] for x in lookups] for i, c in enumerate(("step", "request_id", "salt", "tokens", "hit_tokens"))}
    rows["run_id"] = [run_id] * len(lookups)
    RunStore.insert(con, "cache_lookups", schema.arrow_table("cache_lookups", rows))
    RunStore.insert(
        con,
        "requests",
        schema.arrow_table(
            "requests",
            {
                "run_id": [run_id] * len(requests),
                "request_id": [f"r{i}" for i in range(len(requests))],
                "prompt_ids": prompts,
                "output_ids": [[] for _ in requests],
            },
        ),
    )
    workload = {
        "requests": [
            {"id": f"r{i}", **({"adapter": r["adapter"]} if r["adapter"] else {})} for i, r in enumerate(requests)
        ]
    }
    con.execute(
        "INSERT INTO runs (run_id, status, engine, workload) VALUES (?, 'complete', ?, ?)",
        [run_id, json.dumps({"block_size": 2}), json.dumps(workload)],
    )
    return run_id


@pytest.mark.slow
def test_sql_and_replay_agree_on_every_lookup_of_random_engine_runs(con):
    """Engine runs: lookups of whole prompts (partial blocks), re-admissions after preemption, salts and
    adapters as namespaces; every lookup agrees, and the runs give every reason."""
    seen = Counter()

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(
        st.lists(st.integers(1, 3), min_size=12, max_size=12),
        st.lists(ENGINE_REQUEST, min_size=4, max_size=4),
        st.lists(ENGINE_OP, min_size=10, max_size=40),
    )
    def check(base, requests, ops):
        run_id = add_engine_run(con, base, requests, ops)
        try:
            said = agreed(con, run_id)
        finally:
            forget(con, run_id)
        seen.update(e.reason for e in said)

    check()
    assert REASONS | {"partial_block", "preempted"} <= set(seen), seen


def contradicting(path: Path, contradict: bool) -> Path:
    """A capture that contradicts itself (or, the control, the same without): a child stored before its
    parent, a removal of a block never stored, a sequence number that goes back."""
    sent = [
        [stored_map([1, 2], None, [1, 2, 3, 4], salt="t")],
        [stored_map([5], 4, [9, 9])] if contradict else [],  # 4 is stored only in the next message
        [stored_map([4], 2, [5, 6]), stored_map([6], 4, [7, 8])],
        [{"type": "BlockRemoved", "block_hashes": [77] if contradict else [6], "medium": "GPU"}],
        [stored_map([3], 2, [5, 7])],
    ]
    w = CaptureWriter(path, {"replica-0": "x"})
    for seq, events in zip([0, 1, 2, 0 if contradict else 3, 4], sent, strict=True):
        w.add(Message("replica-0", 0, seq, "kv", batch(*events)))
    w.close()
    return path


def test_a_capture_that_contradicts_itself_is_explained_where_it_can_be_and_the_contradictions_are_said(tmp_path):
    """Each contradiction counted and said (by the CLI), the rest explained as the replay explains it;
    the same capture without them says nothing of the kind."""
    from kvviz.runners.uploads import import_file

    store = RunStore.open(tmp_path / "k.duckdb")
    runs = {
        name: import_file(contradicting(tmp_path / f"{name}.jsonl", name == "contradicts"), store)
        for name in ("contradicts", "control")
    }
    with store.read() as con:
        said = {name: [(e.request, e.reason, e.hit_tokens) for e in agreed(con, run)] for name, run in runs.items()}
        counted = {name: contradictions(con, run) for name, run in runs.items()}
    chain = f"chain-{1:016x}"
    assert said["control"] == [
        (chain, "cold", 0),
        (f"chain-{4:016x}", "cold", 4),
        (f"chain-{6:016x}", "cold", 6),
        (f"chain-{3:016x}", "diverged", 4),
    ]
    assert said["contradicts"] == said["control"], "5, stored before its parent, is left out"
    assert counted == {"control": Contradictions(), "contradicts": Contradictions(1, 1, 1)}
    assert counted["control"].sentence() is None
    p = kvviz("explain", runs["contradicts"], "--db", str(store.path))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert (
        "The capture contradicts itself: 1 removal of a block not cached (removed twice, or stored before the "
        "capture began); 1 block stored before its parent; 1 message whose sequence number goes back."
    ) in p.stderr
    p = kvviz("explain", runs["control"], "--db", str(store.path))
    assert p.returncode == 0 and "contradicts" not in p.stderr


@pytest.mark.parametrize("contradict", [True, False], ids=["contradicts", "control"])
def test_the_activity_view_says_what_a_capture_contradicts(tmp_path, monkeypatch, contradict):
    """Beside the explained lookups, the counts in a sentence; nothing of the kind for the control."""
    from kvviz.runners.uploads import import_file
    from tests.test_app import explained_in_background, page

    db = tmp_path / "kvviz.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(db))
    run_id = import_file(contradicting(tmp_path / "c.jsonl", contradict), RunStore.open(db))
    at = explained_in_background(page("inspector", run_id=run_id), run_id)
    at.toggle(key="insp_explain").set_value(True).run()
    warned = [w.value for w in at.warning if "contradicts" in w.value]
    assert not at.exception and len(at.dataframe[-1].value) == 4
    assert warned == (
        [
            "The capture contradicts itself: 1 removal of a block not cached (removed twice, or stored "
            "before the capture began); 1 block stored before its parent; 1 message whose sequence "
            "number goes back. The rest is explained."
        ]
        if contradict
        else []
    )


def two_replica_dataset(folder: Path, seed: int = 11) -> Path:
    """A generated fleet: two replicas of random histories (the property test's ops), over a few parts."""
    rng = random.Random(seed)

    def op() -> dict:
        r = rng.random()
        if r < 0.55:
            return {
                "op": "store",
                "parent": rng.choice([None, "pending", "never", *range(64)]),
                "blocks": [(rng.randint(1, 3), rng.randint(1, 3)) for _ in range(rng.randint(1, 3))],
                "salt": rng.choice([None, "a", "b"]),
                "named": rng.choice(["first", "every"]),
                "hashing": rng.choice(["salted", "salted", "unsalted", "reused"]),
                "group": None,
                "medium": "GPU",
                "session": None,
            }
        if r < 0.65:
            return {
                "op": "again",
                "which": rng.randrange(64),
                "evict": rng.random() < 0.5,
                "medium": "GPU",
                "salt": rng.choice([None, "a", "b"]),
            }
        if r < 0.8:
            return {"op": "remove", "which": [rng.randrange(64)], "group": None, "medium": "GPU"}
        return rng.choice([{"op": "message"}] * 6 + [{"op": "clear"}])

    w = DatasetWriter(folder, {"pod-a": "tcp://a:5557", "pod-b": "tcp://b:5557"}, rotate_rows=150, group_rows=50)
    sent = {name: messages([op() for _ in range(160)]) for name in ("pod-a", "pod-b")}
    for i in range(max(map(len, sent.values()))):
        for name, msgs in sent.items():
            if i < len(msgs):
                restart, seq, events = msgs[i]
                payload = msgpack.packb([1000.0 + i, events, None])
                w.add(Message(name, restart, seq, "kv", payload), decode_batch(payload, name))
    w.close()
    return folder


def duck_explain(folder: Path) -> list[tuple]:
    con = duckdb.connect()
    register_duckdb(con, str(folder))
    sql = explain_sql.DuckSql(con)
    explain_sql.capture_inputs(sql.view)
    explain_sql.explain(sql)
    return con.execute(f"SELECT {', '.join(explain_sql.RESULT_COLUMNS)} FROM explain_result").fetchall()


def normalise(rows):
    def value(v):
        if isinstance(v, Decimal):
            assert v == v.to_integral_value()
            return int(v)
        return v

    return sorted(tuple(value(v) for v in row) for row in rows)


def test_the_explain_queries_run_in_duckdb_over_a_dataset_registered_in_place(tmp_path):
    """The same queries over the Parquet dataset where it lies (fleet_sql's capture_events) give what
    explain says of the same dataset registered in the store, lookup by lookup."""
    from kvviz.runners.uploads import import_file

    folder = two_replica_dataset(tmp_path / "capture")
    rows = duck_explain(folder)
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id = import_file(folder, store, in_place=True)
    with store.read() as con:
        said = agreed(con, run_id)
    assert len(rows) == len(said) >= 100
    by_lid = sorted(rows, key=lambda r: (r[4], r[1], r[2] == -1, r[2], r[3]))  # step, replica, group, pos
    assert [(r[12], r[9], r[10]) for r in by_lid] == [(e.reason, e.hit_tokens, e.stop_block) for e in said]
    assert {r[12] for r in rows} >= {"cold", "evicted", "diverged", "namespace"}


def explained_here_and_by_the_result(tmp_path, folder: Path) -> tuple[list, list]:
    """The dataset registered in place twice: once bare (explained here) and once carrying the result
    written into its _explained folder (kept as imported)."""
    from kvviz.analysis.explained import explained, kept
    from kvviz.runners.uploads import import_file

    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("_explained"))
    store = RunStore.open(tmp_path / "k.duckdb")
    carried = import_file(folder, store, in_place=True)
    with store.read() as con:
        assert kept(con, carried), "import --in-place keeps the reasons the result carries"
    here = explained(store, import_file(bare, store, in_place=True))
    return here, explained(store, carried)


def test_import_in_place_keeps_the_reasons_a_result_written_beside_the_dataset_carries(tmp_path):
    """What a cluster writes back (explain_result as Parquet in DIR/_explained) opens with its reasons,
    named and evidenced as if explained here; a result that is no explain_result imports nothing."""
    from kvviz.runners.uploads import import_file

    folder = two_replica_dataset(tmp_path / "capture")
    con = duckdb.connect()
    register_duckdb(con, str(folder))
    sql = explain_sql.DuckSql(con)
    explain_sql.capture_inputs(sql.view)
    explain_sql.explain(sql)
    (folder / "_explained").mkdir()
    con.execute(f"COPY explain_result TO '{folder / '_explained' / 'part-0.parquet'}' (FORMAT parquet)")
    here, imported = explained_here_and_by_the_result(tmp_path, folder)
    assert imported == here and len(here) >= 100
    con.execute(f"COPY (SELECT lid, reason FROM explain_result) TO '{folder / '_explained' / 'part-0.parquet'}' "
                "(FORMAT parquet)")
    store = RunStore.open(tmp_path / "other.duckdb")
    with pytest.raises(CaptureError, match="_explained: not an explain_result kvviz can read"):
        import_file(folder, store, in_place=True)
    with store.read() as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 0, "all or nothing"
    assert folder.is_dir(), "the user's dataset stays where it is"


@pytest.mark.spark
def test_the_explain_queries_give_the_same_rows_in_spark(tmp_path, spark):
    """On a cluster as the README says: Spark explains the dataset, writes explain_result back beside it,
    and import --in-place opens it with those reasons, the same as DuckDB's."""
    folder = two_replica_dataset(tmp_path / "capture")
    want = duck_explain(folder)
    started = time.monotonic()
    spark.read.parquet(str(folder)).createOrReplaceTempView("capture_events")
    sql = explain_sql.SparkSql(spark)
    explain_sql.capture_inputs(sql.table)
    explain_sql.explain(sql)
    got = sql.rows(f"SELECT {', '.join(explain_sql.RESULT_COLUMNS)} FROM explain_result")
    assert normalise(got) == normalise(want) and len(want) >= 100
    assert time.monotonic() - started < 300
    spark.table("explain_result").write.parquet(str(folder / "_explained"))
    here, imported = explained_here_and_by_the_result(tmp_path, folder)
    assert imported == here
