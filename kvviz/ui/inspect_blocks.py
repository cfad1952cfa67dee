"""Inspector, Blocks view: the pool as a clickable grid, one block's story, page tables, occupancy,
and memory utilisation against a contiguous allocator."""

from __future__ import annotations

import streamlit as st

from ..analysis import blocks, memory
from ..analysis.runs import RunInfo
from ..figures import blocks as fig

MAX_PAGE_TABLE_REQUESTS = 16
MAX_DRAWN_BLOCKS = 2048  # a grid of more markers is unreadable and slow to draw


def render(con, info: RunInfo, step: int) -> None:
    pool = blocks.block_map(con, info.run_id, step)
    leaky = blocks.leaky_blocks(con, info.run_id, step, info.block_size) if info.has_attention else set()
    crossed = blocks.cross_read_blocks(con, info.run_id, step) - leaky
    used = int((pool.state == "used").sum())
    left, right = st.columns([3, 2])
    with left:
        colour_by = st.radio("Colour by", ("owner", "state"), horizontal=True, key="insp_colour_by")
        title = (f"Pool after step {step}: {used} of {len(pool)} blocks used, {int((pool.refcount > 1).sum())} "
                 f"shared, {int((pool.state == 'cached').sum())} cached" + (f", {len(leaky)} read by a leak"
                                                                             if leaky else "")
                 + (f", {len(crossed)} read by another tenant" if crossed else ""))
        n = len(pool)
        touched = pool.block[~pool.state.isin(("free", "reserved"))]
        shown = n if n <= MAX_DRAWN_BLOCKS else min(MAX_DRAWN_BLOCKS, max(256, int(touched.max()) + 1
                                                                          if len(touched) else 0))
        if shown < n:
            st.caption(f"Blocks {shown}..{n - 1} are not drawn: " + (
                "all free." if not len(touched) or touched.max() < shown else "showing the first "
                f"{shown} of {n}; pick any block by number on the right."))
            pool = pool[pool.block < shown]

        def clicked() -> None:
            points = st.session_state["insp_blockmap"]["selection"]["points"]
            picked = fig.block_at(points[0], shown) if points else None
            if picked is not None:
                st.session_state["insp_block"] = picked

        split = int(info.engine.get("num_blocks", 0)) if info.engine.get("disaggregated") else None
        st.plotly_chart(fig.block_map(pool, leaky, colour_by, title, split, crossed), key="insp_blockmap",
                        on_select=clicked, selection_mode="points", width="stretch")
        st.caption("Click a block to see who holds it. Red outline: a query read a foreign or stale key "
                   "from this block at this step." + (" Black outline: a request of another tenant read this block "
                                                      "at this step (the same content: a cross-tenant read, no "
                                                      "attention leak)." if crossed else "")
                   + _finished(con, info, step))
        _prefill_instance(con, info, step)
        _host_tier(con, info, step)
    with right:
        _block_story(con, info, step, n)
    tables = blocks.page_tables(con, info.run_id, step)
    if not tables.empty:
        names = sorted(tables.request_id.unique())
        chosen = st.multiselect("Page tables of", names, default=names[:MAX_PAGE_TABLE_REQUESTS],
                                key=f"insp_pt_requests_{info.run_id}_{step}")
        if chosen:
            st.plotly_chart(fig.page_tables(tables[tables.request_id.isin(chosen)]), width="stretch",
                            key="insp_pagetables")
    else:
        st.caption("No request holds blocks after this step.")
    with st.expander("Occupancy over time", expanded=True):
        grid, steps, per_row = blocks.occupancy(con, info.run_id)
        st.plotly_chart(fig.occupancy(grid, steps, step, per_row), width="stretch", key="insp_occupancy")
    held = "llama.cpp's cells" if info.backend == "llama.cpp" else "paged"  # its cache is cells, not pages
    with st.expander(f"Memory utilisation: {held} against contiguous", expanded=True):
        _memory(con, info, step)


