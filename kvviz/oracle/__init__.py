"""The leak oracles: provenance (every attention weight classified) and reference (each request
rerun alone)."""

from .provenance import KINDS, Finding, OracleConfig, ProvenanceOracle, StepLeak

__all__ = ["KINDS", "Finding", "OracleConfig", "ProvenanceOracle", "StepLeak"]
