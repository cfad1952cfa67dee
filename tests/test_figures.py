"""The pure figure functions: what each picture draws, and that clicks on it map back to what was
drawn (block_at and cell_at invert the layouts). Synthetic frames cover the edges; one recorded
boundary run and its control give real frames."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from kvviz.analysis import attention, blocks, cross_reads, leaks, memory, runs
from kvviz.figures import attention as fig_attention
from kvviz.figures import blocks as fig_blocks
from kvviz.figures import cache as fig_cache
from kvviz.figures import captures as fig_captures
from kvviz.figures import timeline
from kvviz.figures.palette import (
    CROSS_TENANT,
    LEAK,
    LINE_PX,
    MODEBAR_PX,
    REQUEST_COLOURS,
    STALE,
    STATE_COLOURS,
    grid_columns,
    request_colours,
)
from kvviz.models import load_model
from kvviz.runners import live
from kvviz.store import RunStore


@functools.cache
def tiny():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    db = tmp_path_factory.mktemp("figures") / "kvviz.duckdb"
    m = tiny()
    wl = live.scenario_workload("boundary", m)
    return db, live.run(RunStore.open(db), m, wl, "boundary").run_id, live.run(RunStore.open(db), m, wl, None).run_id


@pytest.fixture(scope="module")
def unsalted(tmp_path_factory):
    db = tmp_path_factory.mktemp("unsalted") / "kvviz.duckdb"
    m = tiny()
    return db, live.run(RunStore.open(db), m, live.scenario_workload("unsalted_prefix", m), "unsalted_prefix").run_id


def markers(fig: go.Figure) -> list[tuple]:
    """(x, y, trace) of every marker of every scatter trace with markers."""
    return [(x, y, t) for t in fig.data if t.type == "scatter" and "markers" in (t.mode or "")
            for x, y in zip(t.x, t.y, strict=True)]


def pool(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    state = rng.choice(["free", "cached", "used"], n)
    refcount = np.where(state == "used", rng.integers(1, 4, n), 0)
    owners = [",".join(sorted(rng.choice(list("ABCD"), r, replace=False))) if r else "" for r in refcount]
    return pd.DataFrame({"block": range(n), "state": state, "refcount": refcount, "owners": owners})


# -- block map --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 8, 33, 128, 500, 2048])
@pytest.mark.parametrize("colour_by", ["owner", "state"])
def test_block_map_draws_each_block_once_and_block_at_inverts_it(n, colour_by):
    df = pool(n)
    fig = fig_blocks.block_map(df, colour_by=colour_by)
    drawn = markers(fig)
    assert len(drawn) == n
    ids = [int(b) for t in fig.data for b in np.asarray(t.customdata)[:, 0]]
    assert sorted(ids) == list(range(n))
    for (x, y, _), block in zip(drawn, ids, strict=True):
        assert fig_blocks.block_at({"x": x, "y": y}, n) == block
        assert fig_blocks.block_at({"x": x + 0.3, "y": y - 0.3}, n) == block  # a click near the centre
    cols = grid_columns(n)
    assert fig_blocks.block_at({"x": n % cols, "y": n // cols}, n) is None  # past the last block
    assert fig_blocks.block_at({"x": 0, "y": -1}, n) is None
    assert fig_blocks.block_at({"curveNumber": 0}, n) is None  # a click without coordinates


def test_block_map_colours_by_owner_and_state():
    df = pd.DataFrame({"block": range(5), "state": ["used", "used", "used", "cached", "free"],
                       "refcount": [1, 1, 2, 0, 0], "owners": ["A", "B", "A,B", "", ""]})
    fig = fig_blocks.block_map(df)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"A", "B", "shared", "cached", "free"}
    colours = request_colours(["A", "B"])
    assert by_name["A"].marker.color == colours["A"] and by_name["B"].marker.color == colours["B"]
    assert by_name["shared"].marker.color == STATE_COLOURS["shared"] and list(by_name["shared"].text) == ["2"]
    by_state = {t.name: t for t in fig_blocks.block_map(df, colour_by="state").data}
    assert set(by_state) == {"used", "shared", "cached", "free"}
    assert by_state["used"].marker.color == STATE_COLOURS["used"]


def test_reserved_blocks_have_their_own_colour_and_legend_entry_not_free():
    """transformers' trash blocks (state reserved) are drawn apart from the free ones, in either colouring."""
    df = pd.DataFrame({"block": range(4), "state": ["used", "free", "reserved", "reserved"],
                       "refcount": [1, 0, 0, 0], "owners": ["A", "", "", ""]})
    assert len({STATE_COLOURS[s] for s in ("free", "cached", "used", "shared", "reserved")}) == 5
    for colour_by in ("owner", "state"):
        by_name = {t.name: t for t in fig_blocks.block_map(df, colour_by=colour_by).data}
        assert list(by_name["reserved"].customdata[:, 0]) == [2, 3] and list(by_name["free"].customdata[:, 0]) == [1]
        assert by_name["reserved"].marker.color == STATE_COLOURS["reserved"], colour_by


