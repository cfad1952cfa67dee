"""The inspector: one run at one step, as a block map, attention, leaks, its prefix cache and
requests (or, for an imported KV-event capture, a time range and its cache's activity in it)."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from ..analysis import blocks, cross_reads, leaks, runs
from ..analysis.runs import RunInfo
from ..store import RunStore
from . import inspect_attention, inspect_blocks, inspect_cache, inspect_capture, inspect_leaks, inspect_whatif
from .common import ENGINES, cross_tenant_warning, db_path, reader, runs_or_hint

ENGINE_VIEWS = ("Blocks", "Attention", "Leaks", "Cache", "Requests", "What if")
TICK_S = 0.8  # play: seconds per step
FOLLOW_S = 2.0  # a run being recorded: seconds between looks for new steps
MANY_STEPS = 2000  # past this, the step slider is a plain range: a list of every step would go to the browser


def render() -> None:
    st.title("Inspector")
    listing = runs_or_hint()
    if listing is None:
        return
    run_id = _choose_run(listing)
    with reader() as con:
        info = runs.run_info(con, run_id)
        if info.steps and st.session_state.get("insp_for") != run_id:
            _reset(con, info)
        crossed = cross_reads.sentence(cross_reads.from_store(con, run_id))
    _header(listing[listing.run_id == run_id].iloc[0], info, crossed)
    if not info.steps:
        st.warning("This run has no recorded steps (yet): it failed before its first step, or it is still "
                   "recording its first steps.", icon=":material/hourglass_empty:")
        return
    if info.has_kv_events:  # a capture: a time range, not steps to play
        inspect_capture.render(info)
        return
    playing = st.session_state.get("insp_playing", False)
    st.fragment(run_every=TICK_S if playing else None)(_step_views)(info, playing)


def _when(created) -> str:
    """A run's creation time as the picker says it (to the second: a scenario and its control are seconds
    apart), or nothing for a run that has none."""
    return "" if created is None or pd.isna(created) else pd.Timestamp(created).strftime(" · %Y-%m-%d %H:%M:%S")


def _choose_run(listing) -> str:
    """The run a link asked for (another page's "Open in the inspector", or the URL's ?run=), else the
    newest; a link to a run the store does not hold is said, not swapped silently for another run."""
    ids = list(listing.run_id)
    asked = st.session_state.get("run_id") or st.query_params.get("run")
    current = asked if asked in ids else ids[0]
    if asked and asked not in ids:
        st.session_state["insp_gone"] = (asked, current)  # said until the user picks a run
    st.session_state["insp_run"] = current
    labels = {r.run_id: f"{r.run_id} · {r.scenario or 'workload'}"
              + ("" if r.model in runs.CAPTURE_MODELS else f" · {r.engine} · fault {r.fault or 'none'}")
              + f" · {r.status}" + _when(r.created_at)  # two runs of one scenario differ by when
              for r in listing.itertuples()}

    def chosen() -> None:
        st.session_state["run_id"] = st.session_state["insp_run"]
        st.session_state.pop("insp_gone", None)

    st.selectbox("Run", ids, format_func=labels.get, key="insp_run", on_change=chosen)
    gone = st.session_state.get("insp_gone")
    if gone and gone[1] == current:
        st.warning(f"Run {gone[0]} is not in the store: it was deleted, or never recorded in {db_path()}. "
                   f"Showing run {current} instead.", icon=":material/link_off:")
    else:
        st.session_state.pop("insp_gone", None)  # the user went on to another run
    st.session_state["run_id"] = current
    st.query_params["run"] = current
    return current


def _reset(con, info: RunInfo) -> None:
    """A run just opened: start where its first finding is (so playing on shows what follows), or, in a
    clean run, where the pool was fullest (a run ends by freeing its blocks); the page says which and why."""
    first = leaks.first_finding(con, info.run_id)
    views = inspect_capture.VIEWS if info.has_kv_events else ENGINE_VIEWS
    st.session_state.update(insp_for=info.run_id, insp_block=None, insp_playing=False, insp_layer=None,
                            insp_head=None, insp_position=None, insp_view=views[0])
    if first is not None and info.has_blocks:
        f = leaks.focus_of(first)
        focus(f, view=ENGINE_VIEWS[0])
        where = f" at layer {f.layer}, head {f.head}" if f.layer is not None and f.head is not None else ""
        why = (f"the first step with a finding ({first['kind']}, request {f.request}{where}); the Leaks view lists "
               "every finding and goes to the heaviest")
    else:
        busiest = blocks.busiest_step(con, info.run_id) if info.has_blocks else None
        st.session_state.update(insp_step=info.steps[-1] if busiest is None else busiest,
                                insp_request=info.requests[0] if info.requests else None)
        none = ": no finding yet (a run's are written when it ends)" if info.recording else ": this run has no finding"
        why = ("the last step" if busiest is None else "where the most blocks were in use") + (
            none if first is None else "")
    st.session_state["insp_opened"] = (st.session_state["insp_step"], why)


def focus(f: leaks.Focus, view: str | None = None) -> None:
    """Point the inspector at a finding's step, request, layer and head."""
    st.session_state.update(insp_step=f.step, insp_request=f.request, insp_position=f.position)
    if f.layer is not None and f.head is not None:
        st.session_state.update(insp_layer=f.layer, insp_head=f.head)
    if view:
        st.session_state["insp_view"] = view


