"""Captures keep tenants (issue 26): each store of a block carries the tenant its own event names,
so a block evicted and stored again by another tenant is that tenant's for that life, and the
cross_tenant finding, the Cross-tenant view and explain see it; a store whose event names no salt
(vLLM names it in a chain's first block only) is said to be of a tenant the capture cannot tell. An
engine run with the unsalted-prefix fault and its own capture are compared lookup by lookup, and so
are its control's (salts honoured)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvviz.analysis import capture_time
from kvviz.capture.capture_file import DEFAULT_REPLICA, CaptureWriter, Message
from kvviz.capture.emit import KVEventEmitter
from kvviz.capture.import_vllm import import_capture
from kvviz.engine.workload import Workload
from kvviz.models import load_model
from kvviz.runners.recorded import record_run
from kvviz.store import RunStore
from kvviz.store.attention import AttentionSelection
from tests.explain_replay import agreed
from tests.test_capture import batch, stored_map, write_capture

UNKNOWN = "unknown (its event names no salt)"
REMOVED = {"type": "BlockRemoved", "medium": "GPU"}


def sglang(hashes, parent, tokens, salt):
    """A store whose event names its salt for every block (SGLang's cache_salt), a continuation too."""
    return stored_map(hashes, parent, tokens) | {"cache_salt": salt}


def imported(tmp_path: Path, payloads: list[bytes]) -> tuple[RunStore, str]:
    store = RunStore.open(tmp_path / "k.duckdb")
    return store, import_capture(write_capture(tmp_path / "c.jsonl", payloads), store)


def stores(con, run_id: str) -> list[tuple]:
    return con.execute("SELECT step, block_hash, salt, salt_named FROM kv_events WHERE run_id = ? AND "
                       "kind = 'BlockStored' ORDER BY step, block_index", [run_id]).fetchall()


@pytest.mark.parametrize("crossed", [True, False], ids=["re-stored-by-the-other-tenant", "control-by-the-owner"])
def test_a_block_stored_again_is_the_tenant_its_event_names_for_that_life(tmp_path, crossed):
    """tenant-1 caches 1-2-3, tenant-2 caches 4-5; 3, 5 and 4 are evicted. Then block 3 is stored
    again continuing 2 (an event naming its salt for every block), and 4-5 again as a chain's first
    blocks (vLLM names the salt there): by the other tenant, or (the control) by the owner."""
    three, four = ("tenant-2", "tenant-1") if crossed else ("tenant-1", "tenant-2")
    store, run = imported(tmp_path, [
        batch(stored_map([1, 2, 3], None, [1, 2, 3, 4, 5, 6], salt="tenant-1")),
        batch(stored_map([4, 5], None, [7, 8, 9, 10], salt="tenant-2")),
        batch(REMOVED | {"block_hashes": [3]}, REMOVED | {"block_hashes": [5]}, REMOVED | {"block_hashes": [4]}),
        batch(sglang([3], 2, [5, 6], three)),
        batch(stored_map([4, 5], None, [7, 8, 9, 10], salt=four))])
    with store.read() as con:
        assert stores(con, run) == [(0, 1, "tenant-1", True), (0, 2, "tenant-1", True), (0, 3, "tenant-1", True),
                                    (1, 4, "tenant-2", True), (1, 5, "tenant-2", True), (3, 3, three, True),
                                    (4, 4, four, True), (4, 5, four, True)]
        found = con.execute("SELECT request_id, source_request, step FROM findings WHERE run_id = ? AND "
                            "kind = 'cross_tenant' ORDER BY step, position", [run]).fetchall()
        shared = capture_time.cross_tenant(con, run, 0, 10)
        n, events = shared.named, shared.events
        untold = capture_time.untold_restores(con, run, 0, 10)
        said = {e.request: e for e in agreed(con, run)}
    assert untold == 0, "every store names its tenant"
    restored = said[f"chain-{3:016x}#2"]
    assert restored.hit_tokens == 4, "it continues 1-2"
    if crossed:
        assert found == [("tenant-2", "tenant-1", 3), ("tenant-1", "tenant-2", 4), ("tenant-1", "tenant-2", 4)]
        assert n == 3 and {h: set(g.salt) for h, g in events.groupby("block_hash")} == {
            3: {"tenant-1", "tenant-2"}, 4: {"tenant-1", "tenant-2"}, 5: {"tenant-1", "tenant-2"}}
        assert restored.evidence == {"new_from_token": 4, "hits_cached_under": "tenant-1",
                                     "continues_block": f"{2:016x}"}, "tenant-2 continued tenant-1's chain"
    else:
        assert found == [] and n == 0 and events.empty
        assert restored.evidence == {"stored_at": 0, "removed_at": 2, "before": 1}, "the owner's own block again"
    assert all(not {"hits_cached_under", "tenant"} & set(e.evidence) for e in said.values() if e is not restored)


@pytest.mark.parametrize("salted", [True, False], ids=["tenants", "control-without-salts"])
def test_a_store_whose_event_names_no_salt_is_of_a_tenant_the_capture_cannot_tell(tmp_path, salted):
    """Block 3 is evicted and stored again continuing 2 by an event that names no salt, as vLLM sends it
    for any request that hit the chain's first block: whoever stored it, the import can only give it
    the chain's salt, and says that it did; a capture without tenants has nothing to tell apart."""
    salt = "tenant-1" if salted else None
    store, run = imported(tmp_path, [
        batch(stored_map([1, 2, 3], None, [1, 2, 3, 4, 5, 6], salt=salt)),
        batch(REMOVED | {"block_hashes": [3]}),
        batch(stored_map([3], 2, [5, 6]))])
    with store.read() as con:
        restore = stores(con, run)[-1]
        untold = capture_time.untold_restores(con, run, 0, 10)
        findings = con.execute("SELECT count(*) FROM findings WHERE run_id = ?", [run]).fetchone()[0]
        said = agreed(con, run)[-1]
    assert restore == (2, 3, salt, False) and findings == 0, "the chain's salt, not named by its own event"
    assert (said.request, said.hit_tokens, said.reason) == (f"chain-{3:016x}#2", 4, "evicted")
    if salted:
        assert untold == 1
        assert said.evidence == {"stored_at": 0, "removed_at": 1, "before": 1, "continues_chain_of": "tenant-1",
                                 "continues_block": f"{2:016x}", "tenant": UNKNOWN}
    else:
        assert untold == 0 and said.evidence == {"stored_at": 0, "removed_at": 1, "before": 1}


def test_the_cross_tenant_view_says_what_the_capture_cannot_tell(tmp_path, monkeypatch):
    """Block 3 stored again by an event naming no salt: the view says the capture cannot tell who; the
    control, the same store naming its salt, says nothing of the kind."""
    from tests.test_app import page

    db = tmp_path / "kvviz.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(db))
    first = [batch(stored_map([1, 2, 3], None, [1, 2, 3, 4, 5, 6], salt="tenant-1"), ts=1.0),
             batch(REMOVED | {"block_hashes": [3]}, ts=2.0)]
    untold = write_capture(tmp_path / "u.jsonl", [*first, batch(stored_map([3], 2, [5, 6]), ts=3.0)])
    named = write_capture(tmp_path / "n.jsonl", [*first, batch(sglang([3], 2, [5, 6], "tenant-1"), ts=3.0)])
    warned = {}
    for path in (untold, named):
        at = page("inspector", run_id=import_capture(path, RunStore.open(db)))
        at.segmented_control(key="insp_view").set_value("Cross-tenant").run()
        assert not at.exception and any("No block hash was stored under two salts" in i.value for i in at.info)
        warned[path.stem] = [w.value for w in at.warning]
    assert len(warned["u"]) == 1 and warned["u"][0].startswith(
        "1 stored segment continues tenant-1's chain, naming no salt: the capture cannot tell which tenant stored "
        "it. 1 of their stores put back a block evicted earlier.")
    assert warned["n"] == []


@pytest.mark.parametrize("salted", [False, True], ids=["continued-naming-no-salt", "control-naming-its-salt"])
def test_the_capture_views_say_the_segments_whose_tenant_is_unknown_and_show_the_evidence(tmp_path, monkeypatch,
                                                                                          salted):
    """As vLLM sends the unsalted-prefix scenario: tenant-a caches 1-2-3, then three segments continue
    its chain (no eviction, nothing stored twice) by events that name no salt. The Cross-tenant view
    says so beside 'no hash under two salts', and the Activity view's explanation lists the evidence;
    the control, the same segments naming tenant-a, says nothing of the kind."""
    from tests.test_app import explained_in_background, page

    db = tmp_path / "kvviz.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(db))
    stored = sglang if salted else (lambda hashes, parent, tokens, salt: stored_map(hashes, parent, tokens))
    run = import_capture(write_capture(tmp_path / "c.jsonl", [
        batch(stored_map([1, 2, 3], None, [1, 2, 3, 4, 5, 6], salt="tenant-a"), ts=1.0),
        batch(stored([4, 5], 3, [7, 8, 9, 10], "tenant-a"), stored([6], 3, [7, 11], "tenant-a"),
              ts=2.0),
        batch(stored([7], 5, [12, 13], "tenant-a"), ts=3.0)]), RunStore.open(db))
    with RunStore.open(db).read() as con:
        assert capture_time.untold_segments(con, run, 0, 10) == ({} if salted else {"tenant-a": 3})
    at = page("inspector", run_id=run)
    at.segmented_control(key="insp_view").set_value("Cross-tenant").run()
    assert not at.exception and any("No block hash was stored under two salts" in i.value for i in at.info)
    warned = [w.value for w in at.warning]
    at.segmented_control(key="insp_view").set_value("Activity").run()
    explained_in_background(at, run)
    at.toggle(key="insp_explain").set_value(True).run()
    lookups = at.dataframe[-1].value
    assert not at.exception and list(lookups.request) == [f"chain-{h:016x}" for h in (1, 4, 6, 7)]
    unknown = lookups.evidence.str.contains("tenant unknown")
    if salted:
        assert warned == [] and not unknown.any()
    else:
        assert len(warned) == 1 and warned[0].startswith(
            "3 stored segments continue tenant-a's chain, naming no salt: the capture cannot tell which tenant "
            "stored them. vLLM names")
        assert list(unknown) == [False, True, True, True]
        assert lookups.evidence[1].endswith(f"continues chain of tenant-a, continues block {3:016x}, tenant unknown "
                                            "(its event names no salt)")


@pytest.mark.parametrize("salted", [False, True], ids=["continued-naming-no-salt", "control-naming-its-salt"])
def test_the_tree_and_occupancy_label_a_block_whose_event_names_no_salt_as_its_chains_own_tenant_unknown(
        tmp_path, salted, monkeypatch):
    """tenant-a caches 1-2-3; 4 continues 3 by an event naming no salt, and is evicted; 5 continues 3
    the same way and stays. The tree draws 4 and 5 as tenant-a's chain with their own tenant unknown,
    and the occupancy counts them apart from tenant-a's own blocks, through 4's eviction; the control,
    whose events name tenant-a, has tenant-a's blocks only."""
    from kvviz.analysis import captures
    from kvviz.figures import captures as tree_fig

    stored = sglang if salted else (lambda hashes, parent, tokens, salt: stored_map(hashes, parent, tokens))
    store, run = imported(tmp_path, [
        batch(stored_map([1, 2, 3], None, [1, 2, 3, 4, 5, 6], salt="tenant-a"), ts=0.0),
        batch(stored([4], 3, [7, 8], "tenant-a"), ts=1.0), batch(stored([5], 3, [7, 9], "tenant-a"), ts=2.0),
        batch(REMOVED | {"block_hashes": [4]}, ts=3.0), batch(stored_map([9], None, [0, 0], salt="tenant-a"), ts=4.0)])
    with store.read() as con:
        tree = captures.prefix_tree(con, run)
        occupancy = capture_time.occupancy(con, run, 0.0, 4.0, 1.0, "tenant")
        said = con.execute("SELECT salt_named FROM kv_events WHERE run_id = ? AND kind = 'BlockRemoved'",
                           [run]).fetchall()
        monkeypatch.setattr(capture_time, "_named_source", lambda con, run: capture_time._LOOKED_UP_NAMED)
        looked_up = capture_time.occupancy(con, run, 0.0, 4.0, 1.0, "tenant")  # as for a capture imported before
    assert said == [(salted,)], "the removal says whether the store that cached 4 named its salt"
    assert looked_up.equals(occupancy), "the same as looking up each removal's store"
    untold = "tenant-a's chain, own tenant unknown"
    levels = {name: list(part.cached) for name, part in occupancy.groupby("series")}
    drawn = {t.name: t.marker.symbol for t in tree_fig.prefix_tree(tree).data[1:]}
    if salted:
        assert not tree.untold.any() and levels == {"tenant-a": [3, 4, 5, 4, 5]}
        assert drawn == {"salt tenant-a": "circle", "salt tenant-a (evicted)": "circle-open"}
    else:
        assert dict(zip(tree.block_hash, tree.untold, strict=True)) == {1: False, 2: False, 3: False, 4: True,
                                                                       5: True, 9: False}
        assert levels == {"tenant-a": [3, 3, 3, 3, 4], untold: [0, 1, 2, 1, 1]}
        assert drawn == {"salt tenant-a": "circle", untold: "diamond", f"{untold} (evicted)": "diamond-open"}


SHARED, TAIL_A, TAIL_B = list(range(100, 140)), list(range(150, 158)), list(range(160, 168))


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory) -> dict:
    """The unsalted-prefix fault and its control on one workload, each with its own capture: t1-a
    (tenant-1) caches 40 shared tokens and a tail; t2-a (tenant-2) sends the 40 with another tail; p
    evicts t1-a's tail (its two blocks, first in line); t2-b (tenant-2) sends t1-a's prompt again.
    The capture's clock is the engine's step."""
    m = load_model("tiny-llama")
    reqs = [{"id": "t1-a", "prompt_ids": SHARED + TAIL_A, "max_new_tokens": 1, "cache_salt": "tenant-1"},
            {"id": "t2-a", "prompt_ids": SHARED + TAIL_B, "max_new_tokens": 1, "cache_salt": "tenant-2",
             "arrival_step": 3},
            {"id": "p", "prompt_ids": [200 + i % 50 for i in range(32)], "max_new_tokens": 1, "arrival_step": 6},
            {"id": "t2-b", "prompt_ids": SHARED + TAIL_A, "max_new_tokens": 1, "cache_salt": "tenant-2",
             "arrival_step": 9}]
    wl = Workload.from_dict({"requests": reqs, "engine": {"block_size": 4, "num_blocks": 20, "max_batch_tokens": 64}})
    return {fault: _recorded_with_capture(tmp_path_factory.mktemp(fault or "control"), m, wl, fault)
            for fault in ("unsalted_prefix", None)}


