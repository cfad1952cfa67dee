"""Scenarios: the catalogue, each explained; one click runs a scenario and its clean control and
shows them side by side (the seed's three leak patterns come first)."""

from __future__ import annotations

import numpy as np
import streamlit as st

from ..analysis import attention, cross_reads, leaks, runs
from ..catalogue.faults import FAULTS
from ..catalogue.scenarios import SCENARIOS
from ..errors import KvvizError
from ..figures import attention as fig
from ..runners import live
from ..store import RunStore
from .common import (
    EMPTY,
    ENGINE_HELP,
    ENGINES,
    MODELS,
    cross_tenant_warning,
    load_model_or_error,
    open_run,
    reader,
    store,
)

# findings that move no attention weight: a block read across tenants holds the reader's own content, and a
# reply's cached-token count is telemetry; a fault with only these leaves the generated text as it was
SAME_READS = ("cross_tenant", "telemetry_mismatch")
OTHER = {  # what running a catalogue scenario on another engine means
    "transformers": "**In transformers:** its continuous batching runs the scenario's requests as shipped (no kvviz "
                    "fault is injected into it, and it isolates requests with its own paged attention), beside kvviz's "
                    "engine running the same requests clean: what each one shares and what the oracles see in each.",
    "llama.cpp": "**In llama.cpp:** the scenario's requests run through llama.cpp as shipped, scheduled as "
                 "llama-server schedules its slots (no kvviz fault is injected: it isolates requests by its attention "
                 "mask over one unified cache), beside kvviz's engine running the same requests clean. llama.cpp's "
                 "own API misuses are the scenarios listed after the catalogue.",
}


def render() -> None:
    st.title("Scenarios")
    st.caption("Each scenario is a workload with an injected isolation fault and the finding it must raise; "
               "its control is the same workload with correct defences, which must stay clean.")
    c1, c2, c3 = st.columns([3, 1, 1])
    engine = c3.selectbox("Engine", list(ENGINES), key="sc_engine", help=ENGINE_HELP)
    misuses = live.misuse_scenarios() if engine == "llama.cpp" else {}
    names = [*SCENARIOS, *misuses]
    if st.session_state.get("sc_name") not in names:  # a misuse, listed no more once the engine changed
        st.session_state.pop("sc_name", None)
    name = c1.selectbox("Scenario", names, key="sc_name",
                        format_func=lambda n: f"{n}: {(SCENARIOS.get(n) or misuses[n]).title}")
    model = c2.selectbox("Model", MODELS, key="sc_model")
    if name in misuses:
        m = misuses[name]
        st.markdown(f"### {m.title}\n{m.explanation[0].upper()}{m.explanation[1:]}: {m.pattern}.  \n*Marked as "
                    "such:* a mistake in code that drives llama.cpp, made through its API, not a fault of kvviz's "
                    "catalogue. Its control is the same requests with the calls made right.")
        label = "Run it with its control"
    else:
        sc = SCENARIOS[name]
        st.markdown(f"### {sc.title}\n{sc.explanation}")
        if engine in OTHER:
            st.markdown(OTHER[engine])
            label = f"Run it in {engine} and in kvviz's engine"
        elif sc.fault:
            f = FAULTS[sc.fault]
            st.markdown(f"**Fault** `{f.name}` replaces `{f.defence}`: {f.breaks}.  \n*Mirrors:* {f.mirrors}.  \n"
                        f"**Expected finding:** {' or '.join(sc.expected)}")
            label = "Run it with its control"
        else:
            st.markdown("**A clean control:** it must produce no finding.")
            label = "Run it"
    if st.button(label, type="primary", icon=":material/science:", key="sc_go"):
        _run_pair(name, model, engine, misuses)
    pair = st.session_state.get("sc_pair")
    if pair and pair["name"] == name:
        _compare(pair)
    with st.expander("The whole catalogue"):
        st.dataframe([{"scenario": s.name, "fault": s.fault or "(control)", "title": s.title,
                       "expects": ", ".join(s.expected) or "nothing"} for s in SCENARIOS.values()],
                     hide_index=True, width="stretch")


def _plan(name: str, model, engine: str, misuses: dict) -> list[tuple[str, str | None, dict]]:
    """(role, fault, workload) of each run, the control first: the run under study is then the newest, the one
    the inspector opens. A misuse and its control run on llama.cpp; a catalogue scenario on another engine runs
    its requests there as shipped, beside kvviz's engine running them clean."""
    if name in misuses:
        return [("control", None, misuses[name].workload), ("scenario", name, misuses[name].workload)]
    sc, workload = SCENARIOS[name], live.scenario_workload(name, model)
    if engine in OTHER:
        isolation = {"isolation": "paged"} if engine == "transformers" else {}
        other = {**workload, "engine": {**workload["engine"], "backend": engine, **isolation}}
        return [("control", None, workload), (engine, None, other)]
    return ([("control", None, workload)] if sc.fault else []) + [("scenario", sc.fault, workload)]


