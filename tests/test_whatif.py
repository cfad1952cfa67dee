"""The what-if replay (kvviz/whatif/): hand-counted traces for every policy, LRU's one pass against its
exact replay on random traces, the bounds every policy keeps, salting, each refusal, and the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvviz.errors import CaptureError, KvvizError
from kvviz.whatif import POLICIES, as_dicts, as_table, capacity_grid, curve, read_mooncake, request_hits
from kvviz.whatif.lru import NEVER, lru_hits, reuse_distances
from kvviz.whatif.policies import Seed
from kvviz.whatif.salting import assign_tenants, cross_reads, keyed, tenant_costs
from kvviz.whatif.simulate import parents, replay
from kvviz.whatif.trace import trace_from_blocks
from tests.cli import kvviz, kvviz_process

TRACES = Path("/work/shared/traces")


def blocks(*requests: str, block_size: int = 1, extra: int = 0):
    """A trace of one request per string, one block per letter, every block full unless `extra` tokens
    are added to each prompt (a partial last block)."""
    return trace_from_blocks([[ord(c) for c in r] for r in requests],
                             [len(r) * block_size + extra for r in requests], block_size=block_size)


def hits(trace, capacity: int) -> dict[str, int]:
    return {p: int(replay(trace, p, capacity).sum()) for p in POLICIES}


def write(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def row(ts: float = 0, inp: int = 1024, out: int = 10, ids: list[int] | None = None) -> dict:
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": [1, 2] if ids is None else ids}


# --- hand-counted traces ------------------------------------------------------------------------------------


def test_a_cyclic_scan_defeats_every_online_policy_but_not_belady():
    """x y z w x y z w, capacity 3: each policy evicts what comes next (0 hits); MIN keeps x and y, then
    w (3 hits). Newcomer's handicap changes nothing, every block arriving new."""
    assert hits(blocks(*"xyzwxyzw"), 3) == {"lru": 0, "lfu": 0, "seed": 0, "newcomer": 0, "belady": 3}


def test_a_prefix_reused_after_a_scan_is_kept_by_frequency_and_by_newcomer():
    """x a x b c x, capacity 2. LRU: b evicts a, c evicts x (1 hit). LFU keeps x (used twice), as does
    newcomer (a, b and c arrive new, a capacity behind) and MIN (2 hits). Seed's GreedyDual gives every
    block the cost 1, so b evicts a (older) and c evicts x (its priority 1, below b's 2): 1 hit."""
    assert hits(blocks(*"xaxbcx"), 2) == {"lru": 1, "lfu": 2, "seed": 1, "newcomer": 2, "belady": 2}


def test_the_seed_policy_evicts_leaves_only_so_a_shared_first_block_never_strands_its_prefix(monkeypatch):
    """sab, sc, sab with capacity 3 (keys s 0, a 1, c 2, b 3). LRU frees sab tail first, so sc's block c
    evicts b; the third request hits s and a (1 + 2 = 3 hits, every other policy too). Seed ranks a leaf
    by its prefix length; when c comes, s is held and a has a cached child, so b, the one leaf, goes: 3
    hits as well. Read at the block level instead (any unheld block a victim), GreedyDual would evict a
    (priority 2, below b's 3) and strand b, cached but unreachable: the third request hits s alone (2)."""
    trace = blocks("sab", "sc", "sab")
    assert hits(trace, 3) == {"lru": 3, "lfu": 3, "seed": 3, "newcomer": 3, "belady": 3}
    monkeypatch.setattr(Seed, "leaves_only", False)
    cached: list[list[int]] = []
    assert replay(trace, "seed", 3, after=lambda r, c: cached.append(list(c))).tolist() == [0, 1, 1]
    assert cached[1] == [1, 0, 1, 1]  # b (key 3) cached without a (key 1)


def test_the_seed_policy_keeps_a_long_prefix_over_a_short_recent_one():
    """abc, x, y, abc with capacity 4. y finds the cache full (a b c x). LRU evicts c, the least recent
    (abc was freed tail first, before x came): the second abc hits a and b (2). Seed may evict the leaves
    c (priority 0 + 3) and x (0 + 1) and keeps c, the end of the longer prefix: 3 hits, as MIN's (x is
    never used again). LFU (every block used once, c the oldest) and newcomer (every block new, all
    handicapped alike) evict c as LRU does."""
    assert hits(blocks("abc", "x", "y", "abc"), 4) == {"lru": 2, "lfu": 2, "seed": 3, "newcomer": 2, "belady": 3}


