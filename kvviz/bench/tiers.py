"""`python -m kvviz bench --tiers`: what a host tier and disaggregated prefill cost, against the plain
engine on the same cases in the same run, interleaved (the fast path, so the engine's own work shows).

Plain: no host tier, one instance. Host tier, unused: offloading configured on a pool roomy enough
that nothing is ever evicted (the code paths are there, the tier is never touched). Disaggregated:
every prompt computed on a prefill instance and transferred to the decode instance (used).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ..models import LoadedModel
from .throughput import BenchCase, Measurement, cases, run_kvviz

VARIANTS: dict[str, dict] = {
    "plain": {},
    "host tier, unused": {"offload": {"cpu_blocks": 4096}},
    "disaggregated": {"disaggregated": True},
}


def run_tiers_bench(model: LoadedModel, sizes: list[int], new_tokens: int, repeat: int = 3,
                    progress: Callable[[str], None] = print) -> dict[str, dict[str, list[Measurement]]]:
    """case -> variant -> its runs, the variants taking turns in a rotated order each round."""
    out: dict[str, dict[str, list[Measurement]]] = {}
    names = list(VARIANTS)
    for v in names:  # warm up every variant's code paths before anything is timed
        run_kvviz(model, BenchCase("warm-up", [[101, 102, 103, 104]] * 2, 2), "fast", engine=VARIANTS[v])
    for case in cases(model.config.vocab_size, sizes, new_tokens):
        runs = out[case.name] = {v: [] for v in names}
        for i in range(repeat):
            for v in names[i % len(names):] + names[:i % len(names)]:
                runs[v].append(run_kvviz(model, case, "fast", engine=VARIANTS[v], peer=v))
                progress(f"{case.name:>18}  {v:<18} {runs[v][-1].seconds:7.2f} s")
    return out


def tiers_report(model: LoadedModel, results: dict[str, dict[str, list[Measurement]]], repeat: int) -> str:
    lines = [f"Model `{model.name}`, device {model.device}, fast path; the median of {repeat} interleaved runs per "
             "variant, and its time against plain in the same run.", "",
             "| case | variant | seconds (median) | runs | x plain |", "| --- | --- | ---: | --- | ---: |"]
    for case, runs in results.items():
        plain = statistics.median(r.seconds for r in runs["plain"])
        for v, measured in runs.items():
            med = statistics.median(r.seconds for r in measured)
            lines.append(f"| {case} | {v} | {med:.2f} | {', '.join(f'{r.seconds:.2f}' for r in measured)} | "
                         f"{med / plain:.3f} |")
    return "\n".join(lines) + "\n"
