"""The inference engine: the shared block pool and (later) the scheduler and paged attention.

Knows nothing of Streamlit or DuckDB; a recorder consumes its events and snapshots.
"""

from .block_pool import Block, BlockPool, OutOfBlocks
from .events import BlockEvent
from .kv_cache import Allocation, InvariantError, KVCacheManager, PoolSnapshot, Sequence

__all__ = [
    "Allocation", "Block", "BlockEvent", "BlockPool", "InvariantError", "KVCacheManager",
    "OutOfBlocks", "PoolSnapshot", "Sequence",
]
