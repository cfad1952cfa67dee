"""`python -m kvviz bench`: throughput of kvviz against transformers, measured in one process.

Peers, on the same prompts: kvviz `fast` and `inspect` (paged, prefix caching on), `inspect` with
the provenance oracle on every layer, transformers batched `generate` with left padding,
transformers `generate_batch` (its own continuous batching), that same continuous batching run
by kvviz's transformers backend under the oracle, and llama.cpp on the model's GGUF file: through
llama-cpp-python with nothing of kvviz in the loop, and through kvviz's llama.cpp backend with and
without the oracle. Ratios are against `generate` measured in the
same run; every request generates exactly the same number of tokens (EOS ignored) so the work is
equal.
"""

from __future__ import annotations

import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList

from ..engine import Engine, EngineConfig, StepRecord
from ..engine.workload import RequestSpec, Workload
from ..models import LoadedModel
from ..models.routing import stock_copy
from ..oracle import ProvenanceOracle
from ..store import RunStore
from ..store.attention import AttentionRecorder, AttentionSelection
from ..store.recorder import RunRecorder


@dataclass(frozen=True)
class BenchCase:
    name: str
    prompts: list[list[int]]
    new_tokens: int


@dataclass
class Measurement:
    case: str
    peer: str
    seconds: float
    generated: int
    prefill_computed: int | None = None  # kvviz only: prompt positions actually computed
    ttft: float | None = None  # mean seconds to a request's first token (prefill and queueing)
    tpot: float | None = None  # mean seconds per output token after the first (prefill chunks it waited on included)
    decode_step: float | None = None  # median seconds of a step that only decodes (generate: each after its first)

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds


CASES = ("uniform", "mixed", "shared-system")
STEP_TOKENS = 2048  # every continuous-batching peer's step budget (a server's), but the one-step peer's


def cases(vocab: int, sizes: list[int], new_tokens: int, seed: int = 0) -> list[BenchCase]:
    """Uniform prompts (144 tokens), mixed prompts (32-256), and a shared 256-token system prompt."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    out = []
    for n in sizes:
        mixed = [32 + (224 * i) // max(n - 1, 1) for i in range(n)]
        rng.shuffle(mixed)
        system = ids(256)
        out += [
            BenchCase(f"uniform-{n}", [ids(144) for _ in range(n)], new_tokens),
            BenchCase(f"mixed-{n}", [ids(k) for k in mixed], new_tokens),
            BenchCase(f"shared-system-{n}", [system + ids(rng.randrange(16, 64)) for _ in range(n)], new_tokens),
        ]
    return out


def pool_blocks(case: BenchCase, page: int) -> int:
    """The cache every peer gets for a case: room for every request at its longest, and 8 blocks spare."""
    longest = max(len(p) for p in case.prompts) + case.new_tokens
    return len(case.prompts) * -(-longest // page) + 8


def run_kvviz(model: LoadedModel, case: BenchCase, compute: str, prefix_caching: bool = True,
              oracle: bool = False, record: bool = False, engine: dict | None = None,
              peer: str | None = None) -> Measurement:
    """One kvviz run of the case (`engine`: settings over the defaults, `peer`: its name then)."""
    cfg = EngineConfig(block_size=16, num_blocks=pool_blocks(case, 16), max_batch_tokens=STEP_TOKENS, isolation="paged",
                       compute=compute, prefix_caching=prefix_caching)
    cfg = EngineConfig.from_dict({**cfg.to_dict(), **(engine or {})})
    reqs = [RequestSpec(f"r{i}", prompt_ids=p, max_new_tokens=case.new_tokens, ignore_eos=True)
            for i, p in enumerate(case.prompts)]
    observers = [ProvenanceOracle()] if oracle or record else []
    wl, recorder, tmp = Workload(reqs, cfg), None, None
    decoding: list[float] = []  # seconds of the steps where every request scheduled decodes one token

    def on_step(rec: StepRecord) -> None:
        if all(n == 1 for _, n in rec.work.values()):
            decoding.append(rec.seconds)
        if recorder is not None:
            recorder.on_step(rec)

    if record:  # default recording: every step, oracle metrics, default attention rows
        tmp = tempfile.TemporaryDirectory()
        observers.append(AttentionRecorder(observers[0], model.config.num_hidden_layers, AttentionSelection()))
        recorder = RunRecorder(RunStore.open(Path(tmp.name) / "bench.duckdb"), "bench", model=model, workload=wl,
                               oracle=observers[0], attention=observers[1])
    t = time.perf_counter()
    res = Engine(model, cfg).run(wl, observers=observers, on_step=on_step)
    if recorder is not None:
        recorder.flush()
        recorder.wait()
        tmp.cleanup()
    seconds = time.perf_counter() - t
    peer = peer or (f"kvviz {compute}" + (" + oracle + recorder" if record else " + oracle" if oracle else "")
                    + ("" if prefix_caching else " (no prefix cache)"))
    n = len(res.requests)
    return Measurement(case.name, peer, seconds, res.stats.generated_tokens, res.stats.prefill_tokens_computed,
                       sum(r.first_token_seconds for r in res.requests) / n,
                       sum(r.seconds_per_output_token for r in res.requests) / n,
                       statistics.median(decoding) if decoding else None)


def _no_eos(model: LoadedModel, n: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=model.tokenizer.pad_token_id or 0)


class _StepClock(LogitsProcessor):
    """Notes when each of `generate`'s forwards has produced its logits; changes nothing."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_generate(model: LoadedModel, case: BenchCase) -> Measurement:
    width = max(len(p) for p in case.prompts)
    pad = model.tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in case.prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in case.prompts], device=model.device)
    clock = _StepClock()
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.model.generate(input_ids=ids, attention_mask=mask, generation_config=_no_eos(model,
                                                                                                 case.new_tokens),
                               logits_processor=LogitsProcessorList([clock]))
    end = time.perf_counter()
    steps = len(clock.times)
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)] or [0.0]
    return Measurement(case.name, "hf generate", end - t, (out.shape[1] - width) * len(case.prompts), None,
                       clock.times[0] - t, (end - clock.times[0]) / (steps - 1) if steps > 1 else 0.0,
                       statistics.median(gaps))


