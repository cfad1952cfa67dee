"""`kvviz serve` through the official openai client: completions and chat, streamed and whole, each
equal to the request run alone; cached tokens as vLLM reports them under each sharing policy;
concurrent clients in one batch; errors as OpenAI's; metrics as Prometheus parses them; shutdown."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvviz.engine import Engine, EngineConfig
from kvviz.engine.workload import RequestSpec, Workload
from kvviz.models import load_model
from kvviz.serve.app import ServeOptions
from kvviz.serve.local import LocalServer, free_port
from kvviz.store import RunStore
from tests.cli import kvviz

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONFIG = dict(block_size=4, num_blocks=256, max_batch_tokens=256)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


class Server(LocalServer):
    """kvviz serve in this process on the tiny model's settings, with an openai client."""

    def __init__(self, model, sharing: str = "global", max_in_flight: int = 64, oracle: bool = False,
                 fault: str | None = None, isolation: str = "paged", config: dict | None = None,
                 record: RunStore | None = None, on_step=None):
        cfg = EngineConfig(**(config or CONFIG), isolation=isolation, compute="inspect" if oracle else "fast",
                           prefix_caching=sharing != "off")
        super().__init__(model, cfg, ServeOptions("tiny", sharing, chat_template=TEMPLATE), max_in_flight, oracle,
                         fault, record, on_step)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="key-1", max_retries=0)


@pytest.fixture
def server(tiny):
    s = Server(tiny)
    yield s
    s.close()


def alone(model, ids: list[int], n: int) -> str:
    """What the engine generates for this request run by itself (greedy)."""
    cfg = EngineConfig(**CONFIG, compute="fast")
    res = Engine(model, cfg).run(Workload([RequestSpec("x", prompt_ids=ids, max_new_tokens=n)], cfg))
    return res.requests[0].text


def test_a_completion_whole_and_streamed_equals_the_request_alone(server, tiny):
    prompt = "The colours are red orange yellow"
    whole = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    ids = tiny.tokenizer(prompt).input_ids
    assert whole.choices[0].text == alone(tiny, ids, 12) and whole.object == "text_completion"
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 12
    assert whole.choices[0].finish_reason == "length"
    chunks = list(server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    by_ids = server.client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text


def test_chat_whole_and_streamed(server, tiny):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    ids = tiny.tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    assert whole.choices[0].message.content == alone(tiny, list(ids), 10)
    assert whole.choices[0].message.role == "assistant" and whole.usage.prompt_tokens == len(ids)
    stream = list(server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                                        temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant" and stream[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == whole.choices[0].message.content


def test_a_repeated_prefix_reports_cached_tokens(server):
    prompt = "abcdefghij" * 4  # 40 byte tokens: ten blocks of 4
    first = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = server.client.completions.create(model="tiny", prompt=prompt + "xyz", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 40  # every full block of the shared prefix


def test_concurrent_clients_share_steps_and_each_equals_its_run_alone(server, tiny):
    prompts = [f"request number {i} says" + " hello" * i for i in range(6)]
    barrier = threading.Barrier(len(prompts))

    def ask(p: str) -> str:
        barrier.wait()
        r = server.client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(ask, prompts))
    assert texts == [alone(tiny, tiny.tokenizer(p).input_ids, 16) for p in prompts]
    assert server.worker.stats.peak_batch > 1  # they were batched together, not one after another


def cached(client, prompt: str, **extra) -> int:
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, **extra)
    return r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("sharing", ["global", "per-user", "off"])
def test_each_sharing_policy(tiny, sharing):
    s = Server(tiny, sharing)
    try:
        prompt = "shared system prompt! " * 3
        first = cached(s.client, prompt, user="alice")
        bob = cached(s.client, prompt, user="bob")
        alice = cached(s.client, prompt, user="alice")
        salted = [cached(s.client, prompt + "?", user=u, extra_body={"cache_salt": "team"}) for u in ("alice", "bob")]
    finally:
        s.close()
    assert first == 0
    if sharing == "global":
        assert bob > 0 and alice > 0
    elif sharing == "per-user":  # isolation by user, and caching still works within a user
        assert bob == 0 and alice > 0 and salted[0] == 0 and salted[1] > 0
    else:
        assert bob == alice == salted[0] == salted[1] == 0


def test_bad_requests_get_openai_errors(server):
    c = server.client
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-9", prompt="x")
    assert "this server serves 'tiny'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x" * 100, max_tokens=1000)
    assert "the pool holds 1024" in e.value.body["message"] and "--num-blocks is too small" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[])
    assert e.value.body["param"] == "messages"
    raw = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["message"].startswith("the request body is not valid JSON")
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert c.models.list().data[0].id == "tiny"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_a_full_server_says_429_and_a_client_that_leaves_frees_its_place(tiny):
    s = Server(tiny, max_in_flight=1, oracle=True)  # the inspect path: a 900-token reply takes a while
    try:
        stream = s.client.completions.create(model="tiny", prompt="hold on", max_tokens=900, temperature=0,
                                             stream=True)
        next(iter(stream))  # the first token is out: the request is running
        with pytest.raises(openai.RateLimitError):
            s.client.completions.create(model="tiny", prompt="me too", max_tokens=2)
        stream.close()  # the client goes away
        deadline = time.monotonic() + 10
        while s.worker.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.worker.in_flight() == 0 and s.worker.stats.generated_tokens < 900  # stopped, not run to the end
        assert s.client.completions.create(model="tiny", prompt="now", max_tokens=2).usage.completion_tokens == 2
    finally:
        s.close()


