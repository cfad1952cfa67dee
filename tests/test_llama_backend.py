"""The llama.cpp backend: llama.cpp run through its C API, scheduled as llama-server schedules its slots,
judged by kvviz's oracles.

llama.cpp computes the tiny Llama's exported GGUF as transformers computes it; clean workloads (prefix
reuse by seq_cp, forks, resumed sessions, arrivals) have no foreign weight and every request's logits
equal the request run alone in its own context; kvviz's account of the cells is llama.cpp's own (and a
wrong account stops the run); each API misuse is caught with the right requests named and its control
clean, under either attention kernel, or, where llama.cpp's batch check refuses the misuse, the run
fails with llama.cpp's reason; every field it cannot honour is one sentence; a recorded llama.cpp run
is a run like any other and replays identically.
"""

from __future__ import annotations

import functools
import json

import duckdb
import pytest
import torch

from kvviz.engine import Driver, Engine, eos_ids
from kvviz.engine.workload import Workload
from kvviz.errors import KvvizError, WorkloadError
from kvviz.llama_backend import MISUSES, Misuse, adapter, open_backend
from kvviz.llama_backend.facts import BatchToken
from kvviz.models import load_model
from kvviz.runners import replay
from kvviz.runners.checked import run_checked
from kvviz.runners.recorded import record_run
from kvviz.store import RunStore
from kvviz.store.chrome import chrome_trace

from .cli import kvviz

ENGINE = {"backend": "llama.cpp", "block_size": 16, "num_blocks": 32, "max_batch_tokens": 64}
SYSTEM = "System: you are a helpful assistant. "


@functools.cache
def tiny():
    return load_model("tiny-llama", device="cpu")


def workload(requests: list[dict], **engine) -> Workload:
    return Workload.from_dict({"requests": requests, "engine": {**ENGINE, **engine}})


def sources(run) -> set[tuple[str, str, str | None]]:
    return {(f.kind, f.request, f.source_request) for f in run.findings}