def test_leaky_blocks_get_the_red_outline(recorded):
    db, rid, ctl = recorded
    with RunStore.open(db).read() as con:
        B = runs.run_info(con, rid).block_size
        step = int(leaks.findings(con, rid).iloc[0].step)
        leaky = blocks.leaky_blocks(con, rid, step, B)
        fig = fig_blocks.block_map(blocks.block_map(con, rid, step), leaky)
        clean = fig_blocks.block_map(blocks.block_map(con, ctl, step), blocks.leaky_blocks(con, ctl, step, B))
    assert leaky
    outlined = set()
    for t in fig.data:
        for b, colour, width in zip(np.asarray(t.customdata)[:, 0], t.marker.line.color, t.marker.line.width,
                                    strict=True):
            assert (colour == LEAK) == (int(b) in leaky) and (width == 3) == (int(b) in leaky)
            if colour == LEAK:
                outlined.add(int(b))
    assert outlined == leaky
    assert all(c != LEAK for t in clean.data for c in t.marker.line.color)


# -- occupancy and page tables ------------------------------------------------------------------------------

def test_occupancy_is_a_heatmap_of_the_grid(recorded):
    db, rid, _ = recorded
    with RunStore.open(db).read() as con:
        grid, steps, per = blocks.occupancy(con, rid)
    fig = fig_blocks.occupancy(grid, steps, current=steps[1], per_row=per)
    (heat,) = fig.data
    assert heat.type == "heatmap" and np.asarray(heat.z).shape == grid.shape and grid.shape[1] == len(steps)
    assert (np.asarray(heat.z) == grid).all() and list(heat.x) == steps
    assert (heat.zmin, heat.zmax) == (-0.5, 3.5) and len(fig.layout.shapes) == 1
    assert len(fig_blocks.occupancy(grid, steps).layout.shapes) == 0
    short, long = fig_blocks.occupancy(grid[:, :4], steps[:4]), fig_blocks.occupancy(np.zeros((2, 60)), list(range(60)))
    assert short.layout.xaxis.dtick == 1 and long.layout.xaxis.dtick is None, "a tick per step only when few"


def test_occupancy_of_a_small_pool_is_tall_enough_to_read_each_block():
    """A pool of a few blocks was a strip 100 px high with a tick every few blocks: now the plot is at least 200 px
    tall, a tick a block; a big pool is capped, not a screen tall."""
    for n in (1, 2, 4, 16):
        fig = fig_blocks.occupancy(np.zeros((n, 5)), list(range(5)))
        assert fig.layout.height - fig.layout.margin.t - fig.layout.margin.b >= 200, n
        assert fig.layout.yaxis.dtick == 1, n
    grouped = fig_blocks.occupancy(np.zeros((8, 5)), list(range(5)), per_row=4)
    assert grouped.layout.yaxis.dtick == 4  # a row of 4 blocks: a tick a row, labelled by its first block
    big = fig_blocks.occupancy(np.zeros((400, 5)), list(range(5)))
    assert big.layout.height <= 520 and big.layout.yaxis.dtick is None

def test_page_tables_outline_shared_blocks_and_copies():
    entries = pd.DataFrame({"request_id": ["P", "P", "F", "G"], "logical_block": [0, 1, 0, 0],
                            "physical_block": [0, 2, 0, 1], "refcount": [2, 1, 2, 1],
                            "shared": [True, False, True, False], "cow": [False, True, False, False]})
    fig = fig_blocks.page_tables(entries)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"shared", "copy-on-write copy", "own"}
    assert list(by_name["copy-on-write copy"].text) == [2] and by_name["copy-on-write copy"].marker.line.width == 4
    assert sorted(by_name["shared"].y) == ["F", "P"] and by_name["shared"].marker.line.width == 3
    assert len(markers(fig)) == len(entries)
    # two logical blocks keep a column's width, not half the page each (a walk saw them at its two edges)
    assert tuple(fig.layout.xaxis.range) == (-0.5, fig_blocks.PAGE_COLUMNS - 0.5)
    wide = entries.assign(logical_block=entries.logical_block * 20)
    assert tuple(fig_blocks.page_tables(wide).layout.xaxis.range) == (-0.5, 20.5)


def test_page_tables_of_a_real_run(recorded):
    db, rid, _ = recorded
    with RunStore.open(db).read() as con:
        entries = blocks.page_tables(con, rid, 1)
    fig = fig_blocks.page_tables(entries)
    drawn = sorted((y, x, int(p)) for t in fig.data for x, y, p in zip(t.x, t.y, t.text, strict=True))
    assert drawn == sorted(zip(entries.request_id, entries.logical_block, entries.physical_block, strict=True))
    assert "shared" in {t.name for t in fig.data}  # B hits A's prefix blocks


# -- attention -----------------------------------------------------------------------------------------------

def heatmap_traces(fig) -> dict[str, go.Heatmap]:
    return {t.name: t for t in fig.data if t.type == "heatmap"}


