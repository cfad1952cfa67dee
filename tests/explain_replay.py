"""The test oracle for explain: the Python replay that kvviz answered with before the reasons became
SQL (kvviz/capture/explain_sql.py), kept to check the SQL against, lookup by lookup. It streams the
history in time order and keeps, as events come, what is cached now (each life of a stored block,
from its store to the removal that takes the oldest open life of its hash, or a clear of its
replica), so it is built another way than the SQL's joins over the whole history.

The reasons and their order are explain_sql's; so are a history's rules: a store's content is the
chain its parent hash's latest store began (a parent never stored before it leaves the block and
everything under it unknown), a store's namespace is the salt its event names or else its chain's.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

import duckdb

from kvviz.analysis import explain as product
from kvviz.analysis.explain import Explanation
from kvviz.store import StoreError
from kvviz.util.gcpause import paused_gc

ROOT = b"kvviz/explain-root"


Tokens = array  # array('i'): a block's tokens in 128 bytes, where a tuple of ints takes about 600


def tokens(values) -> Tokens:
    return array("i", values)


def _digest(parent: bytes, block: Tokens) -> bytes:
    """A name for a token prefix: chained like block hashes, over tokens only (any engine's capture)."""
    return hashlib.blake2b(parent + block.tobytes(), digest_size=16).digest()


class CacheEvent(NamedTuple):
    """A block stored or removed, or every block removed (clear)."""

    t: int  # step (engine run) or message (capture)
    kind: str  # store | remove | clear
    hash: int | None = None
    parent: int | None = None
    tokens: Tokens = tokens(())
    salt: str | None = None


@dataclass(frozen=True)
class Lookup:
    request: str
    t: int
    tokens: Tokens
    salt: str | None
    hit_tokens: int
    preempted_at: int | None = None  # a re-admission: the step the request was preempted
    whole_prompt: bool = True  # False for a capture's chain segment: the prompt went on past its blocks
    chain: dict = field(default_factory=dict)  # a capture's segment: what it can say of the chain it continues


@dataclass(slots=True)
class _Life:
    """One time a block was cached: it served lookups in the steps after `stored`, up to and not
    including `removed` (evictions in a lookup's own step come from allocations before or at it)."""

    stored: int
    removed: int | None = None
    reset: bool = False  # ended by a clear of the cache, not a removal


@dataclass(slots=True)
class _Content:
    """One token prefix cached in one namespace: its last block, and each time it was cached."""

    parent: bytes  # the prefix digest before its last block
    block: Tokens
    nth: int  # among its parent's children in this namespace, in the order first cached (ties go to the first)
    lives: list[_Life]


Node = tuple[str | None, bytes]  # (salt, prefix digest): one cached content in one namespace


class CacheHistory:
    """Every stored block's token prefix and salt, and when it lived, built from events added in time
    order; no event is kept once added. A lookup at step t is explained once every event up to t is
    in (the step's own evictions count against it, its own stores do not). Which contents are
    cached now is kept as events come, so the closest cached sibling is a search among those alone,
    however many have come and gone."""

    def __init__(self, block_size: int | None):
        self.block_size = block_size  # a capture's is known from its first stored block
        # hash -> (prefix digest, chain salt, parent hash, the whole prefix's tokens), as its latest store said
        self._blocks: dict[int, tuple[bytes, str | None, int | None, Tokens]] = {}
        # hash -> its lives not yet removed, first stored first: two blocks can hold one hash at once, and
        # a removal ends the oldest
        self._open: dict[int, list[tuple[Node, _Life]]] = {}
        self._contents: dict[Node, _Content] = {}
        self._salts: dict[bytes, tuple[str | None, ...]] = {}  # digest -> every salt it was cached under
        self._children: dict[Node, int] = {}  # (salt, parent digest) -> children seen
        self._cached: dict[Node, list] = {}  # (salt, parent digest) -> [(block, nth, digest)] cached, in token order
        self._count: dict[Node, int] = {}  # contents cached now: how many of their lives are
        self._now: int | None = None  # the step of what was added last
        self._new: list[tuple[Node, _Life]] = []  # lives begun in step _now: cached from the next step on

    def add(self, e: CacheEvent) -> None:
        self._advance(e.t)
        if e.kind == "store":
            self._store(e)
        elif e.kind == "remove":
            lives = self._open.get(e.hash)
            if lives:
                self._end(*lives.pop(0), e.t)
        else:  # clear: every block of the replica
            for lives in self._open.values():
                for node, life in lives:
                    self._end(node, life, e.t)
                    life.reset = True
            self._open = {}

    def _end(self, node: Node, life: _Life, t: int) -> None:
        life.removed = t
        if life.stored < t:  # it was cached (one stored in this step never was)
            self._turn(node, -1)

    def _advance(self, t: int) -> None:
        if self._now is not None and t < self._now:
            raise ValueError(f"step {t} comes after step {self._now}: a history is built in time order")
        if t != self._now:
            for node, life in self._new:
                if life.removed is None:
                    self._turn(node, 1)
            self._new, self._now = [], t

    def _store(self, e: CacheEvent) -> None:
        if e.parent is None:
            parent, salt = ROOT, e.salt
        elif e.parent in self._blocks:
            parent, chain_salt = self._blocks[e.parent][:2]
            salt = chain_salt if e.salt is None else e.salt  # a salt its event names: this life is that tenant's
        else:  # its chain began before the capture did (or its parent comes later): its tokens are unknown
            self._blocks.pop(e.hash, None)
            return
        d = _digest(parent, e.tokens)
        above = tokens(()) if e.parent is None else self._blocks[e.parent][3]
        self._blocks[e.hash] = (d, salt, e.parent, above + e.tokens)
        node = (salt, d)
        content = self._contents.get(node)
        if content is None:
            nth = self._children[(salt, parent)] = self._children.get((salt, parent), 0) + 1
            content = self._contents[node] = _Content(parent, e.tokens, nth, [])
            if salt not in self._salts.get(d, ()):
                self._salts[d] = (*self._salts.get(d, ()), salt)
        life = _Life(e.t)
        content.lives.append(life)
        self._new.append((node, life))
        self._open.setdefault(e.hash, []).append((node, life))

    def known(self, h: int) -> bool:
        return h in self._blocks

    def salt_of(self, h: int) -> str | None:
        return self._blocks[h][1]

    def tokens_of(self, h: int | None) -> Tokens:
        """The token prefix a stored block ends, as its chain was when it was stored."""
        return tokens(()) if h is None else self._blocks[h][3]

    def _cached_now(self, node: Node) -> bool:
        return node in self._count

    def explain(self, lookup: Lookup) -> Explanation:
        """Why `lookup` stopped where it did; every event up to its step must be added, none after."""
        B, T, s, t = self.block_size, lookup.tokens, lookup.salt, lookup.t
        self._advance(t)
        k = lookup.hit_tokens // B
        usable = (len(T) - 1) // B  # the last token is always computed
        parent, crossed = ROOT, None
        for j in range(k):
            parent = _digest(parent, T[j * B : (j + 1) * B])
            if crossed is None and not self._cached_now((s, parent)):  # a hit on a block not cached under s
                crossed = self._cached_under_other(parent, s)

        def ex(reason: str, **evidence) -> Explanation:
            if crossed is not None:  # the hits themselves crossed a namespace: whatever stopped the lookup
                evidence["hits_cached_under"] = crossed
            if crossed is not None or "tenant" in lookup.chain:  # where the segment's tenant is in question
                evidence.update(lookup.chain)
            return Explanation(lookup.request, t, lookup.hit_tokens, k, k * B, reason, evidence)

        if lookup.whole_prompt and k >= usable:
            return ex("partial_block", tokens_after=len(T) - lookup.hit_tokens)
        if lookup.preempted_at is not None:
            return ex("preempted", preempted_at=lookup.preempted_at)
        block = T[k * B : (k + 1) * B]
        d = _digest(parent, block)
        content = self._contents.get((s, d))
        if content is not None and content.lives[0].stored < t:  # cached before this step, at least once
            if self._cached_now((s, d)):
                return ex("unexplained", note="this block was cached when the lookup ran")
            last = next(life for life in reversed(content.lives) if life.stored < t)
            if last.reset:
                return ex("reset", stored_at=last.stored, removed_at=last.removed, before=t - last.removed)
            if last.removed == t:
                return ex("capacity", stored_at=last.stored, removed_at=last.removed)
            return ex("evicted", stored_at=last.stored, removed_at=last.removed, before=t - last.removed)
        other = self._cached_under_other(d, s)
        if other is not None:
            return ex("namespace", cached_under=other)
        theirs = self._closest_sibling(s, parent, block)
        if theirs is not None and k * B + _common(theirs, block) > 0:  # nothing in common is not a divergence
            at = _common(theirs, block)
            return ex(
                "diverged",
                shared_tokens=k * B + at,
                **({"ours": block[at]} if at < len(block) else {}),
                **({"theirs": theirs[at]} if at < len(theirs) else {}),
            )
        return ex("cold", new_from_token=k * B)  # the tokens from here were never cached (under any salt)

    def _cached_under_other(self, d: bytes, salt: str | None) -> str | None:
        """The first namespace other than `salt` the prefix `d` is cached under now, by name."""
        others = sorted(
            (o for o in self._salts.get(d, ()) if o != salt and self._cached_now((o, d))),
            key=lambda o: (o is None, str(o)),
        )
        return None if not others else others[0] if others[0] is not None else "(no salt)"

    def _closest_sibling(self, salt: str | None, parent: bytes, block: Tokens) -> Tokens | None:
        """The cached sibling block sharing the most leading tokens with `block` now. In sorted order
        the shared length falls away from where `block` would go, so the best is one of the two
        cached siblings either side of it (ties go to the sibling cached first)."""
        kids = self._cached.get((salt, parent), [])
        at = bisect.bisect_left(kids, (block,))
        near = kids[max(at - 1, 0) : at + 1]
        return max(near, key=lambda k: (_common(k[0], block), -k[1]))[0] if near else None

    def _turn(self, node: Node, change: int) -> None:
        """A life of `node` begins (+1) or ends (-1): its content enters or leaves its parent's cached list."""
        n = self._count[node] = self._count.get(node, 0) + change
        if n == (1 if change > 0 else 0):
            content = self._contents[node]
            kids = self._cached.setdefault((node[0], content.parent), [])
            item = (content.block, content.nth, node[1])
            if change > 0:
                bisect.insort(kids, item)
            else:
                del kids[bisect.bisect_left(kids, item)]
        if n == 0:
            del self._count[node]


def _common(a: Tokens, b: Tokens) -> int:
    for n, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return n
    return min(len(a), len(b))


def replay_run(con: duckdb.DuckDBPyConnection, run_id: str) -> list[Explanation]:
    """Every lookup of an engine run, or every stored chain segment of a capture, explained by replay."""
    head = con.execute("SELECT engine FROM runs WHERE run_id = ?", [run_id]).fetchone()
    if head is None:
        raise StoreError(f"no run {run_id!r}")
    with paused_gc():  # the history is millions of small objects, none in a cycle
        if con.execute("SELECT count(*) FROM kv_events WHERE run_id = ?", [run_id]).fetchone()[0]:
            return _explain_capture(con, run_id)
        return _explain_engine_run(con, run_id, int(json.loads(head[0] or "{}").get("block_size", 16)))


def _explain_engine_run(con: duckdb.DuckDBPyConnection, run_id: str, B: int) -> list[Explanation]:
    """The engine's lookups (cache_lookups) against its prefix cache's history (block_events)."""
    events = [
        CacheEvent(step, product.ENGINE_KINDS[kind], h, parent, tokens(block or ()), namespace(salt, adapter))
        for step, kind, h, parent, block, salt, adapter in con.execute(
            "SELECT step, kind, hash, parent_hash, token_ids, salt, adapter FROM block_events WHERE "
            "run_id = ? AND kind IN (SELECT unnest(?)) AND (hash IS NOT NULL OR kind NOT IN ('cache', 'evict')) "
            "ORDER BY step, seq",
            [run_id, list(product.ENGINE_KINDS)],
        ).fetchall()
    ]
    if not events and not con.execute("SELECT count(*) FROM cache_lookups WHERE run_id = ?", [run_id]).fetchone()[0]:
        raise StoreError(
            f"run {run_id} has no cache lookups to explain (recorded before kvviz recorded them, or a "
            "run without the prefix cache's history)"
        )
    history = CacheHistory(B)
    ids = {
        r: (p or []) + (o or [])
        for r, p, o in con.execute(
            "SELECT request_id, prompt_ids, output_ids FROM requests WHERE run_id = ?", [run_id]
        ).fetchall()
    }
    preempted = con.execute(
        "SELECT DISTINCT request_id, step FROM block_events WHERE run_id = ? AND kind = 'preempt' ORDER BY step",
        [run_id],
    ).fetchall()
    workload = json.loads(con.execute("SELECT workload FROM runs WHERE run_id = ?", [run_id]).fetchone()[0] or "{}")
    adapters = {r.get("id"): r.get("adapter") for r in workload.get("requests", [])}
    out, added = [], 0
    for step, req, salt, n, hit in con.execute(
        "SELECT step, request_id, salt, tokens, hit_tokens FROM cache_lookups "
        "WHERE run_id = ? ORDER BY step, request_id",
        [run_id],
    ).fetchall():
        while added < len(events) and events[added].t <= step:  # the lookup's own step included
            history.add(events[added])
            added += 1
        before = [s for r, s in preempted if r == req and s < step]
        out.append(
            history.explain(
                Lookup(
                    req,
                    step,
                    tokens(ids.get(req, [])[:n]),
                    namespace(salt, adapters.get(req)),
                    hit,
                    before[-1] if before else None,
                )
            )
        )
    return out


def namespace(salt: str | None, adapter: str | None) -> str | None:
    """What a lookup's blocks are keyed under: its salt, and its adapter when it has one (a block cached
    under another adapter is another namespace, as a salt is)."""
    if adapter is None:
        return salt
    return f"adapter {adapter}" if salt is None else f"{salt} + adapter {adapter}"


def _explain_capture(con: duckdb.DuckDBPyConnection, run_id: str) -> list[Explanation]:
    """Each replica's cache (each KV group's, in a hybrid model) is its own history: a chain cached on
    one replica serves no lookup on another. Its lookups are named by replica (and group) when the
    capture has more than one, in time order across them."""
    parts = con.execute(
        "SELECT DISTINCT coalesce(replica, 'replica-0'), group_idx FROM kv_events WHERE run_id = ? "
        "AND kind = 'BlockStored' ORDER BY ALL",
        [run_id],
    ).fetchall()
    fleet = len({replica for replica, _ in parts}) > 1
    out = []
    for replica, group in parts:
        name = "/".join(([replica] if fleet else []) + ([f"group-{group}"] if group is not None else []))
        out += _explain_part(con, run_id, replica, group, name + "/" if name else "")
    return sorted(out, key=lambda e: e.step)


def _explain_part(
    con: duckdb.DuckDBPyConnection, run_id: str, replica: str, group: int | None, name: str
) -> list[Explanation]:
    """Each stored chain segment (an event's blocks, or those after the hits it repeats) is a lookup,
    named by its session where the server says one (a conversation's turns, one after another) or by
    its first block. Repeats change nothing in the
    cache (a re-reported hit, a removal of a block not cached) and are left out; a replica's clear (or
    its publisher's restart) removes every block of every group. A step's lookups are explained once
    its last event is in."""
    cur = con.execute(
        "SELECT step, kind, block_hash, parent_hash, token_ids, salt, salt_named, session_id, "
        "block_index, block_size, group_idx, coalesce(restart, 0), coalesce(repeat, false), "
        "coalesce(event_index, 0) FROM kv_events "
        "WHERE run_id = ? AND coalesce(replica, 'replica-0') = ? "
        "ORDER BY step, coalesce(event_index, 0), coalesce(block_index, 0)",
        [run_id, replica],
    )
    history, out, seen, step_lookups, tenants, restart = CacheHistory(None), [], {}, [], False, None
    before = None  # the last block of this group kept (not a repeat): (step, event, index)
    for step, kind, h, parent, block, salt, named, session, index, size, g, started, rep, event in cur.fetchall():
        if step_lookups and step != step_lookups[0].t:  # every event of their step is in
            out += map(history.explain, step_lookups)
            step_lookups = []
        if restart is not None and started != restart:
            history.add(CacheEvent(step, "clear"))
        restart = started
        if kind == "AllBlocksCleared":
            history.add(CacheEvent(step, "clear"))
        if kind not in ("BlockStored", "BlockRemoved") or h is None or g != group or rep:
            continue
        # a segment begins at its event's first block, or at the first after the hits its event repeats
        begins, before = index == 0 or before != (step, event, index - 1), (step, event, index)
        own = salt if parent is None or named else None  # a continuation's salt is its event's, or the chain's
        e = CacheEvent(step, "store" if kind == "BlockStored" else "remove", h, parent, tokens(block or ()), own)
        if kind == "BlockStored":  # what it continues, before it is in (a block may name itself as its parent)
            tenants = tenants or salt is not None
            chain = _continues(history, parent, named, tenants) if parent is None or history.known(parent) else {}
        history.add(e)
        if kind != "BlockStored":
            continue
        history.block_size = history.block_size or size or 16
        seen[h] = seen.get(h, 0) + 1  # stored again after an eviction: its n-th life
        if begins and history.known(h):  # a request's new blocks begin here
            whole, n = history.tokens_of(h), seen[h]
            request = name + (session or f"chain-{h:016x}" + (f"#{n}" if n > 1 else ""))
            step_lookups.append(
                Lookup(
                    request,
                    step,
                    whole,
                    history.salt_of(h),
                    len(whole) - len(e.tokens),
                    whole_prompt=False,
                    chain=chain,
                )
            )
    return out + list(map(history.explain, step_lookups))


def _continues(history: CacheHistory, parent: int | None, named: bool | None, tenants: bool) -> dict:
    """What a segment's lookup can say of the chain it continues: the block, and where its event names
    no salt in a capture that has tenants, whose chain it is and that its own tenant is unknown (an
    import from before kvviz kept `salt_named` says nothing more than it did)."""
    if parent is None:
        return {}
    block = {"continues_block": f"{parent:016x}"}
    if named is not False or not tenants:
        return block
    chain = history.salt_of(parent)
    return {
        "continues_chain_of": "(no salt)" if chain is None else chain,
        **block,
        "tenant": "unknown (its event names no salt)",
    }


def agreed(con: duckdb.DuckDBPyConnection, run_id: str) -> list[Explanation]:
    """The run explained by SQL (what kvviz says), after checking that the replay says the same of every
    lookup, evidence and order included."""
    said, replayed = product.explain_run(con, run_id), replay_run(con, run_id)
    differ = [(s, r) for s, r in zip(said, replayed, strict=False) if s != r]
    assert len(said) == len(replayed) and not differ, (len(said), len(replayed), differ[:3])
    return said
