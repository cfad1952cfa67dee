"""`python -m kvviz bench --capture-import`: how fast captures import and how much memory that takes,
for the JSONL capture and the Parquet dataset of one synthetic two-replica fleet
(kvviz/capture/synthetic.py: 16-token blocks, shared tenant prefixes, one-hash removals as vLLM
sends them), each import in a fresh process so its peak RSS is its own. Writing the dataset is timed
too: it is what `capture-vllm --out DIR` does per message besides receiving it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..capture.capture_file import CaptureWriter
from ..capture.dataset import DatasetWriter
from ..capture.events import decode_batch
from ..capture.synthetic import fleet_messages

# Peak RSS is the child's VmHWM: getrusage's ru_maxrss survives exec on Linux, so it would count the
# parent (which holds the synthetic messages) as well. A JSONL import decodes in a process of its own
# per further core, so the child also samples its own RSS plus its children's every 20 ms, and the
# larger of that sum and its own high-water mark is the import's peak.
CHILD = """
import json, os, sys, threading, time
from kvviz.runners.uploads import import_file
from kvviz.store import RunStore

def rss_kb(pid):
    try:
        return next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0

def children():
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1] == me:
                yield pid
        except (OSError, IndexError):
            pass

together, done = [0], threading.Event()
def sample():
    while not done.wait(0.02):
        together[0] = max(together[0], rss_kb("self") + sum(rss_kb(pid) for pid in children()))

threading.Thread(target=sample, daemon=True).start()
t = time.perf_counter()
import_file(sys.argv[1], RunStore.open(sys.argv[2]))
seconds = time.perf_counter() - t
done.set()
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "peak_mb": max(int(hwm.split()[1]), together[0]) / 1024}))
"""


EXPLAIN_CHILD = """
import json, sys, time
from kvviz.analysis.explained import explained
from kvviz.store import RunStore
store = RunStore.open(sys.argv[1])
with store.read() as con:
    run = con.execute("SELECT run_id FROM runs").fetchone()[0]
t = time.perf_counter()
found = explained(store, run)  # replayed and kept, as the CLI and the app do
seconds = time.perf_counter() - t
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "lookups": len(found), "peak_mb": int(hwm.split()[1]) / 1024}))
"""
VIEWS_CHILD = """
import json, sys, time
from kvviz.analysis import capture_time, captures, explained, runs
from kvviz.runners.uploads import import_file
from kvviz.store import RunStore
store = RunStore.open(sys.argv[1])
t = time.perf_counter()
in_place = import_file(sys.argv[2], store, in_place=True)
out = {"register in place": time.perf_counter() - t}
with store.read() as con:
    copied = con.execute("SELECT run_id FROM runs WHERE run_id <> ? LIMIT 1", [in_place]).fetchone()[0]
    for how, run in (("copied", copied), ("in place", in_place)):
        first = captures.replicas(con, run)[0]
        span = capture_time.span(con, run)
        a, b, w = span.start, span.end, capture_time.interval_s(span.start, span.end)
        top = capture_time.shared_prefixes(con, run, a, b)
        kept = [("misses by reason (kept explanation)", lambda: explained.reasons_per_interval(con, run, a, b, w))]
        for name, view in (*(kept if explained.kept(con, run) else ()),
                           ("run metadata", lambda: runs.run_info(con, run)),
                           ("time span", lambda: capture_time.span(con, run)),
                           ("activity (churn, hits)", lambda: capture_time.churn(con, run, a, b, w)),
                           ("occupancy per tenant", lambda: capture_time.occupancy(con, run, a, b, w, "tenant")),
                           ("occupancy per replica", lambda: capture_time.occupancy(con, run, a, b, w, "replica")),
                           ("lifetimes, idle, reuse gaps", lambda: capture_time.distributions(con, run, a, b)),
                           ("shared prefixes", lambda: capture_time.shared_prefixes(con, run, a, b)),
                           ("a shared prefix's chain", lambda: capture_time.chain(
                               con, run, top.replica[0], int(top.block_hash[0]))),
                           ("cross-tenant blocks", lambda: capture_time.cross_tenant(con, run, a, b)),
                           ("reuse tree (one replica)", lambda: captures.reuse_tree(con, run, a, b, first)),
                           ("prefix tree (one replica)", lambda: captures.prefix_tree(con, run, replica=first))):
            t = time.perf_counter()
            view()
            out[f"{name}, {how}"] = time.perf_counter() - t
print(json.dumps(out))
"""
LINT_CHILD = """
import json, sys, time
from pathlib import Path
from kvviz.capture.dataset import dataset_files
from kvviz.capture.lint import Source, lint_run
from kvviz.store import RunStore
store = RunStore.open(sys.argv[1])
with store.write() as con:  # a copied run's source dataset is no file a sandboxed reader may open
    run = con.execute("SELECT run_id FROM runs").fetchone()[0]
    path = con.execute("SELECT path FROM capture_sources WHERE run_id = ?", [run]).fetchone()
    files = dataset_files(Path(path[0] if path else sys.argv[2]))
    t = time.perf_counter()
    found = lint_run(con, run, Source.of(files, hive=files[0].parent.name.startswith("replica="), renumber=not path))
    print(json.dumps({"seconds": time.perf_counter() - t, "breaches": len(found)}))