def test_hit_rate_counts_prompt_tokens_and_the_partial_last_block_never_hits():
    """Blocks of 4 tokens and 3 tokens more per prompt: 'ab' twice is 11 tokens each, 2 full blocks; the
    second request is served 8 of its 11 tokens, the partial block recomputed."""
    trace = blocks("ab", "ab", block_size=4, extra=3)
    assert (trace.lookups, trace.distinct_blocks, trace.prompt_tokens) == (4, 2, 22)
    (p,) = curve(trace, ["lru"], [5])
    assert (p.hits, p.lookups, p.tokens_saved, p.prompt_tokens, p.hit_rate) == (2, 4, 8, 22, 8 / 22)


def test_a_request_longer_than_the_cache_stores_its_first_blocks():
    """abcd, capacity 2: a and b are stored, so abcd again hits a and b under every policy."""
    assert set(hits(blocks("abcd", "abcd"), 2).values()) == {2}


def test_the_same_id_after_another_prefix_is_another_block():
    """Keys are chained: 'b' after 'a' and 'b' after 'c' are different blocks, so 'cb' hits nothing."""
    trace = blocks("ab", "cb", "ab")
    assert trace.distinct_blocks == 4
    assert replay(trace, "lru", 10).tolist() == [0, 0, 2]


# --- LRU in one pass ----------------------------------------------------------------------------------------


@st.composite
def traces(draw: st.DrawFn):
    """Requests over a small alphabet (so prefixes are shared), some with a partial last block."""
    letters = draw(st.sampled_from(["ab", "abc", "abcde"]))
    requests = draw(st.lists(st.text(letters, max_size=6), min_size=1, max_size=12))
    return blocks(*requests, block_size=2, extra=draw(st.integers(0, 1)))


@settings(max_examples=150, deadline=None)
@given(traces())
def test_lru_from_one_pass_equals_its_exact_replay_at_every_capacity(trace):
    distances = reuse_distances(trace)
    caps = list(range(1, trace.distinct_blocks + 2))
    exact = [int(replay(trace, "lru", c).sum()) for c in caps]
    assert lru_hits(distances, caps).tolist() == exact
    assert exact == sorted(exact)  # LRU is a stack policy: more room never loses a hit


@settings(max_examples=150, deadline=None)
@given(traces())
def test_along_a_request_distances_only_grow_so_the_prefix_rule_needs_no_cut_off(trace):
    """The blocks LRU holds at a request's start are its leading ones: counting every block with
    distance below the capacity is the prefix rule, checked per request against the replay."""
    distances = reuse_distances(trace)
    for r in range(trace.requests):
        d = distances[trace.offsets[r]:trace.offsets[r + 1]]
        assert (np.diff(d) >= 0).all() or not len(d)
    for c in range(1, trace.distinct_blocks + 1):
        per_request = np.bincount(trace.request_of, distances < c, trace.requests)
        assert per_request.tolist() == replay(trace, "lru", c).tolist()


@settings(max_examples=100, deadline=None)
@given(traces())
def test_belady_bounds_every_policy_and_unbounded_bounds_belady(trace):
    """MIN keeps the cache prefix-closed (a parent is next used no later than its child, ties evict the
    child), so its hits are the most any policy that stores what each request brings can have: checked,
    not assumed, seed's leaves-only GreedyDual included. At the unbounded capacity every policy serves
    every block seen before."""
    unbounded = int(request_hits(trace, "lru", max(trace.distinct_blocks, 1)).sum())
    assert unbounded == int((reuse_distances(trace) != NEVER).sum())
    for c in range(1, trace.distinct_blocks + 1):
        got = hits(trace, c)
        assert max(got.values()) == got["belady"] <= unbounded
        assert got["seed"] <= got["belady"]
    assert set(hits(trace, max(trace.distinct_blocks, 1)).values()) == {unbounded}


@settings(max_examples=100, deadline=None)
@given(traces())
def test_every_policy_keeps_the_cache_prefix_closed(trace):
    """After every request, at every capacity, each cached block's parent is cached too: nothing is
    stranded behind a missing prefix (seed's by evicting leaves only, the others' by their priorities)."""
    up = parents(trace)

    def closed(r: int, cached: bytearray) -> None:
        assert all(cached[up[x]] for x in range(len(cached)) if cached[x] and up[x] >= 0), (r, list(cached))

    for p in POLICIES:
        for c in range(1, trace.distinct_blocks + 1):
            replay(trace, p, c, after=closed)


def test_the_dominance_count_matches_a_direct_count():
    from kvviz.whatif.lru import count_before

    rng = np.random.default_rng(7)
    values = rng.integers(-1, 50, 300)
    at, below = rng.integers(0, 301, 200), rng.integers(-1, 52, 200)
    direct = [int((values[:a] < b).sum()) for a, b in zip(at, below, strict=True)]
    assert count_before(values, at, below).tolist() == direct


# --- salting ------------------------------------------------------------------------------------------------


