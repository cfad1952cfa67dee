"""SQL: read-only queries over every run (a locked-down DuckDB instance), example questions, a
quick chart of the result and the schema."""

from __future__ import annotations

from decimal import Decimal
from functools import partial

import pandas as pd
import plotly.express as px
import streamlit as st

from ..analysis.runs import CAPTURE_MODELS
from ..runners import explain_jobs
from ..store import SqlError
from ..store.sql import run_query
from .common import EMPTY, empty_store_hint, has_db, reader, store

# the run a per-step example looks at: after a scenario replay the newest run is its clean control, which shows nothing
LEAKING_ENGINE_RUN = (f"WHERE run_id = (SELECT run_id FROM runs WHERE model NOT IN {CAPTURE_MODELS}  -- not a capture\n"
                      "                -- the newest run with findings, else the newest\n"
                      "                ORDER BY coalesce(findings, 0) > 0 DESC, created_at DESC LIMIT 1)")
EXAMPLES = {
    "Runs, newest first": "SELECT run_id, status, model, scenario, fault, steps, leak_rate, findings\n"
                          "FROM runs ORDER BY created_at DESC",
    "Top leaking heads": "SELECT run_id, layer, head, max_foreign_mass, leak_rows\nFROM top_leaking_heads\n"
                         "WHERE leak_rows > 0 ORDER BY max_foreign_mass DESC LIMIT 20",
    "Leak rate over time": ("SELECT run_id, step, request_id, leak_rate, max_foreign_mass\nFROM leak_rate_per_step\n"
                            + LEAKING_ENGINE_RUN + "\nORDER BY step"),
    "Block churn per step": "SELECT run_id, step, count(*) FILTER (kind = 'allocate') AS allocated,\n"
                            "       count(*) FILTER (kind = 'free') AS freed, count(*) FILTER (kind = 'evict') AS "
                            "evicted\nFROM block_events GROUP BY run_id, step ORDER BY run_id, step",
    "Prefix-cache hit rate per step (runs)": "SELECT run_id, interval_start AS step, hit_rate, tokens, hit_tokens\n"
                                             "FROM hit_rate_per_interval WHERE unit = 'step' ORDER BY run_id, step",
    "Prefix-cache hit rate per minute (captures)": (
        "SELECT run_id, replica, to_timestamp(interval_start) AS minute, hit_rate, tokens, hit_tokens\n"
        "FROM hit_rate_per_interval WHERE unit = 'minute' ORDER BY run_id, replica, minute"),
    "Block lifetimes and idle time before eviction": (
        "SELECT run_id, count(*) AS lives, avg(lifetime_steps) AS mean_lifetime_steps,\n"
        "       avg(idle_steps) AS mean_idle_steps, avg(lifetime_s) AS mean_lifetime_s, sum(hits) AS hits\n"
        "FROM block_lifetimes WHERE removed_step IS NOT NULL GROUP BY run_id"),
    "Capture lifetimes, idle times and reuse gaps (s)": (
        "SELECT run_id, coalesce(replica, 'replica-0') AS replica,\n"
        "       quantile_cont(lifetime_s, [0.5, 0.99]) AS lifetime_p50_p99,\n"
        "       quantile_cont(idle_s, [0.5, 0.99]) AS idle_p50_p99,\n"
        "       quantile_cont(reuse_gap_s, [0.5, 0.99]) AS reuse_gap_p50_p99\n"
        "FROM kv_events WHERE lifetime_s IS NOT NULL OR reuse_gap_s IS NOT NULL GROUP BY ALL"),
    "Why lookups missed, by reason (runs explained so far)": (
        "SELECT r.run_id, r.scenario, e.reason, count(*) AS lookups, avg(e.hit_tokens) AS mean_hit_tokens\n"
        "FROM lookup_explanations e JOIN runs r USING (run_id)\nGROUP BY ALL ORDER BY r.run_id, lookups DESC"),
    "Block occupancy": "SELECT run_id, step, used, cached, free FROM block_occupancy ORDER BY run_id, step",
    "Findings by kind": "SELECT kind, count(*) AS n, max(mass) AS max_mass FROM findings GROUP BY kind",
    "Positional entropy by position": ("SELECT request_id, position, avg(entropy) AS entropy_nats, "
                                       "avg(leak_rate) AS leak_rate\nFROM positional_entropy\n" + LEAKING_ENGINE_RUN
                                       + "\nGROUP BY request_id, position ORDER BY request_id, position"),
}
MAX_ROWS = 10_000