"""
EXPLAIN_UP_TO = 1_000_000  # larger captures' explain is timed on its own (--capture-explain)


@dataclass(frozen=True)
class ImportResult:
    events: int
    messages: int
    form: str  # jsonl | dataset
    seconds: float
    peak_mb: float
    written_per_s: float  # messages per second written into this form (decoding included for the dataset)
    explain_s: float | None = None  # `explain` over the imported capture, in another fresh process
    explain_mb: float | None = None  # that process's peak RSS
    views_s: dict[str, float] | None = None  # the dataset's: registering it in place, and each view's query
    lint_s: float | None = None  # the KV-event contract linter alone (part of the import), in another fresh process


def _child(script: str, *args: str, what: str) -> dict:
    """Run a bench script in a fresh Python (its peak RSS its own) and read the JSON it prints last."""
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       cwd=Path(__file__).parents[2])
    if p.returncode:
        raise RuntimeError(f"{what} failed: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class ExplainResult:
    events: int
    lookups: int
    seconds: float  # `explained` on the copied capture: worked out and kept, as the CLI and the app do
    peak_mb: float  # that process's peak RSS


def run_explain_bench(sizes: list[int], progress: Callable[[str], None] = lambda s: None) -> list[ExplainResult]:
    """Explain alone, at sizes the import bench does not explain (EXPLAIN_UP_TO): each synthetic capture
    written as a dataset (streamed: the messages are not held), imported in a fresh process, then
    explained in another."""
    out = []
    with tempfile.TemporaryDirectory(prefix="kvviz-bench-explain-") as tmp:
        for n in sizes:
            path, db = Path(tmp) / f"{n}-ds", Path(tmp) / f"{n}.duckdb"
            progress(f"writing a synthetic capture of {n:,} events")
            w = None
            for m in fleet_messages(n):
                w = w or DatasetWriter(path, {f"replica-{i}": "synthetic" for i in range(2)})
                w.add(m, decode_batch(m.payload, "bench"))
            w.close()
            progress(f"importing {n:,} events")
            _child(CHILD, str(path), str(db), what="importing the dataset")
            progress(f"explaining {n:,} events")
            got = _child(EXPLAIN_CHILD, str(db), what="explaining the capture")
            out.append(ExplainResult(n, got["lookups"], got["seconds"], got["peak_mb"]))
            shutil.rmtree(path)
            db.unlink()
    return out


def explain_report(results: list[ExplainResult]) -> str:
    lines = ["| block events | lookups | explain s | events/s | explain peak MB |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.events:,} | {r.lookups:,} | {r.seconds:.1f} | {r.events / r.seconds:,.0f} | {r.peak_mb:,.0f} |"
              for r in results]
    return "\n".join(lines) + "\n"


def run_capture_bench(sizes: list[int], progress: Callable[[str], None] = lambda s: None) -> list[ImportResult]:
    out = []
    with tempfile.TemporaryDirectory(prefix="kvviz-bench-capture-") as tmp:
        for n in sizes:
            msgs = list(fleet_messages(n))
            replicas = {m.replica: "synthetic" for m in msgs[:8]}
            paths = {"jsonl": Path(tmp) / f"{n}.jsonl", "dataset": Path(tmp) / f"{n}-ds"}
            for form, path in paths.items():
                w = CaptureWriter(path, replicas) if form == "jsonl" else DatasetWriter(path, replicas)
                t = time.perf_counter()
                for m in msgs:
                    w.add(m, decode_batch(m.payload, "bench") if form == "dataset" else None)
                w.close()
                rate = len(msgs) / (time.perf_counter() - t)
                progress(f"importing {n:,} events from the {form} ({len(msgs):,} messages)")
                got = _child(CHILD, str(path), str(Path(tmp) / f"{n}-{form}.duckdb"), what=f"importing the {form}")
                progress(f"timing the linter on the {form}'s run alone")
                linted = _child(LINT_CHILD, str(Path(tmp) / f"{n}-{form}.duckdb"), str(path), what="linting")
                explained = {}
                if n <= EXPLAIN_UP_TO:
                    progress(f"explaining the {form}'s lookups")
                    explained = _child(EXPLAIN_CHILD, str(Path(tmp) / f"{n}-{form}.duckdb"),
                                       what=f"explaining the {form}")
                views = None
                if form == "dataset":
                    progress("timing the inspector's views, copied and registered in place")
                    views = _child(VIEWS_CHILD, str(Path(tmp) / f"{n}-{form}.duckdb"), str(path),
                                   what="timing the views")
                out.append(ImportResult(n, len(msgs), form, got["seconds"], got["peak_mb"], rate,
                                        explained.get("seconds"), explained.get("peak_mb"), views, linted["seconds"]))
            del msgs
    return out


def capture_report(results: list[ImportResult]) -> str:
    lines = ["| block events | messages | from | import s | events/s | peak RSS MB | written msgs/s | explain s "
             "| explain peak MB | of which lint s |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        explained = "- | -" if r.explain_s is None else f"{r.explain_s:.1f} | {r.explain_mb:,.0f}"
        lint = "-" if r.lint_s is None else f"{r.lint_s:.2f}"
        lines.append(f"| {r.events:,} | {r.messages:,} | {r.form} | {r.seconds:.1f} | {r.events / r.seconds:,.0f} "
                     f"| {r.peak_mb:,.0f} | {r.written_per_s:,.0f} | {explained} | {lint} |")
    for r in results:
        if r.views_s:
            lines += ["", f"Seconds on the {r.events:,}-event dataset (server side):", "",
                      "| what | s |", "|---|---:|"] + [f"| {k} | {v:.2f} |" for k, v in r.views_s.items()]
    return "\n".join(lines) + "\n"


PUBLISHER = """
import sys, time, zmq
sys.path.insert(0, sys.argv[4])
from kvviz.capture.synthetic import step_batches
endpoint, rate, duration = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.setsockopt(zmq.SNDHWM, 0)
pub.bind(endpoint)
payloads = step_batches(4096, seed=hash(endpoint) & 0xFFFF)
time.sleep(1.0)  # the subscriber connects
start, seq = time.perf_counter(), 0
while seq < rate * duration:
    due = int((time.perf_counter() - start) * rate) + 1  # batches that should have gone out by now
    while seq < min(due, rate * duration):
        pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payloads[seq % len(payloads)]])
        seq += 1
    time.sleep(0.0005)
