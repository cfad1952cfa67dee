"""What a run's isolation costs, as the What if view and `kvviz whatif RUN` show it: per tenant, the share
of its prompt tokens served with every block shared across tenants (keyed by content alone), as the run
keyed them (its salts), and per tenant and conversation; and the reads of other tenants' blocks that
sharing would have allowed. A capture's caches (replicas) are replayed apart and their counts summed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd

from ..whatif import cross_reads, tenant_costs
from .whatif_runs import RunTraces

COSTS = ["tenant", "prompt tokens", "hit rate shared", "hit rate salted", "loss", "hit rate per conversation"]
READS = ["reader", "would read blocks of", "blocks", "tokens"]


def isolation_costs(rt: RunTraces, capacity: int) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """At one capacity per cache (LRU): each tenant's hit rates (COSTS) and the cross-tenant reads
    sharing allows (READS); None for a run of one tenant, or a capture whose events carry no tokens (its
    hashes hold their salts, so they cannot be unsalted)."""
    if not rt.unsalted or len(rt.tenants) < 2:
        return None
    name = {i: t or "(no salt)" for i, t in enumerate(rt.tenants)}
    tally: dict[int, np.ndarray] = {}  # tenant -> prompt tokens, served shared, salted, per conversation
    reads: Counter[tuple[int, int]] = Counter()
    for cache, shared in rt.unsalted.items():
        salted = tenant_costs(shared, capacity, salted=rt.traces[cache])
        apart = tenant_costs(shared, capacity, keying="conversation")
        for a, b in zip(salted, apart, strict=True):
            tally.setdefault(a.tenant, np.zeros(4, np.int64))[:] += (a.prompt_tokens, a.shared_tokens_saved,
                                                                    a.tokens_saved, b.tokens_saved)
        for r in cross_reads(shared, capacity):
            reads[r.reader, r.writer] += r.blocks
    costs = pd.DataFrame([(name[t], int(p), s / p, k / p, (s - k) / p, c / p)
                          for t, (p, s, k, c) in sorted(tally.items())], columns=COSTS)
    size = next(iter(rt.unsalted.values())).block_size
    return costs, pd.DataFrame([(name[r], name[w], b, b * size) for (r, w), b in sorted(reads.items())],
                               columns=READS)
