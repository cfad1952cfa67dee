"""The command line as scripts use it: exit codes, JSON on the last line, errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import duckdb
import pytest

from .cli import kvviz as in_process
from .cli import kvviz_process

ROOT = Path(__file__).resolve().parent.parent
DB = Path(tempfile.mkdtemp(prefix="kvviz-cli-")) / "kvviz.duckdb"  # keep the repository's runs/ untouched


def kvviz(*args: str, process: bool = False) -> subprocess.CompletedProcess:
    """In this process, or (process=True) as `python -m kvviz`; a run records into DB."""
    extra = ["--db", str(DB)] if args and args[0] == "run" else []
    return (kvviz_process if process else in_process)(*args, *extra)


@pytest.mark.slow
def test_run_json_summary_is_the_last_line(tmp_path):
    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps({"requests": [{"id": "A", "prompt": "红 橙 黄", "max_new_tokens": 4},
                                           {"id": "B", "parent": "A", "prompt": "!", "max_new_tokens": 3,
                                            "arrival_step": 2}],
                              "engine": {"block_size": 4, "num_blocks": 32}}))
    p = kvviz("run", "--workload", str(wl), "--model", "tiny-llama", "--json", "--isolation", "masked", process=True)
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(summary["run_id"]) == 12 and summary["engine"]["isolation"] == "masked"
    assert [r["id"] for r in summary["requests"]] == ["A", "B"]
    assert [len(r["output_ids"]) for r in summary["requests"]] == [4, 3]
    assert all(isinstance(r["text"], str) for r in summary["requests"])
    assert "generating" in p.stderr  # the progress bar


def test_run_prints_a_table_without_json(tmp_path):
    p = kvviz("run", "--workload", str(ROOT / "examples" / "colours.json"), "--model", "tiny-gpt2", "--quiet")
    assert p.returncode == 0, p.stderr
    assert "run " in p.stdout and "A2" in p.stdout and "tok/s" in p.stdout


@pytest.mark.parametrize("content,message", [
    (None, "no such workload file"),
    ("{oops", "not valid JSON (line 1"),
    ('{"requests": [{"id": "A", "prompt": "x", "max_new_tokens": "many"}]}', r"requests[0].max_new_tokens"),
    ('{"requests": [{"id": "A", "prompt": "x"}], "engine": {"isolation": "hope"}}', "engine.isolation"),
])
def test_bad_workloads_exit_2_with_a_specific_message(tmp_path, content, message):
    wl = tmp_path / "wl.json"
    if content is not None:
        wl.write_text(content)
    p = kvviz("run", "--workload", str(wl), "--model", "tiny-llama")
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr


def test_bad_model_exits_2(tmp_path):
    wl = tmp_path / "wl.json"
    wl.write_text('{"requests": [{"id": "A", "prompt": "x"}]}')
    p = kvviz("run", "--workload", str(wl), "--model", str(tmp_path / "missing-model"))
    assert p.returncode == 2 and "no such file or folder" in p.stderr and "Traceback" not in p.stderr


def test_capture_example_writes_a_capture_that_imports_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "fleet.jsonl"
    p = kvviz("capture-example", str(out), "--events", "6000", "--replicas", "3", "--seed", "7", process=True)
    assert p.returncode == 0, p.stderr
    messages = int(p.stdout.split(": ")[1].split()[0])
    assert "synthetic 3-replica fleet" in p.stdout and messages == len(out.read_text().splitlines()) - 1
    db = tmp_path / "k.duckdb"
    p = kvviz("import", str(out), "--db", str(db))
    assert p.returncode == 0, p.stderr
    twice = kvviz("import", str(out), "--db", str(db))
    assert twice.returncode == 0 and twice.stdout == p.stdout, "the same file again: the earlier run's id"
    assert "was imported before, as run" in twice.stderr and "--again" in twice.stderr
    anew = kvviz("import", str(out), "--db", str(db), "--again")
    assert anew.returncode == 0 and anew.stdout.strip() not in ("", p.stdout.strip())
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 2
    assert con.execute("SELECT count(DISTINCT replica), count(*) > 5000 FROM kv_events WHERE run_id = ?",
                       [p.stdout.strip()]).fetchone() == (3, True)
    con.close()
    again = kvviz("capture-example", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr
    folder = tmp_path / "ds"
    assert kvviz("capture-example", str(folder), "--events", "500").returncode == 0
    assert any(folder.glob("replica=replica-1/part-*.parquet"))
    assert "not empty" in kvviz("capture-example", str(folder)).stderr
    zero = kvviz("capture-example", str(tmp_path / "x.jsonl"), "--events", "0")
    assert "--events must be at least 1, got 0" in zero.stderr
    assert "give FILE.jsonl" in kvviz("capture-example", str(tmp_path / "out.txt")).stderr


def test_bad_bench_arguments_exit_2(tmp_path):
    p = kvviz("bench", "--sizes", "eight", "--model", "tiny-llama")
    assert p.returncode == 2 and "--sizes takes positive integers" in p.stderr
    p = kvviz("bench", "--sizes", "2", "--new-tokens", "0", "--model", "tiny-llama")
    assert p.returncode == 2 and "--new-tokens must be >= 1" in p.stderr and "--sizes" not in p.stderr
    p = kvviz("bench", "--sizes", "2", "--model", "tiny-llama", "--out", str(tmp_path / "nowhere" / "b.md"))
    assert p.returncode == 2 and "no folder" in p.stderr and "tok/s" not in p.stderr  # refused before running


@pytest.mark.parametrize("flags,named", [(["--endpoint", "bogus"], "--endpoint 'bogus'"),
                                         (["--endpoint", "tcp://127.0.0.1:5999", "--replay", "bogus"], "--replay")])
def test_capture_refuses_a_malformed_endpoint_at_once(tmp_path, flags, named):
    out = tmp_path / "cap.jsonl"
    p = kvviz("capture-vllm", *flags, "--duration", "30", "--out", str(out))
    assert p.returncode == 2 and named in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()


def test_fast_runs_say_they_are_not_judged_and_refuse_fail_on_leak():
    colours = str(ROOT / "examples" / "colours.json")
    p = kvviz("run", "--workload", colours, "--model", "tiny-llama", "--compute", "fast", "--json")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["db"] is None and summary["findings"] is None and "not judged or recorded" in p.stderr
    p = kvviz("run", "--workload", colours, "--model", "tiny-llama", "--compute", "fast", "--fail-on-leak")
    assert p.returncode == 2 and "--fail-on-leak needs the leak oracle" in p.stderr
    # with a fault the oracle runs, so the run is inspect, and says so in its summary and its record
    p = kvviz("run", "--workload", colours, "--model", "tiny-llama", "--compute", "fast", "--fault",
              "unsalted_prefix", "--json")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["engine"]["compute"] == "inspect" and "runs --compute inspect" in p.stderr
    stored = kvviz("sql", f"SELECT engine FROM runs WHERE run_id = '{summary['run_id']}'", "--format", "json",
                   "--db", str(DB))
    assert json.loads(json.loads(stored.stdout)[0]["engine"])["compute"] == "inspect"


def test_unwritable_outputs_and_closed_pipes_end_without_a_traceback(tmp_path):
    colours = str(ROOT / "examples" / "colours.json")
    ran = kvviz("run", "--workload", colours, "--model", "tiny-llama", "--json")
    run_id = json.loads(ran.stdout.splitlines()[-1])["run_id"]
    for fmt in ("kvviz", "chrome"):
        p = kvviz("export", run_id, "--db", str(DB), "--format", fmt, "--out", str(tmp_path))  # a folder
        assert p.returncode == 2 and str(tmp_path) in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert list(tmp_path.iterdir()) == []  # no .partial left behind
    for fmt in ("kvviz", "chrome"):
        p = kvviz("export", "nosuch", "--db", str(DB), "--format", fmt)
        assert p.returncode == 2 and "no run 'nosuch'" in p.stderr
    p = kvviz("export", run_id, "--db", str(tmp_path / "missing.duckdb"))
    assert p.returncode == 2 and "no database at" in p.stderr and not (tmp_path / "missing.duckdb").exists()
    p = kvviz("sql", "SELECT 1", "--limit", "-5", "--db", str(DB))
    assert p.returncode == 2 and "--limit must be >= 0" in p.stderr
    head = subprocess.run(f"{sys.executable} -m kvviz sql 'SELECT * FROM range(200000)' --db {DB} | head -2",
                          shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert len(head.stdout.splitlines()) == 2 and "Traceback" not in head.stderr, head.stderr


def test_scenarios_lists_the_seed_patterns_first():
    p = kvviz("scenarios")
    names = [line.split()[0] for line in p.stdout.splitlines()]
    assert p.returncode == 0 and names[:4] == ["passphrase", "boundary", "global", "positional"]
    assert "control_tenants" in names
    from kvviz.catalogue.scenarios import SCENARIOS

    faults = [line.split()[1] for line in p.stdout.splitlines()]
    assert faults == [sc.fault or "(control)" for sc in SCENARIOS.values()], "no long name runs into the next column"


def test_run_scenario_json_has_the_gating_keys_and_fail_on_leak():
    p = kvviz("run", "--scenario", "boundary", "--model", "tiny-llama", "--json", "--fail-on-leak")
    assert p.returncode == 1, p.stderr
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(s["leak"]) == {"max_foreign_mass", "mean_foreign_mass", "leak_rate", "counts"}
    assert set(s["leak"]["counts"]) == {"own", "foreign", "stale"}
    assert set(s["divergence"]) == {"diverged_requests", "max_logit_diff"}
    assert s["findings"] and set(s["findings"][0]) == {"kind", "request", "step", "layer", "head", "position",
                                                       "source_request", "mass", "block", "last_step"}
    assert s["leak"]["max_foreign_mass"] > 0 and s["fault"] == "boundary" and s["cross_tenant"] is None
    clean = kvviz("run", "--scenario", "passphrase", "--model", "tiny-llama", "--json", "--fail-on-leak")
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout.strip().splitlines()[-1])["findings"] == []


def test_run_says_the_cross_tenant_reads_in_one_sentence_and_json_lists_each_block():
    p = kvviz("run", "--scenario", "unsalted_prefix", "--model", "tiny-llama", "--quiet")
    assert p.returncode == 0, p.stderr
    said = next(line for line in p.stdout.splitlines() if line.startswith("cross-tenant reads: "))
    assert "blocks of tenant-a read by tenant-b (B read blocks" in said
    assert "finding cross_tenant" not in p.stdout  # one per block: the sentence says them, --json lists them
    s = json.loads(kvviz("run", "--scenario", "unsalted_prefix", "--model", "tiny-llama", "--json").stdout
                   .splitlines()[-1])
    assert s["cross_tenant"] == said.split(": the same content")[0]
    said_of = {(f["kind"], f["layer"], f["head"], f["mass"]) for f in s["findings"]}
    assert said_of == {("cross_tenant", None, None, None)}
    assert f"{len(s['findings'])} blocks of tenant" in said and len({f["block"] for f in s["findings"]}) == \
        len(s["findings"])


def test_run_workload_with_a_fault_and_the_seed_table(tmp_path):
    p = kvviz("run", "--scenario", "passphrase", "--fault", "boundary", "--model", "tiny-llama", "--quiet")
    assert p.returncode == 0 and "last prompt token over the shared buffer" in p.stdout
    assert "finding foreign" in p.stdout
    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps({"requests": [{"id": "A", "prompt": "abc"}, {"id": "B", "prompt": "xyz"}],
                              "engine": {"isolation": "paged"}}))
    p = kvviz("run", "--workload", str(wl), "--fault", "zero_block_table", "--model", "tiny-llama", "--json")
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["findings"]


def test_fault_scope_flags():
    p = kvviz("run", "--scenario", "global", "--fault-requests", "B", "--model", "tiny-llama", "--json", "--quiet")
    assert p.returncode == 0, p.stderr
    assert {f["request"] for f in json.loads(p.stdout.splitlines()[-1])["findings"]} == {"B"}
    bad = kvviz("run", "--scenario", "global", "--fault-steps", "two", "--model", "tiny-llama")
    assert bad.returncode == 2 and "--fault-steps takes integers" in bad.stderr


@pytest.mark.parametrize("args,message", [
    (["--scenario", "nope"], "unknown scenario 'nope'"),
    (["--scenario", "passphrase", "--fault", "nope"], "unknown fault 'nope'"),
    (["--scenario", "softmax_then_mask", "--fault", "boundary"], "breaks the masked mechanism"),
    ([], "exactly one of --workload FILE or --scenario NAME"),
    (["--scenario", "global", "--fault-steps", "-1"], "--fault-steps takes integers >= 0"),
    (["--scenario", "control_tenants", "--fault-steps", "1"], "confine a fault: give --fault"),
    (["--scenario", "global", "--attention-requests", "ZZ"], "attention requests: 'ZZ' is not a request"),
    (["--scenario", "global", "--attention-layers", "99"], "attention layers: the model has layers 0..1, not 99"),
])
def test_bad_scenario_or_fault_exits_2(args, message):
    p = kvviz("run", *args, "--model", "tiny-llama")
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_audit_on_both_tiny_models_passes():
    from kvviz.catalogue.faults import FAULTS

    p = kvviz("audit", "--model", "tiny-llama,tiny-gpt2")
    assert p.returncode == 0, p.stdout[-2000:]
    assert "rows as expected on tiny-llama, tiny-gpt2." in p.stdout
    rows = [line.split() for line in p.stdout.splitlines()]
    for fault in FAULTS:  # each fault's row on each model, caught
        caught = [r for r in rows if len(r) > 2 and r[0] == fault and r[1] == fault]
        assert len(caught) == 2 and all(r[-1] == "yes" for r in caught), fault
    row = next(line for line in p.stdout.splitlines() if line.startswith("unsalted_prefix") and "clean" not in line)
    assert "cross-tenant" in row


def test_bench_tiers_compares_an_unused_host_tier_and_disaggregation_with_plain(tmp_path):
    out = tmp_path / "t.md"
    p = kvviz("bench", "--tiers", "--model", "tiny-llama", "--sizes", "2", "--new-tokens", "2", "--repeat", "2",
              "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| uniform-2")]
    assert [r.split("|")[2].strip() for r in rows] == ["plain", "host tier, unused", "disaggregated"]
    assert rows[0].rstrip(" |").endswith("1.000")


@pytest.mark.slow
def test_bench_repeats_interleaved_and_reports_medians(tmp_path):
    from kvviz.bench.throughput import PEERS

    out = tmp_path / "b.md"
    p = kvviz("bench", "--model", "tiny-llama", "--sizes", "2", "--new-tokens", "2", "--repeat", "3",
              "--cases", "uniform", "--out", str(out))
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert "median of 3 interleaved runs" in text and "| uniform-2 |" in text and "mixed-2" not in text
    generate = next(line for line in text.splitlines() if line.startswith("| uniform-2 | hf generate |"))
    ttft, tpot = (float(cell) for cell in generate.split("|")[5:7])
    assert ttft > 0 and tpot > 0  # measured from generate's own forwards
    observed = next(line for line in text.splitlines() if "| transformers backend (eager_paged) + oracle |" in line)
    assert float(observed.split("|")[3]) > 0 and "x generate_batch alone" in text
    runs = [line for line in p.stderr.splitlines() if "(runs:" in line]
    assert len(runs) == len(PEERS) and all(line.count(",") == 2 for line in runs)
    assert "recording runs at" in text and "x inspect + oracle" in text
    bad = kvviz("bench", "--model", "tiny-llama", "--sizes", "2", "--cases", "nothing")
    assert bad.returncode == 2 and "matches no case" in bad.stderr


@pytest.mark.slow
def test_bench_measures_only_the_peers_asked_for(tmp_path):
    """--peers oracle,recorder: the recorder's cost over the oracle path, without the other five peers."""
    out = tmp_path / "b.md"
    p = kvviz("bench", "--model", "tiny-llama", "--sizes", "2", "--new-tokens", "2", "--cases", "uniform",
              "--peers", "oracle,recorder", "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| uniform-2 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["kvviz inspect + oracle", "kvviz inspect + oracle + recorder"]
    assert all(r.split("|")[4].strip() == "" for r in rows), "no generate measured: no ratio to it"
    assert "recording runs at" in out.read_text() and "generate_batch alone" not in out.read_text()
    p = kvviz("bench", "--model", "tiny-llama", "--sizes", "2", "--new-tokens", "2", "--cases", "uniform",
              "--peers", "fast-one-step,generate", "--out", str(out))
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    one = next(line for line in text.splitlines() if line.startswith("| uniform-2 | kvviz fast (every prompt in one"))
    assert float(one.split("|")[4]) > 0 and "uniform-2: every prompt fits one 2048-token step; its TPOT is" in text
    assert "runs as fast does" not in text and "prefill chunks" not in text, "no fast measured, no chunk taken"
    bad = kvviz("bench", "--model", "tiny-llama", "--sizes", "2", "--peers", "oracle,vllm")
    assert bad.returncode == 2 and "no peer 'vllm'" in bad.stderr and "recorder" in bad.stderr


def test_the_bench_report_says_chunks_only_where_a_case_takes_more_than_one_step():
    """Walk finding: at 2 requests the one-step peer is fast's configuration, and the report compared the two
    as if fast had waited on prefill chunks."""
    from kvviz.bench.throughput import ONE_STEP, STEP_TOKENS, Measurement, _ratios

    peer = {name: Measurement("c", name, 10.0, 640, 0, ttft, 0.1, 0.09) for name, ttft in
            (("kvviz fast", 2.0), (ONE_STEP, 3.0), ("hf generate", 4.0))}
    one_step = " ".join(_ratios("c", peer, 64, chunked=False))
    assert "runs as fast does" in one_step and "prefill chunks" not in one_step and "with every prompt" not in one_step
    chunked = " ".join(_ratios("c", peer, 64, chunked=True))
    assert "fast's TPOT also waits on the prefill chunks" in chunked
    assert f"the first token comes after 3000 ms (2000 ms with {STEP_TOKENS}-token steps)" in chunked
    assert "100.0 ms against generate's 100.0 ms" in chunked


@pytest.mark.slow
def test_bench_sessions_runs_four_at_once_and_one_after_another():
    p = kvviz("bench", "--model", "tiny-llama", "--sessions", "4")
    assert p.returncode == 0, p.stderr
    row = next(line for line in p.stdout.splitlines() if line.startswith("| 4 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert float(cells[1]) > 0 and float(cells[2]) > 0
    assert cells[4] == "3" and cells[5] == "yes"  # three sessions waited; each recorded what it did alone
    bad = kvviz("bench", "--model", "tiny-llama", "--sessions", "0")
    assert bad.returncode == 2 and "--sessions must be >= 1" in bad.stderr


def test_runs_lists_the_newest_first_and_refuses_a_bad_limit(tmp_path):
    from .test_capture import batch, stored_map, write_capture

    db = str(tmp_path / "runs.duckdb")
    for i, name in enumerate(("first", "second", "third")):  # three captures: the same bytes would be one run
        cap = write_capture(tmp_path / f"{name}.jsonl", [batch(stored_map([i + 1], None, [1, 2]))])
        assert kvviz("import", str(cap), "--db", db).returncode == 0
    p = kvviz("runs", "--db", db, "--format", "json", "--limit", "2")
    assert p.returncode == 0, p.stderr
    listed = json.loads(p.stdout)
    assert [r["scenario"] for r in listed] == ["capture third.jsonl", "capture second.jsonl"]
    assert [r["engine"] for r in listed] == [None, None]  # a capture's server is not an engine kvviz ran
    assert [r["breaches"] for r in listed] == [0, 0], "linted: each stores and never removes, which is advisory"
    assert "the newest 2 of 3" in p.stderr
    table = kvviz("runs", "--db", db).stdout.splitlines()
    assert table[0].split()[:3] == ["run_id", "created_at", "status"] and len(table) == 4
    bad = kvviz("runs", "--db", db, "--limit", "0")
    assert bad.returncode == 2 and "--limit must be >= 1" in bad.stderr


def test_sql_and_import_load_no_model_code(tmp_path):
    """Reading the store is quick: `kvviz sql` and `kvviz import` never import torch or transformers."""
    code = ("import sys; from kvviz.cli import main; "
            f"main(['sql', 'SELECT count(*) FROM runs', '--db', {str(DB)!r}]); "
            f"main(['import', {str(tmp_path / 'missing.jsonl')!r}, '--db', {str(tmp_path / 'x.duckdb')!r}]); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "[]" and "no such file" in p.stderr
