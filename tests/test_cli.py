"""The command line as scripts use it: exit codes, JSON on the last line, errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def kvviz(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvviz", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_run_json_summary_is_the_last_line(tmp_path):
    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps({"requests": [{"id": "A", "prompt": "红 橙 黄", "max_new_tokens": 4},
                                           {"id": "B", "parent": "A", "prompt": "!", "max_new_tokens": 3,
                                            "arrival_step": 2}],
                              "engine": {"block_size": 4, "num_blocks": 32}}))
    p = kvviz("run", "--workload", str(wl), "--model", "tiny-llama", "--json", "--isolation", "masked")
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


def test_bad_bench_arguments_exit_2():
    p = kvviz("bench", "--sizes", "eight", "--model", "tiny-llama")
    assert p.returncode == 2 and "--sizes takes positive integers" in p.stderr