def render() -> None:
    st.title("SQL")
    if not has_db():
        empty_store_hint()
        return
    st.caption("Read-only: one SELECT at a time, no files, no extensions, at most "
               f"{MAX_ROWS:,} rows and 30 s. Ctrl+Enter runs the query.")
    busy = explain_jobs.running(store())
    if busy:
        st.caption(f"Being explained in the background (opened in the inspector): {', '.join(j.run_id for j in busy)}; "
                   "lookup_explanations holds their reasons once done.")

    def use_example() -> None:
        st.session_state["sql_text"] = EXAMPLES[st.session_state["sql_example"]]

    chosen = st.session_state.get("sql_example")
    if chosen is not None and st.session_state.get("sql_text", EXAMPLES[chosen]) != EXAMPLES[chosen]:
        st.session_state["sql_example"] = None  # the query was edited: it is that example no more
    st.selectbox("Example", list(EXAMPLES), key="sql_example", on_change=use_example, index=None,
                 placeholder="choose an example query")
    st.session_state.setdefault("sql_text", EXAMPLES["Runs, newest first"])
    with st.form("sql_form", border=False):
        query = st.text_area("Query", key="sql_text", height=160)
        submitted = st.form_submit_button("Run", type="primary", icon=":material/play_arrow:")
    if submitted or "sql_result" in st.session_state:
        if submitted:  # a new result: its chart's pickers are new widgets, from its own defaults (popping the
            # old keys reset the server's values but not the browser's, which went on showing the last choices)
            st.session_state.pop("sql_result", None)
            st.session_state["sql_results"] = st.session_state.get("sql_results", 0) + 1
            try:
                with reader() as con:
                    res = run_query(con, query, max_rows=MAX_ROWS)
                st.session_state["sql_result"] = _frame(res.rows, res.columns), res.truncated
            except SqlError as e:
                st.error(f"Not run: {e}", icon=":material/block:")
        if "sql_result" in st.session_state:
            _result(*st.session_state["sql_result"])
    _schema()


def _result(df: pd.DataFrame, truncated: bool) -> None:
    st.caption(f"{len(df):,} row{'' if len(df) == 1 else 's'}" +
               (f" (the first {MAX_ROWS:,}; more exist)" if truncated else ""))
    st.dataframe(df, hide_index=True, width="stretch", placeholder=EMPTY)
    numeric = [c for c in df.columns if pd.api.types.is_numeric_dtype(df[c])]
    if len(df) > 1 and not numeric:
        st.caption("No quick chart: no column holds a number (a list, such as quantile_cont's, charts once "
                   "unnested: `unnest(...)` or `q[1]`).")
    if len(df) > 1 and numeric:
        with st.expander("Quick chart", expanded=True):
            c = st.columns(4)
            columns = list(df.columns)
            axis = next((columns.index(n) for n in ("step", "interval_start", "position") if n in columns), 0)
            n = st.session_state.get("sql_results", 0)
            x = c[0].selectbox("x", columns, key=f"sql_x_{n}", index=axis)
            ys = [n for n in numeric if n != x] or numeric
            y = c[1].selectbox("y", ys, key=f"sql_y_{n}", index=_measure(df, ys))
            others = [n for n in df.columns if n not in (x, y) and not pd.api.types.is_numeric_dtype(df[n])]
            colour = c[2].selectbox("colour", [None, *others], key=f"sql_colour_{n}",
                                    index=_series_index(df, x, others))
            ordered = pd.api.types.is_numeric_dtype(df[x]) or pd.api.types.is_datetime64_any_dtype(df[x])
            kind = c[3].radio("chart", ("line", "bar", "scatter"), horizontal=True, key=f"sql_kind_{n}",
                              index=0 if ordered else 1)  # a line only along an ordered axis
            chart = {"line": partial(px.line, markers=True), "bar": px.bar, "scatter": px.scatter}[kind]
            shown, title = df.head(5000), None
            if kind == "bar" and colour is None and df[x].duplicated().any():
                # plotly would stack the rows that share an x: 20 heads' max masses read as one mass of 11
                how = _combined(y)
                shown = shown.groupby(x, as_index=False, sort=False)[y].agg(how)
                title = f"{y}, {COMBINED[how]} the rows of each {x}"
            fig = chart(shown, x=x, y=y, color=colour)  # markers: a series of one point still shows
            if (df[y].dropna() >= 0).all():
                fig.update_yaxes(rangemode="tozero")  # all zeros at the bottom, not mid -1..1
            if title:
                fig.update_yaxes(title=title)
            st.plotly_chart(fig, width="stretch", key="sql_chart")


