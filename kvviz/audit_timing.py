"""`kvviz audit-timing`: does an OpenAI-compatible server share its prompt cache across users, seen
from the outside by time to first token (TTFT)? The published protocol (Gu et al. 2025, see
shared/reference/production-debugging.md): for each sample a fresh random prompt (a miss) and a
prompt sent just before by someone else (a hit), then a one-sided two-sample Kolmogorov-Smirnov
test that hits come faster.

`level` says who sent the prompt before: `global`, another user with another API key (do tenants
share a cache?); `per-user`, the same user and key (does caching work at all within a user?). A
server that salts its cache per user is detected at the per-user level and not at the global one.
"""

from __future__ import annotations

import math
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from .errors import AuditError
from .ids import new_run_id
from .store import RunStore

LEVELS = ("global", "per-user")
ENDPOINTS = ("completions", "chat")
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
    samples: int = 250  # per side
    prompt_tokens: int = 512  # words, about one token each in common tokenizers
    interval: float = 0.0  # seconds to wait between requests
    alpha: float = 1e-8
    endpoint: str = "completions"
    api_key: str = "kvviz-audit"  # the victim's key; the attacker's is this with "-other" at global level
    timeout: float = 120.0
    target: str | None = None  # what was audited, in words (a kvviz server the app started: its model and policy)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise AuditError(f"level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.endpoint not in ENDPOINTS:
            raise AuditError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_tokens < 16:
            raise AuditError(f"prompt length must be >= 16 words, got {self.prompt_tokens}")
        if self.interval < 0:
            raise AuditError(f"interval must be >= 0 seconds, got {self.interval}")
        if not 0 < self.alpha < 1:
            raise AuditError(f"alpha must be between 0 and 1, got {self.alpha}")
        if self.samples < 2 or smallest_p(self.samples) >= self.alpha:  # it could never say "detected"
            raise AuditError(f"{self.samples} samples a side cannot reach alpha {self.alpha:g}: even every hit "
                             f"faster than every miss gives p = {smallest_p(max(self.samples, 1)):.2g}; use at "
                             f"least {fewest_samples(self.alpha)} samples (or a larger alpha)")
        if not self.base_url.startswith(("http://", "https://")):
            raise AuditError(f"the base URL must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                             f"got {self.base_url!r}")


def smallest_p(n: int) -> float:
    """The one-sided KS p-value of complete separation with n samples a side: 1 / C(2n, n)."""
    return 1 / math.comb(2 * n, n)


def fewest_samples(alpha: float) -> int:
    """The fewest samples a side with which complete separation is significant at alpha."""
    n = 2
    while smallest_p(n) >= alpha:
        n += 1
    return n


@dataclass(frozen=True)
class Sample:
    kind: str  # hit | miss
    index: int
    ttft_ms: float
    cached_tokens: int | None  # what the server reported for the measured request, when it does


@dataclass
class AuditResult:
    config: AuditConfig
    samples: list[Sample] = field(default_factory=list)
    ks_statistic: float = 0.0
    p_value: float = 1.0

    def times(self, kind: str) -> list[float]:
        return [s.ttft_ms for s in self.samples if s.kind == kind]

    @property
    def detected(self) -> bool:
        return self.p_value < self.config.alpha

    def verdict(self) -> dict:
        hit, miss = self.times("hit"), self.times("miss")
        return {"level": self.config.level, "samples": len(hit), "ks_statistic": round(self.ks_statistic, 6),
                "p_value": self.p_value, "median_hit_ms": round(statistics.median(hit), 3),
                "median_miss_ms": round(statistics.median(miss), 3),
                "hit_faster_than_all_misses": max(hit) < min(miss), "detected": self.detected}


def ks_test(hit: list[float], miss: list[float]) -> tuple[float, float]:
    """One-sided two-sample KS: the alternative is that hit times are stochastically smaller, i.e.
    the hits' distribution function lies above the misses'."""
    from scipy.stats import ks_2samp

    r = ks_2samp(hit, miss, alternative="greater")
    return float(r.statistic), float(r.pvalue)


class _Prober:
    """Sends prompts as one user and times the first token of a streamed reply."""

    def __init__(self, cfg: AuditConfig, key: str, user: str):
        import openai

        self.cfg, self.user = cfg, user
        self.client = openai.OpenAI(base_url=cfg.base_url, api_key=key, max_retries=0, timeout=cfg.timeout)

    def send(self, prompt: str) -> tuple[float, int | None]:
        """Milliseconds to the first chunk that carries the reply (text or its end), and the cached
        tokens the server reported, if it did."""
        import openai

        c, first, cached = self.cfg, None, None
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
                details = getattr(chunk.usage, "prompt_tokens_details", None) if chunk.usage else None
                if details is not None and details.cached_tokens is not None:
                    cached = details.cached_tokens
        except openai.APIConnectionError as e:
            raise AuditError(f"cannot reach {c.base_url}: {e}") from None
        except openai.APIStatusError as e:
            raise AuditError(f"{c.base_url} refused a request with HTTP {e.status_code}: {e.message}") from None
        if first is None:
            raise AuditError(f"{c.base_url} streamed no reply to a request")
        return 1000 * (first - t0), cached


def _carries_reply(choice, endpoint: str) -> bool:
    if choice.finish_reason is not None:
        return True
    return bool(choice.delta.content) if endpoint == "chat" else choice.text is not None


def _prompt(rng: random.Random, words: int) -> str:
    """A prompt no one sent before: a fresh nonce first, so it shares not even a first block."""
    return f"{uuid.UUID(int=rng.getrandbits(128)).hex} " + " ".join(rng.choice(WORDS) for _ in range(words - 1))


def run_audit(cfg: AuditConfig, progress: Callable[[Sample], None] | None = None,
              seed: int | None = None) -> AuditResult:
    """Interleave misses and hits (alternating which goes first), then test."""
    rng = random.Random(seed)
    victim = _Prober(cfg, cfg.api_key, "kvviz-audit-victim")
    attacker = victim if cfg.level == "per-user" else _Prober(cfg, cfg.api_key + "-other", "kvviz-audit-other")
    out = AuditResult(cfg)
    for i in range(cfg.samples):
        for kind in (("miss", "hit") if i % 2 == 0 else ("hit", "miss")):
            prompt = _prompt(rng, cfg.prompt_tokens)
            if kind == "hit":
                victim.send(prompt)  # someone sends it first ...
                time.sleep(cfg.interval)
            ms, cached = attacker.send(prompt)  # ... and the prober times it
            out.samples.append(Sample(kind, i, ms, cached))
            if progress is not None:
                progress(out.samples[-1])
            time.sleep(cfg.interval)
    out.ks_statistic, out.p_value = ks_test(out.times("hit"), out.times("miss"))
    return out


def record(store: RunStore, result: AuditResult) -> str:
    """The audit and its raw timings into the run store, in one transaction; its id."""
    from .store.schema import arrow_table

    audit_id, cfg, v = new_run_id(), result.config, result.verdict()
    head = {"audit_id": [audit_id], "created_at": [datetime.now(UTC).replace(tzinfo=None)],
            "base_url": [cfg.base_url], "target": [cfg.target], "model": [cfg.model], "level": [cfg.level],
            "endpoint": [cfg.endpoint],
            "samples": [v["samples"]], "prompt_tokens": [cfg.prompt_tokens], "alpha": [cfg.alpha],
            "ks_statistic": [result.ks_statistic], "p_value": [result.p_value], "median_hit_ms": [v["median_hit_ms"]],
            "median_miss_ms": [v["median_miss_ms"]],
            "hit_faster_than_all_misses": [v["hit_faster_than_all_misses"]], "detected": [v["detected"]]}
    s = result.samples
    rows = {"audit_id": [audit_id] * len(s), "kind": [x.kind for x in s], "sample": [x.index for x in s],
            "ttft_ms": [x.ttft_ms for x in s], "cached_tokens": [x.cached_tokens for x in s]}
    with store.write() as con:
        con.execute("BEGIN TRANSACTION")
        store.insert(con, "timing_audits", arrow_table("timing_audits", head))
        store.insert(con, "timing_samples", arrow_table("timing_samples", rows))
        con.execute("COMMIT")
    return audit_id