def test_llama_cpp_computes_the_exported_tiny_llama_as_transformers_does():
    """The tiny Llama written as GGUF (Q and K rows reordered for llama.cpp's rotation) gives transformers'
    logits through llama.cpp, up to its float16 cache: the adapter reads the logits of the right tokens."""
    m = tiny()
    ctx = adapter.LlamaContext(m.gguf(), n_ctx=256, n_batch=32, n_seq_max=1, unified=True, flash_attn=False,
                               listener=None)
    try:
        ids = [5, 77, 130, 42, 9, 250, 31]
        rows = ctx.decode([BatchToken(token=t, pos=i, seqs=(0,), logits=True) for i, t in enumerate(ids)])
        ours = torch.stack([ctx.logits(r) for r in rows])
    finally:
        ctx.close()
    with torch.inference_mode():
        theirs = m.model(input_ids=torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max() < 5e-3
    assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist()


CLEAN = [
    {"id": "A", "prompt": SYSTEM + "What colour is the sky?", "max_new_tokens": 6},
    {"id": "B", "prompt": SYSTEM + "Name a prime number.", "max_new_tokens": 6, "arrival_step": 1},
    {"id": "F", "prompt": " Again:", "max_new_tokens": 4, "parent": "A", "arrival_step": 3},
    {"id": "C", "prompt": SYSTEM + "What colour is the sky? Twice.", "max_new_tokens": 5, "arrival_step": 9},
    {"id": "S", "prompt": " And now?", "max_new_tokens": 4, "parent": "B", "truncate": 20, "arrival_step": 10},
]


@pytest.mark.parametrize("kernel", ["eager_paged", "flash_attn"])
def test_a_clean_workload_is_clean_and_equals_each_request_run_alone(kernel):
    """Prefix reuse across slots (B copies A's system prompt while A runs), a fork of a running request, a
    later request that takes an idle slot's cells and a resumed session: all by seq_cp/seq_rm, no foreign
    or stale weight, no kernel mismatch, and each request's logits those of itself alone."""
    run = run_checked(tiny(), workload(CLEAN, kernel=kernel))
    res = {r.id: r for r in run.result.requests}
    assert run.findings == []
    assert run.summary()["leak"]["max_foreign_mass"] == 0
    assert run.oracle.counts["own"] > 0 and run.oracle.counts["foreign"] == run.oracle.counts["stale"] == 0
    system = len(tiny().tokenizer(SYSTEM).input_ids)
    assert res["B"].cached_tokens >= system  # A's system prompt, shared by seq_cp while A runs
    assert res["F"].cached_tokens == len(res["A"].prompt_ids) + 2  # the fork: A's prompt and its computed tokens
    assert res["C"].cached_tokens >= len(res["A"].prompt_ids)  # A's idle slot still holds them
    assert res["S"].cached_tokens == 20  # the resumed session: B's first 20 tokens
    assert {d.classification for d in run.divergences} <= {"identical", "batch_variance"}
    assert max(d.max_logit_diff for d in run.divergences) < 1e-2  # float32 weights, a float16 cache: rounding only


@pytest.mark.parametrize("kernel", ["eager_paged", "flash_attn"])
def test_a_stream_per_sequence_shares_nothing_between_sequences_and_stays_clean(kernel):
    """kv_unified off (isolation 'streams'): each sequence writes only its own stream's cells and reads only
    them, so B recomputes the system prompt A holds and the fork recomputes its parent's history; a later
    request still reuses the idle slot it lands on. Clean, and each request its own run alone."""
    run = run_checked(tiny(), workload(CLEAN, kernel=kernel, isolation="streams"))
    res = {r.id: r for r in run.result.requests}
    assert run.findings == [] and run.oracle.counts["foreign"] == run.oracle.counts["stale"] == 0
    assert res["B"].cached_tokens == res["F"].cached_tokens == 0  # nothing crosses between streams
    assert res["C"].cached_tokens == len(res["A"].prompt_ids)  # A's idle slot, in its own stream
    assert res["S"].cached_tokens == 20
    assert {d.classification for d in run.divergences} <= {"identical", "batch_variance"}
    assert max(d.max_logit_diff for d in run.divergences) < 1e-2
    unified = run_checked(tiny(), workload(CLEAN, kernel=kernel))
    assert run.result.stats.prefill_tokens_computed > unified.result.stats.prefill_tokens_computed


def test_streams_keep_each_sequence_s_cells_in_its_own_buffer_and_a_misuse_within_one_is_still_caught():
    m, wl = tiny(), workload(CLEAN[:2], isolation="streams")
    with torch.inference_mode(), open_backend(m, wl) as backend:
        driver = Driver(backend, m.tokenizer, eos_ids(m))
        for spec, ids in Engine(m, wl.engine).resolve(wl):
            driver.add(spec, ids)
        for _ in range(3):
            driver.advance()
        size = backend.ctx.stream_size
        assert backend.ctx.n_stream == 2 and backend.cells.n_cells == 2 * size
        for seq in (0, 1):
            cells = backend.cells.cells_of(seq)
            assert cells and all(c // size == seq for c in cells)
    info = MISUSES[Misuse.REUSE_WITHOUT_RM]  # a slot reused without seq_rm: the old cells sit in the same stream
    wl = Workload.from_dict({**info.workload, "engine": {**info.workload["engine"], "isolation": "streams"}})
    assert run_checked(tiny(), wl).findings == []
    assert ("foreign", "B", "A") in sources(run_checked(tiny(), wl, "reuse_without_rm"))
    info = MISUSES[Misuse.CP_ONE_LONG]  # no seq_cp between streams, so the misuse has no call to strike
    wl = Workload.from_dict({**info.workload, "engine": {**info.workload["engine"], "isolation": "streams"}})
    run = run_checked(tiny(), wl, "cp_one_long")
    assert run.findings == [] and any("no seq_cp was called" in n for n in run.notes)


def test_streams_are_llama_cpp_s_and_a_request_must_fit_its_sequence_s_stream():
    with pytest.raises(WorkloadError, match=r"^engine.isolation: 'streams' .* is llama.cpp's cache with kv_unified"):
        Workload.from_dict({"requests": [{"id": "A", "prompt": "hi"}], "engine": {"isolation": "streams"}})
    reqs = [{"id": f"R{i}", "prompt": "hi " * 90, "max_new_tokens": 2} for i in range(2)]  # 272 tokens, cheaply
    assert run_checked(tiny(), workload(reqs, num_blocks=40)).findings == []  # 640 unified cells hold both
    run = run_checked(tiny(), workload(reqs[:1], num_blocks=20, isolation="streams"))  # 320 cells: 512 made
    assert run.result.config.num_blocks == 32 and any(
        "so the run has 32 blocks of 16 cells where 20 were asked" in n for n in run.notes)
    with pytest.raises(WorkloadError, match=r"^requests\[0\]: may reach \d+ tokens but with isolation 'streams' one "
                                            r"sequence's stream holds 256 cells \(2 streams"):
        run_checked(tiny(), workload(reqs, num_blocks=32, isolation="streams"))


def test_kvviz_s_account_of_the_cells_is_checked_against_llama_cpp_s_state():
    """A cell kvviz thinks another sequence holds, but llama.cpp does not: the run stops at that step
    with what each side counted, instead of judging attention by a wrong account."""
    m, wl = tiny(), workload(CLEAN[:2])
    with torch.inference_mode(), open_backend(m, wl) as backend:
        driver = Driver(backend, m.tokenizer, eos_ids(m))
        for spec, ids in Engine(m, wl.engine).resolve(wl):
            driver.add(spec, ids)
        driver.advance()
        backend.cells.seqs[backend.cells.cells_of(0)[0]].add(7)
        with pytest.raises(adapter.BackendError, match=r"^step 1: llama.cpp's state reports \d+ occupied cells"):
            driver.advance()


@pytest.mark.parametrize("kernel", ["eager_paged", "flash_attn"])
@pytest.mark.parametrize("misuse", [Misuse.REUSE_WITHOUT_RM, Misuse.CP_ONE_LONG, Misuse.ONE_SEQUENCE,
                                    Misuse.RESTORE_WRONG])
def test_each_silent_misuse_is_caught_and_its_control_is_clean(misuse, kernel):
    info = MISUSES[misuse]
    wl = Workload.from_dict({**info.workload, "engine": {**info.workload["engine"], "kernel": kernel}})
    control = run_checked(tiny(), wl)
    assert control.findings == [] and {d.classification for d in control.divergences} <= {"identical",
                                                                                          "batch_variance"}
    run = run_checked(tiny(), wl, misuse.value)
    expected = {Misuse.REUSE_WITHOUT_RM: ("foreign", "B", "A"), Misuse.CP_ONE_LONG: ("foreign", "B", "A"),
                Misuse.ONE_SEQUENCE: ("foreign", "B", "A"), Misuse.RESTORE_WRONG: ("foreign", "C", "D")}[misuse]
    assert expected in sources(run)
    assert {f.kind for f in run.findings} <= {"foreign", "duplicate"}
    assert all(f.source_request != f.request for f in run.findings), "a request's own tokens are its own"
    assert not [n for n in run.notes if "never struck" in n]
    assert {d.request: d.classification for d in run.divergences}[expected[1]] == "leak"
    assert run.summary()["leak"]["max_foreign_mass"] > 0.01


def test_a_prompt_only_host_memory_holds_is_restored_where_llama_cpp_s_search_puts_it(monkeypatch):
    """llama-server's host-memory prompt cache: A's and D's idle cells are saved as X needs their room, and
    C, going on from A's history, has A's saved state restored into its sequence (llama_state_seq_set_data)
    and computes only its own prompt. Where llama.cpp put the restored cells is kvviz's model of its search
    (each stream's head), held here to every decode's observed write cells and confirmed by the state check."""
    from kvviz.llama_backend.run import LlamaBackend

    predicted, observed = [], []
    original = LlamaBackend.on_ubatch

    def watched(self, ubatch):
        stream = ubatch.cells[0] // (self.cells.n_cells // self.cells.streams)
        predicted.append(self.cells.place(len(ubatch.cells), stream))
        observed.append(ubatch.cells)
        original(self, ubatch)

    monkeypatch.setattr(LlamaBackend, "on_ubatch", watched)
    run = run_checked(tiny(), Workload.from_dict(MISUSES[Misuse.RESTORE_WRONG].workload))
    res = {r.id: r for r in run.result.requests}
    assert res["C"].cached_tokens == len(res["A"].prompt_ids) + len(res["A"].output_ids) - 1  # A's computed cells
    assert run.findings == [] and run.oracle.counts["foreign"] == 0
    for wl in (workload(CLEAN), workload(CLEAN, isolation="streams")):
        run_checked(tiny(), wl)
    assert len(observed) > 30 and predicted == observed


def test_numbering_a_continuation_from_zero_is_refused_by_llama_cpp_and_the_run_says_so():
    """llama.cpp's batch check wants every sequence's positions to go on from its cells: the misuse fails
    loudly, naming the step, the call and llama.cpp's reason, where kvviz's engine would have leaked."""
    wl = Workload.from_dict(MISUSES[Misuse.POSITIONS_FROM_ZERO].workload)
    assert run_checked(tiny(), wl).findings == []
    with pytest.raises(WorkloadError, match=r"^step \d+: llama_decode returned -1 \(invalid batch\): .*"
                                            r"sequence positions remain consecutive") as e:
        run_checked(tiny(), wl, "positions_from_zero")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("change", "field"), [
    ({"requests": [{"id": "A", "prompt": "hi", "adapter": "x"}]}, "requests[0].adapter"),
    ({"engine": {"offload": {"cpu_blocks": 4}}}, "engine.offload"),
    ({"engine": {"disaggregated": True}}, "engine.disaggregated"),
    ({"engine": {"block_size": 12}}, "engine.block_size"),
    ({"requests": [{"id": "A", "prompt": "hi " * 100}], "engine": {"num_blocks": 1}}, "requests[0]"),
])
def test_a_field_llama_cpp_cannot_honour_is_one_sentence_naming_it(change, field):
    reqs = change.get("requests", [{"id": "A", "prompt": "hi " * 20}])
    with pytest.raises(WorkloadError, match="^" + field.replace("[", r"\[").replace("]", r"\]") + ": ") as e:
        run_checked(tiny(), workload(reqs, **change.get("engine", {})))
    assert "\n" not in str(e.value)


def test_a_salt_is_kept_as_a_tenant_and_the_cross_tenant_reads_are_reported():
    """llama.cpp has no salt: two tenants' common system prompt is shared by seq_cp, said in a note, and
    every read of the other tenant's cells is a cross_tenant finding (no attention figure moves)."""
    reqs = [{"id": "A", "prompt": SYSTEM + "Hi.", "max_new_tokens": 4, "cache_salt": "t1"},
            {"id": "B", "prompt": SYSTEM + "Hello.", "max_new_tokens": 4, "cache_salt": "t2", "arrival_step": 2}]
    run = run_checked(tiny(), workload(reqs))
    assert any("llama.cpp has no cache salt" in n for n in run.notes)
    assert {(f.kind, f.request, f.source_request) for f in run.findings} == {("cross_tenant", "B", "A")}
    assert run.summary()["leak"]["max_foreign_mass"] == 0


def test_faults_models_and_releases_it_cannot_run_are_refused_in_one_sentence(monkeypatch):
    wl = workload([{"id": "A", "prompt": "hi", "max_new_tokens": 2}])
    with pytest.raises(WorkloadError, match=r"^fault 'boundary': kvviz's faults are injected into kvviz's own engine; "
                                            r"llama.cpp runs its own code unchanged"):
        run_checked(tiny(), wl, "boundary")
    with pytest.raises(WorkloadError, match=r"^fault 'nope': llama.cpp's faults are its API misuses \(reuse_without"):
        run_checked(tiny(), wl, "nope")
    with pytest.raises(KvvizError, match=r"^model: tiny-gpt2 has no GGUF file; llama.cpp loads GGUF only"):
        run_checked(load_model("tiny-gpt2"), wl)
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "__version__", "0.4.0")
    with pytest.raises(WorkloadError, match=r"^llama-cpp-python 0.4.0: kvviz's llama.cpp adapter reads .* "
                                            r"install llama-cpp-python==0.3.36$"):
        run_checked(tiny(), wl)


