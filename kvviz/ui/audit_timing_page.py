"""Audit: the cross-tenant timing audit of an OpenAI-compatible server (a URL, or a kvviz server
started for it), its samples arriving live as distribution curves, the verdict, and past audits
side by side."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ..audit_timing import recorded as audits
from ..audit_timing.probe import LEVELS, AuditConfig, AuditResult
from ..audit_timing.verdict import HEADLINES, Verdict, fewest_samples, in_words, server_says, tone
from ..errors import KvvizError
from ..figures.audit_timing import ttft_ecdf
from ..serve import SHARING
from .common import MODELS, has_db, load_model_or_error, reader, store

LOCAL, REMOTE = "a kvviz server started for the audit", "a server at a URL"
DEFAULTS = {"audit_samples": 40, "audit_words": 256, "audit_alpha": 1e-8}  # set once, then the user's (kept)
SETTLE = 0.1  # seconds of quiet after drawing a round, before the next round's first (untimed) primer


def render() -> None:
    st.title("Timing audit")
    st.caption("Does a server share its prompt cache across users? Seen from outside by time to first token: a "
               "prompt sent just before by someone else (a hit) against a fresh one (a miss), each timed right "
               "after an untimed prompt of the same length, then a one-sided KS test that hits come sooner (Gu et "
               "al. 2025). A null control (a second miss) takes the same test: if it too comes sooner, the "
               "measurement is biased and there is no verdict. The verdict and every timing are stored with your "
               "runs.")
    for k, v in DEFAULTS.items():
        st.session_state.setdefault(k, v)
    target = st.radio("Audit", (LOCAL, REMOTE), horizontal=True, key="audit_target")
    c = st.columns(3)
    if target == LOCAL:
        name = c[0].selectbox("Model", MODELS, key="audit_model")
        sharing = c[1].selectbox("Its cache sharing", SHARING, key="audit_sharing",
                                 help="global: one prefix cache for everyone; per-user: namespaced by user or API "
                                      "key; off: no prefix cache")
        url = model = key = None
    else:
        url = c[0].text_input("Base URL", placeholder="http://127.0.0.1:8000/v1", key="audit_url").strip()
        model = c[1].text_input("Model", key="audit_remote_model").strip()
        key = c[2].text_input("API key", type="password", key="audit_key") or "kvviz-audit"
        name = sharing = None
    c, alpha_now = st.columns(4), float(st.session_state["audit_alpha"])
    level = c[0].selectbox("Level", LEVELS, key="audit_level",
                           help="global: another user with another API key sends the hit's prompt first; "
                                "per-user: the same user does")
    samples = c[1].number_input("Rounds", 2, 5000, key="audit_samples",
                                help="each round times a hit, a miss, a null control and a one-word floor. The "
                                     f"published protocol uses 250; fewer than {fewest_samples(alpha_now)} can "
                                     f"never reach alpha {alpha_now:g}")
    words = c[2].number_input("Prompt words", 16, 8192, key="audit_words",  # a quarter of the page: no wrap
                              help="the prompt's length in words of one token each (on SmolLM2); the server's own "
                                   "count is checked where it reports it")
    alpha = c[3].number_input("alpha", 1e-15, 0.5, format="%.0e", key="audit_alpha")
    ready = bool(name) or bool(url and model)
    if st.button("Run the audit", type="primary", icon=":material/timer:", key="audit_go", disabled=not ready):
        try:
            _run(name, sharing, url, model, key, level, int(samples), int(words), float(alpha))
        except KvvizError as e:  # said here, not by the app, so that the past audits still show below
            st.error(str(e), icon=":material/error:")
    _past()


def _run(name, sharing, url, model, key, level, samples, words, alpha) -> None:
    cfg = AuditConfig(url or "http://127.0.0.1/v1", model or "local", level, samples, words, interval=SETTLE,
                      alpha=alpha, api_key=key or "kvviz-audit")
    bar, chart = st.progress(0.0, text="starting..."), st.empty()

    def between(r: AuditResult) -> None:  # after a round, never during one: drawing is not timed
        done = r.samples[-1].index + 1
        bar.progress(done / samples, text=f"{done} of {samples} rounds timed (a hit, a miss, a null and a floor each)")
        chart.plotly_chart(ttft_ecdf(r.times("hit"), r.times("miss"), null=r.times("null"), floor=r.times("floor")),
                           key=f"audit_live_{done}")

    if name is not None:
        model = load_model_or_error(name)
        if model is None:
            return
        audit_id, result = audits.audit_local(store(), model, sharing, cfg, between=between)
        what = f"a kvviz server on {name} with cache sharing {sharing}"
    else:
        audit_id, result = audits.audit_url(store(), cfg, between=between)
        what = url
    bar.progress(1.0, text=f"done: audit {audit_id}")
    chart.empty()  # the audit is drawn below with the past ones, with its verdict
    _verdict(result.judge(), level, what, alpha)
    st.session_state["audit_show"] = [audit_id]  # the audit just run is the one drawn below


def _verdict(v: Verdict, level: str, what: str, alpha: float) -> None:
    """One message, coloured by what it means: sharing across users red, a biased or too short
    measurement amber, no sharing green."""
    figures = (f"Median first token {v.median_hit_ms or 0:.1f} ms for hits, {v.median_miss_ms or 0:.1f} ms for "
               f"misses and {v.median_null_ms or 0:.1f} ms for the null control")
    if v.p_value is not None:
        figures += (f"; hits against misses KS D = {v.ks_statistic:.2f}, p = {v.p_value:.2g}, null against misses "
                    f"p = {v.null_p_value:.2g} (alpha {alpha:g})")
    why = "; ".join(x for x in (in_words(v.verdict, level), v.reason) if x)
    says = server_says(v)
    say = f"**{HEADLINES[v.verdict]}** at the {level} level on {what}: {why}. {figures}." + (
        f" {says[:1].upper()}{says[1:]}." if says else "")
    getattr(st, tone(v, level))(say)


def _past() -> None:
    if not has_db():
        return
    with reader() as con:
        listing = audits.list_audits(con)
    st.subheader("Past audits")
    if listing.empty:
        st.caption("None yet. Run one above, or `python -m kvviz audit-timing --base-url URL --model NAME`.")
        return
    st.dataframe(listing, hide_index=True, width="stretch",
                 column_config={"created_at": st.column_config.DatetimeColumn("created"),
                                "p_value": st.column_config.NumberColumn("p-value", format="%.2e"),
                                "null_p_value": st.column_config.NumberColumn("null p-value", format="%.2e"),
                                "median_hit_ms": "median hit ms", "median_miss_ms": "median miss ms",
                                "median_null_ms": "median null ms", "ks_statistic": "KS D",
                                "prompt_words": "prompt words", "server_prompt_tokens": "tokens (server)",
                                "samples": "rounds", "audit_id": "audit",
                                "alpha": st.column_config.NumberColumn("alpha", format="%.0e")})
    rows = listing.set_index("audit_id")
    st.session_state.setdefault("audit_show", list(rows.index[:1]))  # the newest, or the one just run
    picked = st.multiselect("Side by side", list(rows.index), max_selections=3, key="audit_show",
                            format_func=lambda a: f"{a}: {rows.level[a]} level, {rows.target[a]} ({rows.verdict[a]})")
    if not picked:
        return
    with reader() as con:
        drawn = {a: audits.timings(con, a) for a in picked}
    x_max = max((x for t in drawn.values() for kind in ("hit", "miss", "null") for x in t[kind]), default=None)
    for col, (audit_id, t) in zip(st.columns(len(picked)), drawn.items(), strict=True):
        row = rows.loc[audit_id]
        col.plotly_chart(ttft_ecdf(t["hit"], t["miss"], f"{audit_id}: {row.level}, {row.verdict}", null=t["null"],
                                   floor=t["floor"], x_max=x_max), key=f"audit_past_{audit_id}")
        null = "" if pd.isna(row.null_p_value) else f" · null p = {row.null_p_value:.2g}"
        col.caption(f"{row.target} · {row.model} · D = {row.ks_statistic:.2f} · p = {row.p_value:.2g}{null} · "
                    f"alpha {row.alpha:g}"
                    + ("" if pd.isna(row.reason) or not row.reason else f" · {row.reason}"))
