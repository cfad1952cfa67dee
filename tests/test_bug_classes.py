"""The bug classes of 2025-26: a host tier that offloads and restores, hash identity tagged by kind,
sessions resumed with a truncated history; each new fault caught on workloads it was not written
for, and a bug the catalogue does not name caught all the same."""

from __future__ import annotations

import functools
import random

import pytest

from kvviz.catalogue.faults import FAULTS, defences_with
from kvviz.engine import Defences, Engine, KVCacheManager
from kvviz.engine.pool_patches import PoolPatches
from kvviz.engine.workload import Workload
from kvviz.models import load_model
from kvviz.runners.checked import run_checked

NEW_FAULTS = ["offload_wrong_block", "offload_stale_restore", "transfer_wrong_request", "transfer_failed_silently",
              "untagged_namespace", "stale_hash_after_truncate", "partial_hash_promoted"]
WORDS = "red orange yellow green cyan blue violet the sky is and a prime number of legs".split()


@functools.cache
def model(name):
    return load_model(name, device="cpu")


def _events(m, wl: Workload, defences: Defences | None = None):
    """The run and every block event it produced, step by step."""
    events = []
    result = Engine(m, wl.engine, defences).run(wl, on_step=lambda rec: events.extend(rec.events))
    return result, events


# -- the host tier ---------------------------------------------------------------------------------
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
PUSHED_OUT = [{"id": "A", "prompt": SYSTEM, "max_new_tokens": 2},
              {"id": "B", "prompt": "Unrelated filler text " * 4, "max_new_tokens": 2, "arrival_step": 4},
              {"id": "C", "prompt": "Other words fill the pool " * 3, "max_new_tokens": 2, "arrival_step": 8},
              {"id": "D", "prompt": SYSTEM + " Again.", "max_new_tokens": 6, "arrival_step": 12}]


def _pushed_out(offload: dict | None, num_blocks: int = 36) -> Workload:
    return Workload.from_dict({"requests": PUSHED_OUT,
                               "engine": {"block_size": 4, "num_blocks": num_blocks, "offload": offload}})


def test_an_evicted_prefix_is_restored_from_the_host_tier_with_its_provenance():
    m = model("tiny-llama")
    without, _ = _events(m, _pushed_out(None))
    result, events = _events(m, _pushed_out({"cpu_blocks": 64}))
    d = {r.id: r for r in result.requests}["D"]
    assert {r.id: r.cached_tokens for r in without.requests}["D"] == 0  # evicted: computed again
    assert d.cached_tokens == len(SYSTEM) // 4 * 4  # every full block of the system prompt, from the host
    kinds = [e.kind for e in events]
    assert "offload" in kinds and "restore" in kinds and "host_evict" not in kinds
    restored = [e for e in events if e.kind == "restore"]
    assert {e.request for e in restored} == {"D"} and len(restored) == d.cached_tokens // 4
    assert all(e.medium == "GPU" for e in restored)
    # outputs equal to running without any cache pressure, and both oracles clean
    for name in ("tiny-llama", "tiny-gpt2"):
        run = run_checked(model(name), _pushed_out({"cpu_blocks": 64}))
        assert run.findings == [] and run.summary()["divergence"]["diverged_requests"] == 0
    roomy = _events(m, _pushed_out(None, num_blocks=256))[0]
    assert [r.output_ids for r in result.requests] == [r.output_ids for r in roomy.requests]