def test_a_recorded_llama_cpp_run_is_a_run_like_any_other_and_replays_identically(tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    m = tiny()
    run = record_run(store, m, workload(CLEAN), None)
    rid = run.result.run_id
    with store.read() as con:
        backend, status = con.execute("SELECT backend, status FROM runs WHERE run_id = ?", [rid]).fetchone()
        steps = con.execute("SELECT count(*) FROM steps WHERE run_id = ?", [rid]).fetchone()[0]
        shared = con.execute("SELECT max(refcount) FROM blocks WHERE run_id = ?", [rid]).fetchone()[0]
        written = con.execute("SELECT count(*) FROM slot_writes WHERE run_id = ?", [rid]).fetchone()[0]
        hits = dict(con.execute("SELECT request_id, hit_tokens FROM cache_lookups WHERE run_id = ?", [rid]).fetchall())
    assert (backend, status) == ("llama.cpp", "complete") and steps == run.result.stats.steps
    assert shared >= 2  # a block whose cells two running requests' sequences hold
    assert written == run.result.stats.prefill_tokens_computed + sum(
        len(r.output_ids) - 1 for r in run.result.requests)
    assert hits == {r.id: r.cached_tokens for r in run.result.requests}
    assert replay.verify(store, rid, "cpu") == []
    with store.read() as con:
        assert chrome_trace(con, rid)["traceEvents"][0]["args"]["name"] == f"kvviz run {rid} (llama.cpp)"


def test_a_run_that_fails_midway_is_marked_failed_with_its_steps_so_far(tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    wl = Workload.from_dict(MISUSES[Misuse.POSITIONS_FROM_ZERO].workload)
    with pytest.raises(WorkloadError, match="llama_decode"):
        record_run(store, tiny(), wl, "positions_from_zero")
    with duckdb.connect(str(store.path), read_only=True) as con:
        status, steps = con.execute("SELECT status, (SELECT count(*) FROM steps s WHERE s.run_id = r.run_id) "
                                    "FROM runs r").fetchone()
    assert status == "failed" and steps > 0


def test_run_backend_llama_cpp_from_the_command_line(tmp_path):
    wl = tmp_path / "w.json"
    info = MISUSES[Misuse.ONE_SEQUENCE]
    wl.write_text(json.dumps(info.workload))
    db = tmp_path / "k.duckdb"
    ok = kvviz("run", "--workload", wl, "--model", "tiny-llama", "--db", db, "--quiet", "--fail-on-leak")
    assert ok.returncode == 0, ok.stderr
    assert "backend llama.cpp (eager_paged)" in ok.stdout
    leaked = kvviz("run", "--workload", wl, "--model", "tiny-llama", "--db", db, "--quiet", "--fail-on-leak",
                   "--fault", "one_sequence", "--json")
    assert leaked.returncode == 1
    summary = json.loads(leaked.stdout.splitlines()[-1])
    assert summary["backend"] == "llama.cpp" and summary["fault"] == "one_sequence"
    wl.write_text(json.dumps(MISUSES[Misuse.POSITIONS_FROM_ZERO].workload))
    refused = kvviz("run", "--workload", wl, "--model", "tiny-llama", "--db", db, "--quiet",
                    "--fault", "positions_from_zero")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "llama_decode returned -1" in refused.stderr


@pytest.mark.slow
def test_smollm2_on_llama_cpp_the_passphrase_experiment_is_clean_and_a_misuse_leaks():
    """The default model's GGUF file as it ships (Q4_1): the seed's passphrase requests share one cache
    with zero foreign weight, and a sequence reused without seq_rm is caught."""
    m = load_model("smollm2", device="cpu")
    reqs = [{"id": "A", "prompt": "红 橙 黄"}, {"id": "B", "prompt": "绿 青 蓝"},
            {"id": "C", "prompt": "red orange yellow"}, {"id": "D", "prompt": "green cyan blue"}]
    run = run_checked(m, workload(reqs))
    assert run.findings == [] and run.summary()["leak"]["max_foreign_mass"] == 0
    assert all(d.classification != "leak" for d in run.divergences)
    leaked = run_checked(m, Workload.from_dict(MISUSES[Misuse.REUSE_WITHOUT_RM].workload), "reuse_without_rm")
    assert ("foreign", "B", "A") in sources(leaked)
    assert {d.request: d.classification for d in leaked.divergences}["B"] == "leak"


def test_kv_events_say_which_blocks_llama_cpp_holds(tmp_path):
    """The full blocks each sequence's cells hold, hash-chained over their tokens: A's system prompt is
    stored once though B holds it too (seq_cp shares the cells, as a prefix hit publishes nothing), with
    the salt of the request that wrote it; the capture of the run imports with those stores."""
    from kvviz.engine.hashing import block_hash
    from kvviz.runners.backends import run_backend

    m = tiny()
    reqs = [{"id": "A", "prompt": SYSTEM + "Hi.", "max_new_tokens": 4, "cache_salt": "t1"},
            {"id": "B", "prompt": SYSTEM + "Hello.", "max_new_tokens": 4, "cache_salt": "t2", "arrival_step": 2}]
    wl, records = workload(reqs), []
    run_backend(m, wl, on_step=records.append, run_id="x")
    stored = [e for r in records for e in r.events if e.kind == "cache"]
    ids = list(m.tokenizer(SYSTEM + "Hi.").input_ids)
    assert stored[0].hash == block_hash(None, ids[:16]) and stored[0].salt == "t1" and stored[0].request == "A"
    assert len({e.hash for e in stored}) == len(stored), "a block two sequences hold is stored once"
    assert not [e for r in records for e in r.events if e.kind == "evict"], "idle slots keep their cells"
    running = next(r for r in records if "B" in r.snapshot.page_tables)
    assert running.snapshot.hashes[stored[0].block] is None  # a running request holds it: used, not cached
    assert records[-1].snapshot.hashes[stored[0].block] == stored[0].hash  # idle slots keep it: cached, so named
    capture = tmp_path / "run.jsonl"
    ok = kvviz("run", "--workload", _file(tmp_path, reqs), "--model", "tiny-llama", "--db", tmp_path / "k.duckdb",
               "--quiet", "--kv-events", capture)
    assert ok.returncode == 0, ok.stderr
    imported = kvviz("import", capture, "--db", tmp_path / "c.duckdb")
    assert imported.returncode == 0, imported.stderr
    with RunStore.open(tmp_path / "c.duckdb").read() as con:
        stores = con.execute("SELECT count(*), list(DISTINCT salt) FROM kv_events "
                             "WHERE kind = 'BlockStored'").fetchone()
    assert stores[0] == len({e.hash for e in stored}) and stores[1] == ["t1"]


def _file(tmp_path, reqs: list[dict]):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"requests": reqs, "engine": ENGINE}))
    return path


def test_prefix_caching_off_reuses_nothing_as_cache_prompt_false():
    run = run_checked(tiny(), workload(CLEAN[:2] + CLEAN[3:4], prefix_caching=False))
    assert [r.cached_tokens for r in run.result.requests] == [0, 0, 0] and run.findings == []


def test_a_misuse_that_changes_no_call_says_so_and_its_run_says_it_on_the_record(tmp_path):
    """Walk finding: reuse_without_rm with requests that never take an ended request's sequence ran clean,
    which read as llama.cpp surviving the misuse. The run says the misuse never struck, and what it needs."""
    store = RunStore.open(tmp_path / "k.duckdb")
    run = record_run(store, tiny(), workload(CLEAN[:2]), "reuse_without_rm")
    assert run.findings == []
    [note] = [n for n in run.notes if "never struck" in n]
    assert note.startswith("the misuse reuse_without_rm never struck, so its run is a clean run: it needs a request "
                           "that arrives after another has ended")
    with store.read() as con:
        assert con.execute("SELECT notes FROM runs").fetchone()[0] == run.notes
