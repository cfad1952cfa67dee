"""The Live page: a fleet's KV events as they come, from one monitor that every session of the app
shares (started on publishers the user gives, or on a capture replayed at a chosen speed): the hit
rate and block utilisation against the alert thresholds of the shipped Prometheus rules, crossings
marked, and the counts that should stay at zero."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
import streamlit as st

from ..errors import CaptureError
from ..figures import live as live_fig
from ..monitor.course import SharedMonitor
from ..monitor.service import Feed, publishers
from ..monitor.thresholds import thresholds
from ..runners.uploads import example_capture

ZEROS = (("cross_tenant_blocks", "cross-tenant blocks", "block hashes two named tenants stored or hit"),
         ("breaches", "contract breach occurrences", "each occurrence of one of kvviz lint's kinds, as the stream "
          "arrives (kvviz lint and the capture views group the occurrences by kind and replica)"),
         ("lost", "lost messages", "sequence numbers no replay filled"),
         ("invalid", "invalid messages", "messages that did not decode"))


@st.cache_resource
def shared() -> SharedMonitor:
    """The one monitor of this app, for every session."""
    return SharedMonitor()


def render() -> None:
    st.title("Live")
    st.caption("A fleet's KV-cache events as they come: `kvviz monitor` inside the app, one for every user of it "
               "(docs/monitoring.md). The alert thresholds are those of the Prometheus rules kvviz ships.")
    live = shared()
    _controls(live)
    _figures()


def _controls(live: SharedMonitor) -> None:
    with st.expander("What to follow", expanded=not live.running()):
        source = st.radio("Source", ["A capture replayed", "Publishers"], horizontal=True, key="live_source")
        if source == "Publishers":
            endpoints = st.text_area("Endpoints, one a line: [NAME=]tcp://HOST:5557", key="live_endpoints")
            replays = st.text_area("Replay endpoints (optional), one a line: [NAME=]tcp://HOST:5558",
                                   key="live_replays")
        else:
            path = st.text_input("A capture-vllm JSONL capture (empty: the synthetic example fleet)", key="live_path")
            speed = st.number_input("Speed (times as fast as published; 0: as fast as it goes)", min_value=0.0,
                                    value=1.0, key="live_speed")
        capacity = st.number_input("KV blocks per replica (for utilisation; 0: not known)", min_value=0, value=0,
                                   key="live_capacity")
        if st.button("Start", key="live_go", type="primary", help="in place of what is followed now"):
            try:
                feed = (publishers(_lines(endpoints), _lines(replays)) if source == "Publishers" else
                        Feed(capture=_capture(path), speed=speed))
            except CaptureError as e:  # said under the button; what was followed goes on
                st.error(str(e))
            else:
                live.start(feed, {"*": int(capacity)} if capacity else None)
    if st.button("Stop", key="live_stop", disabled=not live.running()):  # outside: the expander folds while running
        live.stop()


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _capture(path: str) -> Path:
    if not path.strip():
        return example_capture(Path(tempfile.gettempdir()) / "kvviz")
    if not Path(path).is_file():
        raise CaptureError(f"{path}: no such file")
    return Path(path)


def _said(live: SharedMonitor) -> bool:
    """What the monitor follows and how far it got; False where there is nothing to draw (a feed that
    failed before its first message, publishers none of which has answered)."""
    feed, monitor = live.feed, live.monitor
    following = (f"{len(feed.sources)} publisher{'s' if len(feed.sources) != 1 else ''}" if feed.sources else
                 f"{feed.capture.name} at {'full speed' if not feed.speed else f'{feed.speed:g}x'}")
    figures = monitor.snapshot().replicas.values() if monitor is not None else []
    fed = sum(f.messages for f in figures)
    messages = f"{fed:,} message{'s' * (fed != 1)}"
    if live.running() and feed.sources:
        up = sum(f.connected for f in figures)
        st.write(f"The app's monitor is following {following}: {up} connected, {messages} so far.")
        if not up and not fed:
            st.warning("No publisher has answered yet: kvviz keeps trying (a server whose KV events are off, or "
                       "an address or port that is wrong, never answers). Nothing to draw until one does.",
                       icon=":material/cloud_off:")
            return False
    elif live.running():
        st.write(f"The app's monitor is following {following}.")
    elif monitor is not None and monitor.ended == "failed":
        st.error(f"The app's monitor stopped following {following} after {messages}: {monitor.error}")
        return bool(fed)
    elif monitor is not None and monitor.ended == "finished":
        st.write(f"The app's monitor replayed all of {following}: {messages}.")
    else:
        st.write(f"The app's monitor stopped following {following} (Stop pressed).")
    return True


@st.fragment(run_every=1.0)
def _figures() -> None:
    live = shared()
    if live.feed is None:
        st.info("Nothing followed yet: give publishers or a capture above and press Start.")
        return
    feed, monitor = live.feed, live.monitor
    if not _said(live):
        return
    course = pd.DataFrame(list(live.course))
    if course.empty:
        st.info("The first figures come within a second.")
        return
    limits = {t.figure: (t.above, t.value) for t in thresholds()}
    last = course.iloc[-1]
    cols = st.columns(2 + len(ZEROS))
    for col, (field, name) in zip(cols, (("hit_ratio", "hit rate"), ("utilisation", "block utilisation")),
                                  strict=False):
        value, when = last[field], None
        if (value is None or pd.isna(value)) and course[field].notna().any():  # a second without stores (a replay
            seen = course[course[field].notna()].iloc[-1]  # that ended, a quiet fleet): the last rate, said as such
            value, when = seen[field], pd.Timestamp(seen.t, unit="s").strftime("%H:%M:%S UTC")
        above, limit = limits[field]
        past = value is not None and not pd.isna(value) and bool(live_fig.crossed(pd.Series([value]), above,
                                                                                    limit).iloc[0])
        unknown = "not reported" if field == "hit_ratio" and not last.hits_reported else "-"
        col.metric(name, unknown if value is None or pd.isna(value) else f"{value:.0%}",
                   delta=f"past the alert threshold ({'over' if above else 'under'} {limit:.0%})" if past else None,
                   delta_color="inverse" if past else "off",
                   help=("Hit tokens of the tokens stored in the last second (the capture views give a whole "
                         "capture's; the alert rule takes 5 minutes). " if field == "hit_ratio" else "")
                   + f"The alert fires {'over' if above else 'under'} {limit:.0%} (kvviz/monitor/rules.yml)"
                   + (". No hit has been published: vLLM reports hits only with kv_cache_report_mode=\"full\", so "
                      "the events cannot tell what the cache served" if unknown != "-" else "")
                   + (f". Nothing was stored in the last second: this is the rate of the last second that stored, at "
                      f"{when}" if when else ""))
        if when:
            col.caption(f"as of {when}: nothing stored since")
        if field == "utilisation" and value is not None and not pd.isna(value) and value > 1:
            col.caption("more blocks held than the capacity given: each replica holds more than that")
    for col, (field, name, what) in zip(cols[2:], ZEROS, strict=True):
        n = int(last[field])
        col.metric(name, f"{n:,}", delta="should be 0" if n else None, delta_color="inverse" if n else "off",
                   help=what)
    st.plotly_chart(live_fig.course(course, limits), width="stretch", key="live_course")
    figures = monitor.snapshot().replicas if monitor is not None else {}
    st.dataframe(pd.DataFrame([{"replica": name, "messages": f.messages, "lost": f.lost, "invalid": f.invalid,
                                "restarts": f.restarts, "followed" if feed.capture else "connected": f.connected,
                                "cross-tenant blocks": f.cross_tenant_blocks,
                                "mean lag s": f.lag_sum_s / f.lag_count if f.lag_count else None}
                               for name, f in figures.items()]), hide_index=True, key="live_replicas")
