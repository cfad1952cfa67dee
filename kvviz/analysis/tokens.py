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
    replayed with every block copy the run made (copy-on-write, offload to the host tier and restore
    from it, a disaggregated transfer), each before its step's writes. The copies are the ones made,
    not the ones asked for: a restore from the wrong host block shows the wrong block's tokens."""
    writes = con.execute("SELECT step, slot, request_id, position, token, lifetime FROM slot_writes "
                         "WHERE run_id = ? AND step <= ? ORDER BY step", [run_id, step]).fetchall()
    copies = con.execute("SELECT step, kind, block, source FROM block_events WHERE run_id = ? AND step <= ? AND kind "
                         "IN ('cow', 'offload', 'restore', 'transfer') ORDER BY step, seq", [run_id, step]).fetchall()
    device: dict[int, tuple] = {}
    host: dict[int, tuple] = {}  # the host tier's slots

    def copy(kind: str, block: int, source: int) -> None:
        if kind == "offload":  # device block -> host block source
            a, src, b, dst = device, block, host, source
        else:  # cow, restore (from host block source), transfer: source -> block
            a, src, b, dst = host if kind == "restore" else device, source, device, block
        for k in range(block_size):
            content = a.get(src * block_size + k)
            if content is None:
                b.pop(dst * block_size + k, None)
            else:
                b[dst * block_size + k] = content

    c = 0
    for s, slot, *content in [*writes, (step + 1, None)]:
        while c < len(copies) and copies[c][0] <= s:
            copy(*copies[c][1:])
            c += 1
        if slot is not None:
            device[slot] = tuple(content)
    rows = [(slot, *v) for slot, v in sorted(device.items())]
    return pd.DataFrame(rows, columns=["slot", "request_id", "position", "token", "lifetime"])