def test_attention_heatmap_puts_foreign_weights_in_their_own_trace(recorded):
    db, rid, ctl = recorded
    with RunStore.open(db).read() as con:
        B = runs.run_info(con, rid).block_size
        top = leaks.findings(con, rid).iloc[0]
        args = (top.request_id, int(top.step), int(top.layer), -1, B)
        v = attention.attention_view(con, rid, *args, upto=True)
        c = attention.attention_view(con, ctl, *args, upto=True)
    fig = fig_attention.attention_heatmap(v.weights, v.classes, v.query_labels, v.key_labels, v.key_owners)
    traces = heatmap_traces(fig)
    assert set(traces) == {"own", "foreign"}
    foreign = np.asarray(traces["foreign"].z, dtype=float)
    own = np.asarray(traces["own"].z, dtype=float)
    assert (~np.isnan(foreign) == (v.classes == attention.FOREIGN)).all()
    assert (~np.isnan(own) == (v.classes == attention.OWN)).all()
    np.testing.assert_allclose(np.nansum(foreign) + np.nansum(own), np.nansum(v.weights), rtol=1e-5)
    assert traces["foreign"].zmax == pytest.approx(np.nanmax(foreign))  # a small leak still shows in full red,
    assert traces["foreign"].showscale is not False and "foreign" in traces["foreign"].colorbar.title.text  # scaled
    own_bar, foreign_bar = traces["own"].colorbar, traces["foreign"].colorbar
    assert own_bar.x == foreign_bar.x and own_bar.y - own_bar.len >= foreign_bar.y - 1e-9, "two bars, one above"
    # a band boundary wherever the writer changes along the key axis
    changes = sum(a != b for a, b in zip(v.key_owners, v.key_owners[1:], strict=False))
    assert len(fig.layout.shapes) == changes > 0
    clean = heatmap_traces(fig_attention.attention_heatmap(c.weights, c.classes, c.query_labels, c.key_labels,
                                                           c.key_owners))
    assert set(clean) == {"own"}


def test_heatmap_axes_name_a_cjk_character_split_over_tokens_never_its_bytes(tmp_path):
    """A newcomer's walk on SmolLM2 found <E7>-like byte labels on the heatmap's axes for Chinese text: the
    byte-level tokenizer splits each character over tokens. Both axes now name the character in each piece."""
    import re

    wl = {"requests": [{"id": "A", "prompt": "红 橙 ok", "max_new_tokens": 1}]}
    rid = live.run(RunStore.open(tmp_path / "kvviz.duckdb"), tiny(), wl).run_id
    with RunStore.open(tmp_path / "kvviz.duckdb").read() as con:
        info = runs.run_info(con, rid)
        view = attention.attention_view(con, rid, "A", info.steps[-1], 0, attention.HEAD_MEAN, info.block_size,
                                        upto=True)
    fig = fig_attention.attention_heatmap(view.weights, view.classes, view.query_labels, view.key_labels,
                                          view.key_owners)
    keys, queries = list(fig.layout.xaxis.ticktext), list(fig.layout.yaxis.ticktext)
    assert queries[:4] == ["0 红(1/3)", "1 红(2/3)", "2 红(3/3)", "3 ␣"]
    assert any(">A:4 橙(1/3)<" in k for k in keys) and any(">A:6 橙(3/3)<" in k for k in keys)
    raw = re.compile(r"<(0x)?[0-9A-F]{2}( [0-9A-F]{2})*>|\\x[0-9a-f]{2}")
    assert not [lab for lab in queries + keys if raw.search(re.sub(r"<[^<>]*span[^<>]*>", "", lab))]

def test_attention_heatmap_stale_and_unseen():
    w = np.array([[0.5, 0.5, np.nan], [0.2, 0.3, 0.5]], np.float32)
    c = np.array([[0, 2, -1], [0, 0, 1]], np.int8)
    fig = fig_attention.attention_heatmap(w, c, ["0 a", "1 b"], ["A:0 a", "B:0 x", "B:1 y"], ["A", "B", "B"])
    traces = heatmap_traces(fig)
    assert set(traces) == {"own", "foreign", "stale"}
    assert np.asarray(traces["stale"].z, dtype=float)[0, 1] == 0.5
    assert np.isnan(np.asarray(traces["stale"].z, dtype=float)).sum() == 5
    assert len(fig.layout.shapes) == 1
    empty = np.full((1, 2), np.nan, np.float32)
    assert set(heatmap_traces(fig_attention.attention_heatmap(empty, np.full((1, 2), -1, np.int8), ["0"],
                                                              ["k0", "k1"], ["", ""]))) == {"own"}


