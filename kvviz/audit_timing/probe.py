"""`kvviz audit-timing`: does an OpenAI-compatible server share its prompt cache across users, seen
from the outside by time to first token (TTFT)? After the published protocol (Gu et al. 2025, see
shared/reference/production-debugging.md), paired: every round times a same-user hit (a prompt the
prober itself sent just before: the positive control, does caching show at all?), a cross-user hit (a
prompt another user, with another API key, sent just before: the test), a miss (a prompt no one sent)
and a null, and one-sided two-sample Kolmogorov-Smirnov tests ask which come sooner
(kvviz/audit_timing/verdict.py). A server that salts its cache per user shows its same-user hits and
not its cross-user ones; a server that caches nothing the audit can see shows neither, and the audit
says it cannot tell that from isolation. (Until schema version 17 an audit timed one kind of hit, at
a `level`: global, another user's; per-user, the prober's own. Those audits stay readable.)

The schedule is symmetric, so nothing but the cache can tell the kinds apart: every timed request
follows an untimed primer of the same token count and max_tokens (the same prompt for a hit, a fresh
one for a miss or the null), which also takes any work the server or this process still had from
before. The primers of cross-user hits and misses are the other user's, those of same-user hits and
the null the prober's own, so that the null differs from a miss only in who primed it: the control of
the schedule and of the sender. The four are timed in one of four orders in turn (a balanced Latin
square: over any four rounds each is timed first, second, third and last once, and right after each
other once), then a one-word floor.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..errors import AuditError
from ..store import RunStore
from ..util.ids import new_run_id
from . import defaults
from .client import Prober, Reply
from .order import KINDS, judge_order, order_round
from .telemetry import Telemetry, contradiction, read
from .verdict import TIMED, Verdict, fewest_samples, judge, smallest_p

ENDPOINTS = ("completions", "chat")
# Williams' balanced Latin square for four: row r times the kinds r, r+1, r-1, r+2 (mod 4) in that order.
ORDERS = tuple(tuple(TIMED[(start + step) % 4] for step in (0, 1, 3, 2)) for start in range(4))
PRIMED_BY_PROBER = ("same", "null")  # the others' primers are the other user's
# Common English words, each one token after a space in SmolLM2's tokenizer (and in most BPE
# vocabularies): a prompt of n of them is about n tokens; the server's usage.prompt_tokens says exactly.
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue side "
         "kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


@dataclass(frozen=True)
class AuditConfig:
    base_url: str
    model: str
    samples: int = defaults.ROUNDS  # rounds: same-user hits, cross-user hits, misses and nulls each
    prompt_tokens: int = defaults.PROMPT_WORDS  # words of WORDS, a token each
    primer_tokens: int = defaults.PRIMER_TOKENS  # max_tokens of every untimed primer (timed requests ask for 1)
    interval: float = 0.0  # seconds of quiet after each round, before the next one's first primer
    alpha: float = defaults.ALPHA
    endpoint: str = "completions"
    api_key: str = "kvviz-audit"  # the prober's key; the other user's is this with "-other" appended
    timeout: float = 120.0
    target: str | None = None  # what was audited, in words (a kvviz server the app started: its model and policy)
    channel: str = "time"  # time: TTFT; order: the probe's finishing rank among dummies (order.py)
    dummies: int = defaults.DUMMIES  # order channel: fresh prompts sent just before each probe
    stagger: float = defaults.STAGGER  # order channel: seconds between the dummies and the probe

    def __post_init__(self) -> None:
        if self.channel not in defaults.CHANNELS:
            raise AuditError(f"channel must be one of {', '.join(defaults.CHANNELS)}, got {self.channel!r}")
        if self.dummies < 2:
            raise AuditError(f"the order channel needs at least 2 dummies a round, got {self.dummies}")
        if not 0 <= self.stagger <= 10:
            raise AuditError(f"stagger must be between 0 and 10 seconds, got {self.stagger}")
        if self.endpoint not in ENDPOINTS:
            raise AuditError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_tokens < 16:
            raise AuditError(f"prompt length must be >= 16 tokens, got {self.prompt_tokens}")
        if self.primer_tokens < 1:
            raise AuditError(f"the primers' max_tokens must be >= 1, got {self.primer_tokens}")
        if self.interval < 0:
            raise AuditError(f"interval must be >= 0 seconds, got {self.interval}")
        if not 0 < self.alpha < 1:
            raise AuditError(f"alpha must be between 0 and 1, got {self.alpha}")
        if self.samples < 2 or smallest_p(self.samples) >= self.alpha:  # it could never give a verdict
            raise AuditError(f"{self.samples} rounds (samples a side) cannot reach alpha {self.alpha:g}: even every "
                             f"hit faster than every miss gives p = {smallest_p(max(self.samples, 1)):.2g}; use at "
                             f"least {fewest_samples(self.alpha)} rounds (or a larger alpha)")
        if not self.base_url.startswith(("http://", "https://")):
            raise AuditError(f"the base URL must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                             f"got {self.base_url!r}")


@dataclass(frozen=True)
class Sample:
    kind: str  # same | cross | miss | null | floor
    index: int  # the round
    ttft_ms: float
    cached_tokens: int | None  # what the server reported for the timed request, when it does
    prompt_tokens: int | None = None  # the timed prompt's length as the server counted it, when it does
    primer_tokens: int | None = None  # the same of the primer sent just before it
    rank: int | None = None  # order channel: how many of the round's dummies finished before the probe


@dataclass
class AuditResult:
    config: AuditConfig
    samples: list[Sample] = field(default_factory=list)
    stopped: str = ""  # why the audit ended before its last round, in one sentence

    def times(self, kind: str) -> list[float]:
        return [s.ttft_ms for s in self.samples if s.kind == kind]

    def judge(self) -> Verdict:
        """The channel's verdict."""
        tokens = {k: [s.prompt_tokens for s in self.samples if s.kind == k and s.prompt_tokens is not None]
                  for k in TIMED}
        if self.config.channel == "order":
            ranks = {k: [s.rank for s in self.samples if s.kind == k] for k in KINDS}
            return judge_order(ranks, {k: self.times(k) for k in KINDS}, tokens, self.config.dummies,
                               self.config.alpha, self.stopped)
        return judge({k: self.times(k) for k in (*TIMED, "floor")}, tokens, self.config.alpha,
                     self.config.primer_tokens, self.stopped)

    def telemetry(self) -> Telemetry:
        """The cached-tokens channel's reading."""
        return read({k: [s.cached_tokens for s in self.samples if s.kind == k] for k in TIMED},
                    any(s.prompt_tokens is not None for s in self.samples))


