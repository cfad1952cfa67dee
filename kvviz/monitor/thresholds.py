"""The alert thresholds, read from the rules file Prometheus loads (rules.yml), so the app's Live page
marks the same crossings Prometheus alerts on: one number in one place."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

RULES = Path(__file__).with_name("rules.yml")
# alert -> the figure of the Live page it bounds
FIGURES = {"KvvizPrefixCacheHitRateLow": "hit_ratio", "KvvizKvCacheUtilisationHigh": "utilisation"}


@dataclass(frozen=True)
class Threshold:
    alert: str
    figure: str  # a Point field (course.py)
    above: bool  # the alert fires above the value (else below it)
    value: float
    for_s: float  # how long the condition must hold


@cache
def thresholds() -> tuple[Threshold, ...]:
    """The alerts of rules.yml whose expression begins by comparing one figure with a number."""
    out = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            figure = FIGURES.get(rule.get("alert"))
            found = re.match(r"\s*\S+\s*([<>])\s*([0-9.]+)\s", rule.get("expr", "") + "\n")
            if figure and found:
                out.append(Threshold(rule["alert"], figure, found[1] == ">", float(found[2]),
                                     _seconds(rule.get("for", "0s"))))
    return tuple(out)


def _seconds(duration: str) -> float:
    return sum(int(n) * {"s": 1, "m": 60, "h": 3600}[u] for n, u in re.findall(r"(\d+)([smh])", duration))