def test_attention_heatmap_draws_another_tenants_keys_apart_and_its_title_says_the_reads():
    """Keys another tenant wrote (same content) are neither own blue nor foreign red: a trace of their own."""
    w = np.array([[0.6, 0.4, np.nan], [0.2, 0.3, 0.5]], np.float32)
    c = np.array([[attention.CROSS, 0, -1], [attention.CROSS, 0, 1]], np.int8)
    said = "cross-tenant reads: 1 block of tenant t-a read by tenant t-b (B read block 0, written by A, at steps 4-5)"
    title = fig_attention.heatmap_title("B", 5, 1, "mean of heads", 0.5, said)
    fig = fig_attention.attention_heatmap(w, c, ["4 a", "5 b"], ["A:0 x [t-a]", "B:1 y", "C:0 z"], ["A", "B", "C"],
                                          title)
    traces = heatmap_traces(fig)
    assert set(traces) == {"own", fig_attention.CROSS_NAME, "foreign"}
    for name, cls in (("own", attention.OWN), (fig_attention.CROSS_NAME, attention.CROSS),
                      ("foreign", attention.FOREIGN)):
        assert (~np.isnan(np.asarray(traces[name].z, dtype=float)) == (c == cls)).all(), name
    cross = traces[fig_attention.CROSS_NAME]
    assert cross.colorscale[-1][1] == CROSS_TENANT and CROSS_TENANT not in (LEAK, STATE_COLOURS["used"])
    assert "another tenant's" in cross.colorbar.title.text
    bars = sorted(((t.colorbar.y - t.colorbar.len, t.colorbar.y) for t in traces.values()), reverse=True)
    assert all(low >= high_below - 1e-9 for (low, _), (_, high_below) in zip(bars, bars[1:], strict=False)), \
        "stacked, so no title overlaps another where the figure is narrow (half a page)"
    assert len({t.colorbar.x for t in traces.values()}) == 1 and all(
        "<br>" not in t.colorbar.title.text for t in traces.values())
    assert said in fig.layout.title.text and fig.layout.title.text.startswith("B, step 5, layer 1, mean of heads")
    assert "cross-tenant" not in fig_attention.heatmap_title("B", 5, 1, "head 2", 0.0, None)


def test_the_unsalted_runs_heatmap_marks_the_other_tenants_blocks(unsalted):
    db, rid = unsalted
    with RunStore.open(db).read() as con:
        B = runs.run_info(con, rid).block_size
        last = con.execute("SELECT max(step) FROM step_work WHERE run_id = ? AND request_id = 'B'", [rid]).fetchone()[0]
        v = attention.attention_view(con, rid, "B", last, 1, -1, B, upto=True)
        stored = cross_reads.sentence(cross_reads.from_store(con, rid))
        a = attention.attention_view(con, rid, "A", last, 1, -1, B, upto=True)
    by_a = np.array([o == "A" for o in v.key_owners])
    seen = v.classes != attention.UNSEEN
    assert by_a.any() and (v.classes[:, by_a][seen[:, by_a]] == attention.CROSS).all()  # every key A wrote
    assert not (v.classes[:, ~by_a] == attention.CROSS).any()
    assert cross_reads.sentence(v.cross_reads) == stored  # the heatmap's rows read every block the findings name
    fig = fig_attention.attention_heatmap(v.weights, v.classes, v.query_labels, v.key_labels, v.key_owners)
    assert fig_attention.CROSS_NAME in heatmap_traces(fig) and a.cross_reads == []
    assert not (a.classes == attention.CROSS).any()  # A's own keys are its own


@pytest.mark.parametrize("layers, heads", [(2, 4), (30, 9), (1, 1), (12, 16)])
def test_leak_grid_has_a_square_per_head_and_cell_at_inverts_it(layers, heads):
    cells = pd.DataFrame([(L, h, (L * heads + h) / (layers * heads)) for L in range(layers) for h in range(heads)
                          if (L + h) % 3], columns=["layer", "head", "max_foreign"])
    fig = fig_attention.leak_grid(cells, layers, heads, selected=(layers - 1, heads - 1))
    drawn = markers(fig)
    assert len(drawn) == layers * heads
    assert sorted(fig_attention.cell_at({"x": x, "y": y}) for x, y, _ in drawn) == \
        [(L, h) for L in range(layers) for h in range(heads)]
    (trace,) = fig.data
    colour = dict(zip(((int(y), int(x)) for x, y, _ in drawn), trace.marker.color, strict=True))
    for r in cells.itertuples():
        assert colour[(r.layer, r.head)] == pytest.approx(r.max_foreign)
    missing = {(L, h) for L in range(layers) for h in range(heads)} - set(zip(cells.layer, cells["head"], strict=True))
    assert all(colour[k] == 0 for k in missing)
    widths = dict(zip(((int(y), int(x)) for x, y, _ in drawn), trace.marker.line.width, strict=True))
    assert widths[(layers - 1, heads - 1)] == 3 and sum(w == 3 for w in widths.values()) == 1
    assert fig_attention.cell_at({}) is None


def test_leak_grid_of_a_real_run(recorded):
    db, rid, ctl = recorded
    with RunStore.open(db).read() as con:
        layers, heads = attention.grid_shape(con, rid)
        grid, clean = attention.leak_grid(con, rid), attention.leak_grid(con, ctl)
    fig = fig_attention.leak_grid(grid, layers, heads)
    (trace,) = fig.data
    assert len(trace.x) == layers * heads and max(trace.marker.color) == pytest.approx(grid.max_foreign.max())
    assert max(fig_attention.leak_grid(clean, layers, heads).data[0].marker.color) == 0
    empty = fig_attention.leak_grid(pd.DataFrame(columns=["layer", "head", "max_foreign"]), 2, 3)
    assert len(empty.data[0].x) == 6