def _header(row, info: RunInfo, cross_tenant: str | None) -> None:
    # names as text, which wraps (fault and model names are too long for a metric tile), numbers as tiles
    fault = "" if info.has_kv_events else f" · fault `{row.fault or 'none'}`"  # a capture's server had no injected one
    engine = (f" · engine: {ENGINES.get(info.backend, info.backend)}, {info.isolation} isolation" if info.backend
              else "")
    st.markdown(f"**{row.status}** · model `{row.model}`{engine}{fault}")
    if info.backend == "transformers":
        st.caption("transformers' own continuous batching ran this run (its scheduler, paged cache, block ledger and "
                   "paged attention, unchanged); kvviz observed it: the pool is transformers' blocks (its reserved "
                   "trash blocks last), page tables its block tables, refcounts and hashes its ledger's.")
    if info.backend == "llama.cpp":
        layout = "a buffer of cells per sequence" if info.isolation == "streams" else "its unified KV cache"
        st.caption(f"llama.cpp ran this run through its C API ({layout}, its masks and attention, "
                   f"unchanged), scheduled as llama-server schedules its slots; kvviz observed it: the pool is the "
                   f"cache's cells in blocks of {info.block_size}, a block's refcount how many running requests hold "
                   "cells in it (they share a cell only where the cell's sequences say so: click a block for what "
                   "its cells hold), a cached block one only an idle slot still holds (kept for the next request "
                   "that shares it), and the attention is every cell on llama.cpp's key axis.")
    if info.engine.get("kernel") in ("sdpa_paged", "flash_attn"):
        st.caption(f"Kernel {info.engine['kernel']} returns no weights: the attention shown is kvviz's float32 "
                   "recomputation from the kernel's own inputs and mask, checked against its output at every layer "
                   "(kernel_mismatch findings past the tolerance).")
    for note in info.notes:
        st.info(note[0].upper() + note[1:] + ".", icon=":material/info:")
    cols = st.columns(3)
    cols[0].metric("messages" if info.has_kv_events else "steps", f"{len(info.steps):,}",
                   help="KV-event messages (batches) the capture holds" if info.has_kv_events else None)
    cols[1].metric("findings", "-" if pd.isna(row.findings) else int(row.findings))
    cols[2].metric("max foreign mass", "-" if pd.isna(row.max_foreign_mass) else f"{row.max_foreign_mass:.4f}")
    cross_tenant_warning(cross_tenant, not pd.isna(row.max_foreign_mass) and row.max_foreign_mass > 0)
    if info.fault_scope:
        scope = info.fault_scope
        beyond = scope.get("steps") and info.steps and min(scope["steps"]) > info.steps[-1]
        st.caption(f"The fault was confined to {runs.scope_text(scope)}."
                   + (f" The run ended at step {info.steps[-1]}: **the fault never struck**, so no finding is "
                      "expected." if beyond else ""))
    if info.recording:
        st.warning("This run is still being recorded, or its process died: showing the steps stored so far.",
                   icon=":material/pending:")
        if st.toggle("Follow it: refresh as steps arrive", key="insp_follow"):
            st.fragment(run_every=FOLLOW_S)(_follow)(info.run_id, len(info.steps))
    elif row.status == "failed":
        st.error(f"This run failed: {row.error}. The steps recorded before the failure are shown.",
                 icon=":material/error:")