def run_generate_batch(model: LoadedModel, case: BenchCase) -> Measurement:
    """transformers' continuous batching with a cache of the size kvviz's engine gets for the case: left
    to itself on a CPU it sizes its cache from the host's free memory, and allocating and clearing
    gigabytes was most of what this peer's time measured."""
    stock = stock_copy(model.model)  # generate_batch switches the attention of the model it runs on
    page = 16
    cache = ContinuousBatchingConfig(page_size=page, num_blocks=pool_blocks(case, page),
                                     max_batch_tokens=STEP_TOKENS)
    t = time.perf_counter()
    with torch.inference_mode():
        out = stock.generate_batch(inputs=case.prompts, generation_config=_no_eos(model, case.new_tokens),
                                   continuous_batching_config=cache, progress_bar=False)
    seconds = time.perf_counter() - t
    return Measurement(case.name, "hf generate_batch", seconds, sum(len(o.generated_tokens) for o in out.values()))


def run_hf_observed(model: LoadedModel, case: BenchCase, kernel: str = "eager_paged") -> Measurement:
    """transformers' continuous batching as kvviz's transformers backend runs it, the provenance oracle
    on every layer: what observing a real engine costs, against `generate_batch` alone with the same
    cache."""
    from ..runners.backends import run_backend

    cfg = EngineConfig(block_size=16, num_blocks=pool_blocks(case, 16), max_batch_tokens=STEP_TOKENS,
                       backend="transformers", kernel=kernel)
    wl = Workload([RequestSpec(f"r{i}", prompt_ids=p, max_new_tokens=case.new_tokens, ignore_eos=True)
                   for i, p in enumerate(case.prompts)], cfg)
    t = time.perf_counter()
    res = run_backend(model, wl, observers=[ProvenanceOracle()], run_id="bench")
    seconds = time.perf_counter() - t
    n = len(res.requests)
    return Measurement(case.name, f"transformers backend ({kernel}) + oracle", seconds, res.stats.generated_tokens,
                       res.stats.prefill_tokens_computed, sum(r.first_token_seconds for r in res.requests) / n,
                       sum(r.seconds_per_output_token for r in res.requests) / n)


