"""What a paired timing audit's times say: one-sided KS tests of same-user hits, cross-user hits and
the null control against the misses (and of same-user against cross-user hits), and the verdict with
its one-sentence reason.

Five verdicts, each with an exit status for CI: `isolated` (0: the same-user control is detected,
cross-user hits are not, and come later than same-user ones), `shared across users` (1: cross-user
hits come sooner), `no verdict` (2: too few samples to ever reach alpha, prompts of unequal length,
or a server that answers a long prompt as fast as a one-word one), `inconclusive` (3: the null
control rejects too, so the measurement is biased; or cross-user hits sit between same-user hits and
misses, too few rounds to say which), `no caching seen` (4: even same-user hits come no sooner, so the
audit cannot tell isolation from no cache). Audits stored before version 17 keep their own verdicts,
`detected` and `not detected` of one level.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from .defaults import PRIMER_TOKENS

VERDICTS = {"isolated": 0, "shared across users": 1, "no verdict": 2, "inconclusive": 3,
            "no caching seen": 4}  # and their exit statuses
HEADLINES = {"isolated": "Isolated", "shared across users": "Shared across users", "no verdict": "No verdict",
             "inconclusive": "Inconclusive", "no caching seen": "No caching seen"}
TIMED = ("same", "cross", "miss", "null")  # the kinds timed and tested; "floor" is timed and only compared


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
class Versus:
    """One one-sided KS test: do the first kind's times come sooner than the second's? (None: a side
    has no times.)"""
    ks_statistic: float | None  # the test's statistic: KS D, or the order channel's shift
    p_value: float | None
    name: str = "D"  # the statistic's, as said

    def said(self) -> str:
        return "" if self.p_value is None else f"{self.name} = {self.ks_statistic:.2f}, p = {self.p_value:.2g}"


def versus(fast: list[float], slow: list[float]) -> Versus:
    if not (fast and slow):
        return Versus(ks_statistic=None, p_value=None)
    d, p = ks_test(fast, slow)
    return Versus(ks_statistic=d, p_value=p)


@dataclass(frozen=True)
class Verdict:
    verdict: str  # a key of VERDICTS
    reason: str  # one sentence: what it says of the server and why (and why the audit stopped early)
    samples: int  # the fewest of same, cross, miss and null
    cross: Versus  # cross-user hits against misses: the test
    same: Versus  # same-user hits against misses: the positive control
    apart: Versus  # same-user hits against cross-user hits: what isolation must show
    null: Versus  # the null control against misses: must not reject
    medians_ms: dict[str, float | None]  # by kind: same, cross, miss, null, floor
    prompt_tokens: int | None  # the median the server counted for timed prompts, when it reports usage
    ranks: dict[str, float] | None = None  # order channel: each kind's median rank among its dummies (None: timing)

    @property
    def exit_status(self) -> int:
        return VERDICTS[self.verdict]


def decide(cross: Versus, same: Versus, apart: Versus, alpha: float) -> str:
    """The paired verdict from its three tests once the measurement is sound, one rule for every
    channel: the cross-user test first, then the same-user control, then the two hits apart."""
    if cross.p_value < alpha:
        return "shared across users"
    if same.p_value >= alpha:
        return "no caching seen"
    return "isolated" if apart.p_value < alpha else "inconclusive"


def unsound_sample(n: int, alpha: float, tokens: dict[str, list[int]]) -> str:
    """Why n samples a side with these prompt lengths (as the server counted them, by kind) can give no
    verdict, in words; empty when they can."""
    if n < (need := fewest_samples(alpha)):
        return (f"{n} samples a side: at alpha {alpha:g} the test needs at least {need} (even complete separation "
                f"of {n} gives p = {smallest_p(max(n, 1)):.2g})")
    counted = {k: statistics.median(v) for k, v in tokens.items() if v}
    lengths = sorted(counted.values())
    if lengths and lengths[-1] - lengths[0] > max(1.0, 0.02 * lengths[-1]):
        return ("the server counted prompts of unequal length (" + ", ".join(f"{k} {v:g}" for k, v in counted.items())
                + " tokens), so the kinds do not compare (the audit's words are a token each in SmolLM2's tokenizer; "
                "one that splits them unevenly makes prompts of unequal length)")
    return ""


def counted_median(tokens: dict[str, list[int]]) -> int | None:
    """The median timed prompt as the server counted it, where it did."""
    every = [t for v in tokens.values() for t in v]
    return round(statistics.median(every)) if every else None


def _median(x: list[float]) -> float | None:
    return round(statistics.median(x), 3) if x else None


def judge(times: dict[str, list[float]], tokens: dict[str, list[int]], alpha: float,
          primer_tokens: int = PRIMER_TOKENS, stopped: str = "") -> Verdict:
    """The verdict on times by kind (same, cross, miss, null, floor) and the server's prompt token
    counts by kind (same, cross, miss, null; empty where it reports none). `primer_tokens` is what the
    primers asked for (said where no caching was seen); `stopped` says why the audit ended early."""
    got = {k: times.get(k, []) for k in (*TIMED, "floor")}
    miss, floor = got["miss"], got["floor"]
    cross, same, apart, null = (versus(got["cross"], miss), versus(got["same"], miss),
                                versus(got["same"], got["cross"]), versus(got["null"], miss))
    n = min(len(got[k]) for k in TIMED)
    if unsound := unsound_sample(n, alpha, tokens):
        verdict, why = "no verdict", unsound
    elif floor and (slower := ks_test(floor, miss)[1]) >= alpha:  # the same test: is a prompt's work seen?
        verdict, why = "no verdict", (f"a full prompt came no measurably later than a one-word one "
                                      f"(medians {statistics.median(miss):.2f} against {statistics.median(floor):.2f} "
                                      f"ms, p = {slower:.2g} at alpha {alpha:g}), so a cached prefix cannot show in "
                                      f"time: use longer prompts, or more rounds where the times are noisy")
    elif null.p_value < alpha:
        verdict, why = "inconclusive", (f"the null control (a miss primed by the prober itself, against a miss "
                                        f"primed by the other user) rejects too ({null.said()}): the measurement "
                                        f"is biased")
    else:
        verdict = decide(cross, same, apart, alpha)
        why = {"shared across users": f"cross-user hits reach their first token sooner than misses ({cross.said()}): "
                                      f"this server answers one user's prompt from what another user's request left "
                                      f"in its cache",
               "no caching seen": f"even same-user hits come no sooner than misses at alpha {alpha:g} ({same.said()}), "
                                  f"so this audit cannot tell a server that isolates users from one whose cache it "
                                  f"cannot see: try longer prompts (--prompt-tokens), primers that generate more than "
                                  f"{primer_tokens} tokens (--primer-tokens), more rounds, or the server's prefix "
                                  f"cache turned on",
               "isolated": f"same-user hits come sooner than misses ({same.said()}) and than cross-user hits "
                           f"({apart.said()}), cross-user hits no sooner than misses at alpha {alpha:g} "
                           f"({cross.said()}): this server caches prompts per user and shares none across users that "
                           f"timing can see",
               "inconclusive": f"same-user hits come sooner than misses ({same.said()}), but cross-user hits are "
                               f"neither sooner than misses ({cross.said()}) nor later than same-user hits "
                               f"({apart.said()}) at alpha {alpha:g}: more rounds can tell isolation from sharing",
               }[verdict]
    return Verdict(verdict=verdict, reason=why + (f" ({stopped})" if stopped else ""), samples=n, cross=cross,
                   same=same, apart=apart, null=null, medians_ms={k: _median(v) for k, v in got.items()},
                   prompt_tokens=counted_median(tokens))
