"""The order channel (`audit-timing --channel order`): a cached prompt can finish ahead of prompts
sent before it, without any clock fine enough to time it. A server that admits waiting requests by
longest cached prefix (SGLang's `lpm`) lets a probe whose prefix is cached jump the queue; one that
serves first come first served does not (PromptPeek, NDSS 2025, reads exactly this).

Each round, per kind in turn: an untimed primer (as the timing channel's: the probe's own prompt,
sent by the prober for a same-user probe and by the other user for a cross-user one; a fresh prompt
by the other user for the null), then `dummies` fresh prompts of the same length sent at once to make
the server queue, and `stagger` seconds later the probe (a fresh prompt in the null round). The
probe's rank is how many dummies finished before it. Two kinds' ranks are compared by an exact
one-sided permutation test of their mean rank (shift_test). It needs no model of the server's queue
(how many steps the dummies take, how ties in a step resolve), and at complete separation it gives
the timing channel's smallest p, so the same rounds reach the same alpha; the verdict follows the
timing channel's rule (verdict.decide).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .client import Prober, Reply
from .verdict import Verdict, Versus, counted_median, decide, unsound_sample

KINDS = ("same", "cross", "null")
ORDERS = (KINDS, KINDS[1:] + KINDS[:1], KINDS[2:] + KINDS[:2])  # each kind first, second and last in turn


def order_round(i: int, prober: Prober, other: Prober, prompt: Callable[[], str], dummies: int, stagger: float,
                primer_tokens: int, pool: ThreadPoolExecutor) -> Iterator[tuple[str, int, Reply, Reply]]:
    """Round i: for each kind (in this round's order) as it is measured, the probe's rank among its
    dummies, its reply and its primer's."""
    for kind in ORDERS[i % len(ORDERS)]:
        probe = prompt()
        primer = (prober if kind == "same" else other).send(probe if kind != "null" else prompt(), primer_tokens)
        if kind == "null":
            probe = prompt()
        sent = [pool.submit(_finish, prober, prompt()) for _ in range(dummies)]
        time.sleep(stagger)
        reply, done = _finish(prober, probe)
        finished = [f.result() for f in sent]  # re-raises a dummy's failure: the round is not measured
        yield kind, sum(t < done for _, t in finished), reply, primer


def _finish(prober: Prober, prompt: str) -> tuple[Reply, float]:
    """The reply, and when it ended on this machine's monotonic clock."""
    reply = prober.send(prompt)
    return reply, time.perf_counter()


def shift_test(a: list[int], b: list[int], dummies: int) -> Versus:
    """Do the first kind's probes finish ahead of the second's? The exact permutation test of the
    difference in mean rank (Fisher-Pitman): of every way to split the pooled ranks into groups of
    these sizes, the share whose first group sums to no more than `a` does. Ranks are small integers,
    so the count is a short dynamic program, exact with any number of ties. The statistic is the
    shift: how many places earlier the first kind finished on average."""
    if not (a and b):
        return Versus(ks_statistic=None, p_value=None, name="shift")
    counts = np.bincount(np.asarray(a + b), minlength=dummies + 1)
    ways = np.zeros((len(a) + 1, dummies * len(a) + 1))  # ways[k, s]: splits taking k ranks that sum to s
    ways[0, 0] = 1.0
    for value, c in enumerate(counts):
        before = ways.copy()
        for j in range(1, min(c, len(a)) + 1):
            ways[j:, value * j:] += before[:-j, : ways.shape[1] - value * j] * math.comb(int(c), j)
    p = float(ways[len(a), : sum(a) + 1].sum() / math.comb(len(a) + len(b), len(a)))
    return Versus(ks_statistic=float(np.mean(b) - np.mean(a)), p_value=min(p, 1.0), name="shift")


def judge_order(ranks: dict[str, list[int]], times: dict[str, list[float]], tokens: dict[str, list[int]],
                dummies: int, alpha: float, stopped: str = "") -> Verdict:
    """The order channel's verdict on each kind's probe ranks (its replies' times and the prompt
    lengths the server counted are kept beside it)."""
    got = {k: ranks.get(k, []) for k in KINDS}
    cross, same = shift_test(got["cross"], got["null"], dummies), shift_test(got["same"], got["null"], dummies)
    apart = shift_test(got["same"], got["cross"], dummies)
    n = min(len(v) for v in got.values())
    rank = {k: f"{statistics.median(v):g}" if v else "-" for k, v in got.items()}
    if unsound := unsound_sample(n, alpha, tokens):
        verdict, why = "no verdict", unsound
    else:
        verdict = decide(cross, same, apart, alpha)
        why = {"shared across users": f"probes another user had just sent finished ahead of fresh ones (median rank "
                                      f"{rank['cross']} against {rank['null']} among {dummies} prompts sent just "
                                      f"before them, {cross.said()}): this server schedules one user's prompt by "
                                      f"what another user's request left in its cache",
               "no caching seen": f"even probes the prober itself had just sent finished no sooner than fresh ones "
                                  f"(median rank {rank['same']} against {rank['null']} among {dummies}, "
                                  f"{same.said()}): this server's order does not show its cache (first come first "
                                  f"served, no cache, or a queue that empties before the probe arrives: try more "
                                  f"--dummies), so the order channel cannot tell isolation from either; the timing "
                                  f"channel may",
               "isolated": f"the prober's own cached probes finished ahead of fresh ones (median rank {rank['same']} "
                           f"against {rank['null']} among {dummies}, {same.said()}) and of another user's (median "
                           f"{rank['cross']}, {apart.said()}), which finished no sooner than fresh ones "
                           f"({cross.said()}): this server schedules by a cache it keeps per user",
               "inconclusive": f"the prober's own cached probes finished ahead of fresh ones ({same.said()}), but "
                               f"another user's neither ahead of fresh ones ({cross.said()}) nor behind the prober's "
                               f"own ({apart.said()}) at alpha {alpha:g}: more rounds can tell isolation from "
                               f"sharing"}[verdict]
    medians = {k: round(statistics.median(v), 3) if (v := times.get(k)) else None for k in KINDS}
    return Verdict(verdict=verdict, reason=why + (f" ({stopped})" if stopped else ""), samples=n, cross=cross,
                   same=same, apart=apart, null=Versus(ks_statistic=None, p_value=None), medians_ms=medians,
                   prompt_tokens=counted_median(tokens),
                   ranks={k: statistics.median(v) for k, v in got.items() if v})
