"""Layer diagnostics of an attached run (amp_core.probes.layerwatch through a Monitor), on real CPU loops: per-layer
ranges every N steps as the race's layer_amax events (the same heatmap draws them) with the shares real casts
overflow / make subnormal / flush to zero, no hook between watched steps, and a planted inf named as the first
inf/NaN, for the failing step when it was watched and for the next step after arming when it was not."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest
from torch import nn

from amp_core.attach.monitor import Monitor
from amp_core.probes.layerwatch import FIRST_NONFINITE_EVENT, FORMATS, figures, tensor_figures
from amp_core.probes.numerics import LAYER_AMAX_EVENT
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from amp_core.views.numerics import amax_heatmap, amax_samples

ROOT = Path(__file__).resolve().parents[1]


class Planted(nn.Module):
    """Multiplies by 1e39 on the steps it is armed for: fp32 overflows to inf in this module's output."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e39 if self.armed else x


def fp16_loop(store: RunStore, steps: int, plant_at: set[int], **settings) -> tuple[Monitor, nn.Module]:
    """An fp16 loop with a GradScaler (a skipped step leaves the weights intact) and an inf planted in module 'blow'."""
    torch.manual_seed(0)
    planted = Planted()
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(10, 32))
    model.add_module("act", nn.ReLU())
    model.add_module("fc2", nn.Linear(32, 32))
    model.add_module("blow", planted)
    model.add_module("head", nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 10, generator=generator), torch.randn(64, 1, generator=generator)
    settings.setdefault("probe_budget", 0)  # every sampled step watched, whatever the machine's speed
    with Monitor(model, optimizer, scaler, store=store, **settings) as monitor:
        for step in range(steps):
            planted.armed = step in plant_at
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            monitor.step(loss)
            if step not in (0, steps - 1):  # no hook stays on the model between steps unless the next is watched
                watched = monitor._layers.current is not None  # (the failing-step flags' hooks stay: their own)
                layer_hooks = [hook for hook in model.fc1._forward_hooks.values()
                               if "Sentinel" not in hook.__qualname__]
                assert bool(layer_hooks) == watched
    return monitor, model


@pytest.fixture
def store(fresh_store) -> RunStore:
    return open_store(fresh_store)


def events_of(store: RunStore, run_id: str, kind: str):
    events = store.events(run_id)
    return events[events["kind"] == kind]


def test_layer_ranges_every_n_steps_draw_the_race_heatmap(store):
    monitor, _ = fp16_loop(store, 12, set(), layers_every=4)
    samples = events_of(store, monitor.run_id, LAYER_AMAX_EVENT)
    assert samples["step"].astype(int).tolist() == [0, 4, 8]
    data = samples.iloc[0]["data"]
    assert data["modules"] == ["fc1", "act", "fc2", "blow", "head", "(root)"] and data["why"] == "sampled"
    assert all(isinstance(v, float) and v > 0 for v in data["output_amax"])
    assert all(isinstance(v, float) and v > 0 for v in data["grad_amax"])  # scaled gradients w.r.t. outputs
    shares = data["shares"]["output"]
    assert set(shares) == {"fp16", "bf16", "fp8 e4m3fn", "fp8 e5m2"}
    assert all(0 <= v <= 1 for effects in shares.values() for values in effects.values() for v in values)
    frame = amax_samples(store.events(monitor.run_id))
    assert sorted(frame["step"].unique().tolist()) == [0, 4, 8]
    figure = amax_heatmap(frame, 0, "16-mixed")
    assert list(figure.data[0].y) == data["modules"]