def _recorded_with_capture(folder, m, wl: Workload, fault: str | None) -> tuple:
    """The run recorded into folder's store with its own KV events captured and imported beside it."""
    store, now = RunStore.open(folder / "k.duckdb"), [0.0]
    writer = CaptureWriter(folder / "e.jsonl", {DEFAULT_REPLICA: "x"})
    emitter = KVEventEmitter(4, lambda seq, topic, payload: writer.add(
        Message(DEFAULT_REPLICA, 0, seq, topic.decode(), payload)), clock=lambda: now[0])

    def step(rec, _oracle) -> None:
        now[0] = float(rec.step)
        emitter.on_step(rec)
    run = record_run(store, m, wl, fault, on_step=step, selection=AttentionSelection(mode="none")).result.run_id
    writer.close()
    return store, run, import_capture(folder / "e.jsonl", store)


def lookup_pairs(store: RunStore, run: str, capture: str) -> list[tuple]:
    """(the run's lookup, its salt, the capture's lookup of the segment the request's first new block
    began) for every request that stored a block."""
    with store.read() as con:
        from_run = agreed(con, run)
        from_capture = {e.request: e for e in agreed(con, capture)}
        cached = con.execute("SELECT request_id, hash FROM block_events WHERE run_id = ? AND kind = 'cache' "
                             "ORDER BY step, seq", [run]).fetchall()
        salts = dict(con.execute("SELECT request_id, salt FROM cache_lookups WHERE run_id = ?", [run]).fetchall())
    first, lives = {}, {}
    for req, h in cached:
        lives[h] = lives.get(h, 0) + 1
        first.setdefault(req, f"chain-{h:016x}" + (f"#{lives[h]}" if lives[h] > 1 else ""))
    return [(e, salts[e.request], from_capture[first[e.request]]) for e in from_run if e.request in first]


