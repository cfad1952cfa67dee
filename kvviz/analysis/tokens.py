"""Token labels and slot contents: what text sits in each slot of the pool at a step."""

from __future__ import annotations

import duckdb
import pandas as pd


def token_texts(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[int, str]:
    """token id -> text (runs imported without a token_text table label tokens by id)."""
    return dict(con.execute("SELECT token_id, text FROM token_text WHERE run_id = ?", [run_id]).fetchall())


def label(texts: dict[int, str], token: int | None) -> str:
    if token is None:
        return "?"
    text = texts.get(int(token))
    return repr(text)[1:-1] if text is not None else f"#{token}"


def request_tokens(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, list[int]]:
    """Each request's full sequence: prompt then output (position p holds element p)."""
    return {r: list(p or []) + list(o or []) for r, p, o in con.execute(
        "SELECT request_id, prompt_ids, output_ids FROM requests WHERE run_id = ?", [run_id]).fetchall()}


def slot_contents(con: duckdb.DuckDBPyConnection, run_id: str, step: int, block_size: int) -> pd.DataFrame:
    """Who wrote each slot, which position and token, as of the end of `step`: the slot_writes log
    replayed with copy-on-write copies (a copy takes its source's slots before the step's writes)."""
    writes = con.execute("SELECT step, slot, request_id, position, token, lifetime FROM slot_writes "
                         "WHERE run_id = ? AND step <= ? ORDER BY step", [run_id, step]).fetchall()
    cows = con.execute("SELECT step, block, source FROM block_events WHERE run_id = ? AND step <= ? AND kind = 'cow' "
                       "ORDER BY step, seq", [run_id, step]).fetchall()
    slots: dict[int, tuple] = {}
    c = 0
    for s, slot, *content in writes:
        while c < len(cows) and cows[c][0] <= s:
            _, copy, src = cows[c]
            for k in range(block_size):
                if src * block_size + k in slots:
                    slots[copy * block_size + k] = slots[src * block_size + k]
            c += 1
        slots[slot] = tuple(content)
    rows = [(slot, *v) for slot, v in sorted(slots.items())]
    return pd.DataFrame(rows, columns=["slot", "request_id", "position", "token", "lifetime"])