def scrape(url: str) -> dict[str, float]:
    """Each sample by name, a labelled one as name{label=value,...}."""
    text = httpx.get(url + "/metrics").text
    return {s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""):
            s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_parse_and_equal_the_servers_own_figures(server):
    usages = [server.client.completions.create(model="tiny", prompt="same prefix, said again " + tail,
                                               max_tokens=3, temperature=0).usage for tail in ("a", "b", "c")]
    m = scrape(server.url)
    assert m["kvviz_prefix_cache_queries_total"] == sum(u.prompt_tokens for u in usages)
    assert m["kvviz_prefix_cache_hits_total"] == sum(u.prompt_tokens_details.cached_tokens for u in usages) > 0
    assert m["kvviz_prefix_cache_hit_ratio"] == pytest.approx(m["kvviz_prefix_cache_hits_total"]
                                                              / m["kvviz_prefix_cache_queries_total"])
    assert m["kvviz_requests_total"] == 3 and m["kvviz_generation_tokens_total"] == 9
    assert m["kvviz_kv_block_utilisation"] == 0  # every request has finished: nothing held
    assert "kvviz_leak_rate" not in m  # no oracle, no isolation metrics


def two_tenants_at_once(s: Server) -> dict[str, float]:
    barrier = threading.Barrier(2)

    def ask(prompt: str, user: str) -> None:
        barrier.wait()
        s.client.completions.create(model="tiny", prompt=prompt, max_tokens=48, user=user, temperature=0,
                                    extra_body={"ignore_eos": True})  # long enough to overlap under load

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ask, ("tenant one: the secret is red", "tenant two: the secret is blue"), ("a", "b")))
    return scrape(s.url)


@pytest.mark.parametrize("fault", [None, "global"])
def test_the_oracle_exports_leak_metrics_and_sees_a_served_fault(tiny, fault):
    s = Server(tiny, oracle=True, fault=fault, isolation="masked")
    try:
        m = two_tenants_at_once(s)
    finally:
        s.close()
    assert s.worker.stats.peak_batch == 2 and s.worker.oracle.steps == []  # batched; totals kept, steps not
    if fault is None:  # the control: correct isolation, nothing foreign
        assert m["kvviz_leak_rate"] == 0 and m["kvviz_foreign_attention_mass_max"] == 0
        assert not any(k.startswith("kvviz_leak_findings_total") for k in m)
    else:  # the mask lets each tenant read the other's tokens: the metrics say so
        assert m["kvviz_leak_rate"] > 0 and m["kvviz_foreign_attention_mass_max"] > 0.01
        assert m["kvviz_leak_findings_total{kind=foreign}"] > 0


@pytest.mark.slow
def test_the_cli_serves_and_stops_cleanly_on_sigterm(tmp_path):
    port = free_port()
    db = tmp_path / "served.duckdb"
    p = subprocess.Popen([sys.executable, "-m", "kvviz", "serve", "--model", "tiny-llama", "--port", str(port),
                          "--fault", "boundary", "--record", "--db", str(db)], cwd=ROOT, stderr=subprocess.PIPE,
                         text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.completions.create, model="tiny-llama", prompt="finish me", max_tokens=64,
                                  temperature=0)
            time.sleep(0.3)
            p.send_signal(signal.SIGTERM)
            assert pending.result(timeout=60).usage.completion_tokens == 64  # in flight: finished, not dropped
        assert p.wait(60) in (0, -signal.SIGTERM)  # uvicorn ends by the signal it was sent, after draining
        said = p.stderr.read()
        assert "kvviz: stopped after 1 request, 64 tokens generated" in said
        assert "fault boundary injected, leak oracle on" in said  # a mask fault: served on the masked mechanism
        with RunStore.open(db).read() as con:  # the recording was finished on the way out, not left running
            status, fault, generated = con.execute("SELECT status, fault, generated_tokens FROM runs").fetchone()
        assert (status, fault, generated) == ("complete", "boundary", 64)
    finally:
        p.kill()
    bad = kvviz("serve", "--port", "0")
    assert bad.returncode == 2 and "--port must be 1-65535" in bad.stderr
    bad = kvviz("serve", "--fault", "boundary", "--isolation", "paged")
    assert bad.returncode == 2 and "breaks the masked mechanism; --isolation is 'paged'" in bad.stderr
    bad = kvviz("serve", "--num-blocks", "0")
    assert bad.returncode == 2 and "--num-blocks: must be a positive integer" in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bad = kvviz("serve", "--port", taken.getsockname()[1])
    assert bad.returncode == 2 and "Address already in use" in bad.stderr and "serving" not in bad.stderr


