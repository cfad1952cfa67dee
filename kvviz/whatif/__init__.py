"""What if the cache were bigger, evicted otherwise, or salted per tenant: a request trace replayed under
prefix caches it never ran on.

The replay, as every module here computes it:

- Requests are replayed one at a time in arrival order (equal timestamps: in file order). Capacity is
  counted in blocks of trace.block_size tokens.
- Only full blocks are cacheable (vLLM hashes and caches only full blocks): a prompt's partial last
  block never hits and is never stored. (vLLM also recomputes the last token of a prompt that hits
  entirely; the replay does not model that one token.)
- A request first looks up its full blocks with the prefix rule: it is served up to its first block
  not in the cache, even if deeper ones are cached. Then its first min(blocks, capacity) blocks are
  stored (touched if already cached): it holds them meanwhile, so its own blocks are never the victims,
  and a request longer than the cache keeps its first blocks.
- Hit rate = prompt tokens served from cache / all prompt tokens (partial blocks included in the
  denominator); tokens saved = the prefill tokens served; hits and lookups count full blocks.
- Blocks are keyed by their whole prefix (chained hashes), shared by every request unless the salting
  replay keys them per tenant or per conversation (salting.py).

Policies (policies.py): lru (vLLM's free-queue order), lfu, seed (the seed article's advice, read as a
radix tree would: GreedyDual by prefix length over the unreferenced leaves), newcomer (kvviz's own: LRU
that makes never-seen blocks enter cold) and belady (MIN, the upper bound), each keeping the cache
prefix-closed and agreeing at the unbounded capacity, where nothing is evicted.

Modules: trace (the Mooncake reader and the array form), lru (every capacity at once from reuse
distances), policies and simulate (any policy, exactly, one pass per capacity), curves (the points),
salting (what isolation costs), records (the rows, to Arrow or dicts).
"""

from .curves import curve, request_hits
from .policies import POLICIES
from .records import CrossRead, CurvePoint, TenantCost, as_dicts, as_table, capacity_grid
from .salting import KEYINGS, assign_tenants, cross_reads, keyed, tenant_costs
from .trace import Trace, read_mooncake, trace_from_blocks

__all__ = ["KEYINGS", "POLICIES", "CrossRead", "CurvePoint", "TenantCost", "Trace", "as_dicts", "as_table",
           "assign_tenants", "capacity_grid", "cross_reads", "curve", "keyed", "read_mooncake", "request_hits",
           "tenant_costs", "trace_from_blocks"]