@pytest.mark.parametrize("fault", ["unsalted_prefix", None], ids=["unsalted", "control"])
def test_a_run_and_its_capture_agree_lookup_by_lookup_where_both_hold_the_facts(engine_runs, fault):
    """Every request stored blocks, so each has a segment in the capture: the same hit tokens, and the
    cross-tenant hit named in both or neither; where the segment's event names no salt the capture
    says whose chain it continues (the tenant whose blocks served the hits) and that its own tenant
    is unknown."""
    store, run, capture = engine_runs[fault]
    pairs = lookup_pairs(store, run, capture)
    assert [e.request for e, _, _ in pairs] == ["t1-a", "t2-a", "p", "t2-b"]
    for e, salt, c in pairs:
        assert c.hit_tokens == e.hit_tokens, e.request
        if "tenant" in c.evidence:  # the capture cannot tell: it says so, and whose chain it is
            assert c.evidence["tenant"] == UNKNOWN and "hits_cached_under" not in c.evidence
            assert c.evidence["continues_chain_of"] == e.evidence.get("hits_cached_under", salt), e.request
        else:
            assert c.evidence.get("hits_cached_under") == e.evidence.get("hits_cached_under"), e.request
    crossed = {e.request: e.evidence.get("hits_cached_under") for e, _, _ in pairs}
    told = {e.request: c.evidence.get("continues_chain_of") for e, _, c in pairs}
    with store.read() as con:
        untold = capture_time.untold_restores(con, capture, 0, 100)
        found = con.execute("SELECT count(*) FROM findings WHERE run_id = ?", [capture]).fetchone()[0]
        restored = con.execute("SELECT DISTINCT salt, salt_named FROM kv_events WHERE run_id = ? AND step = "
                               "(SELECT max(step) FROM kv_events WHERE run_id = ?) AND kind = 'BlockStored'",
                               [capture, capture]).fetchall()
    assert found == 0, "no hash was stored under two salts: the capture cannot claim what it cannot see"
    if fault:
        assert crossed == {"t1-a": None, "t2-a": "tenant-1", "p": None, "t2-b": "tenant-1"}
        assert pairs[1][0].hit_tokens == pairs[3][0].hit_tokens == 40
        assert told == {"t1-a": None, "t2-a": "tenant-1", "p": None, "t2-b": "tenant-1"}
        assert untold == 2 and restored == [("tenant-1", False)], "t2-b stored t1-a's evicted tail again"
    else:
        assert set(crossed.values()) == {None} and untold == 0
        assert told == {"t1-a": None, "t2-a": None, "p": None, "t2-b": "tenant-2"}, "t2-b continues t2-a's chain"


