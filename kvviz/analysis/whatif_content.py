"""A capture's lookups keyed by what their blocks hold, for the salting replay. A block hash folds in the
tenant's salt (vLLM's cache_salt enters a chain's first hash, and every later hash chains from it), so two
tenants' blocks of the same tokens never share a hash: from hashes alone, no replay can say what a cache
shared across tenants would have merged. Where a BlockStored event carries its blocks' `token_ids`, a
block's content key can: its tokens and adapter, chained through its parent's content key, without the
salt, so that equal keys mean equal whole prefixes, whoever stored them.

A block whose tokens the capture lacks (an event without token_ids, or a breach of the token count), or
whose parent is not in the capture, keeps a key of its own, as its hash does: it is never merged, and the
replay says how many there were. Each event is the tenant its first row's salt names (vLLM names it on a
chain's first block; a continuation carries its chain's), no salt being a tenant of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import duckdb
import numpy as np
import pandas as pd

from ..whatif import Trace
from ..whatif.salting import conversations
from .whatif_capture import block_tree, depths, event_starts


@dataclass(frozen=True)
class Content:
    """A capture's caches with each event's tenant (its salt's number) and conversation, and, where there
    are two tenants or more and any block has tokens, the same lookups keyed by content."""

    traces: dict[str, Trace]  # as captured (keys: hashes), tenant and conversation set
    tenants: list[str | None]  # the salts, by tenant number (no salt first)
    unsalted: dict[str, Trace] = field(default_factory=dict)  # keyed by content
    untokened: int = 0  # blocks without tokens, keyed by their hash in `unsalted` too

# per distinct hash of one replica's device medium: a 64-bit hash of its tokens and adapter, from the first
# store that carried tokens (hashes shifted into BIGINT, as the trace's query keeps them). Hashing each row
# keeps the aggregate to integers: grouping the token lists themselves took half a GB more at 10 million
# events. Two contents share a hash with odds of about n^2 / 2^65 (1e-8 for a million blocks).
CONTENT_SQL = """
SELECT CAST(block_hash::HUGEINT - 9223372036854775808 AS BIGINT) AS block_hash,
       arg_min(hash(token_ids, coalesce(lora_name, CAST(lora_id AS VARCHAR), '')), step) AS content
FROM kv_events WHERE run_id = ? AND replica IS NOT DISTINCT FROM ? AND kind = 'BlockStored'
     AND coalesce(medium, 'GPU') = 'GPU' AND token_ids IS NOT NULL
GROUP BY block_hash
"""


def with_content(con: duckdb.DuckDBPyConnection, run_id: str, captured: dict[str, Trace],
                 parts: dict[str, pd.DataFrame]) -> Content:
    """The capture's traces (`captured`, from `parts`: each replica's rows with their salts) as Content."""
    salts = {r: part.salt.to_numpy()[event_starts(part)] for r, part in parts.items()}
    names = sorted({s for v in salts.values() for s in v.tolist()}, key=lambda s: (s is not None, s or ""))
    if len(names) < 2:
        return Content(captured, names)  # one tenant: nothing to share across, no tokens to read
    number = {s: i for i, s in enumerate(names)}
    traces, unsalted, untokened, tokens = {}, {}, 0, 0
    for replica, part in parts.items():
        trace = captured[replica]
        tenant = np.array([number[s] for s in salts[replica].tolist()], np.int64)
        found = con.execute(CONTENT_SQL, [run_id, replica]).fetchnumpy()
        tokens += len(found["block_hash"])
        content = np.unique(found["content"], return_inverse=True)[1].astype(np.int64)  # dense, from 0
        keys, lacking = content_keys(part, found["block_hash"], content)
        shared = replace(trace, keys=np.unique(keys[trace.keys], return_inverse=True)[1].astype(np.int64))
        shared = replace(shared, tenant=tenant, conversation=conversations(shared))
        traces[replica] = replace(trace, tenant=tenant, conversation=shared.conversation)
        unsalted[replica], untokened = shared, untokened + lacking
    return Content(traces, names, unsalted if tokens else {}, untokened)  # no tokens: hashes, which hold salts


def content_keys(part: pd.DataFrame, hashes: np.ndarray, content: np.ndarray) -> tuple[np.ndarray, int]:
    """Per key of the replica's trace (its distinct hashes, sorted), a content key: equal for two blocks
    exactly when their tokens and those of every block before them are; built depth by depth, each the
    dense number of (its parent's content key, its own content). `hashes` and `content` name the blocks
    with tokens. Also how many blocks lack them (each a key of its own)."""
    uniq, _, parent, root = block_tree(part)
    own = np.full(len(uniq), -1, np.int64)
    own[np.searchsorted(uniq, hashes)] = content
    depth = depths(parent)
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(int(depth.max(initial=-1)) + 2))
    keys = np.empty(len(uniq), np.int64)
    width, made = int(own.max(initial=0)) + 1, 0
    for d in range(len(bounds) - 1):
        at = order[bounds[d]:bounds[d + 1]]
        up = np.where(parent[at] >= 0, keys[parent[at].clip(0)] + 1, 0)  # 0: a chain's first block
        known = (own[at] >= 0) & (root[at] | (parent[at] >= 0))  # tokens, and the prefix they continue
        pairs, inv = np.unique(up[known] * width + own[at][known], return_inverse=True)
        keys[at[known]] = made + inv
        made += len(pairs)
        keys[at[~known]] = made + np.arange(int((~known).sum()))
        made += int((~known).sum())
    return keys, int((own < 0).sum())
