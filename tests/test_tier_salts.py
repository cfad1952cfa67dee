"""Salts across tiers (issue 46, item 4): a block hash a replica keeps salted in one medium and unsalted
in another is a cross_tier_salt finding naming both media, the salt, the blocks and the tenants whose
hits the unsalted copies served; salted in both tiers (the control) is none, and so is a copy whose
chain the capture never saw cached there (no evidence that it lacks the salt). The synthetic fleet's
offloading replica shows one, and its linter does not call the tier salt_mixed."""

from __future__ import annotations

import msgpack
import pytest

from kvviz.analysis import captures
from kvviz.analysis.breaches import breaches
from kvviz.capture.capture_file import CaptureWriter
from kvviz.capture.import_vllm import import_capture
from kvviz.capture.synthetic import fleet_messages
from kvviz.store import RunStore

from .test_capture import batch, stored_map, write_capture


def on(medium: str, event: dict) -> dict:
    return event | {"medium": medium}


def tiered(salted_host: bool) -> list[bytes]:
    """tenant-a caches 1-2 on the GPU; both are offloaded to the CPU, each stored there on its own (with
    tenant-a's salt, or none), and tenant-b's request is served 1 from the CPU (a hit naming its salt);
    block 9 reaches the CPU continuing 8, which the capture never saw cached there."""
    host = "tenant-a" if salted_host else None
    return [batch(stored_map([1, 2], None, [1, 2, 3, 4], salt="tenant-a"), ts=1.0),
            batch(stored_map([8, 9], None, [5, 6, 7, 8], salt="tenant-a"), ts=1.5),
            batch({"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU"},
                  on("CPU", stored_map([1], None, [1, 2], salt=host)),
                  on("CPU", stored_map([2], None, [3, 4], salt=host)),
                  on("CPU", stored_map([9], 8, [7, 8])), ts=2.0),
            batch(on("CPU", stored_map([1], None, [1, 2], salt="tenant-b")), ts=3.0)]


@pytest.mark.parametrize("salted_host", [False, True], ids=["host-tier-drops-the-salt", "control-salted-in-both"])
def test_a_hash_salted_on_the_gpu_and_unsalted_on_the_host_is_a_cross_tier_salt_finding(tmp_path, salted_host):
    store = RunStore.open(tmp_path / "k.duckdb")
    run = import_capture(write_capture(tmp_path / "c.jsonl", tiered(salted_host)), store)
    with store.read() as con:
        found = captures.tier_salts(con, run)
        listed = con.execute("SELECT findings FROM runs WHERE run_id = ?", [run]).fetchone()[0]
        hashes = con.execute("SELECT block_hashes FROM cross_tier_salts WHERE run_id = ?", [run]).fetchall()
        lint = breaches(con, run)
    assert "salt_mixed" not in set(lint.kind), "a tier without salts is no stream mixing them"
    if salted_host:
        assert found.empty and not hashes
        return
    [row] = found.to_dict("records")
    assert (row["replica"], row["salted_medium"], row["unsalted_medium"], row["salt"], row["blocks"]) == (
        "replica-0", "GPU", "CPU", "tenant-a", 2), "9 lacks a salt on the CPU only because 8 was never seen there"
    assert list(row["first_blocks"]) == [f"{1:016x}", f"{2:016x}"] and hashes == [([1, 2],)]
    assert (row["hits"], list(row["served"]), list(row["others"]), row["first_step"]) == (
        1, ["tenant-b"], ["tenant-b"], 2), "tenant-b was served tenant-a's block from the CPU"
    assert listed == 2, "listed among the run's findings, beside the cross_tenant one: b's hit of a's block 1"


def test_the_cross_tenant_view_shows_the_tiers_and_the_control_says_none(tmp_path, monkeypatch):
    from tests.test_app import charts, page

    db = tmp_path / "kvviz.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(db))
    said = {}
    for salted_host in (False, True):
        run = import_capture(write_capture(tmp_path / f"{salted_host}.jsonl", tiered(salted_host)), RunStore.open(db))
        at = page("inspector", run_id=run)
        at.segmented_control(key="insp_view").set_value("Cross-tenant").run()
        assert not at.exception
        said[salted_host] = [e.value for e in at.error], [c.value for c in at.caption]
        if not salted_host:
            bars = charts(at)["insp_tier_salts"]["data"]
            assert {(t["name"], tuple(t["y"])) for t in bars} == {("tenant-a", ("replica-0: GPU salted, CPU not",))}
    [error], _ = said[False]
    assert error.startswith("**cross_tier_salt**: 2 block hashes kept with a salt in one tier and without it in "
                            "another, on replica-0") and error.endswith("other than the salt's: tenant-b.")
    errors, notes = said[True]
    assert errors == [] and any(c.startswith("No block hash is kept with its salt in one tier") for c in notes)


def test_the_synthetic_fleets_offloading_replica_drops_the_salt_on_its_cpu_tier(tmp_path):
    """fleet_messages with a replica that offloads (capture-example's last one): every finding is on it,
    salted on the GPU and not on the CPU; the other replica, with the same traffic, has none."""
    path = tmp_path / "fleet.jsonl"
    w = CaptureWriter(path, {"replica-0": "synthetic", "replica-1": "synthetic"})
    media = set()
    for m in fleet_messages(6000, replicas=2, capacity=64, turns=0.3, unsalted=0.05, offload=1):
        media |= {(m.replica, e.get("medium")) for e in msgpack.unpackb(m.payload)[1]}
        w.add(m)
    w.close()
    assert media == {("replica-0", "GPU"), ("replica-1", "GPU"), ("replica-1", "CPU")}
    store = RunStore.open(tmp_path / "k.duckdb")
    run = import_capture(path, store)
    with store.read() as con:
        found = captures.tier_salts(con, run)
        lint = breaches(con, run)
    pairs = set(zip(found.salted_medium, found.unsalted_medium, strict=True))
    assert set(found.replica) == {"replica-1"} and pairs == {("GPU", "CPU")}
    assert found.blocks.sum() > 100 and found.hits.sum() > 0
    assert "salt_mixed" not in set(lint.kind)


def test_a_version_18_store_gains_the_table_in_place(tmp_path):
    """A store from before cross_tier_salts is upgraded where it lies: the table is there, empty, and its
    captures read as having no finding until imported again."""
    import duckdb

    from kvviz.store import SCHEMA_VERSION

    db = tmp_path / "k.duckdb"
    run = import_capture(write_capture(tmp_path / "c.jsonl", tiered(False)), RunStore.open(db))
    con = duckdb.connect(str(db))
    con.execute("DROP TABLE cross_tier_salts")
    con.execute("UPDATE meta SET value = '18' WHERE key = 'schema_version'")
    con.close()
    with RunStore.open(db).read() as con:
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == SCHEMA_VERSION
        assert captures.tier_salts(con, run).empty
