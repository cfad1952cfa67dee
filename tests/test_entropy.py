"""The seed's positional entropy: the positional_entropy view equals a direct computation from the
recorded attention weights, and the CLI, the inspector and the figure show it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvviz.analysis import leaks
from kvviz.models import load_model
from kvviz.runners import live
from kvviz.store import RunStore
from kvviz.store.attention import AttentionSelection
from tests.cli import kvviz

from .apptest import AppTest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The passphrase scenario (masked, no fault) on tiny-llama with every head of every layer kept."""
    m = load_model("tiny-llama")
    store = RunStore.open(tmp_path_factory.mktemp("entropy") / "k.duckdb")
    run_id = live.run(store, m, live.scenario_workload("passphrase", m), None,
                      selection=AttentionSelection("all")).run_id
    return store, run_id


def test_the_view_equals_the_entropy_of_the_recorded_weights(recorded):
    store, run_id = recorded
    with store.read() as con:
        view = con.execute("SELECT step, request_id, layer, head, entropy FROM positional_entropy "
                           "WHERE run_id = ? AND queries = 1", [run_id]).fetchall()
        weights = {(s, r, lay, h): w for s, r, lay, h, w in con.execute(
            "SELECT step, request_id, layer, head, weights FROM attention WHERE run_id = ? AND head >= 0",
            [run_id]).fetchall()}
    assert len(view) > 20
    for step, req, layer, head, entropy in view:  # decode steps: one query, one attention row
        direct = -sum(w * math.log(w) for w in weights[(step, req, layer, head)] if w > 0)
        assert entropy == pytest.approx(direct, abs=1e-4), (step, req, layer, head)


def test_entropy_by_position_and_its_trend(recorded):
    store, run_id = recorded
    with store.read() as con:
        df = leaks.entropy_by_position(con, run_id)
        one = leaks.entropy_by_position(con, run_id, layer=1)
        assert leaks.layer_count(con, run_id) == 2
    assert set(df.request_id) == set("ABCD") and (df.leak_rate == 0).all()  # a correct mask: no leak
    assert (df.entropy > 0).all() and not df.equals(one)
    for _, part in df.groupby("request_id"):
        assert list(part.position) == sorted(part.position)
    trend = leaks.entropy_trend(df).set_index("request_id")
    for req, part in df.groupby("request_id"):
        assert trend.loc[req, "first"] == part.entropy.iloc[0] and trend.loc[req, "last"] == part.entropy.iloc[-1]
        assert -1 <= trend.loc[req, "spearman"] <= 1


def test_the_figure_draws_entropy_and_leak_rate_per_request(recorded):
    from kvviz.figures.timeline import entropy_by_position

    store, run_id = recorded
    with store.read() as con:
        fig = entropy_by_position(leaks.entropy_by_position(con, run_id))
    assert [t.name for t in fig.data] == ["A", "A", "B", "B", "C", "C", "D", "D"]
    assert fig.data[0].yaxis != fig.data[1].yaxis  # entropy above, leak rate below


def test_the_inspector_shows_it(recorded, monkeypatch):
    store, run_id = recorded
    monkeypatch.setenv("KVVIZ_DB", str(store.path))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.session_state["run_id"] = run_id
    at.run()
    at.switch_page("kvviz/ui/pages/inspector.py").run()
    at.segmented_control(key="insp_view").set_value("Leaks").run()
    assert not at.exception
    specs = {el.key: json.loads(el.proto.spec) for el in at.get("plotly_chart") if el.key}
    assert "insp_entropy" in specs and len(specs["insp_entropy"]["data"]) == 8  # entropy and leak rate of A-D
    at.selectbox(key="insp_entropy_layer").set_value(0).run()
    assert not at.exception


def test_the_cli_reports_each_requests_mean_entropy(tmp_path):
    p = kvviz("run", "--scenario", "passphrase", "--model", "tiny-llama", "--db", tmp_path / "k.duckdb", "--json")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.splitlines()[-1])
    assert set(summary["entropy"]) == set("ABCD") and all(v > 0 for v in summary["entropy"].values())
    with RunStore.open(tmp_path / "k.duckdb").read() as con:
        stored = dict(con.execute("SELECT request_id, sum(sum_entropy) / sum(rows) FROM leak_metrics "
                                  "GROUP BY request_id").fetchall())
    assert {k: round(v, 6) for k, v in stored.items()} == pytest.approx(summary["entropy"], abs=1e-6)