def _run_pair(name: str, model_name: str, engine: str, misuses: dict) -> None:
    """The scenario's runs (see _plan), each checked before the first starts: a workload one engine cannot run
    (transformers and forks) is refused before anything is recorded."""
    model = load_model_or_error(model_name)
    if model is None:
        return
    plan = _plan(name, model, engine, misuses)
    for _, fault, wl in plan:
        live.check(model, wl, fault)  # a refusal (KvvizError) is shown by the app, and nothing has run
    bar = st.progress(0.0, text="starting...")
    ids: dict[str, str] = {}
    for i, (role, fault, wl) in enumerate(plan):
        def on_step(s: live.LiveStep, role=role, i=i) -> None:
            bar.progress((i + min(1.0, s.tokens / max(1, s.total))) / len(plan),
                         text=f"{role}: step {s.step}, {s.tokens} tokens, {s.findings} findings")
        def on_wait(ahead: int, role=role) -> None:
            bar.progress(0.0, text=f"{role}: {live.waiting_message(ahead)}")

        def on_reference(done: int, n: int, req: str, role=role, i=i) -> None:
            bar.progress((i + done / n) / len(plan), text=f"{role}: {live.comparing_message(done, n, req)}")

        try:
            ids[role] = live.run(store(), model, wl, fault, on_step=on_step, on_wait=on_wait,
                                 on_reference=on_reference,
                                 scenario_name=_recorded_name(name, role, engine)).run_id
        except KvvizError as e:
            if name not in misuses:
                raise
            ids["refused"] = str(e)  # a misuse llama.cpp's own checks refuse: an outcome, said beside the control
    bar.progress(1.0, text="done")
    st.session_state["sc_pair"] = {"name": name, "engine": engine, **ids}
    last = plan[-1][0] if plan[-1][0] in ids else "control"  # a misuse llama.cpp refused has no run to open
    st.session_state["run_id"] = ids[last]  # the inspector, opened next, shows it


def _recorded_name(name: str, role: str, engine: str) -> str:
    """What the Runs page calls each run: beside another engine, kvviz's run is the same requests clean, not a
    fault's control."""
    if role != "control":
        return name
    beside = engine in OTHER and name in SCENARIOS
    return f"{name} on kvviz's engine, beside {engine}" if beside else f"control of {name}"


