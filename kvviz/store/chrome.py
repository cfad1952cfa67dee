"""Chrome trace-event JSON of a recorded run, for Perfetto (ui.perfetto.dev) or chrome://tracing:
one track per request with a slice per step it computed, and counters for free blocks, prefix-cache
hits and the leak rate."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

from ..errors import StoreError
from .run_store import RunStore


def chrome_trace(con: duckdb.DuckDBPyConnection, run_id: str) -> dict:
    RunStore.require_run(con, run_id)
    steps = con.execute("SELECT step, seconds, free_blocks FROM steps WHERE run_id = ? ORDER BY step",
                        [run_id]).fetchall()
    if not steps:
        raise StoreError(f"no recorded steps for run {run_id!r}")
    start, t = {}, 0.0
    for step, seconds, _ in steps:  # steps run back to back: step i starts when step i-1 ends
        start[step] = (t, seconds)
        t += seconds
    us = 1e6
    requests = [r[0] for r in con.execute("SELECT DISTINCT request_id FROM step_work WHERE run_id = ? ORDER BY 1",
                                          [run_id]).fetchall()]
    tid = {r: i + 2 for i, r in enumerate(requests)}
    (backend,) = con.execute("SELECT backend FROM runs WHERE run_id = ?", [run_id]).fetchone()
    events = [{"ph": "M", "name": "process_name", "pid": 1,
               "args": {"name": f"kvviz run {run_id}" + (f" ({backend})" if backend else "")}},
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "engine steps"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid[r], "args": {"name": f"request {r}"}}
               for r in requests]
    for step, (s, d) in start.items():
        events.append({"ph": "X", "name": f"step {step}", "pid": 1, "tid": 1, "ts": s * us, "dur": d * us})
    for step, req, first, n, tok, preempted in con.execute(
            "SELECT step, request_id, start, tokens, sampled_token, preempted FROM step_work WHERE run_id = ?",
            [run_id]).fetchall():
        s, d = start[step]
        name = "decode" if n == 1 and first > 0 else "prefill"
        events.append({"ph": "X", "name": name, "pid": 1, "tid": tid[req], "ts": s * us, "dur": d * us,
                       "args": {"positions": f"{first}..{first + n - 1}", "sampled": tok, "preempted": preempted}})
    hits = dict(con.execute("SELECT step, count(*) FROM block_events WHERE run_id = ? AND kind = 'hit' GROUP BY 1",
                            [run_id]).fetchall())
    leak = dict(con.execute("SELECT step, sum(leak_rows) / sum(rows) FROM leak_metrics WHERE run_id = ? GROUP BY 1",
                            [run_id]).fetchall())
    for step, _, free in steps:
        ts = start[step][0] * us
        events.append({"ph": "C", "name": "free blocks", "pid": 1, "ts": ts, "args": {"free": free}})
        events.append({"ph": "C", "name": "prefix hits", "pid": 1, "ts": ts, "args": {"blocks": hits.get(step, 0)}})
        if step in leak:
            events.append({"ph": "C", "name": "leak rate", "pid": 1, "ts": ts, "args": {"rate": leak[step]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def export_chrome(store: RunStore, run_id: str, out: str | Path) -> Path:
    with store.read() as con:
        trace = chrome_trace(con, run_id)
    out = Path(out)
    out.write_text(json.dumps(trace))
    return out