def test_tensor_figures_count_what_real_casts_do():
    values = torch.tensor([0.0, 1e-30, 1e-6, 3e-5, 1.0, 300.0, 450.0, 500.0, 6e4, 7e4, 1e39, float("nan")])
    counted = figures(tensor_figures(values).tolist())
    assert counted["numel"] == 12 and counted["nonfinite"] == 2  # 1e39 is inf in fp32, and the NaN
    assert counted["fp16 overflow"] == 1  # 7e4 (6e4 rounds to 60000 < 65504)
    assert counted["fp16 zero"] == 1 and counted["fp16 subnormal"] == 2  # 1e-30 -> 0; 1e-6 and 3e-5 subnormal
    assert counted["bf16 overflow"] == 0 and counted["bf16 zero"] == 0 and counted["bf16 subnormal"] == 0
    assert counted["fp8 e4m3fn overflow"] == 3  # 500, 6e4, 7e4 (450 rounds to 448; a cast saturates or gives NaN)
    assert counted["fp8 e4m3fn zero"] == 3  # 1e-30, 1e-6, 3e-5 below half of 2^-9
    assert counted["fp8 e5m2 overflow"] == 1 and counted["fp8 e5m2 zero"] == 2  # 7e4; 1e-30 and 1e-6 -> 0
    assert counted["fp8 e5m2 subnormal"] == 1  # 3e-5 below 2^-14


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8 e4m3fn", "fp8 e5m2"])
def test_the_limits_agree_with_real_casts_across_the_whole_fp32_range(name):
    dtype = FORMATS[name]
    generator = torch.Generator().manual_seed(0)
    values = torch.exp2(torch.empty(200_000).uniform_(-150, 128, generator=generator))
    values = values[torch.isfinite(values) & (values != 0)]
    info = torch.finfo(dtype)
    tiny, largest = torch.tensor(info.smallest_normal), torch.tensor(info.max)  # values at and around each limit too
    top_step = largest.log2().floor().exp2() * info.eps
    for edge in (tiny * info.eps / 2, tiny - tiny * info.eps / 2, largest + top_step / 2):
        values = torch.cat([values, edge.reshape(1), torch.nextafter(edge, torch.tensor(0.0)).reshape(1),
                            torch.nextafter(edge, torch.tensor(math.inf)).reshape(1)])
    cast = values.to(dtype).float()
    counted = figures(tensor_figures(values).tolist())
    assert counted[f"{name} zero"] == int((cast == 0).sum())
    assert counted[f"{name} subnormal"] == int(((cast != 0) & (cast.abs() < info.smallest_normal)).sum())
    overflow = ~torch.isfinite(cast)
    if dtype == torch.float8_e4m3fn:  # no inf: a cast saturates at 448 (or gives NaN) beyond 448 + 16
        overflow |= (cast == info.max) & (values >= info.max + 16)
    assert counted[f"{name} overflow"] == int(overflow.sum())


def test_a_planted_inf_in_a_watched_step_is_named_for_that_step(store):
    monitor, _ = fp16_loop(store, 10, {4}, layers_every=4)
    (event,) = events_of(store, monitor.run_id, FIRST_NONFINITE_EVENT).itertuples()
    assert event.data["module"] == "blow" and event.data["phase"] == "forward"
    assert event.data["failed_step"] == 4 and event.data["same_step"] and int(event.step) == 4
    assert event.data["after_amax"] == "inf" and isinstance(event.data["before_amax"], float)
    assert "first inf/NaN: blow" in event.message and "the failing step itself" in event.message


def test_a_planted_inf_in_an_unwatched_step_is_named_at_the_next_step_without_the_device_flags(store):
    monitor, _ = fp16_loop(store, 10, {5, 6}, layers_every=0, failing_step=False)
    (event,) = events_of(store, monitor.run_id, FIRST_NONFINITE_EVENT).itertuples()
    assert event.data["module"] == "blow" and event.data["failed_step"] == 5 and int(event.step) == 6
    assert not event.data["same_step"] and "the next step after arming the hooks" in event.message
    (sample,) = events_of(store, monitor.run_id, LAYER_AMAX_EVENT).itertuples()  # only the step armed after it
    assert int(sample.step) == 6 and sample.data["why"].startswith("after step 5 failed")


def test_the_failing_step_sentinel_names_an_unwatched_failing_step_itself(store):
    monitor, _ = fp16_loop(store, 10, {5, 6}, layers_every=0)  # failing_step is on by default
    (event,) = events_of(store, monitor.run_id, FIRST_NONFINITE_EVENT).itertuples()
    assert event.data["module"] == "blow" and event.data["failed_step"] == 5 and int(event.step) == 5
    assert event.data["same_step"] and "in the failing step itself (step 5" in event.message


