"""Replay: read a recorded run at any step, and re-execute it from its stored config to verify
that the tokens and the oracle's metrics come out the same."""

from __future__ import annotations

import json
from dataclasses import dataclass

import duckdb

from ..errors import StoreError
from ..store.run_store import RunStore

LEAK_TOLERANCE = 1e-5  # max foreign mass per (step, request, layer, head), recomputed vs recorded
FINDING_FIELDS = ("kind", "request", "step", "layer", "head", "position", "source_request", "mass", "block",
                  "last_step")  # oracle.Finding's, without loading the oracle (torch)


@dataclass
class RunRecord:
    run_id: str
    status: str
    model: str
    fingerprint: str
    scenario: str | None
    fault: str | None
    fault_scope: dict | None
    workload: dict


@dataclass
class StepState:
    step: int
    work: list[tuple]  # (request, start, tokens, sampled token)
    page_tables: dict[str, list[int]]
    blocks: list[tuple]  # (block, refcount, state, lifetime, hash)
    leak: dict[str, float]  # request -> max foreign + stale mass at this step
    findings: list[dict]  # the findings spanning this step: Finding's fields (cli.common.finding_text's arguments)


def load_run(con: duckdb.DuckDBPyConnection, run_id: str) -> RunRecord:
    row = con.execute("SELECT run_id, status, model, model_fingerprint, scenario, fault, fault_scope, workload "
                      "FROM runs WHERE run_id = ?", [run_id]).fetchone()
    if row is None:
        raise StoreError(f"no run {run_id!r} in this database")
    return RunRecord(*row[:6], json.loads(row[6]) if row[6] else None, json.loads(row[7]))


def state_at(con: duckdb.DuckDBPyConnection, run_id: str, step: int) -> StepState:
    """The block map, page tables, work, leak and findings of one recorded step."""
    steps = [r[0] for r in con.execute("SELECT step FROM steps WHERE run_id = ? ORDER BY step", [run_id]).fetchall()]
    if step not in steps:
        raise StoreError(f"run {run_id} has no step {step}; recorded steps: "
                         f"{steps[0]}..{steps[-1]}" if steps else f"run {run_id} has no recorded steps")
    q = lambda sql: con.execute(sql, [run_id, step]).fetchall()  # noqa: E731
    tables: dict[str, list[int]] = {}
    for req, blk in q("SELECT request_id, physical_block FROM page_tables WHERE run_id = ? AND step = ? "
                      "ORDER BY request_id, logical_block"):
        tables.setdefault(req, []).append(blk)
    return StepState(
        step,
        q("SELECT request_id, start, tokens, sampled_token FROM step_work WHERE run_id = ? AND step = ? "
          "ORDER BY request_id"),
        tables,
        q("SELECT block, refcount, state, lifetime, hash FROM blocks WHERE run_id = ? AND step = ? ORDER BY block"),
        dict(q("SELECT request_id, max(max_foreign) FROM leak_metrics WHERE run_id = ? AND step = ? "
               "GROUP BY request_id")),
        [dict(zip(FINDING_FIELDS, r, strict=True)) for r in q(
            "SELECT kind, request_id, step, layer, head, position, source_request, mass, block, last_step "
            "FROM findings WHERE run_id = ? AND ? BETWEEN step AND coalesce(last_step, step) "
            "ORDER BY mass DESC NULLS LAST, block")],
    )


def verify(store: RunStore, run_id: str, device: str = "auto") -> list[str]:
    """Re-execute a recorded run and list every difference, first divergence first ([] = identical).
    The record is read first and the store let go: re-execution holds no connection."""
    from ..catalogue.faults import Scope
    from ..engine.workload import Workload
    from ..models import load_model
    from .checked import run_checked

    with store.read() as con:
        rec = load_run(con, run_id)
        stored = dict(con.execute("SELECT request_id, output_ids FROM requests WHERE run_id = ?",
                                  [run_id]).fetchall())
        recorded = {(s, q, lay, h): v for s, q, lay, h, v in con.execute(
            "SELECT step, request_id, layer, head, max_foreign FROM leak_metrics WHERE run_id = ?",
            [run_id]).fetchall()}
    if rec.status != "complete":
        return [f"run {run_id} is {rec.status}, not complete: there is no full record to compare with"]
    model = load_model(rec.model, device=device)
    if model.fingerprint != rec.fingerprint:
        return [f"model {rec.model!r} has other weights now (sha256 {model.fingerprint[:12]}, recorded "
                f"{rec.fingerprint[:12]})"]
    scope = Scope.from_dict(rec.fault_scope) if rec.fault_scope else None
    run = run_checked(model, Workload.from_dict(rec.workload), rec.fault, reference=False, scope=scope)
    problems = []
    for r in run.result.requests:
        old = list(stored.get(r.id) or [])
        if old != r.output_ids:
            at = next((i for i, (a, b) in enumerate(zip(old, r.output_ids, strict=False)) if a != b),
                      min(len(old), len(r.output_ids)))
            problems.append(f"request {r.id}: generated token {at} differs (recorded {old[at:at + 3]}, "
                            f"now {r.output_ids[at:at + 3]})")
    for st in run.oracle.steps:
        for r, req in enumerate(st.requests):
            for (lay, h), v in _cells(st.max_foreign[r]):
                old = recorded.get((st.step, req, lay, h))
                if old is None or abs(old - v) > LEAK_TOLERANCE:
                    problems.append(f"step {st.step}, request {req}, layer {lay}, head {h}: foreign mass "
                                    f"recorded {old}, now {v:.6f}")
                    break
    return problems


def _cells(t) -> list[tuple[tuple[int, int], float]]:
    return [((lay, h), float(t[lay, h])) for lay in range(t.shape[0]) for h in range(t.shape[1])]
