"""What every page shares: where the database is, a safe read, the model cache, the current run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pandas as pd
import streamlit as st

from ..analysis import cross_reads, runs
from ..errors import ModelError
from ..store import RunStore, StoreError

MODELS = ("smollm2", "tiny-llama", "tiny-gpt2")
EMPTY = "—"  # a missing value in a table (st.dataframe says "None", which reads as a name)
ENGINES = {"kvviz": "kvviz's engine", "transformers": "transformers' continuous batching",
           "llama.cpp": "llama.cpp"}  # engine.backend
KERNELS = {"transformers": ("eager_paged", "sdpa_paged"), "llama.cpp": ("eager_paged", "flash_attn")}  # engine.kernel
KERNEL_HELP = ("eager_paged computes the attention weights and hands them over as they are (transformers' eager "
               "kernel; llama.cpp's KQ, softmax, KQV); sdpa_paged (torch's SDPA) and flash_attn (llama.cpp's flash "
               "attention) return none, so kvviz recomputes them in float32 from the kernel's own inputs and mask "
               "and checks its output against theirs at every layer (a kernel_mismatch finding past the tolerance)")
# engine.isolation each engine runs, its default first
ISOLATIONS = {"kvviz": ("paged", "masked"), "transformers": ("paged",), "llama.cpp": ("masked", "streams")}
ISOLATION_HELP = ("paged: each request gathers its own slots through its page table. masked: every live slot on one "
                  "key axis, the attention mask the only wall (llama.cpp: one unified cache of cells, kv_unified). "
                  "streams: llama.cpp with kv_unified off, a buffer of cells per sequence: nothing is shared between "
                  "sequences, a request reuses only its own slot's cells")
EVICTIONS = ("lru", "lfu", "seed", "newcomer")  # engine.eviction: kvviz's engine's pool
EVICTION_HELP = ("Which free cached block kvviz's pool reuses first when it needs room. lru: the least recently "
                 "used, as vLLM's free queue. lfu: the least used since cached. seed: the seed article's advice, read "
                 "as a radix tree reads it: only blocks no cached block continues, the shortest prefixes first. "
                 "newcomer: LRU in which a block never seen before enters cold, as if used a cache's length ago. The "
                 "inspector's What if view predicts each one's hits on any run")
# the engine pickers show the short names (ENGINES' long ones are cut in a narrow column); the help says the rest
ENGINE_HELP = ("kvviz: kvviz's own paged engine. transformers: Hugging Face transformers' own continuous batching "
               "(its scheduler, paged cache and attention, as generate_batch runs them) observed by kvviz's oracles: "
               "it has no cache salt (tenants share prefix blocks, reported as cross-tenant reads) and runs no fork, "
               "resumed session, adapter, masked isolation, host tier, disaggregation or kvviz fault. llama.cpp: "
               "llama.cpp through its C API on the model's GGUF file (smollm2 as it ships, quantised; tiny-llama), "
               "scheduled as llama-server schedules its slots: every request's cells in one unified cache, isolated "
               "by its attention mask, prefixes shared by seq_cp (or a stream per sequence: isolation streams); "
               "no salt, adapter, host tier, disaggregation or "
               "kvviz fault (its own API misuses instead)")


@dataclass(frozen=True)
class PageSpec:
    url: str
    title: str
    icon: str

    @property
    def path(self) -> str:
        """The page script, relative to app.py."""
        return f"kvviz/ui/pages/{self.url}.py"


PAGES = {p.url: p for p in (
    PageSpec("home", "Home", ":material/home:"),
    PageSpec("run", "Run", ":material/play_arrow:"),
    PageSpec("inspector", "Inspector", ":material/grid_view:"),
    PageSpec("scenarios", "Scenarios", ":material/science:"),
    PageSpec("runs", "Runs", ":material/list:"),
    PageSpec("upload", "Upload", ":material/upload:"),
    PageSpec("sql", "SQL", ":material/database:"),
    PageSpec("audit", "Audit", ":material/timer:"),
    PageSpec("live", "Live", ":material/monitor_heart:"),
)}


# Value widgets whose state outlives a visit to another page. Streamlit drops a widget's state after a
# run that does not draw it; setting it again each run keeps it. (Buttons, uploaders, editors and chart
# selections cannot be set this way and are not listed.)
KEPT_WIDGETS = {"run_model", "run_model_path", "run_source", "run_scenario", "sql_text", "sc_name", "sc_model",
                "sc_engine",
                "insp_view", "insp_upto", "insp_grid_scope", "insp_colour_by", "insp_layer", "insp_head",
                "insp_request", "insp_step", "insp_block", "audit_target", "audit_model", "audit_sharing",
                "audit_url", "audit_remote_model", "audit_level", "audit_samples", "audit_words", "audit_alpha"}
# the Run page's settings, one set per scenario
KEPT_PREFIXES = ("run_bs_", "run_nb_", "run_mbt_", "run_iso_", "run_pc_", "run_host_", "run_dis_", "run_be_",
                 "run_fault_", "run_fs_", "run_fr_", "run_fl_", "run_att_", "run_seed_", "run_alert_")


def keep_widget_state() -> None:
    for key in list(st.session_state):
        if isinstance(key, str) and (key in KEPT_WIDGETS or key.startswith(KEPT_PREFIXES)):
            st.session_state[key] = st.session_state[key]


def store() -> RunStore:
    """The process's one store for $KVVIZ_DB (or runs/kvviz.duckdb), shared by every session."""
    return RunStore.open()


