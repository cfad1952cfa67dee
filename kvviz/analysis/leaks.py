"""Leak figures over time, the findings list and the jump from a finding to where it happened."""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import pandas as pd


@dataclass(frozen=True)
class Focus:
    """Where the inspector looks: a finding jumps here."""

    step: int
    request: str
    layer: int | None = None
    head: int | None = None
    position: int | None = None


def leak_over_time(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """step, request_id, leak_rate, max_foreign_mass (from the leak_rate_per_step view)."""
    return con.execute("SELECT step, request_id, leak_rate, max_foreign_mass FROM leak_rate_per_step "
                       "WHERE run_id = ? ORDER BY step, request_id", [run_id]).df()


def entropy_by_position(con: duckdb.DuckDBPyConnection, run_id: str, layer: int | None = None) -> pd.DataFrame:
    """request_id, position, entropy (nats), leak_rate: the mean over heads and over every layer (or
    one), from the positional_entropy view, in position order."""
    where = "" if layer is None else " AND layer = ?"
    return con.execute("SELECT request_id, position, avg(entropy) AS entropy, avg(leak_rate) AS leak_rate "
                       f"FROM positional_entropy WHERE run_id = ?{where} GROUP BY request_id, position "
                       "ORDER BY request_id, position", [run_id] + ([] if layer is None else [layer])).df()


def layer_count(con: duckdb.DuckDBPyConnection, run_id: str) -> int:
    """Layers the oracle measured in this run (0 for a capture)."""
    return int(con.execute("SELECT coalesce(max(layer) + 1, 0) FROM leak_metrics WHERE run_id = ?",
                           [run_id]).fetchall()[0][0])


def entropy_trend(df: pd.DataFrame) -> pd.DataFrame:
    """Per request: entropy at its first and last position and the rank correlation of entropy with
    position (+1: it only rises), what the seed's claim about long contexts is checked by."""
    rows = []
    for req, part in df.groupby("request_id"):
        rho = part.position.corr(part.entropy, method="spearman") if len(part) > 2 else float("nan")
        rows.append({"request_id": req, "first": part.entropy.iloc[0], "last": part.entropy.iloc[-1],
                     "spearman": rho, "positions": len(part)})
    return pd.DataFrame(rows)


# Leaks of another request's or a dead block's tokens first; for duplicate positions, non-finite
# weights and normalisation errors `mass` is a count or an error, not attention mass.
KIND_ORDER = ("foreign", "stale", "kernel_mismatch", "cross_tenant", "telemetry_mismatch", "non_finite",
              "normalisation", "duplicate")


FINDING_COLUMNS = ("kind, request_id, step, last_step, layer, head, position, source_request, block, "
                   "round(mass, 6) AS mass")


def findings(con: duckdb.DuckDBPyConnection, run_id: str, limit: int = 2000) -> pd.DataFrame:
    """Leaks first (foreign, then stale, ...), the heaviest first within a kind; a cross-tenant read
    names its block and last step (null layer and head: every layer, no one head)."""
    return con.execute(f"SELECT {FINDING_COLUMNS} FROM findings WHERE run_id = ? "
                       "ORDER BY coalesce(list_position(?, kind), 99), mass DESC NULLS LAST, step, request_id, block "
                       "LIMIT ?", [run_id, list(KIND_ORDER), limit]).df()


def first_finding(con: duckdb.DuckDBPyConnection, run_id: str) -> dict | None:
    """Where a run's trouble starts: the earliest step's finding (a leak before other kinds, then the
    heaviest), or None for a clean run. The inspector opens a run here, so playing on shows what follows."""
    df = con.execute(f"SELECT {FINDING_COLUMNS} FROM findings WHERE run_id = ? "
                     "ORDER BY step, coalesce(list_position(?, kind), 99), mass DESC NULLS LAST, request_id, block "
                     "LIMIT 1", [run_id, list(KIND_ORDER)]).df()
    return None if df.empty else df.iloc[0].to_dict()


def divergence(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    return con.execute("SELECT request_id, classification, first_divergent_step, max_logit_diff, max_kl "
                       "FROM divergence WHERE run_id = ? ORDER BY request_id", [run_id]).df()


def focus_of(finding: dict) -> Focus:
    """The inspector position a finding row points at (layer/head/position may be absent)."""
    def opt(k: str) -> int | None:
        v = finding.get(k)
        return None if v is None or pd.isna(v) else int(v)

    return Focus(int(finding["step"]), str(finding["request_id"]), opt("layer"), opt("head"), opt("position"))


def busiest_focus(con: duckdb.DuckDBPyConnection, run_id: str, request: str) -> Focus:
    """Where to look in a run with no finding: the first step at which the most requests held blocks,
    so a shared buffer shows every request's band (the last step may hold none)."""
    row = con.execute("SELECT step FROM page_tables WHERE run_id = ? GROUP BY step "
                      "ORDER BY count(DISTINCT request_id) DESC, step LIMIT 1", [run_id]).fetchone()
    last = con.execute("SELECT max(step) FROM steps WHERE run_id = ?", [run_id]).fetchone()[0]
    return Focus(int(row[0]) if row else int(last or 0), request)