def run_llama(model: LoadedModel, case: BenchCase, oracle: bool = True) -> Measurement:
    """The case through llama.cpp as kvviz's llama.cpp backend runs it (llama-server's slots, every cell and
    every layer's attention observed), with the provenance oracle on every layer or without it."""
    from ..runners.backends import run_backend

    cfg = EngineConfig(block_size=16, num_blocks=pool_blocks(case, 16), max_batch_tokens=STEP_TOKENS,
                       backend="llama.cpp")
    wl = Workload([RequestSpec(f"r{i}", prompt_ids=p, max_new_tokens=case.new_tokens, ignore_eos=True)
                   for i, p in enumerate(case.prompts)], cfg)
    t = time.perf_counter()
    res = run_backend(model, wl, observers=[ProvenanceOracle()] if oracle else [], run_id="bench")
    seconds = time.perf_counter() - t
    n = len(res.requests)
    return Measurement(case.name, "llama.cpp backend" + (" + oracle" if oracle else ""), seconds,
                       res.stats.generated_tokens, res.stats.prefill_tokens_computed,
                       sum(r.first_token_seconds for r in res.requests) / n,
                       sum(r.seconds_per_output_token for r in res.requests) / n)


def run_llama_plain(model: LoadedModel, case: BenchCase) -> Measurement:
    """The case through llama-cpp-python's bindings with nothing of kvviz in the loop (the baseline the
    llama.cpp backend's overhead is measured against)."""
    from ..llama_backend.baseline import run_plain

    t = time.perf_counter()
    out = run_plain(model.gguf(), case.prompts, case.new_tokens, STEP_TOKENS)
    return Measurement(case.name, "llama-cpp-python", time.perf_counter() - t, sum(len(o) for o in out))


def run_one_step(model: LoadedModel, case: BenchCase) -> Measurement:
    """`fast` with a step budget that takes every prompt at once, as `generate` prefills its batch (and as
    vLLM's offline LLM sizes its budget): no request's decode steps share a step with another's prefill
    chunk, so its TPOT is decode alone and compares like for like with generate's."""
    budget = max(STEP_TOKENS, sum(len(p) for p in case.prompts))
    return run_kvviz(model, case, "fast", engine={"max_batch_tokens": budget}, peer=ONE_STEP)


ONE_STEP = "kvviz fast (every prompt in one step)"
PEERS: dict[str, Callable[[LoadedModel, BenchCase], Measurement]] = {
    "kvviz fast": lambda model, c: run_kvviz(model, c, "fast"),
    ONE_STEP: run_one_step,
    "kvviz inspect": lambda model, c: run_kvviz(model, c, "inspect"),
    "kvviz inspect + oracle": lambda model, c: run_kvviz(model, c, "inspect", oracle=True),
    "kvviz inspect + oracle + recorder": lambda model, c: run_kvviz(model, c, "inspect", record=True),
    "hf generate": run_generate,
    "hf generate_batch": run_generate_batch,
    "transformers backend + oracle": run_hf_observed,
    "llama-cpp-python": run_llama_plain,
    "llama.cpp backend": lambda model, c: run_llama(model, c, oracle=False),
    "llama.cpp backend + oracle": run_llama,
}
PEER_NAMES = dict(zip(("fast", "fast-one-step", "inspect", "oracle", "recorder", "generate", "generate_batch",
                       "transformers", "llama-cpp-python", "llama.cpp", "llama.cpp-oracle"), PEERS,
                      strict=True))  # what `bench --peers` takes


