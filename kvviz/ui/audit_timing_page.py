"""Audit: the paired timing audit of an OpenAI-compatible server (a URL, or a kvviz server started for
it), its samples arriving live as distribution curves, the verdict beside what the server itself
reported of its cache, and past audits side by side."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ..audit_timing import defaults
from ..audit_timing import recorded as audits
from ..audit_timing.probe import TIMED, AuditConfig, AuditResult
from ..audit_timing.telemetry import Telemetry, contradiction, said, tone
from ..audit_timing.verdict import HEADLINES, Verdict, fewest_samples
from ..errors import KvvizError
from ..figures.audit_timing import rank_bars, ttft_ecdf
from ..serve import SHARING
from .common import MODELS, has_db, load_model_or_error, reader, store

LOCAL, REMOTE = "a kvviz server started for the audit", "a server at a URL"
# The command line's defaults (kvviz/audit_timing/defaults.py), set once, then the user's (kept).
DEFAULTS = {"audit_primer": defaults.PRIMER_TOKENS, "audit_samples": defaults.ROUNDS,
            "audit_words": defaults.PROMPT_WORDS, "audit_alpha": defaults.ALPHA}
SETTLE = 0.1  # seconds of quiet after drawing a round, before the next round's first (untimed) primer


def render() -> None:
    st.title("Timing audit")
    st.caption("Does a server share its prompt cache across users? Seen from outside by time to first token, "
               "paired: each round times a prompt you sent just before (a same-user hit: does caching show at "
               "all?), one another user sent just before (a cross-user hit: the test), a fresh one (a miss) and a "
               "null control, each right after an untimed prompt of the same length, then one-sided KS tests of "
               "which come sooner (Gu et al. 2025). Where the server reports its cached tokens, its own count is "
               "read beside the timing. The verdict and every timing are stored with your runs.")
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
    primer = c[0].number_input("Primer max_tokens", 1, 64, key="audit_primer",
                               help="what each untimed primer asks the server to generate (timed requests ask for "
                                    "1): a server may cache nothing of a request that ends in its prefill step")
    samples = c[1].number_input("Rounds", 2, 5000, key="audit_samples",
                                help="each round times a same-user hit, a cross-user hit, a miss, a null control "
                                     f"and a one-word floor. The published protocol uses 250; fewer than "
                                     f"{fewest_samples(alpha_now)} can never reach alpha {alpha_now:g}")
    words = c[2].number_input("Prompt words", 16, 8192, key="audit_words",  # a quarter of the page: no wrap
                              help="the prompt's length in words of one token each (on SmolLM2); the server's own "
                                   "count is checked where it reports it")
    alpha = c[3].number_input("alpha", 1e-15, 0.5, format="%.0e", key="audit_alpha")
    ready = bool(name) or bool(url and model)
    if st.button("Run the audit", type="primary", icon=":material/timer:", key="audit_go", disabled=not ready):
        try:
            _run(name, sharing, url, model, key, int(primer), int(samples), int(words), float(alpha))
        except KvvizError as e:  # said here, not by the app, so that the past audits still show below
            st.error(str(e), icon=":material/error:")
    _past()


def _run(name, sharing, url, model, key, primer, samples, words, alpha) -> None:
    cfg = AuditConfig(base_url=url or "http://127.0.0.1/v1", model=model or "local", samples=samples,
                      prompt_tokens=words, primer_tokens=primer, interval=SETTLE, alpha=alpha,
                      api_key=key or "kvviz-audit")
    bar, chart = st.progress(0.0, text="starting..."), st.empty()

    def between(r: AuditResult) -> None:  # after a round, never during one: drawing is not timed
        done = r.samples[-1].index + 1
        bar.progress(done / samples, text=f"{done} of {samples} rounds timed (two hits, a miss, a null and a floor "
                                          f"each)")
        chart.plotly_chart(ttft_ecdf({k: r.times(k) for k in (*TIMED, "floor")}), key=f"audit_live_{done}")

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
    _verdict(result.judge(), result.telemetry(), what, alpha, primer)
    st.session_state["audit_show"] = [audit_id]  # the audit just run is the one drawn below


def _verdict(v: Verdict, t: Telemetry, what: str, alpha: float, primer: int) -> None:
    """One message, coloured by what it means: sharing across users red, isolation both channels agree
    on green, anything the audit cannot settle amber."""
    m = v.medians_ms
    figures = (f"Median first token {m['same'] or 0:.1f} ms for same-user hits, {m['cross'] or 0:.1f} ms for "
               f"cross-user hits, {m['miss'] or 0:.1f} ms for misses and {m['null'] or 0:.1f} ms for the null "
               f"control, primers of max_tokens {primer}")
    if v.cross.p_value is not None:
        figures += (f"; cross-user hits against misses {v.cross.said()}, same-user {v.same.said()}, null "
                    f"{v.null.said()} (alpha {alpha:g})")
    channel = said(t)
    reason = v.reason  # the advice names the command line's flags: here, the form's fields
    for flag, field in (("--prompt-tokens", "Prompt words"), ("--primer-tokens", "Primer max_tokens")):
        reason = reason.replace(f"({flag})", f"(*{field}*)")
    say = (f"**{HEADLINES[v.verdict]}** on {what}: {reason}. {figures}. Cached tokens: {channel}."
           + (f" **Contradiction**: {found}." if (found := contradiction(v, t)) else ""))
    getattr(st, tone(v, t))(say)


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
                                "same_p_value": st.column_config.NumberColumn("same-user p", format="%.2e"),
                                "null_p_value": st.column_config.NumberColumn("null p-value", format="%.2e"),
                                "median_same_ms": "median same-user ms", "median_cross_ms": "median cross-user ms",
                                "median_miss_ms": "median miss ms", "median_null_ms": "median null ms",
                                "ks_statistic": "KS D", "prompt_words": "prompt words",
                                "server_prompt_tokens": "tokens (server)", "primer_tokens": "primer max_tokens",
                                "telemetry": "cached tokens say", "samples": "rounds", "audit_id": "audit",
                                "alpha": st.column_config.NumberColumn("alpha", format="%.0e")})
    rows = listing.set_index("audit_id")
    st.session_state.setdefault("audit_show", list(rows.index[:1]))  # the newest, or the one just run
    picked = st.multiselect("Side by side", list(rows.index), max_selections=3, key="audit_show",
                            format_func=lambda a: f"{a}: {rows.level[a]} {rows.channel[a]}, {rows.target[a]} "
                                                  f"({rows.verdict[a]})")
    if not picked:
        return
    order = {a for a in picked if rows.channel[a] == "order"}
    with reader() as con:
        drawn = {a: audits.ranks(con, a) if a in order else audits.timings(con, a) for a in picked}
    x_max = max((x for a, t in drawn.items() if a not in order for kind, xs in t.items() if kind != "floor"
                 for x in xs), default=None)
    for col, (audit_id, t) in zip(st.columns(len(picked)), drawn.items(), strict=True):
        row = rows.loc[audit_id]
        title = f"{audit_id}: {row.level} {row.channel}, {row.verdict}"
        col.plotly_chart(rank_bars(t, int(row.dummies), title) if audit_id in order else
                         ttft_ecdf(t, title, x_max=x_max), key=f"audit_past_{audit_id}")
        col.caption(" · ".join(x for x in (row.target, row.model, *_tests(row), f"alpha {row.alpha:g}",
                                           _text(row.contradiction), _text(row.reason)) if x))


def _tests(row: pd.Series) -> list[str]:
    """The tests' figures as a past audit's caption says them (a paired audit's hit is cross-user)."""
    hit = "cross-user " if row.level == "paired" else ""
    statistic = "mean-rank shift (places)" if row.channel == "order" else "D"
    said = [] if pd.isna(row.p_value) else [f"{hit}{statistic} = {row.ks_statistic:.2f}", f"p = {row.p_value:.2g}"]
    if not pd.isna(row.same_p_value):
        said.append(f"same-user p = {row.same_p_value:.2g}")
    if not pd.isna(row.null_p_value):
        said.append(f"null p = {row.null_p_value:.2g}")
    return said


def _text(x) -> str:
    return "" if x is None or pd.isna(x) else str(x)
