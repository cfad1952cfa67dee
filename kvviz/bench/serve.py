"""`python -m kvviz bench --serve`: `kvviz serve` under N concurrent streaming clients (the official
openai client, one thread each, all starting together) against the engine's fast path on the same
prompts, measured in the same run. The server runs in its own process, as a real one would, so the
clients' Python does not share its interpreter; both still share this machine's cores.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..models import LoadedModel
from .throughput import BenchCase, Measurement, cases, run_kvviz


@dataclass
class ClientTiming:
    start: float
    first: float
    end: float
    tokens: int

    @property
    def ttft(self) -> float:
        return self.first - self.start

    @property
    def tpot(self) -> float:
        return (self.end - self.first) / (self.tokens - 1) if self.tokens > 1 else 0.0


@dataclass
class ServeMeasurement:
    case: str
    clients: list[ClientTiming]

    @property
    def seconds(self) -> float:
        return max(c.end for c in self.clients) - min(c.start for c in self.clients)

    @property
    def tokens_per_second(self) -> float:
        return sum(c.tokens for c in self.clients) / self.seconds


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


class _ServerProcess:
    """`python -m kvviz serve` in a child process on a free port, ready when it answers /health."""

    def __init__(self, model: str, device: str, num_blocks: int):
        import httpx2

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvviz", "serve", "--model", model, "--device", device, "--port", str(port),
             "--num-blocks", str(num_blocks), "--max-in-flight", "1024"], stderr=subprocess.DEVNULL,
            env={**os.environ, "TQDM_DISABLE": "1"})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvviz serve exited with status {self.proc.returncode}")
            try:
                if httpx2.get(self.url + "/health").status_code == 200:
                    return
            except httpx2.TransportError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError("kvviz serve did not answer within 300 s")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def run_clients(url: str, model: str, case: BenchCase) -> ServeMeasurement:
    """One streaming client per prompt, all released at once; EOS ignored, as in the engine's run."""
    import openai

    barrier = threading.Barrier(len(case.prompts))
    out: list[ClientTiming | None] = [None] * len(case.prompts)

    def client(i: int) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
        barrier.wait()
        start, first, tokens = time.perf_counter(), None, 0
        for chunk in c.completions.create(model=model, prompt=case.prompts[i], max_tokens=case.new_tokens,
                                          temperature=0, stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True}):
            if first is None and chunk.choices:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        out[i] = ClientTiming(start, first or time.perf_counter(), time.perf_counter(), tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(case.prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ServeMeasurement(case.name, [c for c in out if c is not None])


def run_serve_bench(model: LoadedModel, model_arg: str, device: str, sizes: list[int], new_tokens: int,
                    only: set[str] | None = None, progress: Callable[[str], None] = print
                    ) -> list[tuple[Measurement, ServeMeasurement]]:
    """Each case: the engine's fast path here, then the same prompts through the server."""
    chosen = [c for c in cases(model.config.vocab_size, sizes, new_tokens)
              if not only or any(c.name.startswith(o) for o in only)]
    longest = max(len(p) for c in chosen for p in c.prompts) + new_tokens
    server = _ServerProcess(model_arg, device, max(sizes) * -(-longest // 16) + 64)
    out = []
    try:
        warm = BenchCase("warm-up", [[101, 102, 103, 104]] * 2, 2)
        run_kvviz(model, warm, "fast")  # both sides warmed up before anything is timed
        run_clients(server.url, model.name, warm)
        for case in chosen:
            fast = run_kvviz(model, case, "fast")
            served = run_clients(server.url, model.name, case)
            out.append((fast, served))
            progress(f"{case.name:>18}  fast {fast.tokens_per_second:7.1f} tok/s   served "
                     f"{served.tokens_per_second:7.1f} tok/s ({len(served.clients)} streaming clients)")
    finally:
        server.close()
    return out


def serve_report(model: LoadedModel, results: list[tuple[Measurement, ServeMeasurement]], new_tokens: int) -> str:
    lines = [f"Model `{model.name}`, device {model.device}: `kvviz serve` (its own process) under one streaming openai "
             f"client per request, all starting together, against `kvviz fast` in this process on the same prompts; "
             f"{new_tokens} tokens each, EOS ignored. Times are the clients' own.", "",
             "| case | clients | served tok/s | fast tok/s | served / fast | TTFT p50 ms | TTFT p99 ms | "
             "TPOT p50 ms | TPOT p99 ms |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for fast, served in results:
        ttft = [1000 * c.ttft for c in served.clients]
        tpot = [1000 * c.tpot for c in served.clients]
        lines.append(f"| {served.case} | {len(served.clients)} | {served.tokens_per_second:.1f} | "
                     f"{fast.tokens_per_second:.1f} | {served.tokens_per_second / fast.tokens_per_second:.2f} | "
                     f"{statistics.median(ttft):.0f} | {_percentile(ttft, 0.99):.0f} | "
                     f"{statistics.median(tpot):.1f} | {_percentile(tpot, 0.99):.1f} |")
    return "\n".join(lines) + "\n"
