"""A second backend: Hugging Face transformers' continuous batching, run as shipped and judged by
kvviz's oracles (engine.backend "transformers"). Only kvviz.hf_backend.adapter reads transformers'
internals."""

from .run import BACKEND, check_workload, fault_refused, run_workload

__all__ = ["BACKEND", "check_workload", "fault_refused", "run_workload"]
