"""The inspector's Cache view of an engine run: why each prefix-cache lookup stopped where it did,
the hit rate over steps, and how long cached blocks lived before eviction."""

from __future__ import annotations

import streamlit as st

from ..analysis import cache_stats
from ..analysis.explain import Explanation, explain_run
from ..analysis.explained import kept, read_kept
from ..analysis.runs import RunInfo
from ..errors import StoreError
from ..figures import cache as cache_fig
from .common import db_path, lookups_table


def render(con, info: RunInfo, step: int) -> None:
    found = read_kept(con, info.run_id) if kept(con, info.run_id) else _worked_out(con, str(db_path()), info.run_id,
                                                                                    info.status, len(info.steps))
    if not found:
        st.info("This run recorded no prefix-cache lookups (it was recorded before kvviz kept them).",
                icon=":material/info:")
        return
    rates = cache_stats.hit_rates(con, info.run_id)
    lives = cache_stats.lifetimes(con, info.run_id)
    looked, served = int(rates.tokens.sum()), int(rates.hit_tokens.sum())
    evicted = lives[lives.removed_step.notna()]
    c = st.columns(4)
    c[0].metric("lookups", len(found))
    c[1].metric("hit rate (tokens)", f"{served / looked:.0%}" if looked else "-", help=f"{served} of {looked}")
    c[2].metric("blocks cached, whole run", len(lives), help="every time a block entered the prefix cache (one "
                "cached again after an eviction counts again); the block map shows what is cached at one step")
    c[3].metric("evicted", len(evicted))
    st.caption("The tiles count the whole run; the chart marks the step shown, and the table lists the lookups "
               "up to it.")
    (lied,) = con.execute("SELECT count(*) FROM findings WHERE run_id = ? AND kind = 'telemetry_mismatch'",
                          [info.run_id]).fetchall()[0]
    if lied:
        st.warning(f"These lookups are the engine's own counts, which its replies report, and {lied} "
                   f"request{'s were' if lied > 1 else ' was'} served cached K/V they do not count "
                   "(telemetry_mismatch): the hit rate and the reasons here leave those tokens out. The Leaks "
                   "view says what was served and whose it was.", icon=":material/receipt_long:")
    st.plotly_chart(cache_fig.hit_rate(rates, current=step, steps=(info.steps[0], info.steps[-1])), width="stretch",
                    key="insp_hits")
    table = lookups_table(found)
    if info.backend == "llama.cpp":  # prefixes of any length, not whole blocks: block reasons would contradict them
        table = table[["request", "step", "hit tokens"]]
        st.caption("Each request's admission, up to the step shown: how many of its prompt tokens llama.cpp's cells "
                   "already held. llama.cpp reuses cells, not blocks: the longest prefix the request shares with a "
                   "sequence llama.cpp holds (a running request's or an idle slot's), copied by seq_cp, whatever "
                   "the block size.")
    else:
        st.caption("Each lookup (a request's admission, and a re-admission after preemption), up to the step "
                   "shown; reasons as `python -m kvviz explain` gives them.")
    st.dataframe(table[table.step <= step], hide_index=True, width="stretch", key="insp_lookups")
    if info.backend == "transformers" and table.reason.astype(str).str.startswith("cold").any():
        st.caption("A cold miss in a transformers run may follow a request that computed the same prefix: "
                   "transformers registers no block a request fills in its last forward (the request is marked "
                   "finished before those blocks' hashes are registered), so a request that ended in the forward "
                   "that read its prompt leaves nothing to reuse (docs/engines.md).")
    if len(evicted):
        st.plotly_chart(cache_fig.lifetimes(lives), width="stretch", key="insp_lives")
    else:
        st.caption("No block was evicted in this run, so there are no lifetimes to draw.")


@st.cache_resource(max_entries=8, show_spinner="Explaining the run's lookups...")
def _worked_out(_con, db: str, run_id: str, status: str, steps: int) -> list[Explanation]:
    """A run's explanations, worked out once per run and state: moving the step slider redraws the view
    without explaining the run again (a recording run's key changes with each step it adds). Kept as
    objects, not pickled: an edited module reloaded under a running app makes its classes new ones, which
    a pickled cache cannot give back. Read only."""
    try:
        return explain_run(_con, run_id)
    except StoreError:
        return []