def test_conversations_are_named_by_their_first_block_below_the_system_prompt():
    """Twenty chats start from one system block s (so s has 20 prompts below it: a system block); 'sa',
    'sab', 'sabc' are one chat's turns. Dealt to 2 tenants in order of first appearance."""
    chats = ["s" + chr(ord("A") + i) for i in range(19)]
    trace = assign_tenants(blocks("sa", *chats, "sab", "sabc", "s"), 2)
    assert trace.conversation.tolist() == [0, *range(1, 20), 0, 0, 20]
    assert trace.tenant.tolist() == [0, *[i % 2 for i in range(1, 20)], 0, 0, 0]


def test_salting_per_tenant_costs_the_shared_blocks_and_sharing_allows_cross_reads():
    """Chats sx and sy (tenant 0) and sz (tenant 1) below a system block s (3 prompts end below it, past
    the threshold of 2 set here). Shared and unbounded: sz and sy hit s, computed by tenant 0's first
    request. Salted per tenant, tenant 1 loses its hit on s; per conversation, every hit is lost."""
    trace = assign_tenants(blocks("sx", "sz", "sy"), 2, system_ends=2)
    assert trace.tenant.tolist() == [0, 1, 0]
    per_tenant = {c.tenant: (c.shared_hit_rate, c.hit_rate, c.loss) for c in tenant_costs(trace, 10)}
    assert per_tenant == {0: (0.25, 0.25, 0.0), 1: (0.5, 0.0, 0.5)}
    assert [c.hit_rate for c in tenant_costs(trace, 10, keying="conversation")] == [0.0, 0.0]
    assert [(r.reader, r.writer, r.blocks, r.tokens) for r in cross_reads(trace)] == [(1, 0, 1, 1)]


def test_a_cross_read_is_credited_to_whoever_computed_the_copy_still_cached():
    """Tenants 1 0 0 1 over s, t, s, s. Unbounded, the third request (tenant 0) reads tenant 1's first
    copy of s and the fourth reads its own tenant's. With room for 1 block, t evicts s, the third
    request computes s again, and the fourth (tenant 1) reads tenant 0's copy."""
    trace = replace(assign_tenants(blocks("s", "t", "s", "s"), 2), tenant=np.array([1, 0, 0, 1]))
    assert [(r.reader, r.writer, r.blocks) for r in cross_reads(trace)] == [(0, 1, 1)]
    assert [(r.reader, r.writer, r.blocks) for r in cross_reads(trace, 1)] == [(1, 0, 1)]


def test_keying_by_conversation_never_shares_across_conversations():
    trace = assign_tenants(blocks("ab", "ab", "ac"), 3, system_ends=2)  # a is a system block: 2 chats
    assert trace.conversation.tolist() == [0, 0, 1]
    assert keyed(trace, "conversation").distinct_blocks == 4  # a once per conversation
    assert keyed(trace, "shared") is trace


# --- records ------------------------------------------------------------------------------------------------


def test_points_become_rows_for_sql_and_the_grid_reaches_unbounded():
    trace = blocks("ab", "ab", "ac")
    points = curve(trace, ["lru", "belady"], [1, 2, trace.distinct_blocks])
    table = as_table(points)
    assert table.num_rows == 6 and table.column_names[:4] == ["policy", "keying", "capacity", "hits"]
    assert as_dicts(points)[0] == {"policy": "lru", "keying": "shared", "capacity": 1, "hits": 2, "lookups": 6,
                                   "tokens_saved": 2, "prompt_tokens": 6, "hit_rate": 2 / 6}
    grid = capacity_grid(170_899)
    assert len(grid) >= 20 and grid[0] == 4 and grid[-1] == 170_899 and grid == sorted(set(grid))
    assert capacity_grid(6) == [4, 5, 6]


# --- refusals -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, said", [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: not a JSON object"),
    ({"timestamp": 1, "input_length": 5, "output_length": 1}, "line 2: hash_ids is missing"),
    ({"input_length": 5, "output_length": 1, "hash_ids": []}, "line 2: timestamp is missing"),
    ({**row(), "input_length": -1}, "line 2: input_length is -1, a length cannot be negative"),
    ({**row(), "output_length": -4}, "line 2: output_length is -4, a length cannot be negative"),
    ({**row(), "input_length": "5"}, "line 2: input_length must be an integer"),
    (row(ts=-1), "line 2: timestamp -1 goes back from 0"),
    (row(inp=600, ids=[1, 2, 3]), "line 2: hash_ids has 3 blocks, more than the 2 that input_length 600 needs"),
    (row(ids=[1, "2"]), "line 2: hash_ids must hold only integers"),
    ({**row(), "hash_ids": 7}, "line 2: hash_ids must be a list"),
    (row(ids=[1 << 70]), "line 2: hash_ids holds an id that does not fit in 64 bits"),
])
def test_a_bad_line_is_refused_naming_it_and_nothing_is_read(tmp_path, bad, said):
    path = write(tmp_path / "t.jsonl", [row(), bad, row(ts=9)])
    with pytest.raises(CaptureError, match=said):
        read_mooncake(path)