def db_path() -> Path:
    return store().path


def has_db() -> bool:
    return store().exists()


@contextmanager
def reader() -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection for this render; a store that cannot be read stops the page with why."""
    with ExitStack() as stack:
        try:
            con = stack.enter_context(store().read())
        except StoreError as e:
            st.error(f"Cannot read the run store {db_path()}: {e}", icon=":material/error:")
            st.stop()
        yield con


@st.cache_resource(show_spinner="Loading the model (the first load of smollm2 converts its weights, ~20 s)...")
def model(name: str):
    """One copy of each model per process, shared by every session. The engine (torch, transformers:
    seconds to import) is imported here, when a page first needs a model, not when the app starts."""
    from ..runners import live

    return live.model(name)


def load_model_or_error(name: str):
    try:
        return model(name)
    except ModelError as e:
        st.error(f"Cannot load model {name!r}: {e}", icon=":material/error:")
        return None


def open_run(run_id: str) -> None:
    """Make run_id the inspected run and go to the inspector."""
    st.session_state["run_id"] = run_id
    st.session_state.pop("insp_gone", None)  # a link to a run that is there: no earlier missing one to say
    st.switch_page(PAGES["inspector"].path)


BREACHES = st.column_config.NumberColumn(
    "breach kinds", help="A capture's breaches of the KV-event contract found on import, counted as kinds on "
    "each replica, advisory ones aside (the inspector counts every occurrence): its hit rate, occupancy or tenant "
    "counts are distorted by them (the inspector says which). 0: clean; empty: not a capture linted on import.")


def runs_or_hint():
    """The runs table, newest first, or None after saying how to make a first run."""
    if has_db():
        with reader() as con:
            listing = runs.list_runs(con)
        if not listing.empty:
            return listing
    empty_store_hint()
    return None


def empty_store_hint() -> None:
    st.info("No runs yet. Run a scenario (Scenarios page), run a workload (Run page), upload a trace or a "
            "vLLM/SGLang capture (Upload page), or from a shell:", icon=":material/lightbulb:")
    st.code(f"python -m kvviz run --scenario boundary --model tiny-llama --db {db_path()}", language="bash")


def cross_tenant_warning(sentence: str | None, foreign_too: bool) -> None:
    """Say the cross-tenant reads (nothing when none), and why they move no leak figure beside them; when the
    run leaked as well (`foreign_too`), that its figures count the other keys."""
    if sentence:
        st.warning(f"**{sentence}.** {cross_reads.why(foreign_too)}", icon=":material/domain_disabled:")


CROSSED = "hits_cached_under"  # the evidence of a cross-tenant hit: a column of its own, not the evidence's tail


def lookups_table(found: list) -> pd.DataFrame:
    """Explained lookups (analysis.explain's Explanation) as the Cache and capture views list them; where
    a hit came from blocks cached under another tenant, whose, in a column beside the hit tokens."""
    table = pd.DataFrame([{"request": e.request, "step": e.step, "hit tokens": e.hit_tokens,
                           "hits cached under": e.evidence.get(CROSSED), "stopped at block": e.stop_block,
                           "reason": e.reason,
                           "evidence": evidence_text({k: v for k, v in e.evidence.items() if k != CROSSED},
                                                     none_cached=not e.hit_tokens)}
                          for e in found], columns=["request", "step", "hit tokens", "hits cached under",
                                                    "stopped at block", "reason", "evidence"])
    return table if table["hits cached under"].notna().any() else table.drop(columns="hits cached under")


EVIDENCE = {"before": "{} steps before this lookup",
            "tokens_after": "{} prompt tokens after the cached ones (computed: a block not full, or the last token)"}
NONE_CACHED = {"tokens_after": "{} prompt tokens, none of them in a whole block it could reuse (computed: a block "
                               "not full, or the last token)"}


def evidence_text(evidence: dict, none_cached: bool = False) -> str:
    """A lookup's evidence as a reader says it (explain's keys are terse for JSON); `none_cached`: the
    lookup hit nothing, so no tokens are 'after the cached ones'."""
    words = EVIDENCE | NONE_CACHED if none_cached else EVIDENCE
    return ", ".join(words[k].format(v) if k in words else f"{k.replace('_', ' ')} {v}"
                     for k, v in evidence.items())
