"""`kvviz audit-timing`: the paired timing audit against any OpenAI-compatible server; a CI gate for a
deployment, its exit status the timing verdict's: 0 isolated, 1 shared across users, 2 no verdict (or
an error), 3 inconclusive, 4 no caching seen."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from .common import Subcommands, add_db, fail

if TYPE_CHECKING:
    from ..audit_timing.probe import AuditConfig
    from ..audit_timing.telemetry import Telemetry
    from ..audit_timing.verdict import Verdict

SCHEDULE = """Each round times four requests, each right after an untimed primer of the same length that asks
for --primer-tokens tokens, in one of four balanced orders: a same-user hit (the prober sent the
same prompt just before: the positive control), a cross-user hit (another user with another API key
did: the test), a miss (a fresh prompt, primed by the other user) and a null (a fresh prompt, primed
by the prober: the control); then the floor, a one-word prompt timed alone (a server whose full
prompt comes no later than the floor is too fast to time). One-sided KS tests at --alpha ask which
come sooner than the misses. Where replies carry usage.prompt_tokens_details.cached_tokens, the
server's own counts are read beside the timing (the cached-tokens channel), and a disagreement
between the two is reported as a contradiction.

--channel order reads the order replies finish in instead, as PromptPeek (NDSS 2025) does: each
round sends, per kind, the primer, then --dummies fresh prompts at once and the probe just after
(a same-user hit, a cross-user hit, or a fresh prompt: the null); a server that admits its queue by
longest cached prefix (SGLang's lpm; kvviz serve --schedule lpm) lets a cached probe finish ahead of
the dummies, one that serves first come first served does not. Exact permutation tests of the mean
rank at --alpha ask which kinds finish ahead of which, and the same verdicts follow."""
# One line each, in the order of the exit statuses.
VERDICT_HELP = {"isolated": "same-user hits come sooner than misses and than cross-user hits, cross-user hits "
                            "no sooner than misses",
                "shared across users": "cross-user hits come sooner than misses",
                "no verdict": "too few rounds to reach alpha, prompts of unequal length, a server too fast to "
                              "time, or one that failed before enough rounds (also any error)",
                "inconclusive": "the null control rejects too (a biased measurement), or cross-user hits sit "
                                "between same-user hits and misses (more rounds)",
                "no caching seen": "even same-user hits come no sooner: isolation cannot be told from no cache "
                                   "(try longer prompts, more primer tokens, more rounds, the server's prefix "
                                   "cache on)"}
LEVEL_GONE = ("--level is gone: every audit is now paired, timing same-user hits (what --level per-user timed) and "
              "cross-user hits (what --level global timed) in one schedule")


def _epilog() -> str:
    """The schedule, each verdict with its exit status, and what became of --level, wrapped as the
    options above are not (argparse leaves an epilog as written)."""
    import textwrap

    from ..audit_timing.verdict import VERDICTS

    lines = [textwrap.fill(f"  {code}  {verdict:<20} {VERDICT_HELP[verdict]}", 100, subsequent_indent=" " * 26,
                           break_on_hyphens=False)
             for verdict, code in sorted(VERDICTS.items(), key=lambda kv: kv[1])]
    return (SCHEDULE + "\n\nverdicts and exit statuses (the timing verdict's; the cached-tokens channel is said "
            "beside it):\n" + "\n".join(lines) + "\n\n"
            + textwrap.fill(f"{LEVEL_GONE}; audits stored with a level stay readable.", 100))


def cmd_audit_timing(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..audit_timing.order import KINDS
    from ..audit_timing.probe import TIMED, AuditConfig, record, run_audit
    from ..audit_timing.telemetry import contradiction

    if args.level is not None:
        return fail(f"{LEVEL_GONE}; drop --level", args.command)
    cfg = AuditConfig(base_url=args.base_url.rstrip("/"), model=args.model, samples=args.samples,
                      prompt_tokens=args.prompt_tokens, primer_tokens=args.primer_tokens, interval=args.interval,
                      alpha=args.alpha, endpoint=args.endpoint, api_key=args.api_key, channel=args.channel,
                      dummies=args.dummies, stagger=args.stagger)
    store = args.store
    if cfg.channel == "order":  # per kind a primer, the dummies and the probe
        per_round, done = len(KINDS) * (cfg.dummies + 2), lambda s: cfg.dummies + 2
    else:  # a primer and a timed request of each kind, and the floor
        per_round, done = 2 * len(TIMED) + 1, lambda s: 1 if s.kind == "floor" else 2
    with tqdm(total=per_round * cfg.samples, unit="request", desc="auditing", file=sys.stderr,
              disable=args.quiet) as bar:
        result = run_audit(cfg, progress=lambda s: bar.update(done(s)))
    v, t = result.judge(), result.telemetry()
    audit_id = record(store, result, v, t)
    if args.json:
        print(json.dumps({"audit_id": audit_id, **asdict(v), "exit_status": v.exit_status,
                          "primer_tokens": cfg.primer_tokens, "telemetry": asdict(t),
                          "contradiction": contradiction(v, t) or None}))
    else:
        (_say_order if cfg.channel == "order" else _say)(audit_id, cfg, v, t)
    return v.exit_status


def _say(audit_id: str, cfg: AuditConfig, v: Verdict, t: Telemetry) -> None:

    m = v.medians_ms
    print(f"timing audit {audit_id} of {cfg.base_url} ({cfg.model}), {v.samples} rounds of a same-user hit, a "
          f"cross-user hit, a miss and a null of {v.prompt_tokens or cfg.prompt_tokens} tokens"
          + ("" if v.prompt_tokens else " (words; the server reports no usage)")
          + f", each after a primer of max_tokens {cfg.primer_tokens}")
    print(f"  median TTFT        same-user hit {_ms(m['same'])}   cross-user hit {_ms(m['cross'])}   miss "
          f"{_ms(m['miss'])}   null {_ms(m['null'])}   floor (one word) {_ms(m['floor'])}")
    _tests((("cross-user vs miss", v.cross, "the test"), ("same-user vs miss", v.same, "the positive control"),
            ("same vs cross-user", v.apart, "isolation must reject"),
            ("null vs miss", v.null, "the control: must not reject")), lambda x: f"KS D {x:.3f}", cfg.alpha)
    _verdict_lines(v, t)


def _tests(tests, statistic, alpha: float) -> None:
    """A line per test that ran: its name, statistic (as `statistic` says it), p-value and role."""
    for name, test, note in tests:
        if test.p_value is not None:
            print(f"  {name:<18} {statistic(test.ks_statistic)}   p-value {test.p_value:.3g} ({note}; alpha {alpha:g})")


def _verdict_lines(v: Verdict, t: Telemetry) -> None:
    from ..audit_timing.telemetry import contradiction, said
    from ..audit_timing.verdict import HEADLINES

    print(f"  {HEADLINES[v.verdict].upper()} (exit {v.exit_status}): {v.reason}")
    print(f"  cached tokens: {said(t)}")
    if found := contradiction(v, t):
        print(f"  CONTRADICTION: {found}")


def _say_order(audit_id: str, cfg: AuditConfig, v: Verdict, t: Telemetry) -> None:
    ranks = v.ranks or {}
    print(f"order audit {audit_id} of {cfg.base_url} ({cfg.model}), {v.samples} rounds of a same-user hit, a "
          f"cross-user hit and a fresh prompt (the null) of {v.prompt_tokens or cfg.prompt_tokens} tokens, each sent "
          f"{cfg.stagger:g} s after {cfg.dummies} fresh prompts, after a primer of max_tokens {cfg.primer_tokens}")
    print(f"  median rank (dummies finished before it, of {cfg.dummies})   " + "   ".join(
        f"{name} {ranks[k]:g}" for k, name in (("same", "same-user hit"), ("cross", "cross-user hit"), ("null", "null"))
        if k in ranks))
    _tests((("cross-user vs null", v.cross, "the test"), ("same-user vs null", v.same, "the positive control"),
            ("same vs cross-user", v.apart, "isolation must reject")),
           lambda x: f"mean-rank shift {x:+.2f} places", cfg.alpha)
    _verdict_lines(v, t)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def add_audit_timing(sub: Subcommands) -> None:
    from ..audit_timing import defaults as d

    p = sub.add_parser("audit-timing", help="does a server share its prompt cache across users? a paired TTFT "
                       "timing audit", description="Does an OpenAI-compatible server share its prompt cache across "
                       "users? A paired timing audit by time to first token, after Gu et al. 2025.",
                       epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="the server's OpenAI API, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the model name the server serves")
    p.add_argument("--samples", type=int, default=d.ROUNDS, help="rounds, each timing a same-user hit, a "
                   f"cross-user hit, a miss, a null and the floor (default {d.ROUNDS}; the published protocol "
                   "uses 250)")
    p.add_argument("--prompt-tokens", type=int, default=d.PROMPT_WORDS, help="length of each prompt, in words "
                   f"of one token each on SmolLM2 (default {d.PROMPT_WORDS}: a hit shows only in the cache pages "
                   "its prompt fills)")
    p.add_argument("--primer-tokens", type=int, default=d.PRIMER_TOKENS, help="max_tokens of each untimed "
                   f"primer (default {d.PRIMER_TOKENS}: a server may cache nothing of a request that ends in its "
                   "prefill step); timed requests ask for 1")
    p.add_argument("--interval", type=float, default=0.0, help="seconds of quiet between rounds (default 0)")
    p.add_argument("--alpha", type=float, default=d.ALPHA, help=f"significance level of each KS test (default "
                   f"{d.ALPHA:g})")
    p.add_argument("--endpoint", default="completions", help="completions (default) or chat")
    p.add_argument("--api-key", default="kvviz-audit", help="the prober's API key; the other user's is this with "
                   "-other appended")
    p.add_argument("--level", help=argparse.SUPPRESS)  # refused, saying why: see LEVEL_GONE
    p.add_argument("--channel", choices=d.CHANNELS, default="time", help="time: time to first token (default); "
                   "order: the probe's finishing rank among fresh prompts sent just before it")
    p.add_argument("--dummies", type=int, default=d.DUMMIES, help=f"order channel: fresh prompts sent just before "
                   f"each probe, to make the server queue (default {d.DUMMIES})")
    p.add_argument("--stagger", type=float, default=d.STAGGER, help=f"order channel: seconds between the dummies "
                   f"and the probe (default {d.STAGGER:g})")
    p.add_argument("--json", action="store_true", help="print the verdict, its tests and the cached-tokens "
                   "channel as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_db(p, "run store to record the audit into")
    p.set_defaults(func=cmd_audit_timing)