def test_equal_timestamps_and_blank_lines_are_fine_and_an_empty_trace_is_not(tmp_path):
    trace = read_mooncake(write(tmp_path / "t.jsonl", [row(ts=3), "", row(ts=3, inp=1500, ids=[1, 2, 3])]))
    assert (trace.requests, trace.lookups, trace.distinct_blocks) == (2, 4, 2)
    with pytest.raises(CaptureError, match="no requests"):
        read_mooncake(write(tmp_path / "e.jsonl", [""]))


def test_bad_arguments_are_refused_naming_them():
    trace = blocks("ab")
    for call, said in [(lambda: replay(trace, "lru", 0), "capacity must be at least 1 block, got 0"),
                       (lambda: curve(trace, ["lru"], [4, -2]), "got -2"),
                       (lambda: curve(trace, ["mru"], [4]), "policy 'mru' is not known"),
                       (lambda: request_hits(trace, "arc", 4), "policy 'arc' is not known"),
                       (lambda: assign_tenants(trace, 0), "tenants must be at least 1"),
                       (lambda: keyed(trace, "tenant"), "no tenants"),
                       (lambda: keyed(trace, "user"), "keying 'user' is not known"),
                       (lambda: read_mooncake("x", block_size=0), "block_size must be at least 1")]:
        with pytest.raises(KvvizError, match=said):
            call()


# --- the command line ---------------------------------------------------------------------------------------


@pytest.fixture
def small_trace(tmp_path) -> Path:
    """Three chats of two turns over one system block, then one of a single turn."""
    rows = [row(ts=t, inp=512 * len(ids) + 100, ids=ids) for t, ids in
            enumerate([[0, 1, 2], [0, 3], [0, 1, 2, 4], [0, 5, 6], [0, 3, 7], [0, 5, 6, 8], [0, 9]])]
    return write(tmp_path / "chats.jsonl", rows)


def test_whatif_prints_policy_by_capacity_and_writes_the_rows(small_trace, tmp_path):
    out = tmp_path / "rows.parquet"
    done = kvviz("whatif", small_trace, "--capacity", "2", "4", "10", "--tenants", "2", "--out", out)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["capacity", "tokens", "lru", "lfu", "seed", "newcomer", "belady"]
    assert lines[4].split()[:3] == ["10", "(unbounded)", "5,120"]  # 10 distinct blocks
    assert "cross-tenant reads" in done.stdout
    table = pq.read_table(out)
    assert table.num_rows == 5 * 3 + 2 * 3  # five policies, and LRU keyed per tenant and per conversation
    assert set(table.column("keying").to_pylist()) == {"shared", "tenant", "conversation"}


@pytest.mark.parametrize("args, said", [
    (["--policy", "lru,mru"], "kvviz: whatif: policy 'mru' is not known"),
    (["--capacity", "0"], "capacity must be at least 1 block, got 0"),
    (["--points", "1"], "--points must be at least 2"),
    (["--tenants", "0"], "--tenants must be at least 1"),
    (["--out", "rows.txt"], "write .csv or .parquet"),
])
def test_whatif_refuses_bad_arguments_with_exit_2(small_trace, args, said):
    done = kvviz("whatif", small_trace, *args)
    assert done.returncode == 2 and said in done.stderr and done.stdout == ""


def test_whatif_refuses_a_bad_trace_with_exit_2(tmp_path):
    done = kvviz("whatif", write(tmp_path / "t.jsonl", [row(), {"timestamp": 1}]))
    assert done.returncode == 2 and "line 2: input_length is missing" in done.stderr


@pytest.mark.slow
def test_whatif_runs_as_a_process(small_trace, tmp_path):
    done = kvviz_process("whatif", small_trace, "--policy", "lru,belady", "--out", tmp_path / "rows.csv")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "rows.csv").read_text().startswith('"policy","keying","capacity"')


@pytest.mark.skipif(not TRACES.is_dir(), reason="the public Mooncake traces are in ../shared/traces only")
def test_the_conversation_trace_reads_whole_and_lru_agrees_with_its_replay():
    trace = read_mooncake(TRACES / "conversation_trace.jsonl")
    assert (trace.requests, trace.lookups, trace.distinct_blocks) == (12_031, 276_491, 170_899)
    assert lru_hits(reuse_distances(trace), [3000]).tolist() == [int(replay(trace, "lru", 3000).sum())]
