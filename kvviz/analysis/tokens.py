"""Token labels and slot contents: what text sits in each slot of the pool at a step."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import duckdb
import pandas as pd

from ..store.token_text import label_bytes
from ..util.byte_level import whole_characters


def token_texts(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[int, str]:
    """token id -> text (runs imported without a token_text table label tokens by id)."""
    return dict(con.execute("SELECT token_id, text FROM token_text WHERE run_id = ?", [run_id]).fetchall())


def label(texts: dict[int, str], token: int | None) -> str:
    if token is None:
        return "?"
    text = texts.get(int(token))
    return f"#{token}" if text is None else _shown(text)


def _shown(text: str) -> str:
    shown = repr(text)[1:-1]
    return shown if text.strip() else shown.replace(" ", "␣") or "∅"  # a lone space must show


def sequence_labels(texts: dict[int, str], seq: list[int]) -> list[str]:
    """label() of each position of a request's sequence, but a character split over tokens (byte-level BPE
    splits 红 in three, whose labels alone are its bytes, <E7> <BA> <A2>) named in each piece with which piece
    it is: 红(1/3) 红(2/3) 红(3/3); a piece that makes no whole character with its neighbours shows as �."""
    raw = [label_bytes(texts[t]) if t in texts else f"#{t}".encode() for t in seq]
    out: list[str] = []
    for a, b, text in whole_characters(len(seq), lambda a, b: b"".join(raw[a:b]).decode("utf-8", "replace")):
        if b - a == 1 and "\ufffd" not in text:
            out.append(label(texts, seq[a]))
        else:
            out += [f"{_shown(text)}({k}/{b - a})" if b - a > 1 else _shown(text) for k in range(1, b - a + 1)]
    return out


def request_tokens(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, list[int]]:
    """Each request's full sequence: prompt then output (position p holds element p)."""
    return {r: list(p or []) + list(o or []) for r, p, o in con.execute(
        "SELECT request_id, prompt_ids, output_ids FROM requests WHERE run_id = ?", [run_id]).fetchall()}


COLUMNS = ["slot", "request_id", "position", "token", "lifetime"]


def slot_contents(con: duckdb.DuckDBPyConnection, run_id: str, step: int, block_size: int) -> pd.DataFrame:
    """Who wrote each slot, which position and token, as of the end of `step`."""
    *_, (_, device) = _replay(con, run_id, step, block_size)
    return pd.DataFrame([(slot, *v) for slot, v in sorted(device.items())], columns=COLUMNS)


def slot_contents_at(con: duckdb.DuckDBPyConnection, run_id: str, when: dict[int, int],
                     block_size: int) -> pd.DataFrame:
    """Each slot's content at the end of its own step (`when`: slot -> step), in one replay: what a
    request read from each slot when it last read it, though the slot holds something else since."""
    by_step: dict[int, list[int]] = {}
    for slot, s in when.items():
        by_step.setdefault(s, []).append(slot)
    rows = []
    for s, device in _replay(con, run_id, max(when.values(), default=None), block_size, by_step):
        rows += [(slot, *device[slot]) for slot in by_step.get(s, ()) if slot in device]
    return pd.DataFrame(sorted(rows), columns=COLUMNS)


def _replay(con: duckdb.DuckDBPyConnection, run_id: str, upto: int | None, block_size: int,
            stops: Iterable[int] = ()) -> Iterator[tuple[int, dict[int, tuple]]]:
    """(step, slot -> (writer, position, token, lifetime)) after `upto`, each of `stops` and each step
    before that wrote or copied anything (the dict is the replay's own: read it before the next
    step). The slot_writes log is replayed with every block copy the run made (copy-on-write, offload
    to the host tier and restore from it, a disaggregated transfer), each before its step's writes.
    The copies are the ones made, not the ones asked for: a restore from the wrong host block shows
    the wrong block's tokens."""
    if upto is None:
        return
    writes = con.execute("SELECT step, slot, request_id, position, token, lifetime FROM slot_writes "
                         "WHERE run_id = ? AND step <= ? ORDER BY step", [run_id, upto]).fetchall()
    copies = con.execute("SELECT step, kind, block, source FROM block_events WHERE run_id = ? AND step <= ? AND kind "
                         "IN ('cow', 'offload', 'restore', 'transfer') ORDER BY step, seq", [run_id, upto]).fetchall()
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

    steps = sorted({w[0] for w in writes} | {c[0] for c in copies} | {upto, *stops})
    w = c = 0
    for s in steps:
        while c < len(copies) and copies[c][0] == s:
            copy(*copies[c][1:])
            c += 1
        while w < len(writes) and writes[w][0] == s:
            device[writes[w][1]] = tuple(writes[w][2:])
            w += 1
        yield s, device
