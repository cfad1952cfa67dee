"""The inference engine: the shared block pool, the scheduler and paged attention over it.

Knows nothing of Streamlit or DuckDB; a recorder consumes its events and snapshots.
"""

from .block_pool import Block, BlockPool, OutOfBlocks
from .config import ConfigError, EngineConfig
from .defences import Defences
from .engine import Engine, EngineError
from .events import BlockEvent
from .kv_cache import Allocation, InvariantError, KVCacheManager, PoolSnapshot, Sequence
from .loop import EngineLoop
from .records import RequestResult, RunResult, RunStats, StepRecord

__all__ = [
    "Allocation", "Block", "BlockEvent", "BlockPool", "ConfigError", "Defences", "Engine", "EngineConfig",
    "EngineError", "EngineLoop", "InvariantError", "KVCacheManager", "OutOfBlocks", "PoolSnapshot", "RequestResult",
    "RunResult", "RunStats", "Sequence", "StepRecord",
]