def _follow(run_id: str, seen: int) -> None:
    """Rerun the page when the recorder has stored more steps or the run has ended."""
    with reader() as con:
        status, steps = con.execute("SELECT status, (SELECT count(*) FROM steps WHERE run_id = ?) FROM runs "
                                    "WHERE run_id = ?", [run_id, run_id]).fetchone()
    if status != runs.RUNNING or steps != seen:
        st.rerun(scope="app")


def _toggle_play(steps: list[int]) -> None:
    playing = not st.session_state.get("insp_playing", False)
    st.session_state["insp_playing"] = playing
    st.session_state["insp_tick"] = time.monotonic()
    if playing and st.session_state.get("insp_step") == steps[-1]:
        st.session_state["insp_step"] = steps[0]


def _step_views(info: RunInfo, playing: bool) -> None:
    with reader() as con:
        if not RunStore.has_run(con, info.run_id):  # this fragment reruns alone: the run may be gone since
            st.warning(f"Run {info.run_id} is no longer in the store: another session or a script deleted it.",
                       icon=":material/delete:")
            return
    steps = info.steps
    if st.session_state.get("insp_playing", False) != playing:
        st.rerun(scope="app")  # start or stop the timer that reruns this fragment
    if st.session_state.get("insp_step") not in steps:
        st.session_state["insp_step"] = steps[-1]
    if playing and time.monotonic() - st.session_state.get("insp_tick", 0.0) >= TICK_S * 0.9:  # a timer tick
        st.session_state["insp_tick"] = time.monotonic()
        i = steps.index(st.session_state["insp_step"])
        if i + 1 < len(steps):
            st.session_state["insp_step"] = steps[i + 1]
        else:
            st.session_state["insp_playing"] = False
            st.rerun(scope="app")
    left, right = st.columns([6, 1])
    with left:
        label = f"Step (numbered from {steps[0]}: {len(steps)} steps)"  # a run's "12 steps" end at step 11
        if steps[-1] - steps[0] + 1 != len(steps):  # idle steps (no request yet, one cancelled) record nothing
            label = f"Step ({len(steps)} steps recorded, {steps[0]} to {steps[-1]}: a step no request ran is skipped)"
        if len(steps) > MANY_STEPS and steps[-1] - steps[0] + 1 == len(steps):  # a long run: a number range,
            st.slider(label, steps[0], steps[-1], key="insp_step")  # not a list of every step for the browser
        elif len(steps) > 1:
            st.select_slider(label, steps, key="insp_step")
        else:
            st.caption(f"step {steps[0]} (the only step)")
        opened = st.session_state.get("insp_opened")
        if opened and opened[0] == st.session_state["insp_step"]:  # why here, until the user moves on
            st.caption(f"Opened at step {opened[0]}, {opened[1]}.")
    with right:
        st.button("Pause" if playing else "Play", icon=":material/pause:" if playing else ":material/play_arrow:",
                  key="insp_play", disabled=len(steps) < 2, on_click=_toggle_play, args=(steps,))
    if st.session_state.get("insp_view") not in ENGINE_VIEWS:
        st.session_state["insp_view"] = ENGINE_VIEWS[0]
    view = st.segmented_control("View", ENGINE_VIEWS, key="insp_view", label_visibility="collapsed") or ENGINE_VIEWS[0]
    step = st.session_state["insp_step"]
    if view == "What if":  # writes what it computes: no reader held
        inspect_whatif.render(info)
        return
    with reader() as con:
        if view == "Blocks":
            inspect_blocks.render(con, info, step)
        elif view == "Attention":
            inspect_attention.render(con, info, step)
        elif view == "Leaks":
            inspect_leaks.render(con, info, step, focus)
        elif view == "Cache":
            inspect_cache.render(con, info, step)
        else:
            inspect_leaks.render_requests(con, info)