def test_difference_grid_shows_the_layers_that_differ_on_a_scale_centred_at_zero():
    """The scenario-minus-control grid was leak_grid's: 30 x 9 squares, less mass clipped to white, a few pale
    squares. Now: the differing layers only, zero at the middle of a diverging scale, each difference written and
    tinted however small; a control with the same mass says so in the title."""
    df = pd.DataFrame([(layer, h, 0.0) for layer in range(30) for h in range(9)],
                      columns=["layer", "head", "max_foreign"])
    df.loc[(df.layer == 11) & (df["head"] == 3), "max_foreign"] = 0.41
    df.loc[(df.layer == 11) & (df["head"] == 5), "max_foreign"] = 0.0007
    df.loc[(df.layer == 20) & (df["head"] == 0), "max_foreign"] = -0.05
    fig = fig_attention.difference_grid(df, 30, 9, "A: boundary minus control")
    (heat,) = fig.data
    assert list(heat.y) == ["layer 11", "layer 20"] and list(heat.x) == list(range(9))
    assert heat.zmid == 0 and heat.zmin == -0.41 and heat.zmax == 0.41
    z = np.asarray(heat.z, float)
    assert z[0, 3] == 0.41 and z[1, 0] == -0.05 and np.isnan(z[0, 0]), "a head that does not differ shows no number"
    assert heat.text[0][3] == "+0.410" and heat.text[1][0] == "-0.050" and heat.text[0][0] == ""
    # the smallest difference either way is a tint, not white: the scale jumps at 0 from pale blue to pale red
    (_, darkest), (m1, pale_blue), (m2, pale_red), (_, reddest) = heat.colorscale
    assert m1 == m2 == 0.5 and "#ffffff" not in {darkest.lower(), pale_blue.lower(), pale_red.lower()}
    assert reddest == LEAK
    assert "2 of 30 layers differ; the other 28 are the same in both runs" in fig.layout.title.text
    none = fig_attention.difference_grid(df.assign(max_foreign=0.0), 30, 9, "A")
    assert len(none.data[0].y) == 0 and "no layer or head differs" in none.layout.title.text

# -- timelines -----------------------------------------------------------------------------------------------

def test_leak_timeline_has_a_line_per_request_and_panel(recorded):
    db, rid, _ = recorded
    with RunStore.open(db).read() as con:
        df = leaks.leak_over_time(con, rid)
    fig = timeline.leak_timeline(df, current=2)
    assert sorted((t.name, t.yaxis) for t in fig.data) == [("A", "y"), ("A", "y2"), ("B", "y"), ("B", "y2")]
    for t in fig.data:
        part = df[df.request_id == t.name]
        col = "max_foreign_mass" if t.yaxis == "y" else "leak_rate"
        assert list(t.x) == list(part.step) and np.allclose(list(t.y), part[col])
    assert sum(t.showlegend for t in fig.data) == 2
    assert fig.layout.yaxis.rangemode == "nonnegative", "a clean run's zeros sit at the bottom, not mid -1..1"


def test_two_runs_compared_keep_a_request_in_one_colour_and_a_run_in_one_dash():
    """The Runs page draws a fault's run beside its control: request A is the same colour in both, and
    each run's lines have their own dash (a walk found A of one run green and A of the other pink)."""
    one = pd.DataFrame({"step": [0, 1, 0, 1], "request_id": ["A", "A", "B", "B"], "leak_rate": [0.0, 0.5, 0.0, 0.0],
                        "max_foreign_mass": [0.0, 0.8, 0.0, 0.0]})
    fig = timeline.leak_timeline(pd.concat([one.assign(run="fault"), one.assign(run="control")]))
    top = {t.name: t for t in fig.data if t.yaxis == "y"}
    assert set(top) == {"A (fault)", "A (control)", "B (fault)", "B (control)"}
    for req in "AB":
        assert top[f"{req} (fault)"].line.color == top[f"{req} (control)"].line.color
    assert top["A (fault)"].line.color != top["B (fault)"].line.color
    assert {top[f"{r} (fault)"].line.dash for r in "AB"} == {"solid"}
    assert {top[f"{r} (control)"].line.dash for r in "AB"} == {"dash"}
    assert list(top["A (fault)"].y) == [0.0, 0.8] and sum(t.showlegend for t in fig.data) == 4


def test_a_request_of_one_point_is_drawn_as_a_marker_not_an_invisible_line():
    df = pd.DataFrame({"step": [2, 2, 3], "request_id": ["A", "B", "A"], "leak_rate": [0.0, 0.0, 0.0],
                       "max_foreign_mass": [0.0, 0.0, 0.0]})
    modes = {(t.name, t.yaxis): t.mode for t in timeline.leak_timeline(df).data}
    assert modes == {("A", "y"): "lines+markers", ("A", "y2"): "lines+markers", ("B", "y"): "markers",
                     ("B", "y2"): "markers"}
    entropy = df.rename(columns={"step": "position", "max_foreign_mass": "entropy"})
    assert {t.name: t.mode for t in timeline.entropy_by_position(entropy).data} == {"A": "lines", "B": "markers"}


