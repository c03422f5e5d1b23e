"""Headroom and forecasts (amp_core.probes.headroom) on real runs: a planted layer whose output grows until fp16
overflows is forecast before it fails, by name, in a race and in a Monitor's loop alike; a healthy race forecasts
nothing; `amp-lab forecast` prints the table (exit 0) or says how to sample layers (exit 2). The trend's own
arithmetic is held to known series, and the format table to torch.finfo."""

from __future__ import annotations

import contextlib
import io
import math
import subprocess
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from amp_core.attach.monitor import Monitor
from amp_core.cli import main
from amp_core.config import RunConfig
from amp_core.probes.headroom import (
    FORECAST_EVENT,
    FORMAT_LIMITS,
    LaneHeadroom,
    formats_of_mode,
    headroom_bits,
    theil_sen,
)
from amp_core.race.runner import Run
from amp_core.records.opening import open_store
from amp_core.views.forecast import lane_forecast_lines, told_line
from amp_core.workshop import planted

ROOT = Path(__file__).resolve().parents[1]

EVERY = 10


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                        ("fp8 e4m3fn", torch.float8_e4m3fn), ("fp8 e5m2", torch.float8_e5m2)])
def test_format_limits_are_torch_finfo(name, dtype):
    info = torch.finfo(dtype)
    assert FORMAT_LIMITS[name].max == info.max and FORMAT_LIMITS[name].smallest_normal == info.smallest_normal
    assert headroom_bits(info.max / 8, FORMAT_LIMITS[name], "max") == pytest.approx(3.0)
    assert headroom_bits(info.smallest_normal * 4, FORMAT_LIMITS[name], "smallest normal") == pytest.approx(2.0)


def test_theil_sen_ignores_one_spike_and_refuses_one_sample():
    steps = list(range(0, 200, 10))
    values = [0.02 * s + 1.0 for s in steps]
    values[7] += 12.0  # one sample far off (an outlier batch)
    trend = theil_sen(steps, values)
    assert trend.slope == pytest.approx(0.02) and trend.slope_lo <= 0.02 <= trend.slope_hi
    assert trend.intercept == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least two samples"):
        theil_sen([0], [1.0])


def sample(step: int, amax: float, scale: float | None = None) -> dict:
    return {"modules": ["layer", "(loss)"], "output_amax": [amax, 1.0], "grad_amax": [1e-3, scale or 1.0],
            "scale": scale}


def test_steady_growth_is_forecast_with_an_interval_and_flat_noise_is_not():
    growing, flat = LaneHeadroom(), LaneHeadroom()
    generator = torch.Generator().manual_seed(0)
    for step in range(0, 160, EVERY):
        noise = float(torch.randn((), generator=generator)) * 0.1  # bits of batch-to-batch scatter
        growing.add(step, sample(step, 2.0 ** (4 + 0.03 * step + noise)))
        flat.add(step, sample(step, 2.0 ** (4 + noise)))
    forecast = growing.earliest(["fp16"])
    actual = (math.log2(65504) - 4) / 0.03  # where the planted line crosses fp16's max
    assert forecast.module == "layer" and forecast.tensor == "output" and forecast.limit == "max"
    assert forecast.lo_step <= forecast.predicted_step <= forecast.hi_step
    assert abs(forecast.predicted_step - actual) < 0.1 * actual
    assert flat.earliest(["fp16"]) is None
    assert all(row.module != "(loss)" for row in flat.rows())


def test_a_scaled_gradient_is_the_scalers_to_keep_below_the_max():
    lane = LaneHeadroom()
    for step in range(0, 160, EVERY):  # the unscaled gradient grows steadily, held at a scale of 2**16
        lane.add(step, {"modules": ["layer"], "output_amax": [1.0], "grad_amax": [2.0 ** (-8 + 0.03 * step + 16)],
                        "scale": 2.0**16})
    (row,) = [r for r in lane.rows(["fp16"]) if r.tensor == "grad" and r.limit == "max"]
    assert row.forecast is None and "GradScaler" in row.why_none
    assert row.headroom_bits == pytest.approx(math.log2(65504) - (-8 + 0.03 * 150 + 16))


@pytest.mark.parametrize("mode,formats", [("16-mixed", ("fp16",)), ("bf16-mixed+fp8-tensorwise", ("bf16",)),
                                          ("16-true", ("fp16",)), ("32-true", ())])
def test_formats_of_mode(mode, formats):
    assert formats_of_mode(mode) == formats


# --- real runs ----------------------------------------------------------------------------------------------------

def first_failure(frame) -> int:
    failed = frame[~frame["loss"].map(math.isfinite)]
    return int(failed["step"].min())