def test_a_dataset_written_before_salt_named_imports_with_it_unknown(tmp_path):
    """A version 2 dataset's parts lack salt_named: copied or registered in place, the rows read it as
    null, and explain says of a store naming no salt no more than it did before kvviz kept it."""
    import pyarrow.parquet as pq

    from kvviz.runners.uploads import import_file
    from tests.test_fleet_capture import write_dataset

    sent = [stored_map([1, 2, 3], None, [1, 2, 3, 4, 5, 6], salt="tenant-1"), REMOVED | {"block_hashes": [3]},
            stored_map([3], 2, [5, 6])]
    folder = write_dataset(tmp_path / "ds", [Message("pod-a", 0, i, "kv", batch(e, ts=float(i)), float(i))
                                             for i, e in enumerate(sent)]).folder
    for part in folder.rglob("*.parquet"):
        pq.write_table(pq.read_table(part).drop_columns(["salt_named"]), part, write_page_checksum=True)
    store = RunStore.open(tmp_path / "k.duckdb")
    for run in (import_file(folder, store), import_file(folder, store, in_place=True)):
        with store.read() as con:
            stored, named = con.execute("SELECT count(*), count(salt_named) FROM kv_events WHERE run_id = ? AND "
                                        "kind = 'BlockStored'", [run]).fetchone()
            said = agreed(con, run)[-1]
            untold = capture_time.untold_restores(con, run, 0, 10)
        assert (stored, named, untold) == (4, 0, 0)
        assert (said.hit_tokens, said.evidence) == (4, {"stored_at": 0, "removed_at": 1, "before": 1})


