"""`kvviz audit-timing`: the cross-tenant timing audit against any OpenAI-compatible server; a CI
gate for a deployment (exit 1 when its prompt cache is shared at the level asked)."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_audit_timing(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..audit_timing import AuditConfig, record, run_audit

    cfg = AuditConfig(args.base_url.rstrip("/"), args.model, args.level, args.samples, args.prompt_tokens,
                      args.interval, args.alpha, args.endpoint, args.api_key)
    store = args.store
    with tqdm(total=2 * cfg.samples, unit="request", desc=f"auditing ({cfg.level})", file=sys.stderr,
              disable=args.quiet) as bar:
        result = run_audit(cfg, progress=lambda s: bar.update(1))
    verdict = result.verdict()
    audit_id = record(store, result)
    if args.json:
        print(json.dumps({**verdict, "audit_id": audit_id}))
    else:
        says = ("DETECTED: hits reach their first token sooner; this server shares its prompt cache "
                + ("across users" if cfg.level == "global" else "within a user"))
        print(f"timing audit {audit_id} of {cfg.base_url} ({cfg.model}), level {cfg.level}, "
              f"{verdict['samples']} hits and {verdict['samples']} misses of {cfg.prompt_tokens} words")
        print(f"  median TTFT      hit {verdict['median_hit_ms']:.1f} ms   miss {verdict['median_miss_ms']:.1f} ms")
        print(f"  KS statistic     {verdict['ks_statistic']:.3f}   p-value {verdict['p_value']:.3g} "
              f"(alpha {cfg.alpha:g})")
        print(f"  every hit faster than every miss: {'yes' if verdict['hit_faster_than_all_misses'] else 'no'}")
        print(f"  {says if verdict['detected'] else 'not detected at this level'}")
    return 1 if verdict["detected"] else 0


def add_audit_timing(sub, add_db) -> None:
    p = sub.add_parser("audit-timing", help="does a server share its prompt cache across users? a TTFT timing audit")
    p.add_argument("--base-url", required=True, help="the server's OpenAI API, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the model name the server serves")
    p.add_argument("--level", default="global", help="global: the hit's prompt is sent first by another user and "
                   "API key; per-user: by the same one (default global)")
    p.add_argument("--samples", type=int, default=250, help="hits and misses each (default 250)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="length of each prompt, in words (default 512)")
    p.add_argument("--interval", type=float, default=0.0, help="seconds between requests (default 0)")
    p.add_argument("--alpha", type=float, default=1e-8, help="significance level of the KS test (default 1e-8)")
    p.add_argument("--endpoint", default="completions", help="completions (default) or chat")
    p.add_argument("--api-key", default="kvviz-audit", help="the first user's API key; the other user's is this "
                   "with -other appended")
    p.add_argument("--json", action="store_true", help="print the verdict as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_db(p, "run store to record the audit into")
    p.set_defaults(func=cmd_audit_timing)