def _finished(con, info: RunInfo, step: int) -> str:
    """Requests that finished in the step: their blocks are gone from the map of the pool after it,
    though a leak may have read them in it. One that ran before holds them in the step before; one
    that ran in this step only held them in no map at all."""
    done = con.execute("SELECT r.request_id, coalesce(min(w.step) < any_value(r.finish_step), true) FROM requests r "
                       "LEFT JOIN step_work w ON w.run_id = r.run_id AND w.request_id = r.request_id "
                       "WHERE r.run_id = ? AND r.finish_step = ? GROUP BY r.request_id ORDER BY r.request_id",
                       [info.run_id, step]).fetchall()
    said = []
    for before, names in ((True, [r for r, b in done if b]), (False, [r for r, b in done if not b])):
        if not names:
            continue
        who = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
        its = "its" if len(names) == 1 else "their"
        said.append(f" {who} finished in this step and released {its} blocks: the map shows the pool after the "
                    "step, so step back one to see them." if before else
                    f" {who} ran in this step only (arrived and finished in it): {its} blocks were held within the "
                    "step and released at its end, so no step's map shows them.")
    return "".join(said)


def _prefill_instance(con, info: RunInfo, step: int) -> None:
    """Disaggregated prefill: which blocks are the prefill instance's, and what went over to decode."""
    if not info.engine.get("disaggregated"):
        return
    n = int(info.engine.get("num_blocks", 0))
    sent = blocks.transfers(con, info.run_id, step)
    st.caption(f"Disaggregated prefill: blocks 0..{n - 1} are the decode instance's pool, {n}..{2 * n - 1} the "
               f"prefill instance's (after the dashed line). A prompt is computed there, then its K/V is "
               f"transferred here. "
               f"{len(sent)} transfers up to this step.")
    if sent.empty:
        return
    wrong = sent[sent.delivered.eq(False)]
    if len(wrong):
        st.warning(f"{len(wrong)} of {len(sent)} transfers left decode blocks holding K/V of other tokens than "
                   "the request's own (by slot provenance): " + "; ".join(
                       f"{r.request_id} at step {r.step} got {_whose(r.written_by)}"
                       for r in wrong.head(5).itertuples()), icon=":material/swap_horiz:")
    st.dataframe(sent, hide_index=True, key="insp_transfers", height=min(300, 38 + 35 * len(sent)),
                 column_config={"delivered": st.column_config.CheckboxColumn(
                     "delivered", help="every received slot holds the K/V of this request's own tokens at its "
                                       "position, by slot provenance"),
                     "written_by": st.column_config.TextColumn(
                         "written by", help="who computed the K/V the decode blocks hold after the transfer: the "
                                            "request, or one it hit or forked from; unwritten: slots the transfer "
                                            "never wrote")})


def _whose(written_by: str) -> str:
    """'A, unwritten' as 'K/V written by A and slots never written'."""
    writers = [w for w in written_by.split(", ") if w and w != "unwritten"]
    parts = ([f"K/V written by {', '.join(writers)}"] if writers else []) + \
        (["slots never written"] if "unwritten" in written_by.split(", ") else [])
    return " and ".join(parts) or "nothing"


def _host_tier(con, info: RunInfo, step: int) -> None:
    """The second tier of an offloading run: which host blocks hold content evicted from the device."""
    host = blocks.host_map(con, info.run_id, step)
    if host.empty:
        return
    held = int(host.held.sum())
    moved = blocks.tier_moves(con, info.run_id, step)
    st.plotly_chart(fig.block_map(host, colour_by="state", title=f"Host tier (CPU) after step {step}: {held} of "
                                  f"{len(host)} blocks hold offloaded content"), key="insp_hostmap", width="stretch")
    st.caption("Evicted cached blocks are copied here instead of dropped; a later prefix hit copies them back into "
               f"free device blocks. This step (coloured in the map): {moved['offload']} offloaded, "
               f"{moved['restore']} restored, {moved['host_evict']} dropped from the host (a host block dropped and "
               "filled again in one step shows as offloaded).")


