"""kvviz: a visual debugger for KV-cache sharing and attention isolation in LLM inference."""

__version__ = "0.1.0"
