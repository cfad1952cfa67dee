"""The KV-event contract linter: each breach found on a small crafted stream (and nothing on its clean
control), a capture once refused for one event's token count now imported with that event reported,
`kvviz lint`'s exit statuses, and a breach-laden upload through the app's upload path."""

from __future__ import annotations

import json

import pytest

from kvviz.analysis.breaches import breaches, linted, warning
from kvviz.capture.capture_file import CaptureWriter, Message
from kvviz.capture.events import decode_batch
from kvviz.capture.import_vllm import import_capture
from kvviz.capture.lint import KINDS
from kvviz.capture.synthetic import fleet_messages
from kvviz.runners.uploads import import_file
from kvviz.store import RunStore

from .cli import kvviz
from .test_capture import batch, stored_map

CLEAN = [  # two tenants' chains, one continued, both salted at their roots; what was stored is removed
    batch(stored_map([11, 12], None, [1, 2, 3, 4], salt="a")),
    batch(stored_map([21], 12, [5, 6])),
    batch(stored_map([31], None, [7, 8], salt="b")),
    batch({"type": "BlockRemoved", "block_hashes": [21, 12], "medium": "GPU"}),
]


def removed(*hashes: int, medium: str = "GPU") -> bytes:
    return batch({"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium})


def capture(path, payloads, seqs=None, replicas=("replica-0",)):
    """A JSONL capture of `payloads`, seq 0, 1, ... unless `seqs` says otherwise, taking the replicas in turn."""
    w = CaptureWriter(path, {r: "tcp://test" for r in replicas})
    for i, p in enumerate(payloads):
        w.add(Message(replicas[i % len(replicas)], 0, (seqs or range(len(payloads)))[i], "kv-events", p))
    w.close()
    return path


def lint(tmp_path, payloads, **kw):
    """The breaches of a crafted stream's import, by kind."""
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id = import_capture(capture(tmp_path / "c.jsonl", payloads, **kw), store)
    with store.read() as con:
        assert linted(con, run_id)
        found = breaches(con, run_id)
    return {r.kind: r for r in found.itertuples(index=False)}


def test_the_clean_control_reports_nothing(tmp_path):
    assert lint(tmp_path, CLEAN) == {}


def test_hits_reported_ahead_of_new_blocks_are_hits_not_a_second_store(tmp_path):
    """kv_cache_report_mode="full": 31 again ahead of 32 in one event is a hit; the stream says it reports them."""
    assert lint(tmp_path, [*CLEAN, batch(stored_map([31, 32], None, [7, 8, 9, 10], salt="b"))]) == {}


CASES = {  # kind: (the stream, its count, its first step, words its detail holds)
    "token_count": ([*CLEAN, batch(stored_map([41, 42], None, [1, 2, 3], salt="a"))], 1, 4,
                    "3 token_ids for 2 block hashes of block_size 2"),
    "remove_unstored": ([*CLEAN, removed(99)], 1, 4, f"block {99:016x} removed while not cached"),
    "stored_twice": ([*CLEAN, batch(stored_map([31], None, [7, 8], salt="b"))], 1, 4, f"block {31:016x} stored "
                     "again"),
    "parent_after_child": ([*CLEAN, batch(stored_map([52], 51, [1, 2])), batch(stored_map([51], None, [3, 4],
                                                                                           salt="a"))], 1, 4,
                           f"its parent {51:016x} at message 5"),
    "never_removes": (CLEAN[:3], 4, 0, "4 blocks stored, none removed"),
    "salt_mixed": ([*CLEAN, batch(stored_map([61], None, [1, 2]))], 1, 4, "1 of 3 chains begun without a salt"),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_each_breach_is_found_with_its_count_first_occurrence_and_replica(tmp_path, kind):
    stream, count, first, words = CASES[kind]
    found = lint(tmp_path, stream)
    assert list(found) == [kind]
    got = found[kind]
    assert (got.replica, got.count, got.first_step, got.first_seq) == ("replica-0", count, first, first)
    assert words in got.detail and got.what == KINDS[kind]


def test_a_medium_only_removals_name_is_found_and_its_removals_match_no_store(tmp_path):
    found = lint(tmp_path, [*CLEAN, removed(31, medium="CPU")])
    assert set(found) == {"medium_removed_only", "remove_unstored"}
    assert found["medium_removed_only"].detail == "medium CPU on 1 removals, none on a store (stores name GPU)"


def test_lost_and_repeated_sequence_numbers_are_found_per_replica(tmp_path):
    """Two replicas taking turns, each the clean stream: replica-0 skips 2 messages, replica-1 goes back once."""
    stream = [p for p in CLEAN for _ in range(2)]
    found = lint(tmp_path, stream, seqs=[0, 0, 1, 1, 4, 2, 5, 1], replicas=("replica-0", "replica-1"))
    assert set(found) == {"seq_gap", "seq_back"}
    gap, back = found["seq_gap"], found["seq_back"]
    assert (gap.replica, gap.count, gap.first_step, gap.first_seq, gap.detail) == (
        "replica-0", 2, 4, 4, "seq 1 then 4: 2 messages lost there")
    assert (back.replica, back.count, back.first_step, back.detail) == ("replica-1", 1, 7, "seq 2 then 1")


def test_a_capture_once_refused_for_one_events_token_count_imports_with_that_event_reported(tmp_path):
    """The shape of vLLM issue 44451: one event's token_ids do not match its block_hashes; the rest is imported."""
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id = import_capture(capture(tmp_path / "c.jsonl", [CLEAN[0], batch(stored_map([1, 2], None, [1, 2, 3])),
                                                           *CLEAN[1:]]), store)
    with store.read() as con:
        rows = con.execute("SELECT block_hash, token_ids, tokens_given FROM kv_events WHERE run_id = ? AND "
                           "kind = 'BlockStored' ORDER BY step, block_index", [run_id]).fetchall()
        found = breaches(con, run_id)
    assert rows == [(11, [1, 2], None), (12, [3, 4], None), (1, None, 3), (2, None, 3), (21, [5, 6], None),
                    (31, [7, 8], None)], "its blocks are kept without tokens; every other event as it was"
    assert found.kind.tolist() == ["token_count", "salt_mixed"]  # the bad event named no salt either
    assert found.detail[0] == "event 0 of seq 1: 3 token_ids for 2 block hashes of block_size 2"


def test_a_split_import_reports_the_breach_in_its_replica(tmp_path):
    """Two processes decode a fleet's two replicas; message 41 (replica-1) has a wrong token count."""
    path = tmp_path / "fleet.jsonl"
    w = CaptureWriter(path, {"replica-0": "tcp://a", "replica-1": "tcp://b"})
    bad = batch({"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [1], "block_size": 1})
    for i, m in enumerate(fleet_messages(3000, replicas=2)):
        w.add(Message(m.replica, 0, m.seq, m.topic, bad if i == 41 else m.payload, m.received))
    w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id = import_capture(path, store, workers=2)
    with store.read() as con:
        found = breaches(con, run_id)
    token = found[found.kind == "token_count"].iloc[0]
    assert (token.replica, token["count"], token.first_step, token.first_seq) == ("replica-1", 1, 41, 20)


def test_a_dataset_copied_in_or_registered_in_place_is_linted_alike(tmp_path):
    from kvviz.capture.dataset import DatasetWriter

    folder = tmp_path / "ds"
    w = DatasetWriter(folder, {"replica-0": "x"})
    for i, p in enumerate([*CLEAN, removed(99)]):
        w.add(Message("replica-0", 0, i if i < 3 else i + 2, "kv-events", p), decode_batch(p, "test"))
    w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    said = []
    for in_place in (False, True):
        run_id = import_file(folder, store, in_place=in_place)
        with store.read() as con:
            said.append(breaches(con, run_id).drop(columns="first_ts").to_dict("records"))
    assert said[0] == said[1] and [b["kind"] for b in said[0]] == ["remove_unstored", "seq_gap"]


def test_the_views_say_which_breaches_distort_them():
    import pandas as pd

    found = pd.DataFrame([{"kind": "seq_gap", "replica": "r", "count": 3, "first_step": 7, "first_seq": None},
                          {"kind": "salt_mixed", "replica": "r", "count": 1, "first_step": 2, "first_seq": None}])
    said = warning(found, "Activity")
    assert "view. Sequence numbers skip (lost messages) (r 3; the first at the capture's message 7)" in said
    assert "hit rate" in said
    found.loc[0, "first_seq"] = 12  # where the stream numbers its messages, the seq a user can find
    assert "(r 3; the first at seq 12, the capture's message 7)" in warning(found, "Activity")
    assert "salts" not in said and "salts on some chains" in warning(found, "Cross-tenant")
    assert warning(found.iloc[1:], "Activity") is None


def test_lint_exit_statuses_clean_breached_and_unreadable(tmp_path):
    clean = capture(tmp_path / "clean.jsonl", CLEAN)
    (tmp_path / "b").mkdir()
    broken = capture(tmp_path / "b" / "broken.jsonl", [*CLEAN, removed(99)], seqs=[0, 1, 2, 3, 9])
    ok = kvviz("lint", clean)
    assert ok.returncode == 0 and "clean" in ok.stderr and ok.stdout == ""
    bad = kvviz("lint", broken, "--format", "json")
    assert bad.returncode == 1, bad.stderr
    assert [(b["kind"], b["count"], b["first_step"]) for b in json.loads(bad.stdout)] == [
        ("remove_unstored", 1, 4), ("seq_gap", 5, 4)]
    assert "6 breaches of 2 kinds" in bad.stderr  # 1 removal and 5 messages lost
    table = kvviz("lint", broken)
    assert table.returncode == 1 and table.stdout.splitlines()[0].split() == [
        "kind", "replica", "count", "first_step", "first_seq", "detail"]
    short = kvviz("lint", capture(tmp_path / "short.jsonl", CLEAN[:3]))  # stored, nothing removed yet
    assert short.returncode == 0 and "never_removes" in short.stdout, short.stderr
    assert "1 advisory (never_removes: a healthy short capture shows it too, so it fails no check)" in short.stderr
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not a capture\n")
    for unreadable in (junk, tmp_path / "missing.jsonl"):
        got = kvviz("lint", unreadable, "--db", tmp_path / "none.duckdb")
        assert got.returncode == 2 and got.stderr.startswith("kvviz: lint: "), got.stderr
    assert not (tmp_path / "none.duckdb").exists(), "lint writes no store of the user's"


def test_lint_reads_a_stored_runs_breaches(tmp_path):
    db = tmp_path / "k.duckdb"
    run_id = import_capture(capture(tmp_path / "c.jsonl", [*CLEAN, removed(99)]), RunStore.open(db))
    got = kvviz("lint", run_id, "--db", db, "--format", "csv")
    assert got.returncode == 1 and got.stdout.splitlines()[1].startswith("remove_unstored,replica-0,1,4,4,")


def test_a_breach_laden_upload_still_imports_through_the_upload_page(tmp_path, monkeypatch):
    """Most events breach the contract (wrong token counts, removals of blocks never stored, a gap): imported."""
    from .test_app import page, run_ids

    db = tmp_path / "kvviz.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(db))
    stream = [batch(stored_map([100 + i], None, [1, 2, 3], salt="a")) for i in range(6)] + [removed(7), removed(8)]
    cap = capture(tmp_path / "broken.jsonl", stream, seqs=[0, 1, 2, 3, 4, 5, 6, 40])
    at = page("upload")
    at.file_uploader(key="upload_file").set_value(("broken.jsonl", cap.read_bytes(), "application/jsonl")).run()
    at.button(key="upload_go").click().run()
    [run_id] = run_ids(db)
    assert any(f"as run {run_id}" in s.value for s in at.success) and not at.error
    assert any("breaks the contract" in w.value for w in at.warning)
    with RunStore.open(db).read() as con:
        kinds = set(breaches(con, run_id).kind)
    assert kinds == {"token_count", "remove_unstored", "seq_gap"}
    at.button(key="upload_open").click().run()
    at.switch_page("kvviz/ui/pages/inspector.py").run()
    assert not at.exception
    assert any("lost messages" in w.value and "hit rate" in w.value for w in at.warning), "beside the hit rate"


@pytest.mark.parametrize("lost", [True, False], ids=["messages-lost", "control-clean"])
def test_the_figures_a_breach_distorts_say_so_beside_their_numbers_and_the_run_lists_mark_it(tmp_path, monkeypatch,
                                                                                            lost):
    """A stream that lost 5 messages: its hit rate (and occupancy) say so where they are drawn, and Home and
    Runs list the capture with its breach; the same stream numbered without a gap says nothing of it."""
    from .test_app import page

    db = tmp_path / "kvviz.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(db))
    stream = [*CLEAN, batch(stored_map([31, 32], None, [7, 8, 9, 10], salt="b"))]  # 31 again: a hit
    run_id = import_capture(capture(tmp_path / "c.jsonl", stream, seqs=[0, 1, 2, 3, 9] if lost else None),
                            RunStore.open(db))
    at = page("inspector", run_id=run_id)
    [rate] = [m for m in at.metric if m.label.startswith("hit rate")]
    said = [c.value for c in at.caption if "breaks the KV-event contract" in c.value]
    at.segmented_control(key="insp_view").set_value("Occupancy").run()
    occupancy = [c.value for c in at.caption if "breaks the KV-event contract" in c.value]
    listed = {name: page(name).dataframe[0].value.set_index("run_id").breaches[run_id] for name in ("home", "runs")}
    if lost:
        assert rate.label == "hit rate (tokens) :material/report:" and "lost messages" in rate.proto.help
        assert said == [":orange[:material/report: This hit rate is from a stream that breaks the KV-event "
                        "contract: sequence numbers skip (lost messages) (replica-0 5).]"]
        assert len(occupancy) == 1 and "This occupancy is from a stream" in occupancy[0]
        assert listed == {"home": 1, "runs": 1}
    else:
        assert rate.label == "hit rate (tokens)" and not rate.proto.help and said == occupancy == []
        assert listed == {"home": 0, "runs": 0}, "linted and clean: not a blank that reads as unknown"
