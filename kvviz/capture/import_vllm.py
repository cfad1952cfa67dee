"""A vLLM/SGLang KV-event capture becomes a run: the prefix tree (hash chains with their tokens,
salts and LoRA names), blocks stored and evicted per step, cache occupancy over time, and a
cross-tenant finding wherever one block hash is stored under two salts. The events carry no
physical block ids and no attention weights, so the run has neither."""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

from .. import __version__
from ..ids import new_run_id
from ..store import RunStore
from ..store.schema import arrow_table
from .capture_file import read_capture
from .events import CaptureError, decode_batch


def import_capture(path: str | Path, store: RunStore) -> str:
    """Decode every message first (a bad capture changes nothing), then insert in one transaction."""
    path = Path(path)
    messages = list(read_capture(path))
    if not messages:
        raise CaptureError(f"{path}: the capture holds no messages")
    try:
        events = [(step, ev) for step, (seq, payload) in enumerate(messages) for ev in decode_batch(payload, seq)]
    except CaptureError as e:
        raise CaptureError(f"{path}: {e}") from None
    run_id = new_run_id()
    cols: dict[str, list] = defaultdict(list)
    salts_of: dict[int, set] = defaultdict(set)
    findings: dict[str, list] = defaultdict(list)
    for step, ev in events:
        hashes = ev.block_hashes or (None,)
        for i, h in enumerate(hashes):
            salt = ev.salts[i] if i < len(ev.salts) else None
            parent = ev.parent_hash if i == 0 else ev.block_hashes[i - 1]
            size = ev.block_size or 0
            for k, v in dict(run_id=run_id, step=step, seq=ev.seq, ts=ev.ts, rank=ev.rank, kind=ev.kind,
                             block_hash=h, parent_hash=parent if ev.kind == "BlockStored" else None, block_index=i,
                             token_ids=list(ev.token_ids[i * size:(i + 1) * size]) if size else None,
                             block_size=ev.block_size, lora_name=ev.lora_name, medium=ev.medium, salt=salt).items():
                cols[k].append(v)
            if ev.kind == "BlockStored":
                if salts_of[h] and salt not in salts_of[h]:
                    for k, v in dict(run_id=run_id, kind="cross_tenant", request_id=str(salt), step=step, layer=None,
                                     head=None, position=i, source_request=str(sorted(map(str, salts_of[h]))[0]),
                                     mass=None).items():
                        findings[k].append(v)
                salts_of[h].add(salt)
    steps = {"run_id": [run_id] * len(messages), "step": list(range(len(messages))),
             "seconds": [0.0] * len(messages), "free_blocks": [None] * len(messages)}
    with store.write() as con:
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute("INSERT INTO runs (run_id, created_at, status, model, scenario, workload, engine, "
                        "kvviz_version, steps, findings) VALUES (?, ?, 'complete', 'vllm capture', 'import', ?, '{}', "
                        "?, ?, ?)", [run_id, datetime.now(UTC).replace(tzinfo=None),
                                     json.dumps({"capture": path.name}), __version__, len(messages),
                                     len(findings["kind"])])
            for table, data in (("kv_events", cols), ("steps", steps), ("findings", findings)):
                if data and data.get("run_id"):
                    store.insert(con, table, arrow_table(table, data))
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
    return run_id
