"""A second backend: Hugging Face transformers' continuous batching, run as shipped and judged by
kvviz's oracles (engine.backend "transformers"). Only kvviz.hf_backend.adapter reads transformers'
internals."""

from .run import BACKEND, TransformersBackend, check_workload, open_backend

__all__ = ["BACKEND", "TransformersBackend", "check_workload", "open_backend"]
