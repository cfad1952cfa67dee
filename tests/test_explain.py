"""Why did it miss: engine workloads built to miss for each reason are explained with exactly that
reason and evidence, and the capture of the same run (run --kv-events) gives the same answers. Every
run here is explained by SQL and by the replay the SQL replaced (tests/explain_replay.py), which
agree on every lookup."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvviz.analysis.explained import explained, kept
from kvviz.analysis.runs import delete_run
from kvviz.store import RunStore, StoreError
from tests.cli import kvviz
from tests.explain_replay import agreed

ROOT = Path(__file__).resolve().parent.parent
PROMPT = list(range(100, 124))  # six blocks of 4
CHAIN_KEYS = {"continues_chain_of", "continues_block", "tenant"}  # what only a capture's segment says


def run(tmp_path: Path, requests: list[dict], num_blocks: int = 16, budget: int = 64) -> tuple[RunStore, str, str]:
    """Record the workload with its KV events, import the capture; (store, run id, capture id)."""
    w, db, events = tmp_path / "w.json", tmp_path / "k.duckdb", tmp_path / "e.jsonl"
    w.write_text(json.dumps({"requests": requests, "engine": {"block_size": 4, "num_blocks": num_blocks,
                                                               "max_batch_tokens": budget}}))
    p = kvviz("run", "--workload", str(w), "--model", "tiny-llama", "--db", str(db), "--kv-events", str(events),
              "--json", "--quiet")
    assert p.returncode == 0, p.stderr
    run_id = json.loads(p.stdout.splitlines()[-1])["run_id"]
    p = kvviz("import", str(events), "--db", str(db))
    assert p.returncode == 0, p.stderr
    return RunStore.open(db), run_id, p.stdout.split()[-1]


@pytest.fixture(scope="module")
def misses(tmp_path_factory):
    """A (t1) caches the prompt; G (t1) finds all of it; B (t2) the same tokens under another salt; D
    (t1) changes the prompt at token 10; traffic C0-C7 evicts A's blocks before E (t1, 18 shared
    tokens) and F (t1, the same prompt) arrive."""
    reqs = [{"id": "A", "prompt_ids": PROMPT, "max_new_tokens": 6, "cache_salt": "t1"},
            {"id": "G", "prompt_ids": PROMPT, "max_new_tokens": 2, "cache_salt": "t1", "arrival_step": 1},
            {"id": "B", "prompt_ids": PROMPT, "max_new_tokens": 6, "cache_salt": "t2", "arrival_step": 2},
            {"id": "D", "prompt_ids": PROMPT[:10] + [7] * 14, "max_new_tokens": 3, "cache_salt": "t1",
             "arrival_step": 3},
            {"id": "E", "prompt_ids": PROMPT[:18] + [5, 5, 5], "max_new_tokens": 3, "cache_salt": "t1",
             "arrival_step": 8},
            {"id": "F", "prompt_ids": PROMPT, "max_new_tokens": 3, "cache_salt": "t1", "arrival_step": 40}]
    reqs += [{"id": f"C{i}", "prompt_ids": [30 + i] * 20, "max_new_tokens": 4, "arrival_step": 4 + 2 * i}
             for i in range(8)]
    store, run_id, capture_id = run(tmp_path_factory.mktemp("misses"), reqs)
    with store.read() as con:
        first: dict = {}
        for e in agreed(con, run_id):  # each request's first lookup (a preempted one has more)
            first.setdefault(e.request, e)
        return store, run_id, capture_id, first


def test_each_reason_with_its_evidence(misses):
    *_, got = misses
    assert (got["A"].reason, got["A"].hit_tokens) == ("cold", 0)
    assert (got["G"].reason, got["G"].hit_tokens, got["G"].evidence) == ("partial_block", 20, {"tokens_after": 4})
    assert (got["B"].reason, got["B"].evidence) == ("namespace", {"cached_under": "t1"})
    assert (got["D"].reason, got["D"].hit_tokens, got["D"].stop_block) == ("diverged", 8, 2)
    assert got["D"].evidence == {"shared_tokens": 10, "ours": 7, "theirs": 110}
    for r in ("E", "F"):
        e = got[r]
        assert e.reason == "evicted" and e.evidence["removed_at"] < e.step, (r, e)
        assert e.evidence["before"] == e.step - e.evidence["removed_at"]
    assert got["E"].hit_tokens == 0 or got["E"].stop_block * 4 == got["E"].hit_tokens
    assert all(got[f"C{i}"].reason == "cold" for i in range(8))  # unrelated prompts: nothing in common


def test_an_answer_is_columns_read_as_explanations_only_where_asked(misses):
    """explain's answer stays an Arrow table (a capture's is millions of lookups); indexing, slicing,
    counting by reason and picking a request read it as the objects a list would hold."""
    from collections import Counter

    store, run_id, *_ = misses
    with store.read() as con:
        said = agreed(con, run_id)
    listed = list(said)
    assert said.table.num_rows == len(said) == len(listed) > 3
    assert said[0] == listed[0] and said[-1] == listed[-1] and said[1:3] == listed[1:3]
    with pytest.raises(IndexError):
        said[len(said)]
    assert said.by_reason() == Counter(e.reason for e in listed)
    assert list(said.of_request("D")) == [e for e in listed if e.request == "D"] != []
    assert said == listed and said != listed[:-1]


def test_a_preempted_request_is_explained_as_preempted(tmp_path):
    reqs = [{"id": "P", "prompt_ids": list(range(100, 112)), "max_new_tokens": 14},
            {"id": "Q", "prompt_ids": list(range(150, 162)), "max_new_tokens": 14}]
    store, run_id, _ = run(tmp_path, reqs, num_blocks=10)
    with store.read() as con:
        got = agreed(con, run_id)
        preempted = con.execute("SELECT DISTINCT request_id, step FROM block_events WHERE run_id = ? AND "
                                "kind = 'preempt' ORDER BY step", [run_id]).fetchall()
    assert preempted, "the pool was meant to be too small for both"
    victim, at = preempted[0]
    again = [e for e in got if e.request == victim][1:]
    assert again and again[0].reason == "preempted" and again[0].evidence == {"preempted_at": at}


def test_the_capture_of_the_run_gives_the_same_answers(misses):
    store, run_id, capture_id, got = misses
    with store.read() as con:
        from_capture = {e.request: e for e in agreed(con, capture_id)}
        cached = con.execute("SELECT request_id, hash FROM block_events WHERE run_id = ? AND kind = 'cache' "
                             "ORDER BY step, seq", [run_id]).fetchall()
        salts = dict(con.execute("SELECT request_id, salt FROM cache_lookups WHERE run_id = ?", [run_id]).fetchall())
    first_stored, times = {}, {}  # request -> the capture's name for the chain its first new block began
    for req, h in cached:
        times[h] = times.get(h, 0) + 1
        first_stored.setdefault(req, f"chain-{h:016x}" + (f"#{times[h]}" if times[h] > 1 else ""))
    compared = 0
    for req, e in got.items():
        if e.reason == "partial_block" or req not in first_stored:
            continue  # stored nothing new: the capture never sees this lookup
        c = from_capture[first_stored[req]]
        assert (c.reason, c.hit_tokens, c.stop_block) == (e.reason, e.hit_tokens, e.stop_block), req
        if e.reason in ("namespace", "diverged"):  # the capture also says whose chain a segment continues
            assert {k: v for k, v in c.evidence.items() if k not in CHAIN_KEYS} == e.evidence
        if "tenant" in c.evidence:  # its event names no salt: the chain's tenant is said, its own is not known
            assert c.evidence["continues_chain_of"] == e.evidence.get("hits_cached_under", salts[req]), req
        compared += 1
    assert compared >= 12


def test_the_cli_explains_as_a_table_or_json(misses):
    store, run_id, capture_id, _ = misses
    p = kvviz("explain", run_id, "--db", str(store.path), "--request", "D", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["run_id"] == run_id and [x["reason"] for x in out["lookups"]] == ["diverged"]
    assert set(out["lookups"][0]) == {"request", "step", "hit_tokens", "stop_block", "stop_token", "reason",
                                      "evidence"}
    p = kvviz("explain", capture_id, "--db", str(store.path))
    assert p.returncode == 0 and "namespace" in p.stdout and "chain-" in p.stdout
    p = kvviz("explain", run_id, "--db", str(store.path), "--summary", "--json")
    with store.read() as con:
        reasons = [e.reason for e in agreed(con, run_id)]
    summary = json.loads(p.stdout)
    assert {r["reason"]: r["lookups"] for r in summary} == {r: reasons.count(r) for r in set(reasons)}
    assert [r["lookups"] for r in summary] == sorted((r["lookups"] for r in summary), reverse=True)
    assert sum(r["share"] for r in summary) == pytest.approx(1, abs=1e-3)
    p = kvviz("explain", run_id, "--db", str(store.path), "--request", "nobody")
    assert p.returncode == 2 and "no lookup of request 'nobody'" in p.stderr
    p = kvviz("explain", "no-such-run", "--db", str(store.path))
    assert p.returncode == 2 and "no-such-run" in p.stderr


def test_an_explanation_is_kept_once_then_read_back_by_sql_the_cli_and_the_app(misses, tmp_path):
    """A capture is explained once: what was said is kept (lookup_explanations, each lookup at its
    message's time) and read back after; a run still recording is explained but not kept; a deleted
    run leaves nothing behind."""
    store, run_id, capture_id, _ = misses
    copy = RunStore.open(shutil.copy(store.path, tmp_path / "copy.duckdb"))
    with copy.write() as con:  # as explained by nobody yet (the CLI test may have kept it)
        con.execute("DELETE FROM lookup_explanations")
        con.execute("UPDATE runs SET explained_at = NULL")
    with copy.read() as con:
        said = agreed(con, capture_id)
        assert not kept(con, capture_id)
    p = kvviz("explain", capture_id, "--db", str(copy.path), "--json")  # the first time: worked out, said
    assert "explaining the capture's" in p.stderr and len(said) >= 12
    assert "kvviz: explain 1/11: numbering the events\n" in p.stderr, "each stage said as it begins"
    assert "kvviz: explain 10/11: keeping it in the run store\n" in p.stderr
    assert "kvviz: explain 11/11: counting what the capture's events contradict\n" in p.stderr, "as the app counts"
    assert [x["reason"] for x in json.loads(p.stdout.splitlines()[-1])["lookups"]] == [e.reason for e in said]
    with copy.read() as con:
        assert kept(con, capture_id)
        rows, timed, first, last = con.execute(
            "SELECT count(*), count(ts), min(ts), max(ts) FROM lookup_explanations WHERE run_id = ?",
            [capture_id]).fetchone()
        start, end = con.execute("SELECT min(ts), max(ts) FROM kv_events WHERE run_id = ?", [capture_id]).fetchone()
    assert rows == timed == len(said) and start <= first <= last <= end
    assert explained(copy, capture_id) == said, "read back as it was said, evidence and order included"
    with copy.write() as con:  # what is kept is what is read: nothing worked out behind it
        con.execute("UPDATE lookup_explanations SET reason = 'kept' WHERE run_id = ?", [capture_id])
    assert {e.reason for e in explained(copy, capture_id)} == {"kept"}
    p = kvviz("explain", capture_id, "--db", str(copy.path), "--json")
    assert {x["reason"] for x in json.loads(p.stdout.splitlines()[-1])["lookups"]} == {"kept"}, p.stderr
    assert "explaining" not in p.stderr
    with copy.write() as con:
        con.execute("UPDATE runs SET status = 'running' WHERE run_id = ?", [run_id])
    assert explained(copy, run_id)
    with copy.read() as con:
        assert not kept(con, run_id)
        assert con.execute("SELECT count(*) FROM lookup_explanations WHERE run_id = ?", [run_id]).fetchone()[0] == 0
    delete_run(copy, capture_id)
    with copy.read() as con:
        assert con.execute("SELECT count(*) FROM lookup_explanations").fetchone()[0] == 0


def explained_capture(tmp_path, events: list[dict]) -> list:
    """Each event a message of one replica's JSONL capture, imported; its lookups explained."""
    from kvviz.capture.capture_file import CaptureWriter, Message
    from kvviz.runners.uploads import import_file
    from tests.test_capture import batch

    w = CaptureWriter(tmp_path / "c.jsonl", {"replica-0": "x"})
    for seq, ev in enumerate(events):
        w.add(Message("replica-0", 0, seq, "kv", batch(ev)))
    w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    run = import_file(tmp_path / "c.jsonl", store)
    with store.read() as con:
        return agreed(con, run)


def test_a_captures_lookups_are_named_by_session_and_repeats_are_not_lookups(tmp_path):
    """SGLang and vLLM name a request's session: a conversation's turns are its lookups, one after another;
    a store the server repeats for a hit (kv_cache_report_mode=full) is not a new lookup."""
    from tests.test_capture import stored_map

    turns = [stored_map([1, 2], None, [10, 11, 12, 13]) | {"session_id": "conv-7"},
             stored_map([1], None, [10, 11]),  # a repeat: block 1 is cached
             stored_map([3], 2, [14, 15]) | {"session_id": "conv-7"},  # the second turn continues the chain
             stored_map([4], None, [20, 21])]  # no session: named by its first block
    found = [(e.request, e.step, e.hit_tokens) for e in explained_capture(tmp_path, turns)]
    assert found == [("conv-7", 0, 0), ("conv-7", 2, 4), ("chain-0000000000000004", 3, 0)]


def test_the_new_blocks_after_the_hits_an_event_repeats_are_its_lookup(tmp_path):
    """kv_cache_report_mode=full reports a request's hits and its new blocks in one event (as a Mooncake
    trace's import writes each request): the new blocks are a lookup that stopped after the hits."""
    from tests.test_capture import stored_map

    turns = [stored_map([1, 2], None, [10, 11, 12, 13]),
             stored_map([1, 2, 3], None, [10, 11, 12, 13, 14, 15])]  # 1 and 2 reported again: hits
    found = [(e.request, e.step, e.hit_tokens, e.stop_block, e.reason, e.evidence)
             for e in explained_capture(tmp_path, turns)]
    assert found == [(f"chain-{1:016x}", 0, 0, 0, "cold", {"new_from_token": 0}),
                     (f"chain-{3:016x}", 1, 4, 2, "cold", {"new_from_token": 4})]


def test_a_chain_stored_again_after_an_all_blocks_cleared_missed_because_of_the_reset(tmp_path):
    """AllBlocksCleared empties the replica's cache: the chain stored again after it is explained as
    lost to the reset (not still cached, not evicted)."""
    from tests.test_capture import stored_map

    timeline = [stored_map([1, 2], None, [10, 11, 12, 13]), {"type": "AllBlocksCleared"},
                stored_map([1, 2], None, [10, 11, 12, 13])]
    found = [(e.request, e.step, e.reason, e.evidence) for e in explained_capture(tmp_path, timeline)]
    assert found == [("chain-0000000000000001", 0, "cold", {"new_from_token": 0}),
                     ("chain-0000000000000001#2", 2, "reset", {"stored_at": 0, "removed_at": 1, "before": 1})]


def test_two_sessions_and_the_cli_explaining_one_capture_at_once_keep_it_once(misses, tmp_path):
    """Two app sessions (threads on one store) and a CLI process ask at the same moment: each gets the
    same answer, and the store keeps one copy of it."""
    import threading

    store, _, capture_id, _ = misses
    copy = RunStore.open(shutil.copy(store.path, tmp_path / "copy.duckdb"))
    with copy.write() as con:
        con.execute("DELETE FROM lookup_explanations")
        con.execute("UPDATE runs SET explained_at = NULL")
    cli = subprocess.Popen([sys.executable, "-m", "kvviz", "explain", capture_id, "--db", str(copy.path), "--json"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(explained(copy, capture_id))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    out, err = cli.communicate(timeout=300)
    assert cli.returncode == 0, err
    assert len(got) == 2 and got[0] == got[1]
    assert [x["reason"] for x in json.loads(out.splitlines()[-1])["lookups"]] == [e.reason for e in got[0]]
    with copy.read() as con:
        kept_rows = con.execute("SELECT count(*), count(DISTINCT (request, step)) FROM lookup_explanations "
                                "WHERE run_id = ?", [capture_id]).fetchone()
    assert kept_rows[0] == kept_rows[1] == len(got[0])


def test_a_store_that_cannot_be_written_still_gets_its_answer(misses, tmp_path, monkeypatch):
    store, _, capture_id, _ = misses
    copy = RunStore.open(shutil.copy(store.path, tmp_path / "copy.duckdb"))
    with copy.write() as con:
        con.execute("DELETE FROM lookup_explanations")
        con.execute("UPDATE runs SET explained_at = NULL")

    def refuse():
        raise StoreError(f"cannot open {copy.path} for writing: read-only file system")
    monkeypatch.setattr(copy, "write", refuse)
    real = tempfile.TemporaryDirectory

    def nothing_beside(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == copy.path.parent:
            raise PermissionError(f"[Errno 13] Permission denied: '{dir}'")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryDirectory", nothing_beside)  # nor can its folder: it spills elsewhere
    assert explained(copy, capture_id)
    with copy.read() as con:
        assert not kept(con, capture_id)


def test_each_replica_of_a_fleet_capture_is_explained_from_its_own_cache(tmp_path):
    """pod-b stores the chain pod-a holds: a miss of its own (cold), not a block that was "cached"
    (on another replica); pod-a's eviction does not end pod-b's copy, and pod-a storing it again is
    evicted on pod-a. Lookups are named by replica."""
    from kvviz.capture.capture_file import CaptureWriter, Message
    from kvviz.runners.uploads import import_file
    from tests.test_capture import batch, stored_map

    chain = stored_map([1, 2], None, [10, 11, 12, 13])
    removed = {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU"}
    sent = [("pod-a", chain), ("pod-b", chain), ("pod-a", removed), ("pod-a", chain),
            ("pod-b", stored_map([3], 2, [14, 15]))]
    w = CaptureWriter(tmp_path / "c.jsonl", {"pod-a": "x", "pod-b": "y"})
    for seq, (replica, ev) in enumerate(sent):
        w.add(Message(replica, 0, seq, "kv", batch(ev)))
    w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    run = import_file(tmp_path / "c.jsonl", store)
    with store.read() as con:
        found = [(e.request, e.step, e.hit_tokens, e.reason) for e in agreed(con, run)]
    one = f"chain-{1:016x}"
    assert found == [(f"pod-a/{one}", 0, 0, "cold"), (f"pod-b/{one}", 1, 0, "cold"),
                     (f"pod-a/{one}#2", 3, 0, "evicted"), (f"pod-b/chain-{3:016x}", 4, 4, "cold")]


def test_the_closest_cached_sibling_is_the_one_cached_at_the_lookups_time(tmp_path):
    """The lookup (1, 4, 5) diverges from the closest cached sibling: (1, 4, 1), sharing two tokens,
    where it was cached before the lookup's message (`after`), else (1, 2, 9), sharing one: stored in
    the lookup's own message (`same-message`), or removed in it (`removed`). Between two siblings
    sharing as much, the one cached first (`tie`, `tie-reversed`)."""
    from kvviz.capture.capture_file import CaptureWriter, Message
    from kvviz.runners.uploads import import_file
    from tests.test_capture import batch, stored_map

    def store(h, block):
        return stored_map([h], None, block, size=3)
    removed = {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}
    lookup = store(9, [1, 4, 5])
    sent = {"same-message": [[store(1, [1, 2, 9])], [store(2, [1, 4, 1]), store(3, [7, 7, 7]), lookup]],
            "after": [[store(1, [1, 2, 9])], [store(2, [1, 4, 1]), store(3, [7, 7, 7])], [lookup]],
            "removed": [[store(1, [1, 2, 9])], [store(2, [1, 4, 1]), store(3, [7, 7, 7])], [removed, lookup]],
            "tie": [[store(4, [1, 4, 9])], [store(2, [1, 4, 1])], [lookup]],
            "tie-reversed": [[store(2, [1, 4, 1])], [store(4, [1, 4, 9])], [lookup]]}
    w = CaptureWriter(tmp_path / "c.jsonl", {name: "x" for name in sent})
    for name, messages in sent.items():
        for seq, events in enumerate(messages):
            w.add(Message(name, 0, seq, "kv", batch(*events)))
    w.close()
    store_ = RunStore.open(tmp_path / "k.duckdb")
    run_id = import_file(tmp_path / "c.jsonl", store_)
    with store_.read() as con:
        got = {e.request.split("/")[0]: (e.reason, e.evidence) for e in agreed(con, run_id)
               if e.request.endswith(f"chain-{9:016x}")}
    assert got == {"same-message": ("diverged", {"shared_tokens": 1, "ours": 4, "theirs": 2}),
                   "after": ("diverged", {"shared_tokens": 2, "ours": 5, "theirs": 1}),
                   "removed": ("diverged", {"shared_tokens": 1, "ours": 4, "theirs": 2}),
                   "tie": ("diverged", {"shared_tokens": 2, "ours": 5, "theirs": 9}),
                   "tie-reversed": ("diverged", {"shared_tokens": 2, "ours": 5, "theirs": 1})}


def test_a_prefix_evicted_by_its_own_step_is_capacity_not_churn(tmp_path):
    """A and then Z finish, leaving their full blocks cached (A's tail first in line for eviction). At
    step 6 X (7 blocks) is admitted first and takes the 6 free blocks and A's third; F, in the same
    step, finds A's first two and stops at the third: capacity. The capture says the same."""
    a = list(range(10, 22))
    reqs = [{"id": "A", "prompt_ids": a, "max_new_tokens": 1},
            {"id": "Z", "prompt_ids": list(range(40, 52)), "max_new_tokens": 1, "arrival_step": 3},
            {"id": "X", "prompt_ids": list(range(60, 88)), "max_new_tokens": 1, "arrival_step": 6},
            {"id": "F", "prompt_ids": a + [1, 2, 3, 4], "max_new_tokens": 1, "arrival_step": 6}]
    store, run_id, capture_id = run(tmp_path, reqs, num_blocks=12)
    with store.read() as con:
        got = {e.request: e for e in agreed(con, run_id)}
        from_capture = [e for e in agreed(con, capture_id) if e.reason == "capacity"]
    f = got["F"]
    assert (f.reason, f.hit_tokens, f.stop_block) == ("capacity", 8, 2), f
    assert f.evidence["removed_at"] == f.step > f.evidence["stored_at"]
    # the capture counts messages, not engine steps: the same lookup, evicted in its own message
    assert [(e.hit_tokens, e.stop_block, e.evidence["removed_at"] == e.step) for e in from_capture] == [(8, 2, True)]
    assert got["A"].reason == got["Z"].reason == got["X"].reason == "cold"  # the controls: nothing to reuse


def test_an_adapter_is_a_namespace_like_a_salt(tmp_path):
    """The same prompt under salt "foo", then under adapter "foo", then under both: each misses the one
    before as a namespace miss naming where the tokens are cached; the same adapter again hits."""
    reqs = [{"id": "S", "prompt_ids": PROMPT, "max_new_tokens": 2, "cache_salt": "foo"},
            {"id": "L", "prompt_ids": PROMPT, "max_new_tokens": 2, "adapter": "foo", "arrival_step": 3},
            {"id": "SL", "prompt_ids": PROMPT, "max_new_tokens": 2, "cache_salt": "foo", "adapter": "foo",
             "arrival_step": 6},
            {"id": "L2", "prompt_ids": PROMPT, "max_new_tokens": 2, "adapter": "foo", "arrival_step": 9}]
    store, run_id, _ = run(tmp_path, reqs, num_blocks=64)
    with store.read() as con:
        got = {e.request: e for e in agreed(con, run_id)}
    assert (got["L"].reason, got["L"].evidence) == ("namespace", {"cached_under": "foo"})
    assert got["SL"].reason == "namespace" and got["SL"].evidence["cached_under"] in ("foo", "adapter foo")
    assert got["L2"].hit_tokens == 20 and got["L2"].reason == "partial_block"


@pytest.mark.parametrize("fault", ["unsalted_prefix", None])
def test_a_hit_on_another_tenants_blocks_is_named(tmp_path, fault):
    """With the salt left out of the hash, B (tenant b) hits the prompt A (tenant a) cached: whatever
    stopped B's lookup, its explanation names where its hits were cached. Salted, B hits nothing of A's
    and nothing is named."""
    from kvviz.models import load_model
    from kvviz.runners import live

    m = load_model("tiny-llama")
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id = live.run(store, m, live.scenario_workload("unsalted_prefix", m), fault).run_id
    with store.read() as con:
        found = {e.request: e for e in agreed(con, run_id)}
    crossed = {r: e.evidence.get("hits_cached_under") for r, e in found.items()}
    if fault:
        assert found["B"].hit_tokens > 0 and crossed == {"A": None, "B": "tenant-a"}
    else:
        assert found["B"].hit_tokens == 0 and set(crossed.values()) == {None}