def _memory(con, info: RunInfo, step: int) -> None:
    mem = memory.run_memory(con, info.run_id)
    if mem is None:
        st.caption("This run has no live-slot counts: it was recorded before kvviz counted them, or imported "
                   "from such a trace. Run it again to see them.")
        return
    paged, contiguous = memory.overall(mem.paged), memory.overall(mem.contiguous.usage)
    c = st.columns(4)
    c[0].metric("paged", "n/a" if paged is None else f"{paged:.0%}", help="allocated KV slots holding a token, "
                "over every step (the seed: over 90%)")
    c[1].metric("contiguous", "n/a" if contiguous is None else f"{contiguous:.0%}",
                help="the same requests replayed on a first-fit contiguous allocator, each reserving its "
                     "prompt + max_new_tokens on arrival (the seed: about 60%)")
    extra = len(mem.contiguous.usage) - len(mem.paged)
    c[2].metric("steps to finish, contiguous", f"{len(mem.contiguous.usage)}",
                delta=f"{abs(extra)} {'more' if extra > 0 else 'fewer'} than paged" if extra else None,
                delta_color="inverse",
                help=f"paged: {len(mem.paged)}; contiguous requests wait for a free region")
    c[3].metric("fragmented steps", mem.contiguous.fragmented_steps,
                help="steps where the first waiting request found no region although enough slots were free "
                     "in total")
    st.plotly_chart(fig.memory_utilisation(mem.frame(), memory.ARTICLE, step), width="stretch", key="insp_memory")
    trash = (" (transformers' data blocks: its reserved trash blocks, last in the map, hold no request's tokens "
             "and are not counted)" if info.backend == "transformers" else "")
    pool = "llama.cpp's cells: its cache's" if info.backend == "llama.cpp" else "Paged: the pool's"
    st.caption(f"Both in the same {mem.capacity} slots{trash}. {pool} own count after each step; a shared "
               "block counts once. Contiguous: a replay; each request advances as it did here once it has a "
               "region." + (f" Never placed (longer than the space): {', '.join(mem.contiguous.refused)}."
                            if mem.contiguous.refused else "")
               + (f" Paged is low here because blocks of {info.block_size} tokens are large for these short "
                  "sequences: most of each request's last block stays empty." if paged is not None and paged < 0.5
                  else ""))


def _block_story(con, info: RunInfo, step: int, n: int) -> None:
    if (st.session_state.get("insp_block") or 0) >= n:
        st.session_state["insp_block"] = None
    block = st.number_input("Block", min_value=0, max_value=n - 1, key="insp_block", placeholder="click a block")
    if block is None:
        st.info("Click a block in the map (or type its number) to see its references, hash chain, the tokens "
                "its slots hold and its events.", icon=":material/touch_app:")
        return
    story = blocks.block_story(con, info.run_id, step, int(block), info.block_size)
    st.markdown(f"**Block {block}** · {story.state} · refcount {story.refcount}"
                + (f" · hash `{story.hash}`" if story.hash else ""))
    if not story.references.empty:
        st.markdown("Referenced by: " + ", ".join(f"**{r}** (logical block {lb})"
                                                  for r, lb in story.references.itertuples(index=False)))
    for req, chain in story.chains.items():
        st.caption(f"{req}'s hash chain to here: " + " → ".join(h[:8] if h else "(unhashed)" for h in chain))
    if not story.slots.empty:
        st.markdown("What its slots hold (writer, position, token):")
        st.dataframe(story.slots, hide_index=True, width="stretch", height=min(250, 38 + 35 * len(story.slots)))
    st.markdown("Its events up to this step:")
    st.dataframe(story.events, hide_index=True, width="stretch", height=min(250, 38 + 35 * max(1, len(story.events))))
