"""Send what changed: a live chart's update carries the points since its last draw (amp_core.views.chart_feed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from amp_core.config import RunConfig
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.views import plots
from amp_core.views.chart_feed import TAIL_POINTS, ChartFeed, figure_spec, new_points
from amp_core.views.shared import LiveRoom


def spec(*traces: dict, **layout) -> dict:
    return {"data": list(traces), "layout": {"height": 300, **layout}, "template": {"layout": {"font": {}}}}


def line(n: int, start: int = 0, **style) -> dict:
    return {"type": "scatter", "name": "a", "x": list(range(start, n)), "y": [float(v) for v in range(start, n)],
            **style}


@pytest.mark.parametrize("modes", [("32-true",), ("32-true", "bf16-mixed")])
def test_a_live_runs_next_update_carries_only_its_new_steps(stepped_launches, fresh_store, modes, monkeypatch):
    manager = RunManager(open_store(fresh_store))
    lanes = len(modes)
    monkeypatch.setattr(stepped_launches, "pause_after", frozenset({4 * lanes, 7 * lanes}))  # not the class's for good
    run = manager.launch(RunConfig(workload="mlp_regression", modes=modes, steps=100_000, batch_size=16))
    try:
        run.wait_until(stepped_launches.parked)
        room = LiveRoom(share_s=0.5, clock=lambda: 0.0)
        feeds = {name: ChartFeed() for name in ("loss", "memory")}

        def draw(fresh: bool) -> dict:
            frame = room.frame(manager, run.run_id, fresh=fresh)
            figures = plots.train_figures(frame.series, bands=frame.bands)
            return {name: (feed.update(figure_spec(figures[name])), figure_spec(figures[name]))
                    for name, feed in feeds.items()}

        first = draw(False)
        assert all(update["kind"] == "reset" for update, _ in first.values())
        assert new_points(first["loss"][0]) == 4 * lanes
        run.resume()
        run.wait_until(stepped_launches.parked)
        second = draw(True)
    finally:
        run.stop()
        run.join()
    loss, whole = second["loss"]
    assert loss["kind"] == "extend" and loss["base"] == 1 and loss["seq"] == 2 and not loss["replace"]
    # Every lane's loss trace keeps its 4 steps and gains the 3 recorded since: nothing else is sent.
    assert sorted((item["keep"], item["points"]["x"]) for item in loss["extend"]) == [(4, [4, 5, 6])] * lanes
    assert new_points(loss) == 3 * lanes
    assert len(json.dumps(loss)) * 3 < len(json.dumps({"data": whole["data"], "layout": whole["layout"]}))
    memory, _ = second["memory"]
    assert memory["kind"] == "extend" and new_points(memory) <= 3 * lanes


def test_the_bucket_still_filling_is_cut_and_redrawn():
    feed = ChartFeed()
    feed.update(spec(line(10)))
    changed = line(14)
    changed["y"][9] = 99.0  # the last point sent changed in place
    update = feed.update(spec(changed))
    assert update["extend"] == [{"trace": 0, "keep": 9, "points": {"x": [9, 10, 11, 12, 13],
                                                                    "y": [99.0, 10.0, 11.0, 12.0, 13.0]}}]


def test_unchanged_traces_send_nothing_and_a_moved_layout_is_sent():
    feed = ChartFeed()
    feed.update(spec(line(5), line(5)))
    update = feed.update(spec(line(5), line(6), yaxis={"range": [0, 9]}))
    assert [item["trace"] for item in update["extend"]] == [1] and update["layout"]["yaxis"] == {"range": [0, 9]}
    assert "layout" not in feed.update(spec(line(5), line(6), yaxis={"range": [0, 9]}))


@pytest.mark.parametrize("change", ["coarser", "style", "start"])
def test_a_trace_that_does_not_grow_at_its_end_is_sent_whole(change):
    feed = ChartFeed()
    n = TAIL_POINTS * 3
    feed.update(spec(line(n)))
    if change == "coarser":  # the summary went a level coarser: every other point
        new = line(n)
        new["x"], new["y"] = new["x"][::2], new["y"][::2]
    elif change == "style":
        new = line(n + 1, mode="markers")
    else:  # its start moved (a window of steps that slid): finished buckets never change, so only ends are looked at
        new = line(n + 1)
        new["y"][0] = -1.0
    update = feed.update(spec(new))
    assert update["kind"] == "extend" and update["extend"] == [] and update["replace"] == [{"trace": 0, "data": new}]


def test_traces_that_come_or_go_send_the_whole_figure_and_whole_gives_it_at_the_feeds_seq():
    feed = ChartFeed()
    feed.update(spec(line(3)))
    update = feed.update(spec(line(3), line(2)))
    assert update["kind"] == "reset" and update["figure"]["layout"]["template"] == {"layout": {"font": {}}}
    assert feed.update(spec(line(4), line(2)))["base"] == update["seq"]
    whole = feed.whole(spec(line(4), line(2)))  # what a board that holds nothing draws: the next update applies to it
    assert whole["kind"] == "reset" and whole["seq"] == feed.seq and whole["figure"]["data"][0]["x"] == [0, 1, 2, 3]


def test_a_spec_is_json_with_gaps_for_non_finite_values():
    figure = plots.chart_figure({"data": [{"type": "scatter", "x": np.arange(3), "y": np.array([1.0, np.nan, np.inf]),
                                           "customdata": np.array([[1.0, np.nan], [2.0, 3.0], [4.0, 5.0]])}],
                                 "layout": {"height": 300}})
    made = figure_spec(figure)
    assert made["data"][0]["y"] == [1.0, None, None] and made["data"][0]["customdata"][0] == [1.0, None]
    json.loads(json.dumps(made, allow_nan=False))


@pytest.mark.parametrize("modes", [("32-true",), ("32-true", "16-mixed")])
def test_a_live_views_specs_built_without_figures_are_the_figures_specs(stepped_launches, fresh_store, modes,
                                                                         monkeypatch):
    """plots.specs_only(): the live view's specs without plotly Figures are what the Figures give, template and all."""
    manager = RunManager(open_store(fresh_store))
    monkeypatch.setattr(stepped_launches, "pause_after", frozenset({6 * len(modes)}))
    run = manager.launch(RunConfig(workload="mlp_regression", modes=modes, steps=100_000, batch_size=16))
    try:
        run.wait_until(stepped_launches.parked)
        frame = LiveRoom(share_s=0.5, clock=lambda: 0.0).frame(manager, run.run_id)
        figures = plots.train_figures(frame.series, bands=frame.bands, smoothing=0.5)
        with plots.specs_only():
            light = plots.train_figures(frame.series, bands=frame.bands, smoothing=0.5)
    finally:
        run.stop()
        run.join()
    assert set(light) == set(figures) and not any(isinstance(chart, plots.go.Figure) for chart in light.values())
    for name, figure in figures.items():
        assert figure_spec(light[name]) == figure_spec(figure), name
    assert figure_spec(light["loss"])["template"]["layout"]  # plotly's default template, carried whole