def test_a_failure_with_no_inf_in_the_modules_says_so(store):
    # Without the device flags (which name step 3's own 'blow'), step 4, armed after step 3, is clean again.
    monitor, _ = fp16_loop(store, 6, {3}, layers_every=0, failing_step=False)
    (event,) = events_of(store, monitor.run_id, FIRST_NONFINITE_EVENT).itertuples()
    assert event.data["module"] is None and "no module held inf/NaN" in event.message


def test_the_page_says_an_attached_runs_sampled_watches_are_held_to_its_probe_budget(store):
    fp16_loop(store, 3, (), layers_every=4, probe_budget=0.0025)
    page = AppTest.from_file(str(ROOT / "pages" / "layer_numerics.py"), default_timeout=120).run()
    assert not page.exception
    assert any("every 4 steps while its costly probes stay within 0.25% of the loop's time" in caption.value
               for caption in page.caption)


def test_layer_numerics_page_shows_an_attached_runs_heatmap_and_first_inf(store):
    monitor, _ = fp16_loop(store, 10, {4}, layers_every=4)
    page = AppTest.from_file(str(ROOT / "pages" / "layer_numerics.py"), default_timeout=120).run()
    assert not page.exception
    assert page.selectbox(key="lnum_amax_run").value == monitor.run_id
    assert any("An attached run: a Monitor" in caption.value and "every 4 steps, after a failed step" in caption.value
               for caption in page.caption)  # no probe budget: every 4th step, said without a limit
    assert any("first inf/NaN: blow" in error.value for error in page.error)
    tables = [frame.value for frame in page.dataframe]
    (first,) = [table for table in tables if "phase" in table]
    assert first["module"].tolist() == ["blow"] and first["step"].tolist() == [4]
    (shares,) = [table for table in tables if "subnormal" in table]
    assert shares["module"].tolist()[:2] == ["fc1", "act"] and list(shares.columns) == ["module", "overflow",
                                                                                          "subnormal", "zero"]
    page.radio(key="lnum_cast_format").set_value("fp8 e4m3fn").run()
    assert not page.exception


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-rowwise"])
@pytest.mark.extra("recipes")
def test_an_fp8_lanes_scaled_shares_are_what_torchaos_own_scaled_cast_does(recipe):
    from torchao.float8.float8_utils import to_fp8_saturated

    from amp_core.precision import RECIPE_OPTIONS
    from amp_core.probes.layerwatch import FP8_FORMATS, ROLES, _scaled_figures, _ScaledRecorder

    float8 = RECIPE_OPTIONS[recipe]
    # Rows a thousand-fold apart: one scale per tensor flushes the small rows' values, one per row keeps them.
    tensor = (torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
              * torch.logspace(-12, 2, 8)[:, None]).to(torch.bfloat16)
    for which, role in ROLES.items():
        recorder = _ScaledRecorder({}, float8)
        recorder.role = role
        measured = _scaled_figures(recorder._measure(tensor).tolist())
        for name, dtype in FP8_FORMATS.items():
            scaled = tensor.float() * float8.cast_scale(tensor, role, dtype)
            cast = to_fp8_saturated(scaled, dtype).float()  # torchao's own cast of what its scale made
            assert measured[f"{name} scaled zero"] == int(((cast == 0) & (tensor != 0)).sum()), (which, name)
            assert measured[f"{name} scaled overflow"] == 0
            assert measured[f"{name} zero"] == int(((tensor.to(dtype).float() == 0) & (tensor != 0)).sum())
    rowwise = _scaled_figures(_ScaledRecorder({}, RECIPE_OPTIONS["fp8-rowwise"])._measure(tensor).tolist())
    tensorwise = _scaled_figures(_ScaledRecorder({}, RECIPE_OPTIONS["fp8-tensorwise"])._measure(tensor).tolist())
    assert rowwise["fp8 e4m3fn scaled zero"] < tensorwise["fp8 e4m3fn scaled zero"]
