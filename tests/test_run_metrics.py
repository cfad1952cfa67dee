"""The metrics to watch (the seed's section 6.3), live: after every step they equal the run's own
recorded figures, a fault crosses the leak threshold and its control does not, and the Run page turns
a crossed metric red."""

from __future__ import annotations

import pytest

from kvviz.analysis.run_metrics import METRICS
from kvviz.models import load_model
from kvviz.runners import live
from kvviz.store import RunStore

from .apptest import AppTest


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


def live_run(tiny, store: RunStore, workload: dict, fault: str | None = None):
    seen: list[live.LiveStep] = []
    out = live.run(store, tiny, workload, fault, on_step=seen.append)
    return out.run_id, seen


SHARED = {"requests": [{"id": "A", "prompt_ids": list(range(100, 140)), "max_new_tokens": 6},
                       {"id": "B", "prompt_ids": list(range(100, 130)) + [9, 9], "max_new_tokens": 6,
                        "arrival_step": 2},
                       {"id": "C", "prompt_ids": list(range(150, 170)), "max_new_tokens": 6, "arrival_step": 3}],
          "engine": {"block_size": 4, "num_blocks": 32, "max_batch_tokens": 64}}


def test_every_step_equals_the_recorded_figures(tiny, tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id, seen = live_run(tiny, store, SHARED)
    with store.read() as con:
        steps = {s: (free, live_, alloc) for s, free, live_, alloc in con.execute(
            "SELECT s.step, s.free_blocks, u.live_slots, u.allocated_slots FROM steps s JOIN kv_slot_utilisation u "
            "USING (run_id, step) WHERE run_id = ?", [run_id]).fetchall()}
        cached, prompts = con.execute("SELECT sum(cached_tokens), sum(len(prompt_ids)) FROM requests "
                                      "WHERE run_id = ?", [run_id]).fetchone()
        leak_rate, worst = con.execute("SELECT leak_rate, max_foreign_mass FROM runs WHERE run_id = ?",
                                       [run_id]).fetchone()
    assert [s.step for s in seen] == sorted(steps)
    for s in seen:
        free, live_slots, allocated = steps[s.step]
        assert s.metrics["block_utilisation"] == (32 - free) / 32
        assert s.metrics["slot_utilisation"] == (live_slots / allocated if allocated else None)
    final = seen[-1].metrics
    assert cached == 28 and final["hit_rate"] == pytest.approx(cached / prompts)  # B hit A's 7 full blocks
    assert final["leak_rate"] == pytest.approx(leak_rate, abs=1e-6) == 0
    assert final["max_foreign"] == pytest.approx(worst, abs=1e-6)
    assert seen[-1].history["hit_rate"][-1] == final["hit_rate"] and len(seen[-1].history["hit_rate"]) == len(seen)


def test_a_leak_crosses_the_threshold_and_its_control_does_not(tiny, tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    workload = live.scenario_workload("boundary", tiny)
    leak, control = METRICS["leak_rate"], METRICS["max_foreign"]
    _, faulty = live_run(tiny, store, workload, "boundary")
    _, clean = live_run(tiny, store, workload)
    assert leak.crossed(faulty[-1].metrics["leak_rate"], leak.default_limit)
    assert control.crossed(faulty[-1].metrics["max_foreign"], control.default_limit)
    assert not any(leak.crossed(s.metrics["leak_rate"], leak.default_limit) for s in clean)
    assert not any(control.crossed(s.metrics["max_foreign"], control.default_limit) for s in clean)


def test_hit_rate_is_zero_without_prefix_caching_and_alerts_below(tiny, tmp_path):
    off = {**SHARED, "engine": {**SHARED["engine"], "prefix_caching": False}}
    _, seen = live_run(tiny, RunStore.open(tmp_path / "k.duckdb"), off)
    assert seen[-1].metrics["hit_rate"] == 0 and METRICS["hit_rate"].crossed(0.0, 0.2)
    assert not METRICS["hit_rate"].crossed(None, 0.2)  # nothing looked up yet: no alert


def show(values: dict, limits: dict, findings: tuple[int, ...] = ()) -> None:
    from kvviz.ui.run_page import _show_metrics

    _show_metrics(values, {k: [v, v] for k, v in values.items()}, limits, list(findings))


def test_the_run_page_turns_a_crossed_metric_red():
    values = {"hit_rate": 0.5, "block_utilisation": 0.99, "slot_utilisation": 0.9, "leak_rate": 0.0,
              "max_foreign": None}
    limits = {"hit_rate": 0.2, "block_utilisation": 0.95, "slot_utilisation": 0.8, "leak_rate": 0.0,
              "max_foreign": 0.001}
    at = AppTest.from_function(show, args=(values, limits)).run()
    assert not at.exception
    assert [m.value for m in at.metric] == ["50.0%", "99.0%", "90.0%", "0.0%", "n/a", "0"]
    badges = [m.value for m in at.markdown]
    assert [b.startswith(":red-badge") for b in badges] == [False, True, False, False, False, False]
    assert "above 95%" in badges[1]


def test_findings_turn_red_though_no_attention_metric_moved():
    """A cross-tenant hit reads nothing foreign: leak rate and foreign mass stay clean, the findings
    tile does not; a hit-rate threshold of 0, which can never fire, says so."""
    values = {"hit_rate": 0.5, "block_utilisation": 0.5, "slot_utilisation": 0.9, "leak_rate": 0.0,
              "max_foreign": 0.0}
    limits = {"hit_rate": 0.0, "block_utilisation": 0.95, "slot_utilisation": 0.8, "leak_rate": 0.0,
              "max_foreign": 0.001}
    at = AppTest.from_function(show, args=(values, limits, (0, 1, 3))).run()
    assert at.metric[-1].label == "findings" and at.metric[-1].value == "3"
    assert at.metric[-1].proto.delta == "+2 this step"
    badges = [m.value for m in at.markdown]
    assert [b.startswith(":red-badge") for b in badges] == [False, False, False, False, False, True]
    assert badges[0] == ":gray-badge[no alert set (threshold 0%)]"
    assert badges[2] == ":green-badge[ok: alert below 80%]" and badges[4] == ":green-badge[ok: alert above 0.001]"
