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
    step_time = trace(plots.step_time_figure(frame), "bf16-mixed")
    assert values(step_time["y"]).max() == 102.0  # the slow step survives decimation


@pytest.mark.parametrize("log_y", [False, True])
def test_loss_axis_and_smoothing(log_y):
    frame = records(300)
    plain = plots.loss_figure(frame, log_y=log_y)
    assert spec(plain)["layout"]["yaxis"]["type"] == ("log" if log_y else "linear")
    smoothed = plots.loss_figure(frame, log_y=log_y, smoothing=0.9)
    faint = [t for t in spec(smoothed)["data"] if t.get("showlegend") is False]
    assert len(faint) == len(MODES)  # the raw curve stays, faint, behind each smoothed one
    raw_y = values(trace(plain, "bf16-mixed")["y"])
    smooth_y = values(trace(smoothed, "bf16-mixed")["y"])
    assert np.diff(smooth_y).std() < np.diff(raw_y).std()


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
