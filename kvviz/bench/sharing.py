"""`python -m kvviz bench --sharing-sweep`: what prefix sharing saves as the shared share of the
sequence grows (the seed's section 5.3: about 10% more throughput at 128 tokens, 35% at 512 and over
60% at 2048, and about 35% of memory at 512).

Each length is a sequence of that many tokens: a common prefix, then a short private suffix and the
generated answer (PRIVATE + NEW tokens), so the shared share grows with the length. The same
requests run with prefix caching on and off, taking turns; memory is the peak of blocks held, the
work is the prompt tokens the engine computed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..engine import Engine, EngineConfig, StepRecord
from ..engine.workload import RequestSpec, Workload
from ..models import LoadedModel

LENGTHS = (128, 512, 2048)
PRIVATE, NEW = 32, 32  # each request's own prompt tokens and generated tokens
ARTICLE = {128: 0.10, 512: 0.35, 2048: 0.60}  # throughput gained, the seed's table
BLOCK = 16


@dataclass
class SweepRun:
    length: int
    caching: bool
    seconds: float
    generated: int
    prompt_tokens: int
    prefill_computed: int  # prompt positions the engine computed (what the cache spares)
    peak_blocks: int  # most blocks held by requests at once

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds


@dataclass
class SweepPoint:
    length: int
    requests: int
    on: SweepRun
    off: SweepRun

    @property
    def shared_share(self) -> float:
        return (self.length - PRIVATE - NEW) / self.length

    @property
    def memory_saved(self) -> float:
        return 1 - self.on.peak_blocks / self.off.peak_blocks

    @property
    def throughput_gained(self) -> float:
        return self.on.tokens_per_second / self.off.tokens_per_second - 1


def sweep_requests(vocab: int, length: int, n: int, seed: int = 0) -> list[RequestSpec]:
    if length <= PRIVATE + NEW:
        raise ValueError(f"a sweep length must exceed {PRIVATE + NEW} tokens, got {length}")
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab) for _ in range(length - PRIVATE - NEW)]
    return [RequestSpec(f"s{i}", prompt_ids=shared + [rng.randrange(100, vocab) for _ in range(PRIVATE)],
                        max_new_tokens=NEW, ignore_eos=True) for i in range(n)]


def run_once(model: LoadedModel, reqs: list[RequestSpec], caching: bool) -> SweepRun:
    length = len(reqs[0].prompt_ids) + NEW
    cfg = EngineConfig(block_size=BLOCK, num_blocks=len(reqs) * -(-length // BLOCK) + 8,
                       max_batch_tokens=max(2048, length), compute="fast", prefix_caching=caching)
    peak = [0]

    def on_step(rec: StepRecord) -> None:
        snap = rec.snapshot
        peak[0] = max(peak[0], len(snap.refcounts) - len(snap.free_queue))

    t = time.perf_counter()
    res = Engine(model, cfg).run(Workload(reqs, cfg), on_step=on_step)
    seconds = time.perf_counter() - t
    s = res.stats
    return SweepRun(length, caching, seconds, s.generated_tokens, s.prompt_tokens, s.prefill_tokens_computed, peak[0])


def sweep(model: LoadedModel, lengths: tuple[int, ...] = LENGTHS, n: int = 8, repeat: int = 1,
          progress: Callable[[str], None] = print) -> list[SweepPoint]:
    """Every length with caching on and off, interleaved `repeat` times; each side reports its median."""
    run_once(model, sweep_requests(model.config.vocab_size, 96, 2), True)  # warm-up
    out = []
    for length in lengths:
        reqs = sweep_requests(model.config.vocab_size, length, n)
        runs: dict[bool, list[SweepRun]] = {True: [], False: []}
        for i in range(repeat):
            for caching in ((True, False) if i % 2 == 0 else (False, True)):
                runs[caching].append(run_once(model, reqs, caching))
        on, off = (sorted(runs[c], key=lambda r: r.seconds)[len(runs[c]) // 2] for c in (True, False))
        out.append(SweepPoint(length, n, on, off))
        progress(f"{length:>5} tokens  throughput {100 * out[-1].throughput_gained:+.0f}%  "
                 f"memory saved {100 * out[-1].memory_saved:.0f}%")
    return out


def sweep_report(model: LoadedModel, points: list[SweepPoint], repeat: int = 1) -> str:
    runs = "" if repeat == 1 else f" Each figure is the median of {repeat} interleaved runs."
    requests = points[0].requests if points else 0
    lines = [f"Model `{model.name}`, device {model.device}, `fast` compute, {requests} requests "
             f"arriving together; each sequence is a shared prefix + {PRIVATE} private prompt tokens + {NEW} "
             f"generated." + runs, "",
             "| sequence tokens | shared prefix | tok/s cache on | tok/s cache off | throughput gained | "
             "article's gain | peak blocks on / off | memory saved | prefill computed on / off |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in points:
        article = f"{ARTICLE[p.length]:.0%}" if p.length in ARTICLE else ""
        lines.append(f"| {p.length} | {p.shared_share:.0%} | {p.on.tokens_per_second:.1f} | "
                     f"{p.off.tokens_per_second:.1f} | {100 * p.throughput_gained:+.0f}% | {article} | "
                     f"{p.on.peak_blocks} / {p.off.peak_blocks} | {p.memory_saved:.0%} | "
                     f"{p.on.prefill_computed} / {p.off.prefill_computed} |")
    return "\n".join(lines) + "\n"
