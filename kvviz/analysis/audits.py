"""Timing audits as the app shows them: the list, one audit's timings, and running one with the
timings reported as they arrive (against a URL, or a kvviz server started for the audit)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import duckdb
import pandas as pd

from ..audit_timing import AuditConfig, AuditResult, Sample, record, run_audit
from ..engine import EngineConfig
from ..models import LoadedModel
from ..serve.app import ServeOptions
from ..serve.local import LocalServer
from ..store import RunStore

LOCAL_ENGINE = EngineConfig(block_size=16, num_blocks=1024, max_batch_tokens=2048, compute="fast")


def list_audits(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Newest first."""
    return con.execute("SELECT audit_id, created_at, coalesce(target, base_url) AS target, model, level, samples, "
                       "prompt_tokens AS prompt_words, "
                       "round(median_hit_ms, 1) AS median_hit_ms, round(median_miss_ms, 1) AS median_miss_ms, "
                       "round(ks_statistic, 3) AS ks_statistic, p_value, detected FROM timing_audits "
                       "ORDER BY created_at DESC").df()


def timings(con: duckdb.DuckDBPyConnection, audit_id: str) -> tuple[list[float], list[float]]:
    """An audit's hit and miss times to first token (ms)."""
    rows = con.execute("SELECT kind, ttft_ms FROM timing_samples WHERE audit_id = ? ORDER BY sample",
                       [audit_id]).fetchall()
    return [t for k, t in rows if k == "hit"], [t for k, t in rows if k == "miss"]


def audit_url(store: RunStore, cfg: AuditConfig, progress: Callable[[AuditResult], None]) -> tuple[str, AuditResult]:
    """Run and record an audit; progress hears the result so far after every sample."""
    partial = AuditResult(cfg)

    def each(sample: Sample) -> None:
        partial.samples.append(sample)
        progress(partial)

    result = run_audit(cfg, progress=each)
    return record(store, result), result


def audit_local(store: RunStore, m: LoadedModel, sharing: str, cfg: AuditConfig,
                progress: Callable[[AuditResult], None]) -> tuple[str, AuditResult]:
    """The same against a kvviz server on this model with this cache-sharing policy, started for the
    audit and stopped after it (cfg's base_url and model are filled in)."""
    config = EngineConfig(**{**LOCAL_ENGINE.to_dict(), "prefix_caching": sharing != "off"})
    with LocalServer(m, config, ServeOptions(m.name, sharing)) as server:
        local = replace(cfg, base_url=server.url + "/v1", model=m.name,
                        target=f"kvviz serve on {m.name}, cache sharing {sharing}")
        return audit_url(store, local, progress)
