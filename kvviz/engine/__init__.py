"""The inference engine: the shared block pool, the scheduler and paged attention over it.

Knows nothing of Streamlit or DuckDB; a recorder consumes its events and snapshots.
"""

from .backend import Admission, Backend, EngineError
from .block_pool import Block, BlockPool, OutOfBlocks
from .config import ConfigError, EngineConfig
from .defences import Defences
from .driver import Driver
from .engine import Engine, eos_ids
from .events import BlockEvent
from .kv_cache import Allocation, InvariantError, KVCacheManager, PoolSnapshot, Sequence
from .loop import EngineLoop
from .records import RequestResult, RunResult, RunStats, StepRecord

__all__ = [
    "Admission", "Allocation", "Backend", "Block", "BlockEvent", "BlockPool", "ConfigError", "Defences", "Driver",
    "Engine", "EngineConfig", "EngineError", "EngineLoop", "InvariantError", "KVCacheManager", "OutOfBlocks",
    "PoolSnapshot", "RequestResult", "RunResult", "RunStats", "Sequence", "StepRecord", "eos_ids",
]