COMBINED = {"max": "the largest of", "min": "the smallest of", "sum": "summed over"}


def _combined(column: str) -> str:
    """How a bar combines the rows that share its x: a maximum's largest, a minimum's smallest, else their
    sum (a sum of maxima measures nothing)."""
    name = column.lower()
    return "max" if name.startswith(("max", "peak", "largest")) else "min" if name.startswith(("min", "least")) \
        else "sum"


IDENTIFIERS = ("layer", "head", "step", "position", "replica", "block", "hash", "_id", "_start", "_idx")


def _measure(df: pd.DataFrame, columns: list[str]) -> int:
    """The default y: a measured quantity (a float first: a mass, a rate), never an identifier such as a
    layer or head number, whose sum means nothing, and one that is not zero or empty in every row (an
    empty chart tells nothing)."""
    named = [i for i, c in enumerate(columns) if not c.endswith(IDENTIFIERS)]
    floats = [i for i in named if pd.api.types.is_float_dtype(df[columns[i]])]
    told = [i for i in (*floats, *named) if (df[columns[i]].fillna(0) != 0).any()]
    return (told or floats or named or [0])[0]


def _frame(rows: list[tuple], columns: list[str]) -> pd.DataFrame:
    """The result as a frame; DECIMAL columns (6.5 in SQL is one) as floats, so they can be charted."""
    df = pd.DataFrame(rows, columns=columns)
    for c in df.columns:
        values = df[c].dropna()
        if df[c].dtype == object and len(values) and all(isinstance(v, Decimal) for v in values):
            df[c] = df[c].astype(float)
    return df


def _series_index(df: pd.DataFrame, x: str, others: list[str]) -> int:
    """Where x repeats or goes back, the rows are several series (a request, a replica, a reason each):
    colour by the first text column that tells them apart (0: none), so one line does not zig-zag
    across them."""
    if not df[x].duplicated().any() and df[x].is_monotonic_increasing:
        return 0
    return next((i for i, n in enumerate(others, start=1) if 1 < df[n].nunique() <= 20), 0)


def _schema() -> None:
    with st.expander("Schema: tables and views"):
        with reader() as con:
            cols = con.execute("SELECT c.table_name, t.table_type, c.column_name, c.data_type, "
                               "coalesce(dt.comment, '') AS note, coalesce(dc.comment, '') AS column_note FROM "
                               "information_schema.columns c JOIN information_schema.tables t USING (table_name) "
                               "LEFT JOIN duckdb_tables() dt ON dt.table_name = c.table_name "
                               "LEFT JOIN duckdb_columns() dc ON dc.table_name = c.table_name "
                               "AND dc.column_name = c.column_name "
                               "WHERE t.table_schema = 'main' ORDER BY t.table_type, c.table_name, "
                               "c.ordinal_position").df()
        for (table, kind, note), part in cols.groupby(["table_name", "table_type", "note"], sort=False):
            st.markdown(f"**{table}** ({'view' if kind == 'VIEW' else 'table'}){': ' + note if note else ''}  \n" +
                        ", ".join(f"`{c}` {t.lower()}" + (f" ({n})" if n else "")
                                  for c, t, n in zip(part.column_name, part.data_type, part.column_note, strict=True)))