def test_restored_slots_keep_their_writer_position_and_prefix():
    kv = KVCacheManager(num_blocks=2, block_size=2, host_blocks=4)
    kv.add("A", [1, 2, 3, 4])
    a = kv.admit("A", 8)
    kv.commit("A", 4, a.slots)
    kv.free("A")  # both blocks cached
    kv.add("B", [9, 9, 9])
    kv.commit("B", 3, kv.admit("B", 8).slots)  # takes both blocks: A's are offloaded
    kv.free("B")
    kv.add("C", [1, 2, 7])
    c = kv.admit("C", 8)
    assert c.start == 2  # A's first block came back from the host
    slot = kv.slot(kv.seqs["C"], 0)
    facts = kv.provenance.facts(slot)
    assert (facts.writer, facts.pos, facts.token) == ("A", 0, 1)
    assert facts.lifetime == kv.pool.blocks[slot // 2].lifetime  # written in the block's current life
    assert kv.foreign_slots("C") == []
    kv.check()


def watching(managers: list) -> Defences:
    """The default defences, with each of a run's KV cache managers put in `managers` as it is made (a
    patch that replaces nothing: it hands back the manager's own resume), so a test can check them."""
    return Defences(pool_patches=PoolPatches(resume=lambda kv: managers.append(kv) or kv.resume))


def test_a_host_tier_of_one_block_never_restores_a_block_it_gave_away():
    """Restoring a prefix may offload other blocks; the blocks being restored are never the victims."""
    m = model("tiny-llama")
    for host in (1, 2, 3):
        pools = []
        wl = _pushed_out({"cpu_blocks": host}, num_blocks=24)
        Engine(m, wl.engine, watching(pools)).run(wl, on_step=lambda rec, p=pools: p[0].check())
        run = run_checked(m, wl)
        assert run.findings == [] and run.summary()["divergence"]["diverged_requests"] == 0


def test_offload_is_off_by_default_and_unused_offload_changes_nothing():
    m = model("tiny-gpt2")
    wl = _pushed_out(None, num_blocks=256)
    plain, plain_events = _events(m, wl)
    tier, tier_events = _events(m, Workload.from_dict({**wl.to_dict(), "engine": {**wl.to_dict()["engine"],
                                                                                   "offload": {"cpu_blocks": 8}}}))
    assert not any(e.kind in ("offload", "restore", "host_evict") for e in plain_events + tier_events)
    assert [r.output_ids for r in plain.requests] == [r.output_ids for r in tier.requests]


# -- disaggregated prefill -------------------------------------------------------------------------
def _chat(disaggregated: bool, num_blocks: int = 64) -> Workload:
    return Workload.from_dict({"requests": [
        {"id": "A", "prompt": SYSTEM + " Hi.", "max_new_tokens": 6},
        {"id": "B", "prompt": SYSTEM + " Hello there.", "max_new_tokens": 5, "arrival_step": 1},
        {"id": "F", "parent": "A", "prompt": " and", "max_new_tokens": 3, "arrival_step": 2},
        {"id": "C", "prompt": "Other words entirely", "max_new_tokens": 1, "arrival_step": 3},
        {"id": "E", "prompt": "One more prompt to decode", "max_new_tokens": 4, "arrival_step": 3}],
        "engine": {"block_size": 4, "num_blocks": num_blocks, "max_batch_tokens": 16,
                   "disaggregated": disaggregated}})


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_disaggregated_prefill_gives_every_request_its_output_alone(name):
    m, sent = model(name), []
    run = run_checked(m, _chat(True), on_step=lambda rec: sent.extend(rec.transfers))
    assert run.findings == [] and run.summary()["divergence"]["diverged_requests"] == 0
    one = run_checked(m, _chat(False))
    assert [r.output_ids for r in run.result.requests] == [r.output_ids for r in one.result.requests]
    by_id = {r.id: r for r in run.result.requests}
    assert {t.request for t in sent} == {"A", "B", "F", "E"}  # C finished on the prefill instance
    cfg = m.model.config
    per_slot = (cfg.num_hidden_layers * 2 * getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
                * (cfg.hidden_size // cfg.num_attention_heads) * 4)  # float32 K and V in every layer
    n = _chat(True).engine.num_blocks
    for t in sent:
        assert t.status == "ok" and t.bytes == len(by_id[t.request].prompt_ids) * per_slot
        assert t.intact and t.request in t.kv_of, "the decode blocks hold the request's own K/V"
        assert all(b >= n for b in t.from_blocks) and all(b < n for b in t.to_blocks)
        assert len(t.to_blocks) == t.blocks
    assert by_id["B"].cached_tokens > 0  # the system prompt hit on the prefill instance


@pytest.mark.parametrize("fault", ["transfer_wrong_request", "transfer_failed_silently"])
def test_a_transfer_says_whose_kv_arrived(fault):
    """The transfer record reads the received slots' provenance, so a wrong or missing delivery shows on
    the transfer itself; the control's transfers each hold their own request's K/V."""
    m, sent = model("tiny-llama"), []
    run_checked(m, _chat(True), fault, on_step=lambda rec: sent.extend(rec.transfers))
    b = next(t for t in sent if t.request == "B")  # the second transfer: the first has no previous one
    assert not b.intact and b.status == "ok"
    if fault == "transfer_failed_silently":
        assert b.kv_of == ("unwritten",)
    else:  # the blocks the previous transfer sent from, as whoever wrote them since left them
        assert set(b.kv_of) - {"B"}


def test_a_full_decode_pool_makes_prefilled_requests_wait_their_turn():
    m, sent, pools = model("tiny-llama"), [], []
    wl = _chat(True, num_blocks=24)
    Engine(m, wl.engine, watching(pools)).run(
        wl, on_step=lambda rec, p=pools: (sent.append((rec.step, [t.request for t in rec.transfers])),
                                          [kv.check() for kv in p]))
    run = run_checked(m, wl)
    assert run.findings == [] and run.summary()["divergence"]["diverged_requests"] == 0
    received = [r for _, reqs in sent for r in reqs]
    assert sorted(received) == ["A", "B", "E", "F"]
    roomy = run_checked(m, _chat(True))
    assert [r.output_ids for r in run.result.requests] == [r.output_ids for r in roomy.result.requests]
    assert [r.finish_step for r in run.result.requests] != [r.finish_step for r in roomy.result.requests]


# -- hash identity ---------------------------------------------------------------------------------
def _same_prompt(first: dict, second: dict) -> list[int]:
    """Tokens the second request reused from the first (same prompt, each with its namespaces)."""
    m = model("tiny-llama")
    wl = Workload.from_dict({"requests": [{"id": "X", "prompt": SYSTEM, "max_new_tokens": 2, **first},
                                          {"id": "Y", "prompt": SYSTEM, "max_new_tokens": 2, "arrival_step": 3,
                                           **second}],
                             "engine": {"block_size": 4}})
    return [r.cached_tokens for r in Engine(m, wl.engine).run(wl).requests]


def test_namespaces_are_tagged_by_kind_in_both_directions():
    full = (len(SYSTEM) - 1) // 4 * 4
    assert _same_prompt({"cache_salt": "foo"}, {"cache_salt": "foo"})[1] == full  # same salt: reuse
    assert _same_prompt({"adapter": "foo"}, {"adapter": "foo"})[1] == full  # same adapter: reuse
    assert _same_prompt({"cache_salt": "foo"}, {"adapter": "foo"})[1] == 0  # salt "foo" is not adapter "foo"
    assert _same_prompt({"adapter": "foo"}, {"adapter": "bar"})[1] == 0
    assert _same_prompt({}, {"adapter": "foo"})[1] == 0  # an adapter's K/V is not the base model's
    assert _same_prompt({"cache_salt": "s", "adapter": "foo"}, {"cache_salt": "s", "adapter": "foo"})[1] == full


def test_an_adapters_content_is_its_own_for_the_oracle():
    """Provenance names the weights K/V were computed under: a base-model slot read under an adapter is
    foreign, though the prompt is the same (the untagged fault's positive case)."""
    kv = KVCacheManager(num_blocks=8, block_size=2)
    base, tuned = kv.add("A", [1, 2, 3]), kv.add("B", [1, 2, 3], adapter="foo")
    assert base.prefix_ids != tuned.prefix_ids
    assert kv.add("C", [1, 2, 3], adapter="foo").prefix_ids == tuned.prefix_ids


# -- sessions resumed with a truncated history -------------------------------------------------------
def test_a_resumed_session_reuses_exactly_the_full_blocks_it_kept():
    m = model("tiny-gpt2")
    for keep in (8, 10, 3):
        wl = Workload.from_dict({"requests": [
            {"id": "A", "prompt": "User: Name three colours.\nAssistant:", "max_new_tokens": 8},
            {"id": "B", "parent": "A", "truncate": keep, "prompt": " Fruits instead?", "max_new_tokens": 5,
             "arrival_step": 12}], "engine": {"block_size": 4}})
        run = run_checked(m, wl)
        b = run.result.requests[1]
        assert b.prompt_ids[:keep] == run.result.requests[0].prompt_ids[:keep]
        assert len(b.prompt_ids) == keep + len(" Fruits instead?")
        assert b.cached_tokens == keep // 4 * 4
        assert run.findings == [] and run.summary()["divergence"]["diverged_requests"] == 0


def test_a_session_resumed_while_its_parent_runs_starts_from_the_history_so_far():
    m = model("tiny-llama")
    wl = Workload.from_dict({"requests": [
        {"id": "A", "prompt": "abcdefghijkl", "max_new_tokens": 12},
        {"id": "B", "parent": "A", "truncate": 30, "prompt": "xyz", "max_new_tokens": 3, "arrival_step": 2}],
        "engine": {"block_size": 4}})
    run = run_checked(m, wl)
    a, b = run.result.requests
    assert b.prompt_ids == (a.prompt_ids + a.output_ids)[:len(b.prompt_ids) - 3] + list(b"xyz")
    assert run.findings == [] and run.summary()["divergence"]["diverged_requests"] == 0


# -- held-out detection --------------------------------------------------------------------------
def bug_class_workload(rng: random.Random) -> Workload:
    """Random workloads with what the new faults need (a salt and an adapter of one name, a session
    resubmitted cut short, forks, offload pressure, disaggregated prefill), none of them a scenario's own."""
    def text(k: int) -> str:
        return " ".join(rng.choices(WORDS, k=k))

    B, name = rng.choice([2, 4, 8]), rng.choice(["foo", "t1"])
    system = text(rng.randint(5, 10))
    keep = rng.randint(B + 1, len(system))
    reqs = [{"id": "s", "prompt": f"{system} {text(3)}", "max_new_tokens": rng.randint(2, 6), "cache_salt": name},
            {"id": "a", "prompt": f"{system} {text(2)}", "max_new_tokens": rng.randint(1, 4), "adapter": name,
             "arrival_step": rng.randint(2, 5)},
            {"id": "r", "parent": "s", "truncate": keep, "prompt": f" {text(rng.randint(2, 5))}",
             "max_new_tokens": rng.randint(1, 4), "arrival_step": rng.randint(9, 12)}]
    if rng.random() < 0.5:
        reqs.append({"id": "f", "parent": "a", "prompt": f" {text(1)}", "max_new_tokens": 3, "arrival_step": 5})
    for i in range(rng.randint(1, 3)):  # pressure: other prompts push the system prompt out
        reqs.append({"id": f"n{i}", "prompt": text(rng.randint(8, 16)), "max_new_tokens": rng.randint(1, 3),
                     "arrival_step": 14 + 3 * i, "cache_salt": rng.choice([None, name, "other"])})
    reqs.append({"id": "p", "prompt": f"{system} {text(2)}", "max_new_tokens": 3, "cache_salt": name,
                 "arrival_step": 26})
    longest = max(len(r.get("prompt", "")) for r in reqs) + len(system) + 16
    engine = {"block_size": B, "num_blocks": -(-longest // B) + rng.randint(1, 4), "max_batch_tokens": 256,
              "offload": {"cpu_blocks": rng.choice([2, 4, 8, 64])}, "disaggregated": rng.random() < 0.5}
    return Workload.from_dict({"requests": reqs, "engine": engine, "seed": rng.randint(0, 9)})


def _struck(fault: str, faulty, control, kinds: list[str], transfers: int) -> bool:
    """Whether the fault changed what a request reused: the runs are the same until the first request
    whose reuse differs. Some faults reuse as much but the wrong content: a restore from the wrong host
    block (any restore), a transfer of the previous request's K/V (a second transfer), a transfer that
    never arrives (any)."""
    if fault == "offload_wrong_block":
        return "restore" in kinds
    if fault.startswith("transfer_"):
        return transfers >= (2 if fault == "transfer_wrong_request" else 1)
    return [r.cached_tokens for r in faulty.result.requests] != [r.cached_tokens for r in control.result.requests]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_new_faults_are_caught_on_random_workloads_and_controls_stay_clean(name):
    m, struck = model(name), dict.fromkeys(NEW_FAULTS, 0)
    for seed in range(8):
        wl = bug_class_workload(random.Random(seed))
        control = run_checked(m, wl)
        assert control.findings == [] and control.summary()["divergence"]["diverged_requests"] == 0, seed
        for fault in NEW_FAULTS:
            kinds, sent = [], []

            def seen(rec, k=kinds, t=sent):
                k.extend(e.kind for e in rec.events)
                t.extend(rec.transfers)
            faulty = run_checked(m, wl, fault, on_step=seen)
            if not _struck(fault, faulty, control, kinds, len(sent)):
                continue
            struck[fault] += 1
            caught = faulty.findings or faulty.summary()["divergence"]["diverged_requests"]
            assert caught, f"{fault} struck on seed {seed} and nothing saw it"
    assert all(n >= 2 for n in struck.values()), struck  # every fault struck: the test can fail


def test_a_double_free_the_catalogue_does_not_name_is_caught():
    """Real bugs are never announced: a block freed twice sits twice on the free list, so it is handed
    to a second request while the first still holds it. No fault declares it; the oracle sees it."""
    ghosts = []  # blocks on the free list a second time

    def release_twice(pool):
        release = pool.release

        def twice(blocks, request, kind="free"):
            blocks = list(blocks)
            release(blocks, request, kind)
            ghosts.extend(b for b in blocks if b.ref_cnt == 0 and kind == "free")  # the second entry
        return twice

    def allocate_with_ghosts(pool):
        allocate = pool.allocate

        def with_ghosts(n, request):
            again = [b for b in ghosts if b.ref_cnt > 0][:n]  # first entries handed out: the second ones now
            for b in again:
                ghosts.remove(b)
                b.ref_cnt, b.lifetime = b.ref_cnt + 1, b.lifetime + 1
            return again + allocate(n - len(again), request)
        return with_ghosts
    double_free = PoolPatches(release=release_twice, allocate=allocate_with_ghosts)

    wl = Workload.from_dict({"requests": [
        {"id": "A", "prompt": "first short prompt", "max_new_tokens": 1},
        {"id": "B", "prompt": "a second prompt that takes the freed blocks", "max_new_tokens": 6, "arrival_step": 1},
        {"id": "C", "prompt": "and a third one that gets them again", "max_new_tokens": 6, "arrival_step": 2}],
        "engine": {"block_size": 4, "prefix_caching": False}})
    m = model("tiny-llama")
    from kvviz.oracle import ProvenanceOracle
    from kvviz.oracle.reference import compare_with_isolated
    from kvviz.runners.checked import CheckedRun

    oracle = ProvenanceOracle()
    result = Engine(m, wl.engine, Defences(pool_patches=double_free)).run(wl, observers=[oracle], keep_logits=True)
    run = CheckedRun(wl, None, result, oracle, compare_with_isolated(m, result, {}))
    assert {f.kind for f in run.findings} & {"foreign", "stale"}, run.findings
    assert run_checked(m, wl).findings == []  # the same workload without the bug: clean


def test_every_new_fault_is_in_the_catalogue_with_its_scenario():
    from kvviz.catalogue.scenarios import SCENARIOS

    assert set(NEW_FAULTS) <= set(FAULTS)
    assert set(NEW_FAULTS) <= {s.fault for s in SCENARIOS.values()}
    assert all(defences_with(f, 4).pool_patches != PoolPatches() for f in NEW_FAULTS)


# -- both tiers in the store and in a capture --------------------------------------------------------
def test_an_offloading_run_records_both_tiers_and_its_capture_shows_them(tmp_path):
    import json

    from kvviz.analysis import blocks
    from kvviz.store import RunStore

    from .cli import kvviz as cli

    wl, db, events = tmp_path / "w.json", tmp_path / "k.duckdb", tmp_path / "e.jsonl"
    wl.write_text(json.dumps(_pushed_out({"cpu_blocks": 16}).to_dict()))

    def kvviz(*args):
        p = cli(*args, "--db", db)
        assert p.returncode == 0, p.stderr
        return p.stdout

    run_id = json.loads(kvviz("run", "--workload", str(wl), "--model", "tiny-llama", "--kv-events", str(events),
                              "--json", "--quiet").splitlines()[-1])["run_id"]
    capture_id = kvviz("import", str(events)).split()[-1]
    with RunStore.open(db).read() as con:
        def count(sql, rid):
            return con.execute(sql, [rid]).fetchone()[0]

        moved = {k: count(f"SELECT count(*) FROM block_events WHERE run_id = ? AND kind = '{k}'", run_id)
                 for k in ("offload", "restore", "host_evict")}
        assert all(moved.values()), moved  # 16 host blocks: offloads, restores, and drops from the host
        assert count("SELECT count(*) FROM block_events WHERE run_id = ? AND kind = 'host_evict' AND medium <> "
                     "'CPU'", run_id) == 0
        last = count("SELECT max(step) FROM host_blocks WHERE run_id = ?", run_id)
        host = blocks.host_map(con, run_id, last)
        assert len(host) == 16 and set(host.state) <= {"cached", "free"} and (host.state == "cached").any()
        tiers = dict(con.execute("SELECT medium, count(*) FROM kv_events WHERE run_id = ? AND kind = 'BlockStored' "
                                 "GROUP BY medium", [capture_id]).fetchall())
        removed_cpu = count("SELECT count(*) FROM kv_events WHERE run_id = ? AND kind = 'BlockRemoved' AND "
                            "medium = 'CPU'", capture_id)
        assert tiers["CPU"] == moved["offload"] and removed_cpu == moved["host_evict"]
        assert tiers["GPU"] == count("SELECT count(*) FROM block_events WHERE run_id = ? AND kind = 'cache'", run_id)


def test_a_fault_or_an_engine_rename_that_misses_a_pool_method_fails_at_once(monkeypatch):
    """Faults replace engine methods by name, typed: an unknown name is refused where the fault is made,
    and a method renamed in the engine fails when the engine is imported (check_owners runs then), not
    by a fault that silently stops firing."""
    from kvviz.catalogue.faults import _pool_patch
    from kvviz.engine.block_pool import BlockPool
    from kvviz.engine.pool_patches import check_owners

    with pytest.raises(TypeError, match="free_blocks"):
        _pool_patch(free_blocks=lambda pool: pool.release)
    check_owners()
    monkeypatch.delattr(BlockPool, "evict")  # as if renamed
    with pytest.raises(ImportError, match="PoolPatches.evict: BlockPool has no method evict"):
        check_owners()