def test_capture_activity_is_per_second_and_a_horizontal_brush():
    from kvviz.figures import capture_time as time_fig

    churn = pd.DataFrame({"interval_start": [100.0, 100.0, 102.0], "replica": ["a", "b", "a"], "stored": [4, 2, 0],
                          "hits": [1, 1, 2], "evicted": [0, 2, 6], "hit_tokens": [16, 16, 32],
                          "miss_tokens": [64, 32, 0]})
    fig = time_fig.activity(churn, origin=100.0, width=2.0)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["stored (new)"].x) == [0.0, 2.0] and list(by_name["stored (new)"].y) == [3.0, 0.0]
    assert list(by_name["evicted"].y) == [-1.0, -3.0], "summed over replicas, per second, downwards"
    assert list(by_name["tokens computed (misses)"].y) == [96, 0]
    served, hits = by_name["tokens served from the cache"], by_name["hit (stored again)"]
    assert list(served.y) == [32, 32] and served.marker.color == hits.marker.color
    assert served.showlegend is not False and served.legendgroup != hits.legendgroup, \
        "the green bars below have a legend entry of their own, not the hits' above"
    assert {t.legendgrouptitle.text for t in fig.data} == {"blocks", "tokens"}
    assert fig.layout.dragmode == "select" and fig.layout.selectdirection == "h"
    reasons = pd.DataFrame({"interval_start": [100.0, 102.0], "reason": ["cold", "evicted"], "lookups": [3, 1]})
    names = [t.name for t in time_fig.activity(churn, 100.0, 2.0, reasons).data]
    assert "miss: cold" in names and "miss: evicted" in names and "tokens computed (misses)" not in names
    # every bar spans its own interval from its start, whatever the gaps between intervals
    spans = {(t.width, t.offset) for t in [*fig.data, *time_fig.activity(churn, 100.0, 2.0, reasons).data]}
    assert spans == {(2.0, 0)}, spans


def test_capture_occupancy_stacks_a_series_each_and_durations_are_log_histograms():
    from kvviz.figures import capture_time as time_fig

    df = pd.DataFrame({"interval_start": [10.0, 11.0, 10.0, 11.0], "series": ["a", "a", "b", "b"],
                       "cached": [1, 2, 3, 0]})
    fig = time_fig.occupancy(df, origin=10.0, split="tenant")
    assert [t.name for t in fig.data] == ["a", "b"] and all(t.stackgroup == "one" for t in fig.data)
    assert list(fig.data[1].x) == [0.0, 1.0] and list(fig.data[1].y) == [3, 0]
    one = time_fig.occupancy(df[df.series == "a"], origin=10.0, split="tenant")
    assert one.layout.showlegend and [t.name for t in one.data] == ["a"], "one tenant is still named"
    assert fig.layout.legend.orientation != "h", "beside the plot: a row under it ran into the axis title"
    assert fig.layout.xaxis.rangemode == "nonnegative", "walk finding: the axis began at -1"
    d = pd.DataFrame({"measure": ["lifetime", "reuse gap"], "seconds": [1.0, 0.01], "count": [5, 2]})
    fig = time_fig.durations(d, bins_per_decade=10)
    assert [list(t.y) for t in fig.data] == [[5], [], [2]]
    bar = fig.data[0]
    assert bar.offset == 0 and 0.2 < bar.width[0] < 10 ** 0.1 - 1, "the bar spans its bin [1, 1.26) s, on a log axis"
    assert all(fig.layout[f"{a}axis{i}"].type == "log" for a in "xy" for i in ("", "2", "3"))
    # one bar inside a decade (a capture with one eviction) still has decade ticks to read it by
    assert list(fig.layout.xaxis.range) == [0, 1] and list(fig.layout.xaxis3.range) == [-2, -1]


def test_a_tenants_blocks_of_unknown_own_tenant_take_its_colour_hatched():
    from kvviz.analysis.capture_time import UNTOLD
    from kvviz.figures import capture_time as time_fig

    names = [f"tenant-{i}" for i in range(8)]
    series = [n for t in names for n in (t, t + UNTOLD)]
    df = pd.DataFrame({"interval_start": [0.0] * len(series), "series": series, "cached": [1] * len(series)})
    fig = time_fig.occupancy(df, origin=0.0, split="tenant", untold=UNTOLD)
    colour = {t.name: t.line.color for t in fig.data}
    assert all(colour[t] == colour[t + UNTOLD] for t in names), "a tenant's two parts, one colour"
    assert len({colour[t] for t in names}) == 8, "eight tenants, eight colours"
    hatched = {t.name for t in fig.data if t.fillpattern.shape == "/"}
    assert hatched == {t + UNTOLD for t in names} and [t.name for t in fig.data] == sorted(series)
    plain = time_fig.occupancy(df, origin=0.0, split="tenant")
    assert len({t.line.color for t in plain.data}) > 8 and not any(t.fillpattern.shape for t in plain.data), \
        "without the suffix each series is its own"


# -- prefix tree ---------------------------------------------------------------------------------------------

