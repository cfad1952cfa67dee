"""The list of runs, one run's header, and deleting a run."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field

import duckdb
import pandas as pd

from ..capture.import_vllm import CAPTURE_MODELS
from ..capture.lint import ADVISORY
from ..store import RunStore, StoreError

RUNNING = "running"  # runs.status of a run still being recorded (or whose process died before it ended)


@dataclass(frozen=True)
class RunInfo:
    """What the inspector needs to know about a run before it draws anything."""

    run_id: str
    status: str
    error: str | None
    model: str
    scenario: str | None
    fault: str | None
    engine: dict
    steps: list[int]
    requests: list[str]
    has_blocks: bool  # engine runs and kvviz traces; captures have none
    has_attention: bool
    has_kv_events: bool  # an imported vLLM/SGLang capture
    fault_scope: dict | None = None  # where the fault was confined
    backend: str | None = None  # the engine that ran it (kvviz, transformers, llama.cpp); None for a capture
    notes: list[str] = field(default_factory=list)  # what its engine ran with a consequence, or said once it ran

    @property
    def recording(self) -> bool:
        """Still being recorded: its requests, findings and divergences may not be written yet (a recorded
        run writes them when it ends; a served one each request as it ends)."""
        return self.status == RUNNING

    @property
    def block_size(self) -> int:
        return int(self.engine.get("block_size", 16))

    @property
    def isolation(self) -> str | None:
        return self.engine.get("isolation")


def list_runs(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Newest first, with the leak summary the runs table shows and the engine that ran each (a transformers
    run of a fault's scenario runs no fault, which must not read as a fault that never fired), its
    kernel (another engine's: kvviz's own attends by its compute path) and isolation; a run still
    recording (or killed) counts the steps stored so far; `breaches`, a capture's kinds of breach of the
    KV-event contract on each replica (advisory ones aside; 0: clean; None: no capture linted on import),
    so a capture whose figures they distort does not list like a clean one. Missing values are None, not NaN."""
    df = con.execute(
        "SELECT run_id, created_at, status, model, backend AS engine, "
        "CASE WHEN backend <> 'kvviz' THEN engine->>'kernel' END AS kernel, engine->>'isolation' AS isolation, "
        "scenario, fault, fault_scope, "
        "coalesce(r.steps, (SELECT count(*) FROM steps s WHERE s.run_id = r.run_id)) AS steps, "
        "generated_tokens AS tokens, round(leak_rate, 6) AS leak_rate, round(max_foreign_mass, 4) AS "
        "max_foreign_mass, findings, CASE WHEN workload->>'breaches' IS NOT NULL THEN (SELECT count(*) FROM "
        "capture_breaches b WHERE b.run_id = r.run_id AND b.kind NOT IN (SELECT unnest($advisory))) END AS breaches, "
        "round(seconds, 2) AS seconds, error FROM runs r ORDER BY created_at DESC, run_id",
        {"advisory": sorted(ADVISORY)}).df()
    df["fault_scope"] = [scope_text(json.loads(s)) if isinstance(s, str) else None for s in df.fault_scope]
    return df.astype(object).where(df.notna(), None)


def cache_use(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, float | int | None]:
    """What a run's prompts found in the cache: prompt tokens, tokens served from it, and their share (the hit
    rate; None for a run with no request, such as a capture)."""
    prompt, cached = con.execute("SELECT sum(len(prompt_ids)), sum(greatest(cached_tokens, 0)) FROM requests "
                                 "WHERE run_id = ?", [run_id]).fetchone()
    return {"prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": round(cached / prompt, 4) if prompt else None}


def scope_text(scope: dict) -> str:
    """A fault scope as a reader says it: "steps 3, 4; requests A"."""
    parts = [f"{k} {', '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in scope.items() if v is not None]
    return "; ".join(parts) or "everywhere"


def run_info(con: duckdb.DuckDBPyConnection, run_id: str) -> RunInfo:
    row = con.execute("SELECT status, error, model, scenario, fault, engine, fault_scope, backend, notes FROM runs "
                      "WHERE run_id = ?", [run_id]).fetchone()
    if row is None:
        raise StoreError(f"no run {run_id!r} in this database")

    def exists(table: str) -> bool:
        return con.execute(f"SELECT count(*) > 0 FROM (SELECT 1 FROM {table} WHERE run_id = ? LIMIT 1)",
                           [run_id]).fetchone()[0]

    steps = [r[0] for r in con.execute("SELECT DISTINCT step FROM steps WHERE run_id = ? ORDER BY step",
                                       [run_id]).fetchall()]
    requests = [r[0] for r in con.execute("SELECT request_id FROM requests WHERE run_id = ? ORDER BY request_id",
                                          [run_id]).fetchall()]
    return RunInfo(run_id, row[0], row[1], row[2], row[3], row[4], json.loads(row[5]) if row[5] else {}, steps,
                   requests, exists("blocks"), exists("attention"), row[2] in CAPTURE_MODELS or exists("kv_events"),
                   json.loads(row[6]) if row[6] else None, row[7], list(row[8] or []))


def requests_frame(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """Each request as recorded, with the adapter and the truncation the workload gave it, and its
    prompt text last, after the text it wrote (columns only when some request has one: adapter and
    truncation name the namespace and session faults)."""
    df = con.execute(
        "SELECT request_id, tenant, parent, arrival_step, first_token_step, finish_step, finish_reason, "
        "len(prompt_ids) AS prompt_tokens, len(output_ids) AS output_tokens, cached_tokens, text "
        "FROM requests WHERE run_id = ? ORDER BY request_id", [run_id]).df()
    (workload,) = con.execute("SELECT workload FROM runs WHERE run_id = ?", [run_id]).fetchone() or (None,)
    spec = json.loads(workload or "{}")
    given = {r.get("id"): r for r in (spec.get("requests", []) if isinstance(spec, dict) else [])
             if isinstance(r, dict)}
    for name, before in (("adapter", "parent"), ("truncate", "parent"), ("prompt", None)):
        values = df.request_id.map(lambda r, name=name: given.get(r, {}).get(name))
        if values.notna().any():
            df.insert(df.columns.get_loc(before) if before else len(df.columns), name, values)
    return df


def run_tables(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Every base table keyed by run_id (what a delete must clear)."""
    return [r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.columns c JOIN information_schema.tables t USING (table_name) "
        "WHERE c.column_name = 'run_id' AND t.table_type = 'BASE TABLE' ORDER BY table_name").fetchall()]


def delete_run(store: RunStore, run_id: str) -> None:
    """Remove a run and every row that belongs to it, in one transaction, then its attention parts and
    the capture dataset the store made for it (a dataset the user registered in place stays where it is)."""
    with store.write() as con:
        if not store.has_run(con, run_id):
            raise StoreError(f"no run {run_id!r} in {store.path}")
        owned = [p for (p,) in con.execute("SELECT path FROM capture_sources WHERE run_id = ?", [run_id]).fetchall()
                 if store.owns(p)]
        con.execute("BEGIN TRANSACTION")
        for table in run_tables(con):
            con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        store.refresh_file_views(con)  # the dataset leaves kv_events, the parts attention
        con.execute("COMMIT")
    for folder in [*owned, store.attention_dir / run_id]:
        shutil.rmtree(folder, ignore_errors=True)