print(seq, time.perf_counter() - start, flush=True)
time.sleep(1.0)
"""


@dataclass(frozen=True)
class LiveResult:
    replicas: int
    rate: int  # batches per second per publisher
    seconds: float
    sent: int
    written: int
    lost: int
    capture_cpu_s: float  # the capture process's CPU time while it ran


def start_publishers(replicas: int, rate: int, duration: float) -> tuple[list, list[subprocess.Popen]]:
    """Publishers in their own processes, each sending `rate` step batches a second for `duration`
    seconds after a second's wait; their endpoints, and the processes (sent_by reads how many they sent)."""
    import socket

    from ..capture.zmq_capture import Endpoint

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    root = str(Path(__file__).parents[2])
    sources = [Endpoint(f"replica-{i}", f"tcp://127.0.0.1:{port()}") for i in range(replicas)]
    return sources, [subprocess.Popen([sys.executable, "-c", PUBLISHER, s.endpoint.replace("127.0.0.1", "*"),
                                       str(rate), str(duration), root], stdout=subprocess.PIPE, text=True)
                     for s in sources]


def sent_by(pubs: list[subprocess.Popen]) -> int:
    return sum(int(p.communicate(timeout=30)[0].split()[0]) for p in pubs)


def run_live_bench(replicas: int = 2, rate: int = 10_000, duration: float = 60.0,
                   progress: Callable[[str], None] = lambda s: None) -> LiveResult:
    """Publishers in their own processes at `rate` batches a second each, one FleetCapture writing a
    dataset in this process: does it keep up, with no gaps?"""
    import os

    from ..capture.zmq_capture import FleetCapture

    sources, pubs = start_publishers(replicas, rate, duration)
    with tempfile.TemporaryDirectory(prefix="kvviz-bench-live-") as tmp:
        fleet = FleetCapture(sources)
        sink = DatasetWriter(Path(tmp) / "ds", {s.name: s.endpoint for s in sources})
        progress(f"capturing {replicas} publishers at {rate:,} batches/s each for {duration:g} s")
        cpu = os.times()
        try:
            fleet.run(sink, duration=duration + 4)
        finally:
            fleet.close()
            sink.close()
        used = (os.times().user - cpu.user) + (os.times().system - cpu.system)
    sent = sent_by(pubs)
    states = fleet.states.values()
    return LiveResult(replicas, rate, duration, sent, sum(s.count for s in states), sum(s.lost for s in states), used)


def live_report(r: LiveResult) -> str:
    return ("| publishers | batches/s each | seconds | sent | written | lost | capture CPU |\n"
            "|---:|---:|---:|---:|---:|---:|---:|\n"
            f"| {r.replicas} | {r.rate:,} | {r.seconds:g} | {r.sent:,} | {r.written:,} | {r.lost:,} "
            f"| {r.capture_cpu_s / (r.seconds + 4):.0%} of a core |\n")
