"""`python -m kvviz bench`: the benchmarks behind docs/benchmarks.md, one module per question
(throughput against transformers, capture import, memory, serving, sessions, sharing, tiers)."""
