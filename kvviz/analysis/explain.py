"""Why did a request miss? For every prefix-cache lookup, how many tokens hit, at which block and
token the lookup stopped, and why, with the evidence (the question of LMCache #3659 and vLLM RFC
#43711 that no tool answers).

One history serves engine runs and captures alike: blocks stored (hash, parent, tokens, salt) and
removed, in order. Engine runs record it in block_events and their lookups in cache_lookups; a
capture's kv_events are the same history, and each stored chain segment is a lookup that stopped
where the segment begins. Reasons, checked in this order:

- partial_block: every full block the lookup could use was served; the rest of the prompt is in a
  block that is not full (or ends the prompt, whose last token is always computed);
- preempted: a re-admission after the request lost its blocks to preemption;
- capacity: the same block was evicted in the lookup's own step, by the allocations of the batch
  admitted before it: the pool could not hold this step's work and keep the prefix (a sizing
  problem, where `evicted` is churn);
- evicted: the same block (same tokens, same salt) was cached and evicted in an earlier step;
- namespace: the same tokens are cached under another salt (or adapter);
- diverged: a cached chain under this salt shares the blocks before and differs inside this one (at
  which token, with both tokens), sharing at least one token;
- cold: nothing with these tokens was cached before.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from array import array
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import duckdb

from ..store import StoreError

ROOT = b"kvviz/explain-root"


def _digest(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """A name for a token prefix: chained like block hashes, over tokens only (any engine's capture)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class CacheEvent(NamedTuple):
    """A block stored or removed (a tuple: a capture's replay makes one per event)."""
    t: int  # step (engine run) or message (capture)
    kind: str  # store | remove
    hash: int
    parent: int | None = None
    tokens: tuple[int, ...] = ()
    salt: str | None = None


@dataclass(frozen=True)
class Lookup:
    request: str
    t: int
    tokens: tuple[int, ...]
    salt: str | None
    hit_tokens: int
    preempted_at: int | None = None  # a re-admission: the step the request was preempted
    whole_prompt: bool = True  # False for a capture's chain segment: the prompt went on past its blocks


@dataclass(frozen=True)
class Explanation:
    request: str
    step: int
    hit_tokens: int
    stop_block: int
    stop_token: int
    reason: str
    evidence: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Life:
    stored: int
    removed: int | None = None

    def alive(self, t: int) -> bool:
        """Cached when a lookup at t ran: stored in an earlier step, not removed up to t (evictions in
        t's own step come from allocations before or at the lookup)."""
        return self.stored < t and (self.removed is None or self.removed > t)


Node = tuple[str | None, bytes]  # (salt, prefix digest): one cached content in one namespace


class CacheHistory:
    """Every stored block's token prefix and salt, and when it lived. Which siblings were cached at a
    lookup's time is kept by sweeping through the lives as lookups come (in time order), so finding
    the closest cached sibling is a search among those alone, however many have come and gone."""

    def __init__(self, events: list[CacheEvent], block_size: int):
        self.block_size = block_size
        self._prefix: dict[int, tuple[bytes, str | None]] = {}  # hash -> (prefix digest, chain salt)
        self._block: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hash -> (parent, its tokens)
        self.lives: dict[Node, list[_Life]] = {}
        self.salts: dict[bytes, set[str | None]] = {}
        self._node: dict[Node, tuple[bytes, tuple[int, ...], int]] = {}  # -> parent digest, tokens, nth sibling
        self._siblings: dict[Node, int] = {}  # (salt, parent digest) -> children seen
        self._swept: int | None = None  # the time the cached-sibling lists are at
        for e in events:
            if e.kind == "store":
                self._store(e)
            elif e.hash in self._prefix:
                life = self.lives[(self._prefix[e.hash][1], self._prefix[e.hash][0])][-1]
                if life.removed is None:
                    life.removed = e.t

    def _store(self, e: CacheEvent) -> None:
        if e.parent is None:
            parent, salt = ROOT, e.salt
        elif e.parent in self._prefix:
            parent, salt = self._prefix[e.parent]
        else:
            return  # its chain began before the capture did: its tokens are unknown
        d = _digest(parent, e.tokens)
        self._prefix[e.hash] = (d, salt)
        self._block[e.hash] = (e.parent, e.tokens)
        self.lives.setdefault((salt, d), []).append(_Life(e.t))
        self.salts.setdefault(d, set()).add(salt)
        if (salt, d) not in self._node:  # ties between siblings go to the one cached first
            nth = self._siblings[(salt, parent)] = self._siblings.get((salt, parent), 0) + 1
            self._node[(salt, d)] = (parent, e.tokens, nth)

    def known(self, h: int) -> bool:
        return h in self._prefix

    def salt_of(self, h: int) -> str | None:
        return self._prefix[h][1]

    def tokens_of(self, h: int | None) -> tuple[int, ...]:
        """The token prefix a stored block ends (walked up its chain)."""
        parts = []
        while h is not None:
            h, tokens = self._block[h]
            parts.append(tokens)
        return tuple(t for part in reversed(parts) for t in part)

    def _alive(self, salt: str | None, d: bytes, t: int) -> bool:
        return any(life.alive(t) for life in self.lives.get((salt, d), ()))

    def explain(self, lookup: Lookup) -> Explanation:
        B, T, s, t = self.block_size, lookup.tokens, lookup.salt, lookup.t
        k = lookup.hit_tokens // B
        usable = (len(T) - 1) // B  # the last token is always computed
        ex = lambda reason, **evidence: Explanation(lookup.request, t, lookup.hit_tokens, k, k * B,  # noqa: E731
                                                    reason, evidence)
        if lookup.whole_prompt and k >= usable:
            return ex("partial_block", tokens_after=len(T) - lookup.hit_tokens)
        if lookup.preempted_at is not None:
            return ex("preempted", preempted_at=lookup.preempted_at)
        parent = ROOT
        for j in range(k):
            parent = _digest(parent, tuple(T[j * B:(j + 1) * B]))
        block = tuple(T[k * B:(k + 1) * B])
        d = _digest(parent, block)
        past = [life for life in self.lives.get((s, d), ()) if life.stored < t]
        if past and not any(life.alive(t) for life in past):
            last = past[-1]
            if last.removed == t:
                return ex("capacity", stored_at=last.stored, removed_at=last.removed)
            return ex("evicted", stored_at=last.stored, removed_at=last.removed, before=t - last.removed)
        if past:
            return ex("unexplained", note="this block was cached when the lookup ran")
        others = sorted((o for o in self.salts.get(d, ()) if o != s and self._alive(o, d, t)),
                        key=lambda o: (o is None, str(o)))
        if others:
            return ex("namespace", cached_under=others[0] if others[0] is not None else "(no salt)")
        theirs = self._closest_sibling(s, parent, block, t)
        if theirs is not None and k * B + _common(theirs, block) > 0:  # nothing in common is not a divergence
            at = _common(theirs, block)
            return ex("diverged", shared_tokens=k * B + at, ours=block[at], theirs=theirs[at])
        return ex("cold", new_from_token=k * B)  # the tokens from here were never cached (under any salt)


    def _closest_sibling(self, salt: str | None, parent: bytes, block: tuple[int, ...], t: int
                         ) -> tuple[int, ...] | None:
        """The cached sibling block sharing the most leading tokens with `block` at t. In sorted order
        the shared length falls away from where `block` would go, so the best is one of the two
        cached siblings either side of it (ties go to the sibling cached first)."""
        self._sweep_to(t)
        kids = self._cached.get((salt, parent), [])
        at = bisect.bisect_left(kids, (block,))
        near = kids[max(at - 1, 0):at + 1]
        return max(near, key=lambda k: (_common(k[0], block), -k[1]))[0] if near else None

    def _sweep_to(self, t: int) -> None:
        """Bring the cached-sibling lists to time t (from the start again if t is earlier). A life is
        cached for lookups at stored < t < removed."""
        if self._swept is None or t < self._swept:
            spans = [(life.stored + 1, life.removed, node) for node, lives in self.lives.items() for life in lives
                     if life.removed is None or life.stored + 1 < life.removed]
            self._starts = sorted(((a, node) for a, _, node in spans), key=lambda x: x[0])
            self._ends = sorted(((b, node) for _, b, node in spans if b is not None), key=lambda x: x[0])
            self._at = [0, 0]
            self._count: dict[Node, int] = {}
            self._cached: dict[Node, list] = {}  # (salt, parent digest) -> [(tokens, nth, digest)] in token order
        for i, (times, change) in enumerate(((self._starts, 1), (self._ends, -1))):
            while self._at[i] < len(times) and times[self._at[i]][0] <= t:
                self._turn(times[self._at[i]][1], change)
                self._at[i] += 1
        self._swept = t

    def _turn(self, node: Node, change: int) -> None:
        """A life of `node` begins (+1) or ends (-1): its content enters or leaves its parent's cached list."""
        n = self._count[node] = self._count.get(node, 0) + change
        if n == (1 if change > 0 else 0):
            parent, tokens, nth = self._node[node]
            kids = self._cached.setdefault((node[0], parent), [])
            item = (tokens, nth, node[1])
            if change > 0:
                bisect.insort(kids, item)
            else:
                del kids[bisect.bisect_left(kids, item)]


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def explain_run(con: duckdb.DuckDBPyConnection, run_id: str) -> list[Explanation]:
    """Every lookup of an engine run, or every stored chain segment of a capture, explained."""
    head = con.execute("SELECT engine FROM runs WHERE run_id = ?", [run_id]).fetchone()
    if head is None:
        raise StoreError(f"no run {run_id!r}")
    if con.execute("SELECT count(*) FROM kv_events WHERE run_id = ?", [run_id]).fetchone()[0]:
        return _explain_capture(con, run_id)
    B = int(json.loads(head[0] or "{}").get("block_size", 16))
    events = [CacheEvent(step, "store" if kind == "cache" else "remove", h, parent, tuple(tokens or ()),
                         namespace(salt, adapter))
              for step, kind, h, parent, tokens, salt, adapter in con.execute(
                  "SELECT step, kind, hash, parent_hash, token_ids, salt, adapter FROM block_events WHERE run_id = ? "
                  "AND kind IN ('cache', 'evict') AND hash IS NOT NULL ORDER BY step, seq", [run_id]).fetchall()]
    if not events and not con.execute("SELECT count(*) FROM cache_lookups WHERE run_id = ?", [run_id]).fetchone()[0]:
        raise StoreError(f"run {run_id} has no cache lookups to explain (recorded before kvviz recorded them, or a "
                         "run without the prefix cache's history)")
    history = CacheHistory(events, B)
    tokens = {r: (p or []) + (o or []) for r, p, o in con.execute(
        "SELECT request_id, prompt_ids, output_ids FROM requests WHERE run_id = ?", [run_id]).fetchall()}
    preempted = con.execute("SELECT DISTINCT request_id, step FROM block_events WHERE run_id = ? AND "
                            "kind = 'preempt' ORDER BY step", [run_id]).fetchall()
    workload = json.loads(con.execute("SELECT workload FROM runs WHERE run_id = ?", [run_id]).fetchone()[0] or "{}")
    adapters = {r.get("id"): r.get("adapter") for r in workload.get("requests", [])}
    out = []
    for step, req, salt, n, hit in con.execute("SELECT step, request_id, salt, tokens, hit_tokens FROM cache_lookups "
                                               "WHERE run_id = ? ORDER BY step, request_id", [run_id]).fetchall():
        before = [s for r, s in preempted if r == req and s < step]
        out.append(history.explain(Lookup(req, step, tuple(tokens.get(req, [])[:n]), namespace(salt, adapters.get(req)),
                                          hit, before[-1] if before else None)))
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
    parts = con.execute("SELECT DISTINCT coalesce(replica, 'replica-0'), group_idx FROM kv_events WHERE run_id = ? "
                        "AND kind = 'BlockStored' ORDER BY ALL", [run_id]).fetchall()
    fleet = len({replica for replica, _ in parts}) > 1
    out = []
    for replica, group in parts:
        name = "/".join(([replica] if fleet else []) + ([f"group-{group}"] if group is not None else []))
        out += _explain_part(con, run_id, replica, group, name + "/" if name else "")
    return sorted(out, key=lambda e: e.step)


def _explain_part(con: duckdb.DuckDBPyConnection, run_id: str, replica: str, group: int | None,
                  name: str) -> list[Explanation]:
    """Each stored chain segment is a lookup, named by its session where the server says one (a
    conversation's turns, one after another) or by its first block. Repeats change nothing in the
    cache (a re-reported hit, a removal of a block not cached) and are left out. The rows are read a
    batch at a time: only the history is kept."""
    cur = con.execute("SELECT step, kind, block_hash, parent_hash, token_ids, salt, session_id, block_index, "
                      "block_size FROM kv_events WHERE run_id = ? AND coalesce(replica, 'replica-0') = ? AND "
                      "group_idx IS NOT DISTINCT FROM ? AND kind IN ('BlockStored', 'BlockRemoved') AND NOT "
                      "coalesce(repeat, false) ORDER BY step, coalesce(event_index, 0), block_index",
                      [run_id, replica, group])
    events, sessions, B = [], {}, None
    while batch := cur.fetchmany(65536):
        for step, kind, h, parent, tokens, salt, session, index, size in batch:
            if kind == "BlockStored" and index == 0:
                sessions[len(events)] = session
            B = B or size
            events.append(CacheEvent(step, "store" if kind == "BlockStored" else "remove", h, parent,
                                     tuple(tokens or ()), salt))
    history = CacheHistory(events, B or 16)
    out, seen = [], {}
    for i, e in enumerate(events):
        if e.kind == "store":
            seen[e.hash] = seen.get(e.hash, 0) + 1  # stored again after an eviction: its n-th life
        if i in sessions and history.known(e.hash):  # a request's new blocks begin here
            prefix, n = history.tokens_of(e.parent), seen[e.hash]
            request = name + (sessions[i] or f"chain-{e.hash:016x}" + (f"#{n}" if n > 1 else ""))
            out.append(history.explain(Lookup(request, e.t, prefix + e.tokens, history.salt_of(e.hash), len(prefix),
                                              whole_prompt=False)))
    return out