def nodes(rows) -> pd.DataFrame:
    """Nodes as captures.prefix_tree returns them (64-bit hashes kept exact, as DuckDB hands them over)."""
    cols = list(zip(*rows, strict=True)) if rows else [[]] * 5
    return pd.DataFrame({"block_hash": np.array(cols[0], dtype=np.uint64),
                         "parent_hash": pd.array(cols[1], dtype="UInt64"), "stored_step": pd.array(cols[3], "int32"),
                         "salt": pd.array(cols[2], dtype=object), "lora_name": [None] * len(rows),
                         "token_ids": [[i, i + 1] for i in range(len(rows))],
                         "removed_step": pd.array(cols[4], dtype="Int32")})


BIG = (1 << 63) + 5
TREE = nodes([(BIG, None, "t-a", 0, None), (BIG + 1, BIG, None, 0, None), (BIG + 2, BIG + 1, None, 1, 4),
              (BIG + 3, BIG + 1, None, 2, None), (BIG + 4, BIG, None, 3, None), (7, None, "t-b", 3, None),
              (8, 99, None, 5, None)])  # 8's parent was never stored here: a root of its own


def test_tree_layout_depths_and_rows():
    laid = fig_captures.tree_layout(TREE)
    parent = {int(h): None if pd.isna(p) else int(p) for h, p in zip(laid.block_hash, laid.parent_hash, strict=True)}
    depth = {int(h): d for h, d in zip(laid.block_hash, laid.depth, strict=True)}
    row = {int(h): r for h, r in zip(laid.block_hash, laid.row, strict=True)}
    assert laid.depth.notna().all() and laid.row.notna().all() and len(row) == len(TREE)
    for h, p in parent.items():
        assert depth[h] == (depth[p] + 1 if p in depth else 0)
    children = {p: [h for h in parent if parent[h] == p] for p in parent}
    assert depth == {BIG: 0, BIG + 1: 1, BIG + 2: 2, BIG + 3: 2, BIG + 4: 1, 7: 0, 8: 0}
    for h, kids in children.items():
        if kids:  # parents centred over their children
            assert row[h] == pytest.approx(np.mean([row[k] for k in kids]))
    leaves = [h for h, kids in children.items() if not kids]
    assert sorted(row[h] for h in leaves) == list(range(len(leaves)))  # one row per leaf


def test_prefix_tree_figure():
    fig = fig_captures.prefix_tree(TREE)
    edges = fig.data[0]
    assert edges.mode == "lines" and len(edges.x) == 3 * 4  # four nodes with a stored parent
    by_name = {t.name: t for t in fig.data[1:]}
    assert {n.replace(" (evicted)", "") for n in by_name} == {"salt t-a", "salt t-b", "salt (no salt)"}
    assert sum(len(t.x) for t in by_name.values()) == len(TREE)
    hollow = [t for t in by_name.values() if t.marker.symbol == "circle-open"]
    assert [len(t.x) for t in hollow] == [1] and hollow[0].name.endswith("(evicted)")  # the removed block
    text = " ".join(s for t in by_name.values() for s in t.text)
    assert f"{BIG:016x}" in text and "removed at 4" in text


def test_prefix_tree_of_a_single_root_and_of_nothing():
    one = nodes([(BIG, None, None, 0, None)])
    assert fig_captures.tree_layout(one)[["depth", "row"]].values.tolist() == [[0, 0]]
    fig = fig_captures.prefix_tree(one)
    assert sum(len(t.x) for t in fig.data[1:]) == 1 and len(fig.data[0].x) == 0
    empty = fig_captures.tree_layout(nodes([]))
    assert empty.empty and {"depth", "row"} <= set(empty.columns)


