"""The cached-tokens channel: what the server itself reports of each probe
(usage.prompt_tokens_details.cached_tokens, as vLLM, SGLang, llama-server and kvviz serve give it; else
llama.cpp's timings.cache_n, kvviz/audit_timing/client.py), read beside the
timing verdict. It needs no clock, so it speaks where timing is too noisy to; it is the server's own
account, so it can also be wrong, and the audit says so when the two channels disagree (a
contradiction). A server that reports no usage gets no reading from it, only the reason."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .verdict import Verdict

# How much caching each verdict says was seen: the two channels disagree when their readings differ.
SEEN = {"no caching seen": 0, "isolated": 1, "shared across users": 2}


@dataclass(frozen=True)
class Telemetry:
    reading: str | None  # a key of SEEN, from the server's counts alone; None: the channel could not be used
    note: str  # why it could not be used, or which replies said nothing; empty otherwise
    same_cached: int  # same-user hits the server said it served from its cache
    same_of: int  # same-user hits whose reply said how many tokens were cached
    cross_cached: int  # the same of cross-user hits
    cross_of: int
    baseline: int  # cached tokens the server reports for a fresh prompt (the median miss's: a shared template)


def read(cached: dict[str, list[int | None]], any_usage: bool) -> Telemetry:
    """The reading from each timed request's cached tokens by kind (same, cross, miss, null; None where
    its reply did not say); `any_usage`: whether any reply carried usage at all. A probe counts as
    served from cache when it reports more cached tokens than a fresh prompt does."""
    probes = [c for k in ("same", "cross") for c in cached.get(k, [])]
    fresh = [c for k in ("miss", "null") for c in cached.get(k, []) if c is not None]
    baseline = int(statistics.median(fresh)) if fresh else 0
    counts = {}
    for kind in ("same", "cross"):
        said = [c for c in cached.get(kind, []) if c is not None]
        counts[kind] = (sum(c > baseline for c in said), len(said))
    (same_cached, same_of), (cross_cached, cross_of) = counts["same"], counts["cross"]
    if not probes:
        reading, note = None, "the cached-tokens channel could not be used: no probe was answered"
    elif not same_of + cross_of:
        why = ("the replies carry usage but no prompt_tokens_details.cached_tokens (nor llama.cpp's timings.cache_n)"
               if any_usage else
               "the server returned no usage with its streamed replies (asked for with stream_options include_usage)")
        reading, note = None, f"the cached-tokens channel could not be used: {why}"
    else:
        reading = "shared across users" if cross_cached else "isolated" if same_cached else "no caching seen"
        silent = len(probes) - same_of - cross_of
        note = f"{silent} of {len(probes)} probes' replies did not say how many tokens were cached" if silent else ""
    return Telemetry(reading=reading, note=note, same_cached=same_cached, same_of=same_of, cross_cached=cross_cached,
                     cross_of=cross_of, baseline=baseline)


def said(t: Telemetry) -> str:
    """The channel in one sentence: the server's counts and their reading, or why there is none."""
    if t.reading is None:
        return t.note
    return (f"the server itself reported serving {t.cross_cached} of {t.cross_of} cross-user and {t.same_cached} of "
            f"{t.same_of} same-user hits from its cache ({t.reading})" + (f"; {t.note}" if t.note else ""))


def contradiction(v: Verdict, t: Telemetry) -> str:
    """Where timing and the server's own counts disagree, the finding in one sentence (empty where they
    agree, or where either channel has no reading)."""
    if t.reading is None or v.verdict not in SEEN or v.verdict == t.reading:
        return ""
    counts = f"{t.cross_cached} of {t.cross_of} cross-user and {t.same_cached} of {t.same_of} same-user hits"
    order = v.ranks is not None
    channel = "the finishing order" if order else "timing"
    if SEEN[v.verdict] < SEEN[t.reading]:
        why = ("the server's queue does not reorder by its cache (first come first served), or the dummies did not "
               "make it queue" if order else "timing could not see it (more rounds, longer prompts or a quieter "
               "machine)")
        return (f"{channel} says {v.verdict}, but the server itself reported serving {counts} from its cache "
                f"({t.reading}): {why}")
    return (f"{channel} says {v.verdict}, but the server itself reported serving only {counts} from its cache "
            f"({t.reading}): its count leaves out what made those {'probes finish ahead' if order else 'hits faster'}")


def tone(v: Verdict, t: Telemetry) -> str:
    """How the app colours an audit: sharing across users, by either channel, is an error; isolation
    that both channels agree on (or timing alone, where the server reports nothing) success; anything
    the audit cannot settle (no caching seen, inconclusive, no verdict, a contradiction) a warning."""
    if "shared across users" in (v.verdict, t.reading):
        return "error"
    return "success" if v.verdict == "isolated" and not contradiction(v, t) else "warning"
