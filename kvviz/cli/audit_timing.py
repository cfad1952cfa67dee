"""`kvviz audit-timing`: the cross-tenant timing audit against any OpenAI-compatible server; a CI
gate for a deployment: exit 1 when its prompt cache is shared at the level asked, 0 when not, 3 when
the null control says the measurement is biased, 2 when there is no verdict (or an error)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from .common import Subcommands, add_db

if TYPE_CHECKING:
    from ..audit_timing.probe import AuditConfig
    from ..audit_timing.verdict import Verdict


def cmd_audit_timing(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..audit_timing.probe import AuditConfig, record, run_audit

    cfg = AuditConfig(args.base_url.rstrip("/"), args.model, args.level, args.samples, args.prompt_tokens,
                      args.interval, args.alpha, args.endpoint, args.api_key)
    store = args.store
    with tqdm(total=7 * cfg.samples, unit="request", desc=f"auditing ({cfg.level})", file=sys.stderr,
              disable=args.quiet) as bar:  # a round: three primers, hit, miss, null and the floor
        result = run_audit(cfg, progress=lambda s: bar.update(2 if s.kind in ("hit", "miss", "null") else 1))
    v = result.judge()
    audit_id = record(store, result, v)
    if args.json:
        print(json.dumps({"audit_id": audit_id, "level": cfg.level, **asdict(v), "detected": v.detected}))
    else:
        _say(audit_id, cfg, v)
    return v.exit_status


def _say(audit_id: str, cfg: AuditConfig, v: Verdict) -> None:
    from ..audit_timing.verdict import HEADLINES, in_words, server_says

    print(f"timing audit {audit_id} of {cfg.base_url} ({cfg.model}), level {cfg.level}, {v.samples} rounds of a "
          f"hit, a miss and a null of {v.prompt_tokens or cfg.prompt_tokens} tokens"
          + ("" if v.prompt_tokens else " (words; the server reports no usage)"))
    print(f"  median TTFT      hit {_ms(v.median_hit_ms)}   miss {_ms(v.median_miss_ms)}   null "
          f"{_ms(v.median_null_ms)}   floor (one word) {_ms(v.median_floor_ms)}")
    if v.p_value is not None:
        print(f"  hit vs miss      KS D {v.ks_statistic:.3f}   p-value {v.p_value:.3g} (alpha {cfg.alpha:g})")
    if v.null_p_value is not None:
        print(f"  null vs miss     KS D {v.null_ks_statistic:.3f}   p-value {v.null_p_value:.3g} (the control: "
              f"must not reject)")
    says = HEADLINES[v.verdict] if v.verdict == "not detected" else HEADLINES[v.verdict].upper()
    print(f"  {says}: " + "; ".join(x for x in (in_words(v.verdict, cfg.level), v.reason) if x))
    if server_says(v):
        print(f"  {server_says(v)}")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def add_audit_timing(sub: Subcommands) -> None:
    p = sub.add_parser("audit-timing", help="does a server share its prompt cache across users? a TTFT timing audit")
    p.add_argument("--base-url", required=True, help="the server's OpenAI API, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the model name the server serves")
    p.add_argument("--level", default="global", help="global: the hit's prompt is sent first by another user and "
                   "API key; per-user: by the same one (default global)")
    p.add_argument("--samples", type=int, default=250, help="rounds, each timing a hit, a miss and a null "
                   "control (default 250)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="length of each prompt, in words "
                   "of one token each (default 512)")
    p.add_argument("--interval", type=float, default=0.0, help="seconds of quiet between rounds (default 0)")
    p.add_argument("--alpha", type=float, default=1e-8, help="significance level of the KS test (default 1e-8)")
    p.add_argument("--endpoint", default="completions", help="completions (default) or chat")
    p.add_argument("--api-key", default="kvviz-audit", help="the prober's API key; at the global level the other "
                   "user's is this with -other appended")
    p.add_argument("--json", action="store_true", help="print the verdict as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_db(p, "run store to record the audit into")
    p.set_defaults(func=cmd_audit_timing)