def test_palette_is_stable_and_grid_is_wide_enough():
    assert request_colours(["B", "A"]) == request_colours(["A", "B", "A"])
    assert request_colours(["A"])["A"] == request_colours(["A", "B"])["A"]
    for name in "ABCDEFGH":  # a writer keeps its colour whichever others a panel shows (the heatmap's keys, the map)
        panels = ([], ["A"], ["B", "C"], list("ABCDEFGH"))
        assert len({request_colours(others + [name])[name] for others in panels}) == 1, name
    many = [f"r{i}" for i in range(len(REQUEST_COLOURS))]
    assert len(set(request_colours(many).values())) == len(many), "no two share a colour while colours are left"
    for n in (0, 1, 8, 9, 33, 128, 129, 5000):
        cols = grid_columns(n)
        assert cols >= 8 and cols * cols >= 2 * n and (cols == 8 or (cols // 2) ** 2 < 2 * n)


def test_writer_colours_stay_clear_of_what_provenance_colours_mean():
    """Key labels and block owners take writer colours: none may read as own blue, shared or another
    tenant's purple, leak red or stale orange (hues at least 20 degrees away), or as grey."""
    import colorsys

    def hue_sat(c: str) -> tuple[float, float]:
        h, _, s = colorsys.rgb_to_hls(*(int(c[i:i + 2], 16) / 255 for i in (1, 3, 5)))
        return h * 360, s

    meaning = [hue_sat(c)[0] for c in (LEAK, STALE, CROSS_TENANT, STATE_COLOURS["used"], STATE_COLOURS["shared"],
                                       "#08519c")]  # "#08519c": the own heatmap's blue
    for c in REQUEST_COLOURS:
        hue, sat = hue_sat(c)
        assert sat > 0.3, c
        assert all(min(abs(hue - m), 360 - abs(hue - m)) >= 20 for m in meaning), c


def test_miss_reasons_do_not_share_a_colour_with_the_block_churn_above_them():
    from kvviz.figures.cache import HIT
    from kvviz.figures.capture_time import EVICTED, REASONS, STORED

    assert not set(REASONS.values()) & {STORED, EVICTED, HIT}  # (the reasons replace the plain misses' grey)
    assert len(set(REASONS.values())) == len(REASONS)


def modebar_clear(fig: go.Figure) -> bool:
    """Whether the title and a horizontal legend above the plot lie under the toolbar's band (plotly draws it at
    the top right of the chart, over whatever the top margin holds there)."""
    lay, height = fig.layout, fig.layout.height
    title = lay.title.text or ""
    lines = title.count("<br>") + 1 if title else 0
    if lines and not (lay.title.yref == "container" and lay.title.y == 1 and lay.title.yanchor == "top"
                      and lay.title.pad.t >= MODEBAR_PX):
        return False
    legend = lay.legend
    if legend.orientation == "h":
        below = legend.yref != "container" and legend.y is not None and legend.y < 0  # put below on purpose
        on_top = legend.yref == "container" and (1 - legend.y) * height >= MODEBAR_PX + LINE_PX * lines - 0.5
        if not (below or on_top):  # in the top margin under the toolbar, or plotly's default: over the x axis title
            return False
    return lay.margin.t >= MODEBAR_PX + LINE_PX * lines


def test_no_title_or_legend_lies_under_plotlys_toolbar(recorded):
    """The walk through the app found the toolbar over legends and titles: each figure keeps its title and its
    legend under the toolbar's band, and its plot the height it had (the figure grows by the margin it adds)."""
    db, rid, _ = recorded
    with RunStore.open(db).read() as con:
        info = runs.run_info(con, rid)
        view = attention.attention_view(con, rid, info.requests[0], 3, 1, attention.HEAD_MEAN, info.block_size,
                                        upto=True)
        figs = {
            "memory": fig_blocks.memory_utilisation(memory.run_memory(con, rid).frame(), memory.ARTICLE, 2),
            "page tables": fig_blocks.page_tables(blocks.page_tables(con, rid, 1)),
            "block map": fig_blocks.block_map(blocks.block_map(con, rid, 1), title="Pool after step 1"),
            "heatmap": fig_attention.attention_heatmap(view.weights, view.classes, view.query_labels, view.key_labels,
                                                       view.key_owners, "a<br><sup>two lines</sup>"),
            "timeline": timeline.leak_timeline(leaks.leak_over_time(con, rid), 2),
            "hit rate": fig_cache.hit_rate(pd.DataFrame({"interval_start": [0, 1], "tokens": [8, 8],
                                                         "hit_tokens": [0, 4], "hit_rate": [0.0, 0.5]})),
        }
    for name, fig in figs.items():
        assert modebar_clear(fig), name
    heat = figs["heatmap"]
    assert heat.layout.margin.t >= MODEBAR_PX + 2 * LINE_PX  # two title lines
    assert heat.layout.height - heat.layout.margin.t == min(900, max(380, 260 + 14 * len(view.query_labels))) - 40


def test_the_what_if_curve_and_the_isolation_bars_draw_what_they_are_given():
    from kvviz.figures import whatif

    points = pd.DataFrame({"policy": ["lru", "lru", "belady", "belady"], "capacity": [4, 64, 4, 64],
                           "hit_rate": [0.1, 0.3, 0.2, 0.3]})
    fig = whatif.hit_rate_curve(points, own_capacity=32, unbounded=64, block_size=16)
    assert [t.name for t in fig.data] == ["LRU (vLLM's order)", "Belady (optimal)", "this run's cache", "unbounded"]
    assert list(fig.data[1].y) == [0.2, 0.3] and fig.layout.xaxis.type == "log"
    assert [list(t.x) for t in fig.data[2:]] == [[32, 32], [64, 64]]  # in data units: nothing read as 10^64
    assert not fig.layout.shapes and not fig.layout.annotations
    bound = whatif.hit_rate_curve(points, own_capacity=32, unbounded=64, inferred=True)  # a capture's lower bound
    assert bound.data[2].name == "at least 32 blocks held at once" and list(bound.data[2].x) == [32, 32]
    assert (bound.data[2].line.dash, fig.data[2].line.dash) == ("dashdot", "dash")
    same = pd.concat([points, points[points.policy == "lru"].assign(policy="lfu")])  # LFU's points are LRU's
    assert [t.name for t in whatif.hit_rate_curve(same).data] == ["LRU (vLLM's order) = LFU", "Belady (optimal)"]
    costs = pd.DataFrame({"tenant": ["a", "b"], "hit rate shared": [0.5, 0.4], "hit rate salted": [0.5, 0.1]})
    bars = whatif.isolation_cost(costs)
    assert [list(t.y) for t in bars.data] == [[0.5, 0.4], [0.5, 0.1]] and bars.layout.barmode == "group"
