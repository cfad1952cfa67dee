"""The commands that read or fill the run store without running a model: `sql`, `replay`, `export`
and `import` (replay --verify does re-execute, through the store's own replay module). Each gets the
process's one RunStore as args.store; a refusal is a KvvizError, reported by main."""

from __future__ import annotations

import argparse
import json
import sys

from .common import DEVICE_HELP, Subcommands, add_db, fail, finding_text, print_rows


def cmd_sql(args: argparse.Namespace) -> int:
    """A read-only query over the run store; exit 2 with the reason when it is refused."""
    from ..store import run_query

    if args.limit < 0:
        return fail(f"--limit must be >= 0, got {args.limit}", "sql")
    with args.store.read() as con:
        res = run_query(con, args.query, max_rows=args.limit)
    print_rows(res.columns, res.rows, args.format)
    if res.truncated:
        print(f"kvviz: sql: showing the first {args.limit} rows", file=sys.stderr)
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    """The runs in the store, newest first: what the app's Runs page lists."""
    from ..analysis.runs import list_runs

    if args.limit < 1:
        return fail(f"--limit must be >= 1, got {args.limit}", "runs")
    with args.store.read() as con:
        df = list_runs(con)
    shown = df.head(args.limit)[["run_id", "created_at", "status", "model", "engine", "kernel", "isolation", "scenario",
                                 "fault", "steps", "findings", "breaches", "max_foreign_mass"]]
    print_rows(list(shown.columns), [tuple(r) for r in shown.itertuples(index=False)], args.format)
    if len(df) > args.limit:
        print(f"kvviz: runs: the newest {args.limit} of {len(df)} (--limit)", file=sys.stderr)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Show a recorded run at one step, or re-execute it and verify it (exit 1 on a mismatch)."""
    from ..runners.replay import load_run, state_at, verify

    if args.verify:
        problems = verify(args.store, args.run_id, device=args.device)
        for p in problems:
            print(f"MISMATCH {p}")
        print(f"run {args.run_id}: " + ("replays identically" if not problems else f"{len(problems)} mismatches"))
        return 1 if problems else 0
    with args.store.read() as con:
        rec = load_run(con, args.run_id)
        st = state_at(con, args.run_id, args.step)
    print(f"run {rec.run_id} ({rec.status}), model {rec.model}, fault {rec.fault or 'none'}: step {st.step}")
    for req, start, n, tok in st.work:
        sampled = f", sampled {tok}" if tok is not None else ""
        print(f"  {req:>10} computed positions {start}..{start + n - 1}{sampled}")
    for req, table in st.page_tables.items():
        print(f"  page table {req:>10}: {table}")
    used = sum(1 for b in st.blocks if b[2] == "used")
    cached = sum(1 for b in st.blocks if b[2] == "cached")
    print(f"  blocks: {used} used, {cached} cached, {len(st.blocks) - used - cached} free; "
          f"refcounts {[b[1] for b in st.blocks if b[1]]}")
    for req, mass in st.leak.items():
        print(f"  {req:>10} max foreign mass {mass:.4f}")
    for f in st.findings:
        print(f"  finding {finding_text(**f)}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A recorded run as a kvviz trace (zip of Parquet) or Chrome trace JSON for Perfetto."""
    from ..store.chrome import export_chrome
    from ..store.trace import export_run

    out = args.out or f"{args.run_id}.{'zip' if args.format == 'kvviz' else 'json'}"
    (export_run if args.format == "kvviz" else export_chrome)(args.store, args.run_id, out)
    print(out)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Validate and import a kvviz trace, a vLLM/SGLang KV-event capture or a Mooncake trace into the
    store; a bad file is refused whole, with the reason."""
    from ..runners.uploads import earlier_import, import_file

    before = earlier_import(args.file, args.store)
    if before.run_id is not None and not args.again:
        print(f"kvviz: {args.file} was imported before, as run {before.run_id} (--again imports it anew)",
              file=sys.stderr)
        print(before.run_id)
        return 0
    tty = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if tty:
            print(f"\rkvviz: importing {args.file}: {100 * done // total}%", end="", file=sys.stderr, flush=True)

    run_id = import_file(args.file, args.store, progress, args.in_place, None if args.again else before.sha256)
    if tty:
        print("", file=sys.stderr)
    with args.store.read() as con:
        events, messages, replicas, crossed, tiers, breaches = con.execute(
            "SELECT (SELECT count(*) FROM kv_events WHERE run_id = $r), steps, (SELECT count(DISTINCT replica) "
            "FROM kv_events WHERE run_id = $r), (SELECT count(*) FROM findings WHERE run_id = $r), "
            "(SELECT count(*) FROM cross_tier_salts WHERE run_id = $r), "
            "(SELECT count(*) FROM capture_breaches WHERE run_id = $r) FROM runs WHERE run_id = $r",
            {"r": run_id}).fetchone()
    if events:
        print(f"kvviz: imported {events:,} block events from {messages:,} messages of {replicas} "
              f"replica{'' if replicas == 1 else 's'}; {crossed} cross-tenant findings (between salts the events "
              "name)" + (f"; {tiers} cross-tier salt finding{'s' if tiers > 1 else ''} (blocks kept salted in one "
                         "tier, unsalted in another)" if tiers else "") + (
                  f"; {breaches} breach{'es' if breaches > 1 else ''} of the KV-event contract (python -m kvviz "
                  f"lint {run_id})" if breaches else ""), file=sys.stderr)
    print(run_id)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """Why each lookup of a run (or each stored chain of a capture) stopped where it did."""
    from ..analysis.explained import COUNTING, STAGES, contradiction_sentence, explain_seconds, explained, kept

    class SaidOnStderr:  # a capture of millions of events takes a minute: each stage said as it begins
        def stage(self, stage: str, detail: str) -> None:
            number = STAGES.index(stage)  # 0: waiting for another process, which is no stage of the work
            print(f"kvviz: explain{f' {number}/{len(STAGES) - 1}' if number else ''}: {stage}"
                  + (f" ({detail})" if detail else ""), file=sys.stderr)

        def running_on(self, con) -> None:
            pass

    with args.store.read() as con:
        args.store.require_run(con, args.run_id)
        events = 0 if kept(con, args.run_id) else con.execute(
            "SELECT count(*) FROM kv_events WHERE run_id = ?", [args.run_id]).fetchone()[0]
    if events:
        print(f"kvviz: explaining the capture's {events:,} events, each lookup (about {explain_seconds(events):,} s); "
              "the answer is kept, so this happens once", file=sys.stderr)
    watch = SaidOnStderr() if events else None
    found = explained(args.store, args.run_id, watch=watch)
    if watch is not None:
        watch.stage(COUNTING, "")
    said = contradiction_sentence(args.store, args.run_id)
    if said:
        print(f"kvviz: {said}", file=sys.stderr)
    if args.request is not None:
        found = found.of_request(args.request)
        if not found:
            return fail(f"run {args.run_id} has no lookup of request {args.request!r}", "explain")
    if args.summary:
        share = (lambda n: round(n / len(found), 4)) if args.json else (lambda n: f"{n / len(found):.1%}")
        print_rows(["reason", "lookups", "share"], [(r, n, share(n)) for r, n in
                                                      found.by_reason().most_common()],
                    "json" if args.json else "table")
        return 0
    if args.json:
        print(json.dumps({"run_id": args.run_id, "lookups": [
            {"request": e.request, "step": e.step, "hit_tokens": e.hit_tokens, "stop_block": e.stop_block,
             "stop_token": e.stop_token, "reason": e.reason, "evidence": e.evidence} for e in found]}))
        return 0
    rows = [(e.request, str(e.step), str(e.hit_tokens), str(e.stop_block), e.reason,
             ", ".join(f"{k} {v}" for k, v in e.evidence.items())) for e in found]
    head = ("request", "step", "hit tokens", "stopped at block", "reason", "evidence")
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    for r in (head, *rows):
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    return 0


def add_runs(sub: Subcommands) -> None:
    runs = sub.add_parser("runs", help="the runs in the run store, newest first")
    add_db(runs)
    runs.add_argument("--format", choices=["table", "csv", "json"], default="table")
    runs.add_argument("--limit", type=int, default=20, help="most runs listed (default 20)")
    runs.set_defaults(func=cmd_runs)


def add_sql(sub: Subcommands) -> None:
    sql = sub.add_parser("sql", help="a read-only SQL query over the run store")
    sql.add_argument("query", help='e.g. "SELECT run_id, status, fault, max_foreign_mass FROM runs"')
    add_db(sql)
    sql.add_argument("--format", choices=["table", "csv", "json"], default="table")
    sql.add_argument("--limit", type=int, default=10_000, help="most rows returned (default 10000)")
    sql.set_defaults(func=cmd_sql)


def add_replay(sub: Subcommands) -> None:
    rep = sub.add_parser("replay", help="a recorded run at one step, or re-executed and verified")
    rep.add_argument("run_id")
    rep.add_argument("--step", type=int, default=0, help="the step to show (default 0)")
    rep.add_argument("--verify", action="store_true", help="re-execute and compare tokens and leak metrics")
    add_db(rep)
    rep.add_argument("--device", default="auto", help=DEVICE_HELP)
    rep.set_defaults(func=cmd_replay)


def add_export(sub: Subcommands) -> None:
    exp = sub.add_parser("export", help="a recorded run as a kvviz trace or Chrome trace JSON (Perfetto)")
    exp.add_argument("run_id")
    exp.add_argument("--format", choices=["kvviz", "chrome"], default="kvviz")
    exp.add_argument("--out", help="output file (default RUN_ID.zip or RUN_ID.json)")
    add_db(exp)
    exp.set_defaults(func=cmd_export)


def add_import(sub: Subcommands) -> None:
    imp = sub.add_parser("import", help="import a kvviz trace, a vLLM/SGLang KV-event capture or a Mooncake request "
                                        "trace into the run store")
    imp.add_argument("file", metavar="PATH", help="a kvviz trace (.zip), a capture (.jsonl), a Mooncake trace (.jsonl "
                                                 "of hash_ids: imported as a capture), a capture dataset folder or "
                                                 "one of its .parquet parts")
    imp.add_argument("--in-place", action="store_true",
                     help="a capture dataset folder: register it where it lies (kv_events reads its files; nothing "
                          "is copied, and moving it later marks the run failed)")
    imp.add_argument("--again", action="store_true",
                     help="import a capture that was imported before once more, as a new run (without it, the "
                          "earlier run's id is printed)")
    add_db(imp)
    imp.set_defaults(func=cmd_import)


def add_explain(sub: Subcommands) -> None:
    expl = sub.add_parser("explain", help="why each prefix-cache lookup of a run (or capture) stopped where it did")
    expl.add_argument("run_id")
    expl.add_argument("--request", metavar="ID", help="only this request (a capture's: its session id, or chain-HASH)")
    expl.add_argument("--json", action="store_true", help="one JSON object as the last line")
    expl.add_argument("--summary", action="store_true", help="only how many lookups stopped for each reason")
    add_db(expl)
    expl.set_defaults(func=cmd_explain)