def _prompt(rng: random.Random, words: int) -> str:
    """A prompt no one sent before: its first block of random words is new with near certainty
    (100^16 choices), so it shares no cached block with anything."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def run_audit(cfg: AuditConfig, progress: Callable[[Sample], None] | None = None,
              between: Callable[[AuditResult], None] | None = None, seed: int | None = None) -> AuditResult:
    """Time `cfg.samples` rounds. `progress` hears each sample as it is timed (keep it cheap);
    `between` hears the result so far after each round, before the quiet interval and the next
    round's first primer, so work it does (drawing) never overlaps a timed request. A server that
    fails after the first sample ends the audit with the timings so far and `stopped` saying why."""
    rng = random.Random(seed)
    prober = Prober(cfg.base_url, cfg.model, cfg.endpoint, cfg.api_key, "kvviz-audit", cfg.timeout)
    other = Prober(cfg.base_url, cfg.model, cfg.endpoint, cfg.api_key + "-other", "kvviz-audit-other", cfg.timeout)
    out = AuditResult(config=cfg)
    pool = ThreadPoolExecutor(cfg.dummies, thread_name_prefix="kvviz-audit") if cfg.channel == "order" else None
    try:
        for i in range(cfg.samples):
            if pool is not None:
                fresh = lambda: _prompt(rng, cfg.prompt_tokens)  # noqa: E731
                for kind, rank, reply, primer in order_round(i, prober, other, fresh, cfg.dummies, cfg.stagger,
                                                             cfg.primer_tokens, pool):
                    _add(out, kind, i, reply, primer, progress, rank)
            else:
                _time_round(i, rng, cfg, prober, other, out, progress)
            if between is not None:
                between(out)
            time.sleep(cfg.interval)
    except AuditError as e:
        if not out.samples:
            raise
        out.stopped = f"stopped in round {i + 1} of {cfg.samples}: {e}"
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return out


def _time_round(i: int, rng: random.Random, cfg: AuditConfig, prober: Prober, other: Prober, out: AuditResult,
                progress: Callable[[Sample], None] | None) -> None:
    """The timing channel's round i: each kind after its primer, in this round's order, then the floor."""
    for kind in ORDERS[i % len(ORDERS)]:
        prompt = _prompt(rng, cfg.prompt_tokens)
        first = prober if kind in PRIMED_BY_PROBER else other
        primer = first.send(prompt if kind in ("same", "cross") else _prompt(rng, cfg.prompt_tokens),
                            cfg.primer_tokens)
        _add(out, kind, i, prober.send(prompt), primer, progress)
    _add(out, "floor", i, prober.send(rng.choice(WORDS)), None, progress)


def _add(out: AuditResult, kind: str, i: int, r: Reply, primer: Reply | None,
         progress: Callable[[Sample], None] | None, rank: int | None = None) -> None:
    out.samples.append(Sample(kind=kind, index=i, ttft_ms=r.ttft_ms, cached_tokens=r.cached_tokens,
                              prompt_tokens=r.prompt_tokens, primer_tokens=primer.prompt_tokens if primer else None,
                              rank=rank))
    if progress is not None:
        progress(out.samples[-1])


def record(store: RunStore, result: AuditResult, verdict: Verdict | None = None,
           telemetry: Telemetry | None = None) -> str:
    """The audit, its verdict, the cached-tokens channel's reading, any contradiction between them and
    the raw timings (partial ones too) into the run store, in one transaction; its id."""
    from ..store.schema import arrow_table

    audit_id, cfg = new_run_id(), result.config
    v, t = verdict or result.judge(), telemetry or result.telemetry()
    cross, miss, m = result.times("cross"), result.times("miss"), dict.fromkeys((*TIMED, "floor")) | v.medians_ms
    head = {"audit_id": [audit_id], "created_at": [datetime.now(UTC).replace(tzinfo=None)],
            "base_url": [cfg.base_url], "target": [cfg.target], "model": [cfg.model], "level": ["paired"],
            "endpoint": [cfg.endpoint], "samples": [v.samples], "prompt_tokens": [cfg.prompt_tokens],
            "primer_tokens": [cfg.primer_tokens], "alpha": [cfg.alpha],
            "ks_statistic": [v.cross.ks_statistic], "p_value": [v.cross.p_value],
            "median_hit_ms": [m["cross"]], "median_miss_ms": [m["miss"]],
            "hit_faster_than_all_misses": [bool(cross and miss) and max(cross) < min(miss)],
            "detected": [v.verdict == "shared across users"], "verdict": [v.verdict], "reason": [v.reason or None],
            "same_ks_statistic": [v.same.ks_statistic], "same_p_value": [v.same.p_value],
            "median_same_ms": [m["same"]], "apart_ks_statistic": [v.apart.ks_statistic],
            "apart_p_value": [v.apart.p_value],
            "null_ks_statistic": [v.null.ks_statistic], "null_p_value": [v.null.p_value],
            "median_null_ms": [m["null"]], "median_floor_ms": [m["floor"]],
            "counted_prompt_tokens": [v.prompt_tokens],
            "reported_cached_hits": [t.cross_cached if t.reading else None],
            "reported_hits_of": [t.cross_of if t.reading else None],
            "reported_cached_same": [t.same_cached if t.reading else None],
            "reported_same_of": [t.same_of if t.reading else None],
            "telemetry": [t.reading], "telemetry_note": [t.note or None],
            "contradiction": [contradiction(v, t) or None], "channel": [cfg.channel],
            "dummies": [cfg.dummies if cfg.channel == "order" else None]}
    s = result.samples
    rows = {"audit_id": [audit_id] * len(s), "kind": [x.kind for x in s], "sample": [x.index for x in s],
            "ttft_ms": [x.ttft_ms for x in s], "cached_tokens": [x.cached_tokens for x in s],
            "prompt_tokens": [x.prompt_tokens for x in s], "primer_tokens": [x.primer_tokens for x in s],
            "rank": [x.rank for x in s]}
    with store.write() as con:
        con.execute("BEGIN TRANSACTION")
        store.insert(con, "timing_audits", arrow_table("timing_audits", head))
        store.insert(con, "timing_samples", arrow_table("timing_samples", rows))
        con.execute("COMMIT")
    return audit_id