@pytest.fixture(scope="module")
def growing_race(tmp_path_factory):
    """A 16-mixed race of the growing layer (fp16 overflows after some 250 steps), layers sampled every 10 steps."""
    store = tmp_path_factory.mktemp("forecast") / "runs.sqlite3"
    planted.register()
    run = Run(RunConfig(workload=planted.GrowingPlantedDigits.name, size="small", modes=("16-mixed",), steps=320,
                        amax_every=EVERY, device="cpu", intra_op_threads=1), open_store(store)).start()
    run.join()
    return store, run


def test_a_planted_growth_is_forecast_before_it_fails_naming_the_layer(growing_race):
    store, run = growing_race
    failure = first_failure(run.frame())
    told = [e for e in run.events() if e.kind == FORECAST_EVENT]
    assert told and all(e.step < failure for e in told[:1])
    first = told[0]
    assert first.data["module"] == planted.GROWING_MODULE and first.data["format"] == "fp16"
    assert first.data["limit"] == "max" and first.data["tensor"] == "output"
    assert failure - first.step >= 100  # seen coming at least 100 steps ahead
    assert abs(first.data["predicted_step"] - failure) <= 0.3 * (failure - first.step)
    assert planted.GROWING_MODULE in first.message and "fp16's max" in first.message
    assert len(told) < len([e for e in run.events() if e.kind == "layer_amax"]) / 2  # told when it moves, not always
    stored = open_store(store).events(run.run_id)
    assert (stored["kind"] == FORECAST_EVENT).sum() == len(told)


def test_a_healthy_race_forecasts_nothing(fresh_store):
    run = Run(RunConfig(workload="digits_mlp", modes=("16-mixed", "bf16-mixed"), steps=250, amax_every=EVERY,
                        device="cpu", intra_op_threads=1)).start()
    run.join()
    assert len([e for e in run.events() if e.kind == "layer_amax"]) == 2 * 25
    assert [e.message for e in run.events() if e.kind == FORECAST_EVENT] == []


def test_the_monitor_forecasts_what_the_race_does(growing_race, fresh_store):
    _, run = growing_race
    race_first = next(e for e in run.events() if e.kind == FORECAST_EVENT)
    workload = planted.GrowingPlantedDigits()
    data = workload.load_data(RunConfig(workload=workload.name))
    torch.manual_seed(0)
    model = workload.build_model("small", data)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    generator = torch.Generator().manual_seed(0)
    store = open_store(fresh_store)
    with Monitor(model, optimizer, scaler, store=store, layers_every=EVERY, probe_budget=0) as monitor:
        for _ in range(race_first.step + 1):
            inputs, target = data.sample(generator, 64)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = workload.loss(model(inputs), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            monitor.step(loss)
    events = store.events(monitor.run_id)
    told = events[events["kind"] == FORECAST_EVENT]
    assert len(told), "the Monitor told no forecast"
    first = told.iloc[0]["data"]
    for key in ("module", "tensor", "format", "limit"):
        assert first[key] == race_first.data[key]
    # The same growth seen through another batch order: each forecast falls in the other's interval.
    assert race_first.data["lo_step"] <= first["predicted_step"] <= race_first.data["hi_step"]
    assert first["lo_step"] <= race_first.data["predicted_step"] <= first["hi_step"]
    # The Train page's line for the lane: the layer, the format's limit, the steps.
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180).run()
    at.switch_page("pages/train.py").run()
    assert not at.exception, [e.value for e in at.exception]
    (line,) = [w.value for w in at.warning if w.value.startswith("Forecast")]
    assert line.startswith(f"Forecast · 16-mixed: {told_line('16-mixed', first).split(': ', 1)[1]}")
    assert planted.GROWING_MODULE in line and "fp16's max" in line and f"at step {first['predicted_step']}" in line


def test_the_view_line_of_a_race_names_the_layer(growing_race):
    store, run = growing_race
    lines = lane_forecast_lines(open_store(store).events(run.run_id), {0: "16-mixed", 1: "32-true"})
    told = [e for e in run.events() if e.kind == FORECAST_EVENT]
    assert len({(e.data["module"], e.data["limit"]) for e in told}) == 1  # one layer's forecast, told as it moved
    latest = "" if len(told) == 1 else \
        f" · latest, told at step {told[-1].step}: at step {told[-1].data['predicted_step']}"
    assert lines == [told_line("16-mixed", told[0].data) + latest]  # its first warning, where the latest stands
    assert lines[0].startswith(f"16-mixed: {planted.GROWING_MODULE} reaches fp16's max in ~")


