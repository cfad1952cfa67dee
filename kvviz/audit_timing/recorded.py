"""Timing audits as the app shows them: the list, one audit's timings, and running one with the
timings reported as they arrive (against a URL, or a kvviz server started for the audit)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import duckdb
import pandas as pd

from ..engine import EngineConfig
from ..models import LoadedModel
from ..serve.app import ServeOptions
from ..serve.local import LocalServer
from ..store import RunStore
from .probe import AuditConfig, AuditResult, Sample, record, run_audit

LOCAL_ENGINE = EngineConfig(block_size=16, num_blocks=1024, max_batch_tokens=2048, compute="fast")


def list_audits(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Newest first. Audits from before version 11 have no null control: their verdict is read from
    `detected`; those from before version 17 timed one kind of hit at their level (global: cross-user,
    per-user: same-user), shown in the column of that kind. The prompt length asked is in words (a token
    each on SmolLM2 only); beside it, the timed prompt as the server counted it, where it said."""
    return con.execute("SELECT audit_id, created_at, coalesce(target, base_url) AS target, model, level, "
                       "coalesce(channel, 'time') AS channel, dummies, "
                       "coalesce(verdict, CASE WHEN detected THEN 'detected' ELSE 'not detected' END) AS verdict, "
                       "samples, prompt_tokens AS prompt_words, counted_prompt_tokens AS server_prompt_tokens, "
                       "primer_tokens, alpha, "
                       "round(CASE WHEN level = 'per-user' THEN median_hit_ms ELSE median_same_ms END, 1) "
                       "AS median_same_ms, "
                       "round(CASE WHEN level = 'per-user' THEN NULL ELSE median_hit_ms END, 1) AS median_cross_ms, "
                       "round(median_miss_ms, 1) AS median_miss_ms, round(median_null_ms, 1) AS median_null_ms, "
                       "round(ks_statistic, 3) AS ks_statistic, p_value, same_p_value, null_p_value, telemetry, "
                       "contradiction, reason FROM timing_audits ORDER BY created_at DESC").df()


KINDS = ("same", "cross", "hit", "miss", "null", "floor")  # hit: an audit's from before version 17


def timings(con: duckdb.DuckDBPyConnection, audit_id: str) -> dict[str, list[float]]:
    """An audit's times to first token (ms) by kind: same, cross, miss, null, floor (hit, not same and
    cross, in an audit from before version 17); only the kinds it has."""
    rows = con.execute("SELECT kind, ttft_ms FROM timing_samples WHERE audit_id = ? ORDER BY sample",
                       [audit_id]).fetchall()
    return {k: got for k in KINDS if (got := [t for kind, t in rows if kind == k])}


def ranks(con: duckdb.DuckDBPyConnection, audit_id: str) -> dict[str, list[int]]:
    """An order audit's probe ranks (dummies finished before each probe) by kind: same, cross, null."""
    rows = con.execute("SELECT kind, rank FROM timing_samples WHERE audit_id = ? AND rank IS NOT NULL ORDER BY sample",
                       [audit_id]).fetchall()
    return {k: got for k in ("same", "cross", "null") if (got := [r for kind, r in rows if kind == k])}


def audit_url(store: RunStore, cfg: AuditConfig, progress: Callable[[Sample], None] | None = None,
              between: Callable[[AuditResult], None] | None = None) -> tuple[str, AuditResult]:
    """Run and record an audit (a partial one too, when the server fails part way); `progress` hears
    each timed request, `between` the result so far between rounds (where the page draws)."""
    result = run_audit(cfg, progress, between)
    return record(store, result), result


def audit_local(store: RunStore, model: LoadedModel, sharing: str, cfg: AuditConfig,
                progress: Callable[[Sample], None] | None = None,
                between: Callable[[AuditResult], None] | None = None) -> tuple[str, AuditResult]:
    """The same against a kvviz server on this model with this cache-sharing policy, started for the
    audit and stopped after it (cfg's base_url and model are filled in)."""
    config = EngineConfig(**{**LOCAL_ENGINE.to_dict(), "prefix_caching": sharing != "off"})
    with LocalServer(model, config, ServeOptions(model.name, sharing)) as server:
        local = replace(cfg, base_url=server.url + "/v1", model=model.name,
                        target=f"kvviz serve on {model.name}, cache sharing {sharing}")
        return audit_url(store, local, progress, between)
