"""Cross-tenant reads in words: which blocks of which tenant a request of another tenant read, and at
which steps. A read of identical content is no attention leak (it moves neither leak rate nor foreign
mass), so every place that shows those figures says this sentence beside them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import duckdb

if TYPE_CHECKING:
    from ..oracle import Finding


NO_SALT = "(no salt)"
UNKNOWN = "(unknown)"  # a request the store holds no row for (a served run records requests as they end)
_CROSSED = ("each block was computed under another tenant's salt and served to this one: a trust boundary crossed "
            "(the prompt cache's timing side channel).")


def why(foreign_too: bool) -> str:
    """Why a cross-tenant read moves no leak figure: its keys are exact copies of the reader's own. When the run
    leaked as well (`foreign_too`), the figures count the other keys, which hold something else."""
    if foreign_too:
        return ("Where such keys hold the same tokens at the same positions as the request's own prompt would, "
                "its attention there counts as its own; the leak rate and foreign mass count the keys that differ. "
                "Either way " + _CROSSED)
    return ("These keys hold the same tokens at the same positions as the request's own prompt would, so its "
            "attention sees nothing foreign and the leak rate and foreign mass stay 0; yet " + _CROSSED)


@dataclass(frozen=True)
class BlockRead:
    """One block another tenant wrote, read by a request at steps first..last."""

    reader: str
    reader_tenant: str
    writer: str | None
    writer_tenant: str
    block: int
    first: int
    last: int


def tenant_name(salt: str | None) -> str:
    return NO_SALT if salt is None else salt


def tenant(name: str) -> str:
    """'tenant X' said once: a tenant already named like tenant-a is not 'tenant tenant-a'."""
    return name if name.lower().startswith("tenant") else f"tenant {name}"


def from_findings(findings: Iterable[Finding], salts: Mapping[str, str | None]) -> list[BlockRead]:
    """The oracle's cross_tenant findings so far (a run in progress), with each request's salt."""
    return [BlockRead(f.request, tenant_name(salts.get(f.request)), f.source_request,
                      tenant_name(salts.get(f.source_request)) if f.source_request else UNKNOWN,
                      f.block, f.step, f.last_step if f.last_step is not None else f.step)
            for f in findings if f.kind == "cross_tenant" and f.block is not None]


def from_store(con: duckdb.DuckDBPyConnection, run_id: str) -> list[BlockRead]:
    """A recorded run's cross_tenant findings that name a block (a capture's name none), with the
    tenant of each request from the requests table."""
    rows = con.execute(
        "SELECT f.request_id, r.request_id IS NOT NULL, r.tenant, f.source_request, w.request_id IS NOT NULL, "
        "w.tenant, f.block, f.step, coalesce(f.last_step, f.step) FROM findings f "
        "LEFT JOIN requests r ON r.run_id = f.run_id AND r.request_id = f.request_id "
        "LEFT JOIN requests w ON w.run_id = f.run_id AND w.request_id = f.source_request "
        "WHERE f.run_id = ? AND f.kind = 'cross_tenant' AND f.block IS NOT NULL "
        "ORDER BY f.request_id, f.block, f.step", [run_id]).fetchall()
    return [BlockRead(reader, tenant_name(rt) if rk else UNKNOWN, writer, tenant_name(wt) if wk else UNKNOWN,
                      block, first, last) for reader, rk, rt, writer, wk, wt, block, first, last in rows]


def sentence(reads: list[BlockRead]) -> str | None:
    """'cross-tenant reads: N blocks of tenant X read by tenant Y (R read blocks ..., written by W, at
    steps ...)', one clause per pair of tenants (tenant-a, not 'tenant tenant-a'); None when there is no read."""
    if not reads:
        return None
    pairs: dict[tuple[str, str], list[BlockRead]] = {}
    for r in sorted(reads, key=lambda r: (r.writer_tenant, r.reader_tenant, r.reader, r.block, r.first)):
        pairs.setdefault((r.writer_tenant, r.reader_tenant), []).append(r)
    clauses = []
    for (writer_tenant, reader_tenant), group in pairs.items():
        n = len({r.block for r in group})
        readers: dict[str, list[BlockRead]] = {}
        for r in group:
            readers.setdefault(r.reader, []).append(r)
        detail = "; ".join(_reader_detail(name, rs) for name, rs in readers.items())
        clauses.append(f"{n} block{'s' if n != 1 else ''} of {tenant(writer_tenant)} read by {tenant(reader_tenant)} "
                       f"({detail})")
    return "cross-tenant reads: " + "; ".join(clauses)


def _reader_detail(reader: str, reads: list[BlockRead]) -> str:
    blocks = {r.block for r in reads}
    steps = {(r.first, r.last) for r in reads}
    many_steps = len(steps) > 1 or any(a != b for a, b in steps)
    writers = sorted({r.writer for r in reads if r.writer})
    by = f", written by {', '.join(writers)}," if writers else ""
    return (f"{reader} read block{'s' if len(blocks) > 1 else ''} {spans((b, b) for b in blocks)}{by} "
            f"at step{'s' if many_steps else ''} {spans(steps)}")


def spans(intervals: Iterable[tuple[int, int]]) -> str:
    """Inclusive intervals merged where they overlap or touch: (0, 0), (1, 2), (5, 5) -> '0-2, 5'."""
    merged: list[list[int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in merged)