def test_a_seed_repeats_a_sampled_reply_and_ignore_eos_runs_to_max_tokens(server):
    ask = dict(model="tiny", prompt="eos please", max_tokens=600, temperature=1, seed=1)
    first, again = server.client.completions.create(**ask), server.client.completions.create(**ask)
    assert first.choices[0].text == again.choices[0].text and first.choices[0].finish_reason == "stop"
    assert first.usage.completion_tokens < 600  # this seed samples EOS early ...
    longer = server.client.completions.create(**ask, extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 600 and longer.choices[0].finish_reason == "length"  # ... vLLM's flag


@pytest.mark.slow
def test_the_serve_bench_prints_its_table():
    p = kvviz("bench", "--model", "tiny-llama", "--serve", "--sizes", "2", "--cases", "uniform", "--new-tokens", "4")
    assert p.returncode == 0, p.stderr
    row = next(line for line in p.stdout.splitlines() if line.startswith("| uniform-2 |"))
    assert row.split("|")[2].strip() == "2"  # both clients measured


@pytest.mark.parametrize("fault", [None, "global"])
def test_served_traffic_is_recorded_as_one_run(tiny, tmp_path, fault):
    from kvviz.analysis.memory import run_memory

    store = RunStore.open(tmp_path / "k.duckdb")
    s = Server(tiny, oracle=True, fault=fault, isolation="masked", record=store)
    try:
        two_tenants_at_once(s)
        s.client.completions.create(model="tiny", prompt="and a third, alone", max_tokens=5, temperature=0)
    finally:
        s.close()
    run_id = s.worker.recording.run_id
    with store.read() as con:
        status, scenario, findings, leak = con.execute("SELECT status, scenario, findings, leak_rate FROM runs "
                                                       "WHERE run_id = ?", [run_id]).fetchone()
        requests = con.execute("SELECT count(*), sum(len(output_ids)) FROM requests WHERE run_id = ?",
                               [run_id]).fetchone()
        steps = con.execute("SELECT count(*) FROM steps WHERE run_id = ?", [run_id]).fetchone()[0]
        metric_steps = con.execute("SELECT count(DISTINCT step) FROM leak_metrics WHERE run_id = ?",
                                   [run_id]).fetchone()[0]
        stored = con.execute("SELECT count(*) FROM findings WHERE run_id = ?", [run_id]).fetchone()[0]
        assert run_memory(con, run_id) is not None  # the Blocks view's comparison works on a served run
    assert (status, scenario) == ("complete", "serve") and requests == (3, 48 + 48 + 5)
    with store.read() as con:  # each request arrived at the step it joined, the third after the others
        arrivals = [a for (a,) in con.execute("SELECT arrival_step FROM requests WHERE run_id = ? ORDER BY "
                                              "arrival_step", [run_id]).fetchall()]
    assert arrivals[-1] > arrivals[0] and arrivals[-1] >= 48
    assert steps == metric_steps == s.worker.stats.steps  # every step, with the oracle's metrics
    assert stored == findings == sum(s.worker.findings.values())
    if fault is None:
        assert findings == 0 and leak == 0
    else:
        assert findings > 0 and leak > 0


def test_a_served_cross_tenant_read_is_recorded_once_it_has_ended(tiny, tmp_path):
    """Per-user sharing with the salt left out of the hash: b's request reads a's blocks. The server
    writes findings as it goes; a read is written once ended, with its whole range of steps."""
    store = RunStore.open(tmp_path / "k.duckdb")
    s = Server(tiny, sharing="per-user", oracle=True, fault="unsalted_prefix", record=store)
    prompt = "a system prompt both tenants send, long enough for whole blocks"
    try:
        for user, text in (("a", prompt), ("b", prompt), ("c", "and then something else entirely")):
            s.client.completions.create(model="tiny", prompt=text, max_tokens=4, user=user, temperature=0)
    finally:
        s.close()
    run_id = s.worker.recording.run_id
    with store.read() as con:
        found = con.execute("SELECT request_id, step, last_step, layer, head, mass, block FROM findings "
                            "WHERE run_id = ?", [run_id]).fetchall()
        b = con.execute("SELECT request_id FROM requests WHERE run_id = ? AND tenant = 'user:b'",
                        [run_id]).fetchone()[0]
        steps = con.execute("SELECT min(step), max(step) FROM step_work WHERE run_id = ? AND request_id = ?",
                            [run_id, b]).fetchone()
        hit = sorted(r[0] for r in con.execute("SELECT block FROM block_events WHERE run_id = ? AND kind = 'hit' AND "
                                               "request_id = ?", [run_id, b]).fetchall())
    assert s.worker.findings == {"cross_tenant": len(found)} and hit
    assert sorted(f[6] for f in found) == hit
    assert {f[:6] for f in found} == {(b, *steps, None, None, None)}


def test_reset_prefix_cache_is_refused_while_a_request_runs_then_forgets_every_block(tiny, tmp_path):
    """vLLM's POST /reset_prefix_cache: 409 while a request runs; once idle the same prompt is computed
    again, the recorded run says it missed because of the reset, and the KV events carry one
    AllBlocksCleared (with the next step, as vLLM publishes once per step)."""
    import msgpack

    from kvviz.analysis.explain import explain_run
    from kvviz.capture.emit import KVEventEmitter

    store, batches = RunStore.open(tmp_path / "k.duckdb"), []
    emitter = KVEventEmitter(4, lambda seq, topic, payload: batches.append(msgpack.unpackb(payload)[1]))
    s = Server(tiny, oracle=True, record=store, on_step=emitter.on_step)  # the inspect path: a long reply is slow
    prompt = "abcdefghij" * 4  # 40 byte tokens: nine blocks of 4 can be served
    try:
        stream = s.client.completions.create(model="tiny", prompt="hold on", max_tokens=900, temperature=0,
                                             stream=True)
        next(iter(stream))  # the request is running
        refused = httpx.post(s.url + "/reset_prefix_cache")
        stream.close()
        deadline = time.monotonic() + 10
        while s.worker.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [cached(s.client, prompt), cached(s.client, prompt)] == [0, 36]
        reset = httpx.post(s.url + "/reset_prefix_cache")
        assert cached(s.client, prompt) == 0
    finally:
        s.close()
    assert refused.status_code == 409 and "reset only when no request runs" in refused.json()["error"]["message"]
    assert reset.status_code == 200 and reset.json() == {"reset": True}
    assert [e["type"] for events in batches for e in events].count("AllBlocksCleared") == 1
    run_id = s.worker.recording.run_id
    with store.read() as con:
        last = explain_run(con, run_id)[-1]
        step, cleared = con.execute("SELECT min(step), count(*) FROM block_events WHERE run_id = ? AND kind = 'clear'",
                                    [run_id]).fetchone()
        ended = con.execute("SELECT count(*) FROM block_lifetimes WHERE run_id = ? AND removed_step = ?",
                            [run_id, step]).fetchone()[0]
    assert (last.hit_tokens, last.reason) == (0, "reset")
    assert cleared >= 9 and ended == cleared  # every cached block's life ended at the reset


@pytest.mark.parametrize("fault", [None, "uncounted_restore"])
def test_a_reply_that_leaves_restored_tokens_out_of_its_usage_is_a_telemetry_finding(tiny, fault):
    """A prompt pushed out to the host tier and sent again is served from there. The reply's
    usage.prompt_tokens_details.cached_tokens must say so; where the engine counts device hits only, the
    oracle's record of what the request was served disagrees with the reply, and the server says it."""
    from kvviz.engine.config import OffloadConfig

    s = Server(tiny, oracle=True, fault=fault, config=dict(block_size=4, num_blocks=24, max_batch_tokens=256,
                                                           offload=OffloadConfig(cpu_blocks=32)))
    prompt = "a system prompt sent twice, pushed out to the host tier in between"
    try:
        for text in (prompt, "filler words that take the device pool " * 2, "more filler for the pool " * 3):
            s.client.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0)
        again = s.client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    finally:
        s.close()
    cached = again.usage.prompt_tokens_details.cached_tokens
    if fault is None:
        assert cached == (len(prompt) - 1) // 4 * 4 and not s.worker.findings
    else:
        assert cached == 0 and s.worker.findings == {"telemetry_mismatch": 1}