def run_bench(model: LoadedModel, sizes: list[int], new_tokens: int, progress: Callable[[str], None] = print,
              repeat: int = 1, only: set[str] | None = None, peers: list[str] | None = None) -> list[Measurement]:
    """Every peer (or `peers`, names of PEERS) on every case (`only`: cases whose name starts with one of
    these), each peer first warmed up on the case's prompts untimed. With repeat > 1 the peers take turns,
    in a rotated order each round, and each reports its median run: on a noisy machine that compares like
    with like."""
    names = peers or list(PEERS)
    out = []
    for case in cases(model.config.vocab_size, sizes, new_tokens):
        if only and not any(case.name.startswith(o) for o in only):
            continue
        warm = BenchCase(case.name, case.prompts, 2)  # untimed: the first peer would pay the case's new shapes
        for peer in names:
            PEERS[peer](model, warm)
        runs: dict[str, list[Measurement]] = {peer: [] for peer in names}
        for i in range(repeat):
            for peer in names[i % len(names):] + names[:i % len(names)]:
                runs[peer].append(PEERS[peer](model, case))
        for peer, measured in runs.items():
            out.append(sorted(measured, key=lambda r: r.tokens_per_second)[len(measured) // 2])
            spread = "" if repeat == 1 else " (runs: " + ", ".join(f"{r.tokens_per_second:.1f}" for r in measured) + ")"
            progress(f"{case.name:>18}  {peer:<20} {out[-1].tokens_per_second:8.1f} tok/s{spread}")
        if case.name.startswith("shared") and "kvviz fast" in names:
            out.append(run_kvviz(model, case, "fast", prefix_caching=False))
            progress(f"{case.name:>18}  {out[-1].peer:<20} prefill computed {out[-1].prefill_computed}")
    return out


def ingest_rates(rows: int = 20_000, keys: int = 256) -> tuple[float, float]:
    """Attention weights per second written as the recorder writes them (a Parquet part, closed) and
    as it did before (one bulk INSERT of Arrow list columns into DuckDB, and the checkpoint at close)."""
    import numpy as np
    import pyarrow as pa

    from ..store.attention_parts import AttentionParts

    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * keys)
    n = rows * keys
    rows_in = pa.table({
        "run_id": pa.array(["ingest"] * rows), "step": pa.array(np.zeros(rows, np.int32)),
        "layer": pa.array(np.zeros(rows, np.int32)), "head": pa.array(np.full(rows, -1, np.int32)),
        "request_id": pa.array(["r"] * rows), "position": pa.array(np.arange(rows, dtype=np.int32)),
        "key_slots": pa.ListArray.from_arrays(offsets, pa.array(np.arange(n, dtype=np.int32))),
        "weights": pa.ListArray.from_arrays(offsets, pa.array(np.random.rand(n).astype(np.float32))),
        "key_classes": pa.ListArray.from_arrays(offsets, pa.array(np.zeros(n, np.uint8)))})
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        parts = AttentionParts(Path(tmp) / "parts")
        parts.add(rows_in)
        parts.close()
        part = time.perf_counter() - t
        store = RunStore.open(Path(tmp) / "ingest.duckdb")
        with store.write():
            pass  # the schema, made before the clock starts
        t = time.perf_counter()
        with store.write() as con:
            RunStore.insert(con, "attention", rows_in)
        duck = time.perf_counter() - t
    return n / part, n / duck


def _where_fast_gains(case: str, fast: Measurement, gen: Measurement, new_tokens: int, chunked: bool) -> str:
    """Split the ratio into prefill and decode: with decode steps exactly as fast as generate's, the
    whole gain is the time to first token, which bounds the ratio any scheduler can reach."""
    ceiling = gen.seconds / (fast.ttft + gen.tpot * (new_tokens - 1))
    decode = "" if fast.decode_step is None or not gen.decode_step else (
        f" (a step that only decodes: {1000 * fast.decode_step:.1f} ms against generate's "
        f"{1000 * gen.decode_step:.1f}" + ("; fast's TPOT also waits on the prefill chunks batched with its decodes)"
                                           if chunked else ")"))
    return (f"{case}: first token after {1000 * fast.ttft:.0f} ms (fast) and {1000 * gen.ttft:.0f} ms (generate), "
            f"then {1000 * fast.tpot:.1f} and {1000 * gen.tpot:.1f} ms per token{decode}; with decode as fast as "
            f"generate's, fast would be {ceiling:.2f}x generate.")


def report(model: LoadedModel, results: list[Measurement], sizes: list[int], new_tokens: int, repeat: int = 1) -> str:
    """A markdown table: tokens/s per case and peer, ratio to `generate`, prefill tokens computed."""
    runs = "" if repeat == 1 else f" Each figure is the median of {repeat} interleaved runs."
    lines = [
        f"Model `{model.name}` ({model.config.model_type}, {model.dtype}), device {model.device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; {sizes} requests, "
        f"{new_tokens} new tokens each." + runs,
        "",
        "| case | peer | tok/s | x generate | TTFT ms | TPOT ms | decode step ms | prefill tokens computed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = {r.case: r.tokens_per_second for r in results if r.peer == "hf generate"}
    for r in results:
        computed = "" if r.prefill_computed is None else str(r.prefill_computed)
        ttft = "" if r.ttft is None else f"{1000 * r.ttft:.1f}"
        tpot = "" if r.tpot is None else f"{1000 * r.tpot:.1f}"
        decode = "" if r.decode_step is None else f"{1000 * r.decode_step:.1f}"
        ratio = f"{r.tokens_per_second / base[r.case]:.2f}" if r.case in base else ""
        lines.append(f"| {r.case} | {r.peer} | {r.tokens_per_second:.1f} | {ratio} | {ttft} | {tpot} | {decode} "
                     f"| {computed} |")
    chunked = {c.name: sum(len(p) for p in c.prompts) > STEP_TOKENS for c in cases(model.config.vocab_size, sizes,
                                                                                   new_tokens)}
    for case in sorted({r.case for r in results}):
        lines.append("")
        lines += _ratios(case, {r.peer: r for r in results if r.case == case}, new_tokens, chunked[case])
    part, duck = ingest_rates()
    lines.append(f"\nAttention rows written: {part / 1e6:.1f} million weights per second into a Parquet part (the "
                 f"recorder's), {duck / 1e6:.1f} million into DuckDB (one INSERT and its checkpoint), "
                 f"{part / duck:.1f}x.")
    for case in sorted({r.case for r in results if r.case.startswith("shared") and r.peer == "kvviz fast"}):
        on = next(r for r in results if r.case == case and r.peer == "kvviz fast").prefill_computed
        off = next(r for r in results if r.case == case and r.peer.endswith("(no prefix cache)")).prefill_computed
        lines.append(f"\n{case}: prefix caching computes {on} prefill tokens instead of {off} "
                     f"({100 * (1 - on / off):.0f}% fewer).")
    return "\n".join(lines) + "\n"


def _ratios(case: str, peer: dict[str, Measurement], new_tokens: int, chunked: bool) -> list[str]:
    """The case's sentences, each said when both of its peers were measured (`chunked`: the case's prompts
    take more than one step of STEP_TOKENS)."""
    said = []
    if {"kvviz inspect", "kvviz inspect + oracle"} <= peer.keys():
        plain, checked = peer["kvviz inspect"], peer["kvviz inspect + oracle"]
        said.append(f"{case}: the oracle on every layer makes inspect "
                    f"{100 * (plain.tokens_per_second / checked.tokens_per_second - 1):.0f}% slower.")
    if {"kvviz inspect + oracle", "kvviz inspect + oracle + recorder"} <= peer.keys():
        checked, recorded = peer["kvviz inspect + oracle"], peer["kvviz inspect + oracle + recorder"]
        said.append(f"{case}: recording runs at {recorded.tokens_per_second / checked.tokens_per_second:.2f}x "
                    "inspect + oracle.")
    seen = next((m for name, m in peer.items() if name.startswith("transformers backend")), None)
    if seen is not None and "hf generate_batch" in peer:
        said.append(f"{case}: transformers' continuous batching observed by the oracle on every layer runs at "
                    f"{seen.tokens_per_second / peer['hf generate_batch'].tokens_per_second:.2f}x generate_batch "
                    "alone.")
    if "llama-cpp-python" in peer:
        plain = peer["llama-cpp-python"].tokens_per_second
        seen = [f"{name} {m.tokens_per_second / plain:.2f}x" for name, m in peer.items()
                if name.startswith("llama.cpp")]
        others = [f"{name} {m.tokens_per_second:.1f}" for name, m in peer.items()
                  if name in ("kvviz fast", "hf generate", "hf generate_batch")]
        said.append(f"{case}: llama.cpp without kvviz runs {plain:.1f} tok/s"
                    + (f"; observed by kvviz: {', '.join(seen)}" if seen else "")
                    + (f"; on the same model, tok/s: {', '.join(others)}" if others else "") + ".")
    if {"kvviz fast", "hf generate"} <= peer.keys():
        said.append(_where_fast_gains(case, peer["kvviz fast"], peer["hf generate"], new_tokens, chunked))
    if {ONE_STEP, "hf generate"} <= peer.keys():
        one, gen, fast = peer[ONE_STEP], peer["hf generate"], peer.get("kvviz fast")
        if not chunked:
            same = (", so the one-step peer runs as fast does (what differs between them is run-to-run spread)"
                    if fast else "")
            said.append(f"{case}: every prompt fits one {STEP_TOKENS}-token step{same}; its TPOT is "
                        f"{1000 * one.tpot:.1f} ms against generate's {1000 * gen.tpot:.1f} ms.")
        else:
            said.append(f"{case}: with every prompt in one step, as generate prefills, fast's TPOT is "
                        f"{1000 * one.tpot:.1f} ms against generate's {1000 * gen.tpot:.1f} ms, at "
                        f"{one.tokens_per_second / gen.tokens_per_second:.2f}x its throughput; the first token comes "
                        f"after {1000 * one.ttft:.0f} ms"
                        + ("." if fast is None else f" ({1000 * fast.ttft:.0f} ms with {STEP_TOKENS}-token steps)."))
    return said
