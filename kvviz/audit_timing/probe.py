"""`kvviz audit-timing`: does an OpenAI-compatible server share its prompt cache across users, seen
from the outside by time to first token (TTFT)? After the published protocol (Gu et al. 2025, see
shared/reference/production-debugging.md): a hit is a prompt someone else sent just before, a miss a
prompt no one sent, and a one-sided two-sample Kolmogorov-Smirnov test asks whether hits come faster.

`level` says who sends first: `global`, another user with another API key (do tenants share a
cache?); `per-user`, the same user and key (does caching work at all within a user?). A server that
salts its cache per user is detected at the per-user level and not at the global one.

The schedule is symmetric, so nothing but the cache can tell hits from misses: every timed request,
hit or miss, follows an untimed primer of the same token count from the first sender (the same prompt
for a hit, a fresh one for a miss), which also takes any work the server or this process still had
from before. Each round times a hit, a miss and a null (a second miss) in one of the six orders in
turn, then a one-word floor. The null against the misses is the control: when it too "comes faster",
the measurement is biased and the verdict is inconclusive (kvviz/audit_timing/verdict.py).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..errors import AuditError
from ..store import RunStore
from ..util.ids import new_run_id
from .verdict import Verdict, fewest_samples, judge, smallest_p

LEVELS = ("global", "per-user")
ENDPOINTS = ("completions", "chat")
KINDS = ("hit", "miss", "null")  # timed and tested; "floor" is timed and only compared
ORDERS = tuple(itertools.permutations(KINDS))  # a round's order: each kind first, second and last equally
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
    level: str = "global"
    samples: int = 250  # rounds: hits, misses and nulls each
    prompt_tokens: int = 512  # words of WORDS, a token each
    interval: float = 0.0  # seconds of quiet after each round, before the next one's first primer
    alpha: float = 1e-8
    endpoint: str = "completions"
    api_key: str = "kvviz-audit"  # the prober's key (and the first sender's at per-user level; at global
    # level the first sender's is this with "-other" appended)
    timeout: float = 120.0
    target: str | None = None  # what was audited, in words (a kvviz server the app started: its model and policy)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise AuditError(f"level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.endpoint not in ENDPOINTS:
            raise AuditError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_tokens < 16:
            raise AuditError(f"prompt length must be >= 16 tokens, got {self.prompt_tokens}")
        if self.interval < 0:
            raise AuditError(f"interval must be >= 0 seconds, got {self.interval}")
        if not 0 < self.alpha < 1:
            raise AuditError(f"alpha must be between 0 and 1, got {self.alpha}")
        if self.samples < 2 or smallest_p(self.samples) >= self.alpha:  # it could never say "detected"
            raise AuditError(f"{self.samples} rounds (samples a side) cannot reach alpha {self.alpha:g}: even every "
                             f"hit faster than every miss gives p = {smallest_p(max(self.samples, 1)):.2g}; use at "
                             f"least {fewest_samples(self.alpha)} rounds (or a larger alpha)")
        if not self.base_url.startswith(("http://", "https://")):
            raise AuditError(f"the base URL must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                             f"got {self.base_url!r}")


@dataclass(frozen=True)
class Sample:
    kind: str  # hit | miss | null | floor
    index: int  # the round
    ttft_ms: float
    cached_tokens: int | None  # what the server reported for the timed request, when it does
    prompt_tokens: int | None = None  # the timed prompt's length as the server counted it, when it does
    primer_tokens: int | None = None  # the same of the primer sent just before it


@dataclass
class AuditResult:
    config: AuditConfig
    samples: list[Sample] = field(default_factory=list)
    stopped: str = ""  # why the audit ended before its last round, in one sentence

    def times(self, kind: str) -> list[float]:
        return [s.ttft_ms for s in self.samples if s.kind == kind]

    def judge(self) -> Verdict:
        tokens = {k: [s.prompt_tokens for s in self.samples if s.kind == k and s.prompt_tokens is not None]
                  for k in KINDS}
        cached = [s.cached_tokens for s in self.samples if s.kind == "hit" and s.cached_tokens is not None]
        return judge({k: self.times(k) for k in (*KINDS, "floor")}, tokens, self.config.alpha, self.stopped, cached)


@dataclass(frozen=True)
class Reply:
    ttft_ms: float
    cached_tokens: int | None
    prompt_tokens: int | None


class _Prober:
    """Sends prompts as one user and times the first token of a streamed reply."""

    def __init__(self, cfg: AuditConfig, key: str, user: str):
        import openai

        self.cfg, self.user = cfg, user
        self.client = openai.OpenAI(base_url=cfg.base_url, api_key=key, max_retries=0, timeout=cfg.timeout)

    def send(self, prompt: str) -> Reply:
        """Milliseconds to the first chunk that carries the reply (text or its end), and the cached and
        prompt tokens the server reported, if it did."""
        import openai

        c, first, cached, counted = self.cfg, None, None, None
        t0 = time.perf_counter()
        try:
            if c.endpoint == "chat":
                stream = self.client.chat.completions.create(
                    model=c.model, messages=[{"role": "user", "content": prompt}], max_tokens=1, temperature=0,
                    stream=True, stream_options={"include_usage": True}, user=self.user)
            else:
                stream = self.client.completions.create(model=c.model, prompt=prompt, max_tokens=1, temperature=0,
                                                        stream=True, stream_options={"include_usage": True},
                                                        user=self.user)
            for chunk in stream:
                if first is None and chunk.choices and _carries_reply(chunk.choices[0], c.endpoint):
                    first = time.perf_counter()
                if chunk.usage is not None:
                    counted = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    if details is not None and details.cached_tokens is not None:
                        cached = details.cached_tokens
        except openai.APIConnectionError as e:
            raise AuditError(f"cannot reach {c.base_url}: {e}") from None
        except openai.APIStatusError as e:
            raise AuditError(f"{c.base_url} refused a request with HTTP {e.status_code}: {_said(e)}") from None
        except (openai.APIError, ValueError) as e:  # a stream cut short, or not JSON
            raise AuditError(f"{c.base_url} broke off a reply: {e}") from None
        if first is None:
            raise AuditError(f"{c.base_url} streamed no reply to a request")
        return Reply(1000 * (first - t0), cached, counted)


def _said(e) -> str:
    """What the server said, without the client's "Error code: N - " and the body's wrapping; a 404
    that is not about the model is most likely a base URL without its /v1."""
    body = e.body
    said = str(((body.get("message") or body.get("detail")) if isinstance(body, dict) else body) or e.message)
    if e.status_code == 404 and "model" not in said.lower():
        said += " (is the base URL right? an OpenAI-compatible API's usually ends in /v1)"
    return said


def _carries_reply(choice, endpoint: str) -> bool:
    if choice.finish_reason is not None:
        return True
    return bool(choice.delta.content) if endpoint == "chat" else choice.text is not None


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
    prober = _Prober(cfg, cfg.api_key, "kvviz-audit")
    first = prober if cfg.level == "per-user" else _Prober(cfg, cfg.api_key + "-other", "kvviz-audit-other")
    out = AuditResult(cfg)
    try:
        for i in range(cfg.samples):
            for kind in ORDERS[i % len(ORDERS)]:
                prompt = _prompt(rng, cfg.prompt_tokens)
                primer = first.send(prompt if kind == "hit" else _prompt(rng, cfg.prompt_tokens))
                _add(out, kind, i, prober.send(prompt), primer, progress)
            _add(out, "floor", i, prober.send(rng.choice(WORDS)), None, progress)
            if between is not None:
                between(out)
            time.sleep(cfg.interval)
    except AuditError as e:
        if not out.samples:
            raise
        out.stopped = f"stopped in round {i + 1} of {cfg.samples}: {e}"
    return out


def _add(out: AuditResult, kind: str, i: int, r: Reply, primer: Reply | None,
         progress: Callable[[Sample], None] | None) -> None:
    out.samples.append(Sample(kind, i, r.ttft_ms, r.cached_tokens, r.prompt_tokens,
                              primer.prompt_tokens if primer else None))
    if progress is not None:
        progress(out.samples[-1])


def record(store: RunStore, result: AuditResult, verdict: Verdict | None = None) -> str:
    """The audit, its verdict and its raw timings (partial ones too) into the run store, in one
    transaction; its id."""
    from ..store.schema import arrow_table

    audit_id, cfg, v = new_run_id(), result.config, verdict or result.judge()
    hit, miss = result.times("hit"), result.times("miss")
    head = {"audit_id": [audit_id], "created_at": [datetime.now(UTC).replace(tzinfo=None)],
            "base_url": [cfg.base_url], "target": [cfg.target], "model": [cfg.model], "level": [cfg.level],
            "endpoint": [cfg.endpoint], "samples": [v.samples], "prompt_tokens": [cfg.prompt_tokens],
            "alpha": [cfg.alpha], "ks_statistic": [v.ks_statistic], "p_value": [v.p_value],
            "median_hit_ms": [v.median_hit_ms], "median_miss_ms": [v.median_miss_ms],
            "hit_faster_than_all_misses": [bool(hit and miss) and max(hit) < min(miss)],
            "detected": [v.detected], "verdict": [v.verdict], "reason": [v.reason or None],
            "null_ks_statistic": [v.null_ks_statistic], "null_p_value": [v.null_p_value],
            "median_null_ms": [v.median_null_ms], "median_floor_ms": [v.median_floor_ms],
            "counted_prompt_tokens": [v.prompt_tokens], "reported_cached_hits": [v.reported_hits]}
    s = result.samples
    rows = {"audit_id": [audit_id] * len(s), "kind": [x.kind for x in s], "sample": [x.index for x in s],
            "ttft_ms": [x.ttft_ms for x in s], "cached_tokens": [x.cached_tokens for x in s],
            "prompt_tokens": [x.prompt_tokens for x in s], "primer_tokens": [x.primer_tokens for x in s]}
    with store.write() as con:
        con.execute("BEGIN TRANSACTION")
        store.insert(con, "timing_audits", arrow_table("timing_audits", head))
        store.insert(con, "timing_samples", arrow_table("timing_samples", rows))
        con.execute("COMMIT")
    return audit_id
