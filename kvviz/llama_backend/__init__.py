"""A third backend: llama.cpp through its C API (llama-cpp-python's bindings), run as shipped and judged
by kvviz's oracles (engine.backend "llama.cpp"). Only kvviz.llama_backend.adapter imports llama_cpp."""

from . import adapter
from .misuse import MISUSES, Misuse
from .run import (
                  BACKEND,
                  ISOLATIONS,
                  TOLERANCE,
                  LlamaBackend,
                  alone,
                  check_workload,
                  open_backend,
                  pool_blocks,
                  stream_room,
)

__all__ = ["BACKEND", "ISOLATIONS", "MISUSES", "TOLERANCE", "LlamaBackend", "Misuse", "adapter", "alone",
           "check_workload", "open_backend", "pool_blocks", "stream_room"]
