"""Train-page figures: one colour per mode everywhere, decimation that keeps spikes and skipped steps, axes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from figure_json import points_by_trace, spec, values
from step_records import MODES, records

from amp_core.views import plots


def trace(figure, name: str) -> dict:
    (match,) = [t for t in spec(figure)["data"] if t.get("name") == name and t.get("showlegend") is not False]
    return match


def test_decimation_keeps_extremes_skips_and_last_row():
    n = 20_000
    v = np.sin(np.arange(n) / 50.0)
    v[12_345] = 99.0
    v[777] = -99.0
    v[5_000] = np.nan
    keep = np.zeros(n, dtype=bool)
    keep[[3, 10_001, 19_998]] = True
    idx = plots.decimate_indices(v, 2000, keep)
    assert len(idx) <= 2000 + 4
    assert {12_345, 777, 5_000, 3, 10_001, 19_998, n - 1} <= set(idx.tolist())
    assert (np.diff(idx) > 0).all()
    assert (plots.decimate_indices(v[:1500], 2000) == np.arange(1500)).all()


def test_one_colour_per_mode_in_every_chart():
    figures = plots.train_figures(records(50, skipped_at=(10,)))
    seen: dict[str, set[str]] = {}
    for figure in figures.values():
        for t in spec(figure)["data"]:
            color = (t.get("line") or {}).get("color") or (t.get("marker") or {}).get("color")
            seen.setdefault(t["legendgroup"], set()).add(color)
    assert seen == {mode: {plots.MODE_COLORS[mode]} for mode in seen}
    assert set(seen) == set(MODES)


def test_long_run_traces_are_decimated_but_keep_spike_and_skips():
    frame = records(20_000, skipped_at=(123, 15_000), spike_at=9_999)
    loss = plots.loss_figure(frame)
    counts = points_by_trace(loss)
    assert all(count <= plots.MAX_POINTS + 10 for count in counts.values()), counts
    fp32 = trace(loss, "32-true")
    assert 50.0 in values(fp32["y"]) and 9_999 in values(fp32["x"])
    assert values(fp32["x"])[-1] == 19_999
    marks = trace(loss, "16-mixed skipped")
    assert values(marks["x"]).tolist() == [123, 15_000]
    mixed = trace(loss, "16-mixed")
    assert {123, 15_000} <= set(values(mixed["x"]).tolist())
    dots = [t for t in spec(plots.step_time_figure(frame, raw=True))["data"] if t["name"] == "bf16-mixed (each step)"]
    assert values(dots[0]["y"]).max() == 102.0  # the slow step survives decimation among the raw points


@pytest.mark.parametrize("axis", ["linear", "log"])
def test_loss_axis_and_smoothing(axis):
    frame = records(300)
    plain = plots.loss_figure(frame, axis=axis)
    yaxis = spec(plain)["layout"]["yaxis"]
    assert yaxis["type"] == axis
    if axis == "log":
        assert yaxis["minorloglabels"] == "complete"  # in-between ticks read "200", "0.02", not bare digits
    smoothed = plots.loss_figure(frame, axis=axis, smoothing=0.9)
    faint = [t for t in spec(smoothed)["data"] if t.get("showlegend") is False]
    assert len(faint) == len(MODES)  # the raw curve stays, faint, behind each smoothed one
    raw_y = values(trace(plain, "bf16-mixed")["y"])
    smooth_y = values(trace(smoothed, "bf16-mixed")["y"])
    assert np.diff(smooth_y).std() < np.diff(raw_y).std()


def test_an_automatic_loss_axis_goes_log_when_a_spike_would_flatten_the_rest():
    calm = spec(plots.loss_figure(records(300)))
    assert calm["layout"]["yaxis"]["type"] == "linear" and "range" not in calm["layout"]["yaxis"]
    assert calm["layout"]["title"]["text"] == "Loss"
    spiked = spec(plots.loss_figure(records(300, spike_at=150)))  # one step at 50 among losses of 1 to 2
    assert spiked["layout"]["yaxis"]["type"] == "log"
    assert "log axis: the loss spans 1.7 decades" in spiked["layout"]["title"]["text"]


def test_losses_of_exactly_zero_keep_a_log_axis_and_sit_on_its_bottom_edge():
    frame = records(300)
    frame["loss"] = np.where(frame["step"] < 100, 2.0, 1e-9)  # trains to a tiny loss...
    frame.loc[frame["step"].isin([200, 201]), "loss"] = 0.0  # ... that underflows to 0 on two steps
    figure = spec(plots.loss_figure(frame))
    assert figure["layout"]["yaxis"]["type"] == "log"  # not a linear axis of 0..1e-8 with the start off its top
    assert figure["layout"]["title"]["text"] == f"Loss · log axis, 9.3 decades; {2 * len(MODES)} at 0 ▼"  # 2 per lane
    (edge,) = [t for t in figure["data"] if t["name"] == "32-true beyond the axis"]
    assert values(edge["x"]).tolist() == [200, 201] and values(edge["y"]).tolist() == pytest.approx([1e-9, 1e-9])
    mostly_zero = np.where(np.arange(300) < 100, 2.0, 0.0)
    assert plots.loss_axis(mostly_zero)[0]["type"] == "linear"  # most losses 0: a log axis would hide the run


def test_a_spike_among_losses_that_cannot_go_log_sits_on_the_edge_of_a_clipped_axis():
    frame = records(300, spike_at=150)
    frame["loss"] -= 1.5  # some losses at or below 0 (a plugin's loss may be): no log axis
    figure = spec(plots.loss_figure(frame))
    yaxis = figure["layout"]["yaxis"]
    assert yaxis["type"] == "linear"
    _, high = yaxis["range"]
    assert high < 5 and "a spike is off the axis" in figure["layout"]["title"]["text"]
    (edge,) = [t for t in figure["data"] if t["name"] == "32-true beyond the axis"]
    assert values(edge["x"]).tolist() == [150] and values(edge["y"]).tolist() == [high]
    assert values(edge["customdata"]).tolist() == [48.5]  # the true value, in the hover
    assert plots.loss_axis(values(trace(figure, "32-true")["y"]), "linear")[2] is None  # asked linear: no clipping


def test_the_step_time_median_and_band_ignore_a_stall():
    frame = records(300)  # every lane stalls 100 ms at step 100
    figure = spec(plots.step_time_figure(frame))
    median = values(trace(figure, "bf16-mixed")["y"])
    assert median.max() == 2.0 and len(median) == 300
    (band,) = [t for t in figure["data"] if t["name"] == "bf16-mixed p10-p90"]
    assert values(band["y"]).max() == 2.0 and band["fill"] == "tonexty"
    assert "median and p10-p90 band" in figure["layout"]["title"]["text"]


def test_a_long_lanes_band_is_per_bucket_from_its_records_and_reads_each_finished_bucket_once(monkeypatch):
    from amp_core.views.summary import lanes

    frame = records(20_000, modes=("32-true",))
    frame.loc[frame["step"] % 7 == 0, "step_ms"] = 3.0
    (lane,) = lanes(frame)
    assert lane.raw is None
    bands = plots.StepTimeBands()
    band = bands.band(lane)
    size = lane.bucket_steps
    ms = frame["step_ms"].to_numpy()
    for i in (0, len(band["step"]) // 2, len(band["step"]) - 1):
        end = int(band["step"][i]) + 1
        chunk = ms[end - int(band["records"][i]):end]
        assert (band["p10"][i], band["p50"][i], band["p90"][i]) == tuple(np.quantile(chunk, [0.1, 0.5, 0.9]))
    assert band["records"].sum() == 20_000 and (band["records"] <= size).all()
    read = []
    real = type(lane.source).raw_rows
    monkeypatch.setattr(type(lane.source), "raw_rows", lambda self, *a, **k: read.append(a) or real(self, *a, **k))
    again = bands.band(lane)
    assert read == [] and all((again[key] == band[key]).all() for key in band)  # every bucket was final: kept
    _, seconds = bands.median_time_s(lane)
    assert seconds[-1] == pytest.approx(20_000 * 1.0 / 1e3)  # the stall at step 6,666 adds its median, not 100 ms


def test_the_lr_is_one_line_when_it_never_moves():
    assert plots.constant_lr(records(20)) == 1e-3
    moving = records(20)
    moving.loc[moving["step"] > 10, "lr"] = 5e-4
    assert plots.constant_lr(moving) is None


def test_smoothing_skips_non_finite_losses():
    out = plots.smooth(np.array([1.0, np.inf, 1.0, np.nan, 1.0]), 0.5)
    assert np.isfinite(out[[0, 2, 4]]).all() and out[4] == pytest.approx(1.0)


def test_scale_on_log2_axis_with_skip_markers():
    figure = plots.scale_figure(records(100, skipped_at=(20, 40)))
    layout = spec(figure)["layout"]["yaxis"]
    assert layout["type"] == "log"
    assert all(math.log2(v).is_integer() for v in layout["tickvals"])
    assert layout["ticktext"][-1] == "2^16" and "2^14" in layout["ticktext"]
    assert [t["name"] for t in spec(figure)["data"]] == ["16-mixed", "16-mixed skipped"]
    assert values(trace(figure, "16-mixed skipped")["y"]).tolist() == [2.0**15, 2.0**14]


def test_scale_chart_says_why_when_no_lane_has_a_scaler():
    figure = plots.scale_figure(records(10, modes=("32-true", "bf16-mixed")))
    assert spec(figure)["data"] == []
    assert "no lane uses a GradScaler" in spec(figure)["layout"]["annotations"][0]["text"]


@pytest.mark.parametrize("cuda", [False, True])
def test_memory_bars_are_the_latest_bytes_held(cuda):
    frame = records(30, modes=("32-true", "bf16-mixed"), cuda=cuda)
    figure = spec(plots.memory_figure(frame))
    bars = {t["name"]: dict(zip(t["x"], values(t["customdata"]), strict=True)) for t in figure["data"]}
    assert bars["bf16-mixed"]["parameters"] == 8000
    assert bars["32-true"]["activations"] == 2900  # the last step's figure
    assert bars["32-true"]["total held"] == 4000 + 4000 + 8000 + 2900
    assert ("lane peak (CUDA)" in bars["32-true"]) is cuda
    assert ("step peak above its start (CUDA)" in bars["32-true"]) is cuda
    if cuda:
        assert bars["32-true"]["lane peak (CUDA)"] == 3 * 2**20
    assert figure["layout"]["yaxis"]["title"]["text"] == ("MiB" if cuda else "KiB")


def test_empty_records_give_empty_figures_with_a_note():
    for figure in plots.train_figures(records(0)).values():
        assert spec(figure)["data"] == []
        assert spec(figure)["layout"]["annotations"]


def test_lr_axis_starts_at_zero_and_shows_a_constant_lr():
    yaxis = spec(plots.lr_figure(records(20)))["layout"]["yaxis"]
    assert yaxis["range"] == [0, pytest.approx(1.15e-3)]


def test_row_quantiles_are_numpys_for_every_row_with_records_missing():
    rng = np.random.default_rng(0)
    matrix = rng.exponential(size=(50, 37))
    matrix[rng.random(matrix.shape) < 0.3] = np.nan  # steps with no record
    matrix[3], matrix[4, 1:] = np.nan, np.nan  # a bucket with no record, one with a single record
    quantiles, counts = plots.row_quantiles(matrix, (0.1, 0.5, 0.9))
    for row, values_ in enumerate(matrix):
        finite = values_[np.isfinite(values_)]
        expected = np.quantile(finite, [0.1, 0.5, 0.9]) if finite.size else np.full(3, np.nan)
        assert counts[row] == finite.size
        np.testing.assert_allclose(quantiles[row], expected, equal_nan=True)


def test_a_band_over_a_very_long_run_is_estimated_from_the_summary_and_agrees_with_every_record(tmp_path):
    from amp_core.race.runner import RunManager
    from amp_core.records.opening import open_store
    from bench.scale import write_synthetic

    path = tmp_path / "runs.sqlite3"
    write_synthetic(path, "long", 1_000_000, modes=("32-true",))
    (lane,) = RunManager(open_store(path)).lane_series("long")
    assert lane.bucket_steps >= plots.LEVEL_BASE * plots.BAND_SAMPLES  # sampled from the summary
    estimated = plots.StepTimeBands().band(lane)
    rows = lane.source.raw_rows(lane.start, lane.stop, ["step_ms"])  # every record, for the exact figures
    steps, ms = np.asarray(rows["step"]), np.asarray(rows["step_ms"], dtype=float)
    at = np.searchsorted(estimated["step"], steps)  # the bucket each record falls in (steps: each bucket's last)
    for name, q in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9)):
        exact = np.array([np.quantile(ms[at == i], q) for i in range(len(estimated["step"]))])
        assert np.nanmedian(np.abs(estimated[name] / exact - 1)) < 0.05, name


def test_what_streamlit_sends_of_each_chart_is_what_a_validated_plotly_figure_gives():
    """The figures skip plotly's validation and deep copies (ChartFigure): the JSON st.plotly_chart makes of each
    (to_dict, then to_json) must equal plotly's own of the same spec, and making it must leave the figure as it was."""
    import plotly.graph_objects as go
    import plotly.io as pio
    from plotly.tools import return_figure_from_figure_or_data

    def sent(figure) -> dict:
        return spec(pio.to_json(return_figure_from_figure_or_data(figure, validate_figure=True), validate=False))

    figures = {**plots.train_figures(records(60, skipped_at=(10,), spike_at=30), loss_axis="log", smoothing=0.5,
                                     raw_step_times=True),
               "empty": plots.empty_figure("Loss", "no steps yet")}
    for name, figure in figures.items():
        assert isinstance(figure, plots.ChartFigure), name
        traces_before = [dict(trace) for trace in figure._data]
        validated = go.Figure({"data": figure._data, "layout": {key: value for key, value in figure._layout.items()
                                                                if key != "template"}})
        assert sent(figure) == sent(validated), name
        assert sent(figure) == sent(figure), name  # a second send finds the arrays where the first left them
        for trace, before in zip(figure._data, traces_before, strict=True):
            assert all(trace[key] is value for key, value in before.items()), name
