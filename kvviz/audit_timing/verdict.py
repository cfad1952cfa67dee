"""What a timing audit's samples say: the one-sided KS test of hits against misses, the same test of
the null control (misses against misses), and the verdict with its reason.

Four verdicts, each with an exit status for CI: `detected` (1), `not detected` (0), `inconclusive`
(3: the null control rejects too, so the measurement itself is biased and a difference between hits
and misses means nothing), `no verdict` (2: too few samples to ever reach alpha, prompts of unequal
length, or a server that answers a long prompt as fast as a one-word one, so a cached prefix cannot
show in time).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

VERDICTS = {"not detected": 0, "detected": 1, "no verdict": 2, "inconclusive": 3}  # and their exit statuses


def smallest_p(n: int) -> float:
    """The one-sided KS p-value of complete separation with n samples a side: 1 / C(2n, n)."""
    return 1 / math.comb(2 * n, n)


def fewest_samples(alpha: float) -> int:
    """The fewest samples a side with which complete separation is significant at alpha."""
    n = 2
    while smallest_p(n) >= alpha:
        n += 1
    return n


def samples_to_separate(d: float, alpha: float) -> int:
    """The fewest samples a side at which two samples a KS distance d apart reach alpha, by the test's
    exact p-value, not its asymptotic tail exp(-n d^2), which is off by a few samples at this size."""
    n = fewest_samples(alpha)
    while ks_test(*_apart(n, d))[1] >= alpha:
        n += 1
    return n


def _apart(n: int, d: float) -> tuple[list[float], list[float]]:
    """n fast and n slow values whose one-sided KS distance is d rounded up to a step of 1/n."""
    shift = math.ceil(d * n - 1e-9)
    return [float(x) for x in range(n)], [float(x + shift) for x in range(n)]


def ks_test(fast: list[float], slow: list[float]) -> tuple[float, float]:
    """One-sided two-sample KS: the alternative is that `fast` times are stochastically smaller, i.e.
    their distribution function lies above `slow`'s."""
    from scipy.stats import ks_2samp

    r = ks_2samp(fast, slow, alternative="greater")
    return float(r.statistic), float(r.pvalue)


@dataclass(frozen=True)
class Verdict:
    verdict: str  # a key of VERDICTS
    reason: str  # one sentence: why (empty for a plain detected / not detected)
    samples: int  # the fewest of hit, miss and null
    ks_statistic: float | None
    p_value: float | None
    null_ks_statistic: float | None
    null_p_value: float | None
    median_hit_ms: float | None
    median_miss_ms: float | None
    median_null_ms: float | None
    median_floor_ms: float | None
    prompt_tokens: int | None  # the median the server counted for timed prompts, when it reports usage
    reported_hits: int | None = None  # hits the server said it served partly from its cache (cached_tokens > 0)
    reported_of: int = 0  # hits whose reply said how many tokens were cached

    @property
    def detected(self) -> bool:
        return self.verdict == "detected"

    @property
    def exit_status(self) -> int:
        return VERDICTS[self.verdict]


def in_words(verdict: str, level: str) -> str:
    """What a detected or not detected verdict says about the server (the CLI and the app say the
    same); empty for the other two, whose reason says it."""
    where = "across users" if level == "global" else "within a user"
    return {"detected": f"hits reach their first token sooner, so this server shares its prompt cache {where}",
            "not detected": f"hits reach their first token no sooner than misses, so this audit found no sign that "
                            f"the server shares its prompt cache {where}"}.get(verdict, "")


def _median(x: list[float]) -> float | None:
    return round(statistics.median(x), 3) if x else None


def judge(times: dict[str, list[float]], tokens: dict[str, list[int]], alpha: float, stopped: str = "",
          hits_cached: list[int] | None = None) -> Verdict:
    """The verdict on timings by kind (hit, miss, null, floor) and the server's prompt token counts by
    kind (hit, miss, null; empty where it reports none). `stopped` says why the audit ended early;
    `hits_cached` is what the server reported as cached for each hit, where it did: not part of the
    verdict (which is what timing shows an outsider), said beside it."""
    hit, miss, null, floor = (times.get(k, []) for k in ("hit", "miss", "null", "floor"))
    d, p = ks_test(hit, miss) if hit and miss else (None, None)
    nd, np_ = ks_test(null, miss) if null and miss else (None, None)
    n, need = min(len(hit), len(miss), len(null)), fewest_samples(alpha)
    counted = {k: statistics.median(v) for k, v in tokens.items() if v}
    lengths = sorted(counted.values())
    tail = f" ({stopped})" if stopped else ""
    if n < need:
        verdict, reason = "no verdict", (f"{n} samples a side: at alpha {alpha:g} the test needs at least {need} "
                                         f"(even complete separation of {n} gives p = {smallest_p(max(n, 1)):.2g})"
                                         f"{tail}")
    elif lengths and lengths[-1] - lengths[0] > max(1.0, 0.02 * lengths[-1]):
        verdict, reason = "no verdict", ("the server counted prompts of unequal length ("
                                         + ", ".join(f"{k} {v:g}" for k, v in counted.items())
                                         + " tokens), so their times do not compare" + tail)
    elif floor and (slower := ks_test(floor, miss)[1]) >= alpha:  # the same test: is a prompt's work seen?
        verdict, reason = "no verdict", (f"the server answers a full prompt about as fast as a one-word one "
                                         f"({statistics.median(miss):.2f} against {statistics.median(floor):.2f} "
                                         f"ms, p = {slower:.2g}), so a cached prefix cannot show in time: use "
                                         f"longer prompts{tail}")
    elif np_ < alpha:
        verdict, reason = "inconclusive", (f"the null control (a miss against a miss, same schedule) rejects too "
                                           f"(D = {nd:.2f}, p = {np_:.2g}): the measurement is biased{tail}")
    else:
        verdict, reason = ("detected" if p < alpha else "not detected"), stopped
    return Verdict(verdict, reason, n, d, p, nd, np_, _median(hit), _median(miss), _median(null), _median(floor),
                   round(statistics.median([t for v in tokens.values() for t in v])) if lengths else None,
                   sum(c > 0 for c in hits_cached) if hits_cached else None, len(hits_cached or []))


HEADLINES = {"detected": "Detected", "not detected": "Not detected", "inconclusive": "Inconclusive",
             "no verdict": "No verdict"}


def server_says(v: Verdict) -> str:
    """What the server itself reported of the hits (usage.prompt_tokens_details.cached_tokens), in
    words, led by "but" where it contradicts a timing that found nothing; empty where it reported
    nothing."""
    if v.reported_hits is None:
        return ""
    if v.reported_hits == 0:
        return f"the server reported no cached tokens for any of {v.reported_of} hits"
    said = f"the server itself reported serving {v.reported_hits} of {v.reported_of} hits partly from its cache"
    return f"but {said}: timing could not see it (more rounds, or a quieter machine)" if contradicted(v) else said


def contradicted(v: Verdict) -> bool:
    """Timing found nothing while the server says the hits hit its cache: too few rounds or too noisy
    a machine to see what is there, not a server that shares nothing."""
    return v.verdict == "not detected" and bool(v.reported_hits)


def tone(v: Verdict, level: str) -> str:
    """How the app colours a verdict: sharing across users is an error, sharing within a user (caching
    that works) information, nothing found success, and a measurement that cannot tell (inconclusive,
    no verdict, or timing contradicted by the server's own report) a warning."""
    if v.verdict in ("inconclusive", "no verdict") or contradicted(v):
        return "warning"
    if v.detected:
        return "error" if level == "global" else "info"
    return "success"
