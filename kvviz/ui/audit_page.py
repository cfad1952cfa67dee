"""Audit: the cross-tenant timing audit of an OpenAI-compatible server (a URL, or a kvviz server
started for it), its samples arriving live as distribution curves, the verdict, and past audits
side by side."""

from __future__ import annotations

import time

import streamlit as st

from ..analysis import audits
from ..audit_timing import LEVELS, AuditConfig, AuditResult, ks_test
from ..figures.audit import ttft_ecdf
from ..serve import SHARING
from .common import MODELS, has_db, load_model_or_error, reader, store

LOCAL, REMOTE = "a kvviz server started for the audit", "a server at a URL"
DEFAULTS = {"audit_samples": 32, "audit_words": 256, "audit_alpha": 1e-8}  # set once, then the user's (kept)


def render() -> None:
    st.title("Timing audit")
    st.caption("Does a server share its prompt cache across users? Seen from outside by time to first token: a "
               "fresh prompt (a miss) against one sent just before (a hit), then a one-sided KS test that hits "
               "come sooner (Gu et al. 2025). The verdict and every timing are stored with your runs.")
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
    c = st.columns(4)
    level = c[0].selectbox("Level", LEVELS, key="audit_level",
                           help="global: another user with another API key sends the hit's prompt first; "
                                "per-user: the same user does")
    samples = c[1].number_input("Samples a side", 2, 5000, key="audit_samples",
                                help="the published protocol uses 250. At alpha 1e-8 at least 15 are needed, and "
                                     "then only complete separation detects: a few slow hits on a busy machine "
                                     "turn the verdict")
    words = c[2].number_input("Prompt length (words, about a token each)", 16, 8192, key="audit_words")
    alpha = c[3].number_input("alpha", 1e-15, 0.5, format="%.0e", key="audit_alpha")
    ready = bool(name) or bool(url and model)
    if st.button("Run the audit", type="primary", icon=":material/timer:", key="audit_go", disabled=not ready):
        _run(name, sharing, url, model, key, level, int(samples), int(words), float(alpha))
    _past()


def _run(name, sharing, url, model, key, level, samples, words, alpha) -> None:
    cfg = AuditConfig(url or "http://127.0.0.1/v1", model or "local", level, samples, words, alpha=alpha,
                      api_key=key or "kvviz-audit")  # a refusal (KvvizError) is shown by the app
    bar, chart, last = st.progress(0.0, text="starting..."), st.empty(), [0.0]

    def progress(r: AuditResult) -> None:
        done = len(r.samples)
        bar.progress(done / (2 * samples), text=f"{done} of {2 * samples} requests timed")
        if time.monotonic() - last[0] > 0.5 or done == 2 * samples:
            last[0] = time.monotonic()
            chart.plotly_chart(ttft_ecdf(r.times("hit"), r.times("miss")), key=f"audit_live_{done}")

    if name is not None:
        m = load_model_or_error(name)
        if m is None:
            return
        audit_id, result = audits.audit_local(store(), m, sharing, cfg, progress)
        what = f"a kvviz server on {name} with cache sharing {sharing}"
    else:
        audit_id, result = audits.audit_url(store(), cfg, progress)
        what = url
    v = result.verdict()
    bar.progress(1.0, text=f"done: audit {audit_id}")
    say = (f"**{'Detected' if v['detected'] else 'Not detected'}** at the {level} level on {what}: median first "
           f"token {v['median_hit_ms']:.1f} ms for hits and {v['median_miss_ms']:.1f} ms for misses, KS D = "
           f"{v['ks_statistic']:.2f}, p = {v['p_value']:.2g} (alpha {alpha:g}).")
    (st.error if v["detected"] and level == "global" else st.success if not v["detected"] else st.info)(say)
    st.session_state["audit_show"] = [audit_id]  # the audit just run is the one drawn below


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
                                "median_hit_ms": "median hit ms", "median_miss_ms": "median miss ms",
                                "ks_statistic": "KS D", "prompt_words": "prompt words"})
    rows = listing.set_index("audit_id")
    picked = st.multiselect("Side by side", list(rows.index), default=list(rows.index[:1]), max_selections=3,
                            key="audit_show", format_func=lambda a: f"{a}: {rows.level[a]} level, {rows.target[a]} "
                                                                  f"({'detected' if rows.detected[a] else 'not'})")
    if not picked:
        return
    for col, audit_id in zip(st.columns(len(picked)), picked, strict=True):
        row = rows.loc[audit_id]
        with reader() as con:
            hit, miss = audits.timings(con, audit_id)
        d, _ = ks_test(hit, miss)
        col.plotly_chart(ttft_ecdf(hit, miss, f"{audit_id}: {row.level}, {'detected' if row.detected else 'not'}"),
                         key=f"audit_past_{audit_id}")
        col.caption(f"{row.target} · {row.model} · D = {d:.2f} · p = {row.p_value:.2g}")