def cli(store, *args: str) -> subprocess.CompletedProcess:
    """`amp-lab --store STORE ARGS` in this process (a subprocess would spend its time importing torch)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--store", str(store), *args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_cli_forecast_table_and_exit_codes(growing_race, fresh_store):
    store, run = growing_race
    done = cli(store, "forecast", run.run_id)
    assert done.returncode == 0, done.stderr
    assert planted.GROWING_MODULE in done.stdout and "reaches fp16's max" in done.stdout
    assert "lane 0 · 16-mixed" in done.stdout
    refused = cli(store, "forecast", run.run_id, "--lane", "3")
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0 and "no lane 3" in refused.stderr
    plain = Run(RunConfig(workload="mlp_regression", modes=("32-true",), steps=5, device="cpu"),
                open_store(fresh_store)).start()
    plain.join()
    unsampled = cli(fresh_store, "forecast", plain.run_id)
    assert unsampled.returncode == 2 and "--amax-every" in unsampled.stderr
    assert unsampled.stderr.strip().count("\n") == 0 and unsampled.stdout == ""
    missing = cli(fresh_store, "forecast", "nope")
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr


def test_the_lightning_callback_forecasts_what_the_race_does(growing_race, fresh_store):
    """The same growing layer trained by a real Lightning Trainer in 16-true (fp16 weights, no scaler), recorded by
    the AMP Lab callback: its Monitor tells the forecast the race told, for the same layer and format."""
    L = pytest.importorskip("lightning", reason="the `lightning` extra (pip install -e .[lightning]) is not installed")
    from amp_core.integrations.lightning import AmpLabCallback

    _, run = growing_race
    race_first = next(e for e in run.events() if e.kind == FORECAST_EVENT)
    workload = planted.GrowingPlantedDigits()
    data = workload.load_data(RunConfig(workload=workload.name))

    class Growing(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = workload.build_model("small", data)

        def training_step(self, batch, batch_idx):
            return workload.loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)  # Adam's eps is 0 in fp16 weights

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.inputs, data.targets), batch_size=64,
                                         shuffle=True, generator=torch.Generator().manual_seed(0))
    callback = AmpLabCallback(name="growing", store=str(fresh_store), layers_every=EVERY, probe_budget=0)
    trainer = L.Trainer(max_steps=race_first.step + 1, precision="16-true", accelerator="cpu", devices=1,
                        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Growing(), loader)
    events = open_store(fresh_store).events(callback.monitor.run_id)
    told = events[events["kind"] == FORECAST_EVENT]
    assert len(told), "the callback told no forecast"
    first = told.iloc[0]["data"]
    assert first["module"] == f"net.{race_first.data['module']}"
    assert (first["tensor"], first["format"], first["limit"]) == ("output", "fp16", "max")
    assert race_first.data["lo_step"] <= first["predicted_step"] <= race_first.data["hi_step"]


def test_the_hf_trainer_callback_forecasts_what_the_race_does(growing_race, fresh_store):
    """The same growing layer trained by a real Hugging Face Trainer with its weights in fp16 (16-true: the Trainer's
    own fp16 flag is not applied on a CPU), recorded by the AMP Lab callback: its Monitor tells the forecast the race
    told, for the same layer and format, within the race's interval."""
    pytest.importorskip("transformers", reason="the `hf` extra (pip install -e .[hf]) is not installed")
    from transformers import Trainer, TrainingArguments

    from amp_core.integrations.transformers import AmpLabCallback

    _, run = growing_race
    race_first = next(e for e in run.events() if e.kind == FORECAST_EVENT)
    workload = planted.GrowingPlantedDigits()
    data = workload.load_data(RunConfig(workload=workload.name))

    class Growing(torch.nn.Module):
        """The Trainer's shape of a model: named inputs in, a dict with the loss out."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = workload.build_model("small", data)

        def forward(self, inputs, labels):
            return {"loss": workload.loss(self.net(inputs), labels)}

    class Digits(torch.utils.data.Dataset):
        def __len__(self):
            return len(data.targets)

        def __getitem__(self, index):
            return {"inputs": data.inputs[index].half(), "labels": data.targets[index]}

    model = Growing().half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # Adam's eps is 0 in fp16 weights
    callback = AmpLabCallback(name="growing", store=str(fresh_store), layers_every=EVERY, probe_budget=0)
    args = TrainingArguments(output_dir=str(fresh_store.parent / "hf"), max_steps=race_first.step + 1,
                             per_device_train_batch_size=64, use_cpu=True, report_to=[], save_strategy="no",
                             logging_steps=10, remove_unused_columns=False, disable_tqdm=True, seed=0,
                             dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=Digits(), optimizers=(optimizer, None),
            callbacks=[callback]).train()
    events = open_store(fresh_store).events(callback.monitor.run_id)
    assert open_store(fresh_store).run(callback.monitor.run_id)["lanes"][0]["mode"] == "16-true"
    told = events[events["kind"] == FORECAST_EVENT]
    assert len(told), "the callback told no forecast"
    first = told.iloc[0]["data"]
    assert first["module"] == f"net.{race_first.data['module']}"
    assert (first["tensor"], first["format"], first["limit"]) == ("output", "fp16", "max")
    assert race_first.data["lo_step"] <= first["predicted_step"] <= race_first.data["hi_step"]