def _compare(pair: dict) -> None:
    if "refused" in pair:
        st.success(f"llama.cpp refused this misuse: its run failed at {pair['refused']}. llama.cpp's batch check "
                   "wants each sequence's positions to go on from its cells, so the mistake fails loudly instead of "
                   "leaking (the Runs page lists the run as failed). Its control is below.",
                   icon=":material/verified_user:")
    roles = [r for r in ("scenario", "transformers", "llama.cpp", "control") if r in pair]
    subject = roles[0]  # the scenario run, or another engine's run of its requests
    other = subject in OTHER
    with reader() as con:
        gone = [r for r in roles if not RunStore.has_run(con, pair[r])]
    if gone:  # deleted since (Runs page, CLI): said, not a failure of the comparison
        st.warning(f"This comparison's {' and '.join(gone)} run ({', '.join(pair[r] for r in gone)}) is no longer in "
                   "the store: it was deleted. Run the scenario again to compare.", icon=":material/link_off:")
        return
    with reader() as con:
        infos = {r: runs.run_info(con, pair[r]) for r in roles}
        found = {r: leaks.findings(con, pair[r]) for r in roles}
        crossed = {r: cross_reads.sentence(cross_reads.from_store(con, pair[r])) for r in roles}
        shown = ["request_id", "tenant", "cached_tokens", "finish_reason", "text"]  # whose cache served a prompt,
        texts = {r: runs.requests_frame(con, pair[r])[shown] for r in roles}  # why a text ended (or is empty)
        top = found[subject].iloc[0].to_dict() if not found[subject].empty else None
        first = infos[subject].requests[0]
        focus = leaks.focus_of(top) if top else leaks.busiest_focus(con, pair[subject], first)
        layers, heads = attention.grid_shape(con, pair[subject])
        grids = {r: attention.leak_grid(con, pair[r], None, focus.request) for r in roles}
        layer = focus.layer if focus.layer is not None else layers // 2
        views = {r: attention.attention_view(con, pair[r], focus.request, focus.step, layer, attention.HEAD_MEAN,
                                             infos[r].block_size, upto=True,
                                             shared_axis=infos[r].isolation == "masked") for r in roles}
    where = (f"{focus.request} up to step {focus.step}, layer {layer} (mean of heads)"
             + (", where the heaviest finding is" if top and focus.layer is not None else ""))
    weights = [v.weights for v in views.values() if v is not None and np.isfinite(v.weights).any()]
    zmax = max((float(np.nanmax(w)) for w in weights), default=None)  # one colour scale for both panels
    st.subheader("Side by side" if len(roles) == 2 else "Result")
    cols = st.columns(len(roles))
    for col, r in zip(cols, roles, strict=True):
        with col:
            n = len(found[r])
            title = {"control": "kvviz's engine, clean"}.get(r, r) if other else r
            st.markdown(f"#### {title}: `{pair[r]}`")
            st.metric("findings", n)
            if r in OTHER:
                (st.warning if n else st.success)(f"the oracles report {n} finding{'' if n == 1 else 's'} in {r}'s "
                                                  "run" if n else f"clean: {r}'s run has no finding")
            elif r == "scenario" and "control" in roles:
                (st.success if n else st.error)("the detector fired" if n else "the detector missed this fault")
            if r == "control" or "control" not in roles:
                (st.success if not n else st.error)("clean" if not n else "the control is not clean")
            for note in infos[r].notes:
                st.info(note[0].upper() + note[1:] + ".", icon=":material/info:")
            cross_tenant_warning(crossed[r], found[r].kind.isin(["foreign", "stale"]).any())  # beside the heatmap
            v = views[r]
            if v is not None:
                st.plotly_chart(fig.attention_heatmap(v.weights, v.classes, v.query_labels, v.key_labels,
                                                      v.key_owners, where, zmax=zmax), width="stretch",
                                key=f"sc_hm_{r}")
            st.dataframe(texts[r], hide_index=True, width="stretch",
                         column_config={"request_id": "request", "cached_tokens": "prompt tokens from the cache",
                                        "finish_reason": "ended by"}, placeholder=EMPTY)
            if st.button("Open in the inspector", key=f"sc_open_{r}"):
                open_run(pair[r])
    if len(roles) == 2:
        both = texts[subject].merge(texts["control"], on="request_id", suffixes=("", "_control"))
        changed = both.request_id[both.text != both.text_control].tolist()
        if other:
            weights = (" llama.cpp runs the GGUF file's quantised weights, kvviz's engine the float32 weights "
                       "converted from it: their words can differ with no leak at all." if subject == "llama.cpp"
                       else "")
            st.markdown((f"**Generated text:** {', '.join(changed)} wrote something else in {subject} than in "
                         "kvviz's engine." if changed else "**Generated text:** the same in both engines.") + weights)
        else:
            read_alike = not found[subject].empty and found[subject].kind.isin(SAME_READS).all()
            st.markdown(f"**Generated text:** {', '.join(changed)} wrote something else than in the control run."
                        if changed else "**Generated text:** the same as in the control run, as this fault's findings "
                        f"({', '.join(dict.fromkeys(found[subject].kind))}) say no attention weight moved: what was "
                        "read held the same content, only whose it was or what the reply reported changed."
                        if read_alike else "**Generated text:** the same as in the control run: on this model the "
                        "fault did not change what was written, only what was read. The logits moved all the same: the "
                        "inspector's Leaks view compares each request's logits with the request run alone, and a "
                        "request that read foreign keys is listed there as a leak even when its words came out "
                        "the same.")
    if len(roles) == 2 and layers:
        diff = grids[subject].merge(grids["control"], on=["layer", "head"], suffixes=("", "_control"))
        diff["max_foreign"] = diff["max_foreign"] - diff["max_foreign_control"]
        largest = float(np.nanmax(diff.max_foreign.abs())) if diff.max_foreign.notna().any() else 0.0
        if largest == 0:  # a blank grid of every layer and head would only say this, at a screen's height
            st.markdown(f"**Foreign attention mass:** {focus.request}'s is the same as in the control run at every "
                        "layer and head" + (": the keys read across tenants hold the content it would have written "
                                            "itself, so they count as its own" if crossed[subject] else "") + ".")
        else:
            st.plotly_chart(fig.difference_grid(diff[["layer", "head", "max_foreign"]], layers, heads,
                                                title=f"{focus.request}: foreign mass, {subject} minus control "
                                                      "(whole run)"),
                            width="stretch", key="sc_diff")
            st.caption(f"Largest difference: {float(np.nanmax(diff.max_foreign)):.4f}.")
