"""The Prometheus rules shipped with kvviz monitor (kvviz/monitor/rules.yml), unit-tested with
promtool against recorded series: each alert fires on the series it is for and stays quiet on a
clean control, and the hit-rate recording rule computes the capture views' hit rate. Expressions,
labels and `for` are tested on a copy without annotations; the annotations once, rendered."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import kvviz.monitor

RULES = Path(kvviz.monitor.__file__).parent / "rules.yml"
pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian's "
                                "prometheus package has it: apt-get install prometheus, as .ci/run does)")

A = 'replica="a"'
CAPACITY = f"kvviz_kv_cache_capacity_blocks{{{A}}}"
# alert -> (series that make it fire, when to look, the labels it fires with, controls: series on which it must not)
CASES = {
    "KvvizCrossTenantSharing": (
        {f"kvviz_kv_cross_tenant_blocks_total{{{A}}}": "0 0 1 1 1", f"kvviz_kv_blocks_salted_total{{{A}}}": "5+5x4"},
        "4m", {"severity": "critical"},
        [{f"kvviz_kv_cross_tenant_blocks_total{{{A}}}": "0x4", f"kvviz_kv_blocks_salted_total{{{A}}}": "5+5x4"},
         {f"kvviz_kv_cross_tenant_blocks_total{{{A}}}": "0 0 1 1 1", f"kvviz_kv_blocks_salted_total{{{A}}}": "0x4"}]),
    "KvvizPrefixCacheHitRateLow": (
        {f"kvviz_prefix_cache_hit_tokens_total{{{A}}}": "0+10x20",
         f"kvviz_prefix_cache_miss_tokens_total{{{A}}}": "0+200x20", f"kvviz_kv_block_hits_total{{{A}}}": "0+1x20"},
        "20m", {"severity": "warning"},
        [{f"kvviz_prefix_cache_hit_tokens_total{{{A}}}": "0+100x20",
          f"kvviz_prefix_cache_miss_tokens_total{{{A}}}": "0+100x20", f"kvviz_kv_block_hits_total{{{A}}}": "0+6x20"},
         {f"kvviz_prefix_cache_hit_tokens_total{{{A}}}": "0x20",  # hits never reported (vLLM's default mode)
          f"kvviz_prefix_cache_miss_tokens_total{{{A}}}": "0+100x20", f"kvviz_kv_block_hits_total{{{A}}}": "0x20"}]),
    "KvvizPrefixCacheHitRateZero": (
        {f"kvviz_kv_block_hits_total{{{A}}}": "0+1x4 5x40",
         f"kvviz_prefix_cache_hit_tokens_total{{{A}}}": "0+16x4 80x40",
         f"kvviz_prefix_cache_miss_tokens_total{{{A}}}": "0+100x45"},
        "40m", {"severity": "critical"},
        [{f"kvviz_kv_block_hits_total{{{A}}}": "0x45", f"kvviz_prefix_cache_hit_tokens_total{{{A}}}": "0x45",
          f"kvviz_prefix_cache_miss_tokens_total{{{A}}}": "0+100x45"},  # hits never reported (default mode)
         {f"kvviz_kv_block_hits_total{{{A}}}": "0+1x45", f"kvviz_prefix_cache_hit_tokens_total{{{A}}}": "0+16x45",
          f"kvviz_prefix_cache_miss_tokens_total{{{A}}}": "0+100x45"}]),  # hits go on
    "KvvizKvEventContractBreach": (
        {f'kvviz_kv_event_contract_breaches_total{{{A},kind="remove_unstored"}}': "0 0 2 2 2"},
        "4m", {"severity": "warning", "kind": "remove_unstored"},
        [{f'kvviz_kv_event_contract_breaches_total{{{A},kind="remove_unstored"}}': "2x4"}]),
    "KvvizKvEventsLost": (
        {f"kvviz_kv_event_messages_lost_total{{{A}}}": "0 0 3 3 3"}, "4m", {"severity": "warning"},
        [{f"kvviz_kv_event_messages_lost_total{{{A}}}": "0x4"}]),
    "KvvizKvEventsInvalid": (
        {f"kvviz_kv_event_messages_invalid_total{{{A}}}": "0 1 1 1 1"}, "4m", {"severity": "warning"},
        [{f"kvviz_kv_event_messages_invalid_total{{{A}}}": "0x4"}]),
    "KvvizKvEventPublisherDown": (
        {f"kvviz_kv_event_publisher_connected{{{A}}}": "0x10"}, "10m", {"severity": "warning"},
        [{f"kvviz_kv_event_publisher_connected{{{A}}}": "1x10"},
         {f"kvviz_kv_event_publisher_connected{{{A}}}": "1x7 0 0 0"}]),  # down under 5 minutes
    "KvvizKvCacheUtilisationHigh": (
        {f'kvviz_kv_cache_blocks{{{A},medium="GPU"}}': "990x20", CAPACITY: "1000x20"}, "15m", {"severity": "warning"},
        [{f'kvviz_kv_cache_blocks{{{A},medium="GPU"}}': "500x20", CAPACITY: "1000x20"},
         {f'kvviz_kv_cache_blocks{{{A},medium="CPU"}}': "990x20", CAPACITY: "1000x20"}]),  # the host tier is not it
}


def without_annotations(tmp: Path) -> Path:
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    path = tmp / "rules.yml"
    path.write_text(json.dumps(rules))
    return path


def group(series: dict[str, str], alert: str, at: str, fired: list[dict]) -> dict:
    return {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": fired}]}


def promtool(tmp: Path, rules: Path, tests: list[dict]) -> subprocess.CompletedProcess:
    path = tmp / "test.yml"
    path.write_text(json.dumps({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests}))
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_the_rules_file_is_valid():
    p = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == set(CASES)


@pytest.mark.parametrize("alert", list(CASES))
def test_each_alert_fires_on_its_series_and_stays_quiet_on_the_controls(alert, tmp_path):
    series, at, labels, controls = CASES[alert]
    rules = without_annotations(tmp_path)
    fired = [{"exp_labels": {"replica": "a", **labels}}]
    p = promtool(tmp_path, rules, [group(series, alert, at, fired), *(group(c, alert, at, []) for c in controls)])
    assert p.returncode == 0, p.stdout + p.stderr


def test_promtool_fails_a_wrong_expectation(tmp_path):
    series, at, labels, controls = CASES["KvvizKvEventsLost"]
    fired = [{"exp_labels": {"replica": "a", **labels}}]
    p = promtool(tmp_path, without_annotations(tmp_path), [group(controls[0], "KvvizKvEventsLost", at, fired)])
    assert p.returncode != 0 and "FAILED" in p.stdout + p.stderr


def test_the_hit_rate_rule_is_hit_tokens_of_all_stored_tokens(tmp_path):
    test = {"interval": "1m",
            "input_series": [{"series": 'kvviz_prefix_cache_hit_tokens_total{replica="a",medium="GPU"}',
                              "values": "0+30x10"},
                             {"series": 'kvviz_prefix_cache_miss_tokens_total{replica="a",medium="GPU"}',
                              "values": "0+90x10"}],
            "promql_expr_test": [{"expr": "kvviz:prefix_cache_hit_ratio:rate5m", "eval_time": "10m",
                                  "exp_samples": [{"labels": 'kvviz:prefix_cache_hit_ratio:rate5m{replica="a"}',
                                                   "value": 0.25}]}]}
    p = promtool(tmp_path, RULES, [test])
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_cross_tenant_alert_says_which_replica_and_how_many_blocks(tmp_path):
    series, at, labels, _ = CASES["KvvizCrossTenantSharing"]
    said = {"summary": "a: KV blocks shared across tenants",
            "description": "1 block hashes were stored under a second tenant's salt in 5 minutes on a replica that "
                           "salts its cache."}
    fired = [{"exp_labels": {"replica": "a", **labels}, "exp_annotations": said}]
    p = promtool(tmp_path, RULES, [group(series, "KvvizCrossTenantSharing", at, fired)])
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_dashboard_asks_only_for_metrics_the_monitor_serves_or_the_rules_record():
    from prometheus_client import generate_latest

    from kvviz.monitor.metrics import registry
    from kvviz.monitor.state import MonitorState

    dashboard = json.loads((RULES.parent / "grafana-dashboard.json").read_text())
    asked = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"\bkvviz[a-z0-9_:]+", target["expr"])}
    served = set(re.findall(r"^# TYPE (\S+) (\w+)", generate_latest(registry(lambda: MonitorState().snapshot)).decode(),
                            re.M))
    names = {n for n, _ in served} | {f"{n}_total" for n, t in served if t == "counter"}
    names |= {f"{n}_{part}" for n, t in served if t == "summary" for part in ("sum", "count")}
    names |= {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r}
    assert asked and asked <= names, asked - names
    assert len(dashboard["panels"]) == len({p["id"] for p in dashboard["panels"]})


def test_the_live_page_reads_the_thresholds_the_rules_alert_on():
    from kvviz.monitor.thresholds import thresholds

    found = {t.alert: (t.figure, t.above, t.value, t.for_s) for t in thresholds()}
    assert found == {"KvvizPrefixCacheHitRateLow": ("hit_ratio", False, 0.1, 600.0),
                     "KvvizKvCacheUtilisationHigh": ("utilisation", True, 0.95, 600.0)}

