"""Upload: a kvviz trace (.zip of Parquet tables) or a vLLM/SGLang KV-event capture (.jsonl from
`kvviz capture-vllm`) becomes a run; a refused file is explained and imports nothing."""

from __future__ import annotations

import streamlit as st

from ..errors import KvvizError
from ..runners.uploads import earlier_import, import_file, imported, refused, save_upload
from .common import db_path, open_run, store


def render() -> None:
    st.title("Upload")
    st.markdown(
        "Bring in what your server recorded:\n"
        "- a **kvviz trace** (`.zip`): page tables, refcounts and optionally attention rows, written by "
        "`python -m kvviz export` or by your server without kvviz (see docs/trace-format.md);\n"
        "- a **vLLM or SGLang KV-event capture** (`.jsonl`) written by `python -m kvviz capture-vllm --endpoint "
        "tcp://HOST:5557 --out capture.jsonl` (or by kvviz's own engine: `python -m kvviz run ... --kv-events "
        "capture.jsonl`, in the same format): it becomes the prefix tree, cache occupancy over time, evictions and "
        "cross-tenant findings.\n\n"
        "A fleet's **capture dataset** (a folder of Parquet, `capture-vllm --out DIR`) stays where it is: import "
        "it from a shell on this machine with `python -m kvviz import DIR`, then open it in the inspector.")
    up = st.file_uploader("Trace or capture", type=["zip", "jsonl"], key="upload_file")
    if up is None:
        st.caption(f"Uploads are kept in `{_folder()}`; runs go to `{db_path()}`.")
        return
    if st.button(f"Import {up.name}", type="primary", key="upload_go", icon=":material/upload:"):
        saved = save_upload(up.name, up.getvalue(), _folder())
        before = earlier_import(saved, store())
        if before is not None:
            st.session_state["upload_run"] = before
            st.info(f"{up.name} was imported before, as run {before}: it is not imported twice.",
                    icon=":material/content_copy:")
        else:
            with st.spinner(f"Validating and importing {up.name}..."):
                bar = st.progress(0.0, text=f"Importing {up.name}")
                try:
                    run_id = import_file(saved, store(), lambda done, total: bar.progress(
                        done / total, text=f"Importing {up.name}: {done / 2**20:.1f} of {total / 2**20:.1f} MiB"))
                except KvvizError as e:  # said here, not by the app: with the name the user gave the file
                    refused(saved)
                    bar.empty()
                    st.error(f"Not imported: {str(e).replace(str(saved), up.name)}. Nothing was added to the "
                             "database.", icon=":material/error:")
                    return
                bar.empty()
            imported(saved, run_id)
            st.session_state["upload_run"] = run_id
            st.success(f"Imported {up.name} as run {run_id}.", icon=":material/check_circle:")
    run_id = st.session_state.get("upload_run")
    if run_id and st.button("Open it in the inspector", key="upload_open", icon=":material/grid_view:"):
        open_run(run_id)


def _folder():
    return db_path().parent / "uploads"
