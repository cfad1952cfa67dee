"""What isolation costs: the same replay with blocks keyed per tenant (a salt, as vLLM's cache_salt),
per tenant and conversation, or shared, and the cross-tenant reads that sharing allows.

Mooncake traces carry no tenant or conversation; `assign_tenants` derives them deterministically. A
block is a system block when at least `system_ends` distinct prompts end below it (a system prompt or
a document many conversations start from); a request's conversation is named by its first block that is
not a system block, so the turns of one chat, which repeat its whole earlier prompt, share it. A request
made of system blocks only is a conversation of its own. Conversations go to tenants in turn, in the
order they first appear.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import KvvizError
from .curves import request_hits
from .lru import reuse_distances
from .records import CrossRead, TenantCost
from .trace import Trace

KEYINGS = ("shared", "tenant", "conversation")


def assign_tenants(trace: Trace, tenants: int, *, system_ends: int = 16) -> Trace:
    """The trace with a conversation per request and its conversations dealt to `tenants` tenants."""
    if tenants < 1:
        raise KvvizError(f"tenants must be at least 1, got {tenants}")
    conv = conversations(trace, system_ends=system_ends)
    return replace(trace, conversation=conv, tenant=conv % tenants)


def conversations(trace: Trace, *, system_ends: int = 16) -> np.ndarray:
    """Per request, its conversation: dense ids in order of first appearance (see the module's rule)."""
    n_keys, keys, deep = trace.distinct_blocks, trace.keys, trace.depth > 0
    parent = np.full(n_keys, -1, np.int64)
    parent[keys[deep]] = keys[np.nonzero(deep)[0] - 1]
    depth = np.zeros(n_keys, np.int64)
    depth[keys] = trace.depth
    ends = (np.bincount(parent[parent >= 0], minlength=n_keys) == 0).astype(np.int64)  # a leaf ends a prompt
    for d in range(int(depth.max(initial=0)), 0, -1):  # leaves below, summed up the tree
        at = np.nonzero(depth == d)[0]
        np.add.at(ends, parent[at], ends[at])
    own = np.nonzero(ends[keys] < system_ends)[0]
    reqs, first = np.unique(trace.request_of[own], return_index=True)
    name = n_keys + np.arange(trace.requests)  # a request of system blocks only: its own conversation
    name[reqs] = keys[own[first]]
    _, seen_at, dense = np.unique(name, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(seen_at))[dense]


def keyed(trace: Trace, keying: str) -> Trace:
    """The trace with blocks keyed as `keying` says: shared as recorded, salted per tenant, or per
    tenant and conversation."""
    if keying not in KEYINGS:
        raise KvvizError(f"keying {keying!r} is not known (known: {', '.join(KEYINGS)})")
    if keying == "shared":
        return trace
    if trace.tenant is None or trace.conversation is None:
        raise KvvizError("the trace has no tenants: assign them first (assign_tenants)")
    if keying == "tenant":
        return trace.rekeyed(trace.tenant)
    salt = np.unique(np.stack([trace.tenant, trace.conversation]), axis=1, return_inverse=True)[1]
    return trace.rekeyed(salt.reshape(-1))


def tenant_costs(trace: Trace, capacity: int, *, keying: str = "tenant", policy: str = "lru",
                 salted: Trace | None = None) -> list[TenantCost]:
    """Per tenant, its hit rate shared and keyed by `keying`, at one capacity and policy. salted: the same
    requests keyed otherwise, where that is not keyed(trace, keying): a capture's own salted hashes, the
    baseline its content-keyed trace is compared with."""
    if salted is None:
        salted = keyed(trace, keying)
    elif salted.requests != trace.requests:
        raise KvvizError(f"the salted trace has {salted.requests} requests, the shared one {trace.requests}")
    served = [_per_tenant(trace, request_hits(t, policy, capacity)) for t in (trace, salted)]
    tokens = np.bincount(trace.tenant, trace.input_length).astype(np.int64)
    return [TenantCost(tenant=t, keying=keying, policy=policy, capacity=capacity, prompt_tokens=int(tokens[t]),
                       shared_tokens_saved=int(served[0][t]), tokens_saved=int(served[1][t]),
                       shared_hit_rate=served[0][t] / tokens[t], hit_rate=served[1][t] / tokens[t],
                       loss=(served[0][t] - served[1][t]) / tokens[t])
            for t in np.nonzero(tokens)[0].tolist()]


def _per_tenant(trace: Trace, hits: np.ndarray) -> np.ndarray:
    """Prompt tokens served per tenant."""
    return np.bincount(trace.tenant, hits * trace.block_size, int(trace.tenant.max()) + 1).astype(np.int64)


def cross_reads(trace: Trace, capacity: int | None = None) -> list[CrossRead]:
    """Who would read whose blocks in a shared LRU cache of `capacity` blocks (None: unbounded): each hit
    is credited to the tenant whose request computed the cached copy, the block's last miss."""
    cap = trace.distinct_blocks if capacity is None else capacity
    if cap < 1:
        raise KvvizError(f"capacity must be at least 1 block, got {cap}")
    if trace.tenant is None:
        raise KvvizError("the trace has no tenants: assign them first (assign_tenants)")
    order = np.lexsort((np.arange(trace.lookups), trace.keys))  # each block's lookups in time order
    hit = (reuse_distances(trace) < cap)[order]  # a block's first lookup is always a miss
    computed = np.maximum.accumulate(np.where(hit, 0, np.arange(len(order))))
    owner = trace.tenant[trace.request_of]
    reader, writer = owner[order][hit], owner[order[computed]][hit]
    other = reader != writer
    pairs, blocks = np.unique(np.stack([reader[other], writer[other]]), axis=1, return_counts=True)
    return [CrossRead(reader=int(r), writer=int(w), capacity=cap, blocks=int(b), tokens=int(b) * trace.block_size)
            for (r, w), b in zip(pairs.T.tolist(), blocks.tolist(), strict=True)]