@pytest.mark.parametrize("named", [False, True], ids=["restored-naming-no-salt", "control-naming-its-salt"])
def test_a_cross_tenant_finding_needs_two_tenants_the_stream_names(tmp_path, monkeypatch, named):
    """Issue 46's example in small: tenant-a caches prompt 1-2, tenant-c re-reports it whole under its own
    salt (1 and 2 hit: two tenants named on one cache entry) and stores its turn 3 after it. 3 is
    evicted, then stored again continuing 1-2 by an event naming no salt: the import gives it the
    chain's salt, tenant-a's (the cached 2's), which is a guess, not a second tenant. By construction:
    2 named blocks (1, 2: two findings, c after a), and 3 shared only by inference; the control stores
    3 again naming tenant-c, so nothing is inferred."""
    from tests.test_app import charts, page

    db = tmp_path / "kvviz.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(db))
    again = sglang([3], 2, [5, 6], "tenant-c") if named else stored_map([3], 2, [5, 6])
    store = RunStore.open(db)
    run = import_capture(write_capture(tmp_path / "c.jsonl", [
        batch(stored_map([1, 2], None, [1, 2, 3, 4], salt="tenant-a"), ts=1.0),
        batch(stored_map([1, 2, 3], None, [1, 2, 3, 4, 5, 6], salt="tenant-c"), ts=2.0),
        batch(REMOVED | {"block_hashes": [3]}, ts=3.0),
        batch(again, ts=4.0)]), store)
    with store.read() as con:
        assert stores(con, run)[-1] == (3, 3, "tenant-c" if named else "tenant-a", named)
        found = con.execute("SELECT request_id, source_request, step, position FROM findings WHERE run_id = ? "
                            "ORDER BY step, position", [run]).fetchall()
        listed = captures_findings(con, run)
        shared = capture_time.cross_tenant(con, run, 0, 10)
        both = capture_time.cross_tenant(con, run, 0, 10, inferred=True)
        top = capture_time.shared_prefixes(con, run, 0, 10)
    reused = {r.block_hash: (r.tenants, r.salts) for r in top.itertuples()}
    assert reused[1] == (2, "tenant-a, tenant-c") and reused[3] == (
        1, "tenant-c" if named else "tenant-a (inferred), tenant-c"), "the Shared prefixes table counts as findings do"
    assert found == [("tenant-c", "tenant-a", 1, 0), ("tenant-c", "tenant-a", 1, 1)], "1 and 2, not 3"
    assert listed == [(f"{1:016x}", "tenant-c", "tenant-a"), (f"{2:016x}", "tenant-c", "tenant-a")]
    assert (shared.named, shared.inferred) == (2, 0 if named else 1)
    assert set(shared.events.block_hash) == {1, 2} and shared.events.told.all()
    if named:
        assert both.events.equals(shared.events)
    else:
        three = both.events[both.events.block_hash == 3]
        assert list(zip(three.salt, three.told, three.chain.fillna("-"), strict=True)) == [
            ("tenant-c", True, "-"), (capture_time.UNKNOWN, False, "tenant-a")], \
            "named where the event names it; the guess shown as a guess, with the chain it continues"
    at = page("inspector", run_id=run)
    at.segmented_control(key="insp_view").set_value("Cross-tenant").run()
    said = next(m.value for m in at.markdown if "served more than one tenant" in m.value)
    assert not at.exception and said.startswith(
        f"**2** blocks of this range served more than one tenant the stream names; **{0 if named else 1}** more")
    at.toggle(key="insp_inferred").set_value(True).run()
    names = {t["name"] for t in charts(at)["insp_cross_tenant"]["data"]}
    assert ("tenant unknown: stored" in names) is not named


def captures_findings(con, run: str) -> list[tuple]:
    from kvviz.analysis.captures import cross_tenant_findings

    df = cross_tenant_findings(con, run)
    return list(zip(df.block_hash, df.tenant, df.stored_first_by, strict=True))
