"""A capture's breaches of the KV-event contract (capture_breaches, found on import by
capture/lint.py), read for the CLI and the capture views, and said beside each view's figures: a
hit rate computed from a stream with lost messages is not the hit rate the server had."""

from __future__ import annotations

import json

import duckdb
import pandas as pd

from ..capture.lint import ADVISORY, DISTORTS, KINDS, ORDER

# ADVISORY: for the UI, which reads no capture module
__all__ = ["ADVISORY", "beside", "breaches", "linted", "warning"]

# view -> the kinds that distort what it draws (capture/lint.py's DISTORTS says how)
VIEW_KINDS = {
    "Activity": ("seq_gap", "seq_back", "stored_twice", "token_count"),
    "Occupancy": ("seq_gap", "seq_back", "remove_unstored", "stored_twice", "never_removes", "medium_removed_only"),
    "Lifetimes": ("seq_gap", "seq_back", "remove_unstored", "never_removes"),
    "Shared prefixes": ("seq_gap", "seq_back", "stored_twice", "token_count"),
    "Prefix tree": ("seq_gap", "seq_back", "parent_after_child", "token_count"),
    "Cross-tenant": ("seq_gap", "seq_back", "salt_mixed"),
    "What if": ("seq_gap", "seq_back", "stored_twice", "remove_unstored"),
}
COLUMNS = ["kind", "what", "replica", "count", "first_step", "first_seq", "first_ts", "detail"]
# a figure's number -> the kinds that make it wrong (said beside the number, not only above the view)
FIGURES = {
    "hit rate": ("seq_gap", "seq_back", "stored_twice"),
    "occupancy": ("seq_gap", "seq_back", "remove_unstored", "stored_twice", "never_removes", "medium_removed_only"),
    "lifetimes": ("seq_gap", "seq_back", "remove_unstored", "never_removes"),
    "tenant counts": ("seq_gap", "seq_back", "salt_mixed"),
}


def linted(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """Was the run's capture linted on import (kvviz 18 or later; a request trace never is)?"""
    row = con.execute("SELECT workload FROM runs WHERE run_id = ?", [run_id]).fetchone()
    return bool(row) and "breaches" in json.loads(row[0] or "{}")


def breaches(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """Each kind of breach on each replica, in the linter's order, with what it is in words."""
    df = con.execute("SELECT kind, replica, count, first_step, first_seq, first_ts, detail FROM capture_breaches "
                     "WHERE run_id = ?", [run_id]).df()
    df.insert(1, "what", df.kind.map(KINDS))
    order = df.kind.map(ORDER.index)
    return df.assign(_o=order).sort_values(["_o", "replica"]).drop(columns="_o").reset_index(drop=True)[COLUMNS]


def counted(found: pd.DataFrame) -> str:
    """'N breaches of K kinds': every occurrence the linter counted (a row is a kind on a replica)."""
    times, kinds = int(found["count"].sum()), found.kind.nunique()
    return f"{times:,} breach{'es' if times != 1 else ''} of {kinds} kind{'s' if kinds != 1 else ''}"


def warning(found: pd.DataFrame, view: str) -> str | None:
    """The breaches that distort `view`, in one paragraph (None: none do)."""
    kinds = VIEW_KINDS.get(view, ())
    hit = found[found.kind.isin(kinds)]
    if hit.empty:
        return None
    said = []
    for kind, rows in hit.groupby("kind", sort=False):
        where = ", ".join(f"{r.replica} {r['count']:,}" for _, r in rows.iterrows())
        first = rows.sort_values("first_step").iloc[0]
        at = (f"seq {int(first.first_seq)}, the capture's message {int(first.first_step)}"
              if pd.notna(first.first_seq) else f"the capture's message {int(first.first_step)}")
        said.append(f"{KINDS[kind]} ({where}; the first at {at}): {DISTORTS[kind]}")
    listed = "; ".join(said)
    return ("This capture's stream breaks the KV-event contract in ways that distort this view. "
            + listed[:1].upper() + listed[1:] + ".")


def beside(found: pd.DataFrame | None, figure: str) -> str | None:
    """One line for beside a figure's number (a key of FIGURES): the breaches that make it wrong, each with
    its count per replica, or None when none do (or the capture was not linted)."""
    if found is None:
        return None
    hit = found[found.kind.isin(FIGURES[figure])]
    if hit.empty:
        return None
    said = "; ".join(f"{KINDS[kind]} ({', '.join(f'{r.replica} {r.count:,}' for r in rows.itertuples())})"
                     for kind, rows in hit.groupby("kind", sort=False))
    return f"This {figure} is from a stream that breaks the KV-event contract: {said}."
