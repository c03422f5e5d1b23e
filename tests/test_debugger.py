"""Overflow debugger core: skipped-step forensics, loss spikes per mode, exact underflow figures, lost updates,
and the page's data shaping and figures (amp_core.debugger). Real torch on CPU, real runs."""

from __future__ import annotations

import base64
import dataclasses
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from format_layouts import LAYOUTS

from amp_core.config import ConfigError, FaultSpec, RunConfig, ScalerConfig
from amp_core.probes import faults, gradstats
from amp_core.race.runner import Run, RunManager, build_lane_state
from amp_core.race.step import train_step
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from amp_core.runs import LaneInfo
from amp_core.views import debugger, tables
from amp_core.workloads import WORKLOADS, param_names

# ---- helpers --------------------------------------------------------------------------------------------


def _lane(config: RunConfig, mode: str):
    """One lane's state and a batch source, as the runner builds them."""
    workload = WORKLOADS[config.workload]
    data = workload.load_data(config)
    torch.manual_seed(config.seed)
    base = workload.build_model(config.size, data)
    lane = build_lane_state(config, 0, mode, base, workload, "cpu")
    generator = torch.Generator().manual_seed(config.seed)
    return lane, (lambda: data.sample(generator, config.batch_size))


def _finished(config: RunConfig, store: RunStore | None = None) -> Run:
    run = Run(config, store).start()
    run.join(120)
    assert run.status == "finished", [(lane.mode, lane.status, lane.error) for lane in run.lanes]
    return run


def _array(value) -> list:
    """A figure's data array from its JSON: plotly writes numpy arrays as base64 ('bdata'), lists as lists."""
    if isinstance(value, dict) and "bdata" in value:
        flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        return flat.reshape(value["shape"]).tolist() if "shape" in value else flat.tolist()
    return value


def _events(run: Run) -> pd.DataFrame:
    """A run's events as the page gets them from RunManager.events."""
    return pd.DataFrame([dataclasses.asdict(e) for e in run.events()])


# ---- a named parameter's gradient gets inf/NaN at step N in 16-mixed -----------------------------------

@pytest.mark.parametrize("kind", ["grad_inf", "grad_nan"])
@pytest.mark.parametrize("param", ["layer1.weight", "layer2.bias"])
@pytest.mark.parametrize("grad_clip", [0.0, 1.0])
def test_nonfinite_grad_skips_exactly_that_step(kind, param, grad_clip):
    at = 4
    config = RunConfig(workload="mlp_regression", modes=("16-mixed",), steps=8, grad_clip=grad_clip,
                       scaler=ScalerConfig(init_scale=256.0), faults=(FaultSpec(kind=kind, step=at, param=param),))
    lane, batch = _lane(config, "16-mixed")
    results, snapshots = [], []
    for step in range(config.steps):
        snapshots.append({n: p.detach().clone() for n, p in lane.model.named_parameters()})
        results.append(train_step(lane, batch(), step, collect_grad_stats=True))
    assert [step for step, r in enumerate(results) if r.skipped] == [at]
    bad = results[at].bad_params
    # Only the injected parameter: clipping or anything else must not smear NaN over the others.
    assert [p["param"] for p in bad] == [param]
    assert (bad[0]["inf"], bad[0]["nan"]) == ((1, 0) if kind == "grad_inf" else (0, 1))
    assert results[at].scale == 256.0 and results[at].scale_after == 128.0
    assert results[at + 1].scale == 128.0
    after_skip = snapshots[at + 1]
    for name, before in snapshots[at].items():
        assert torch.equal(before, after_skip[name]), f"{name} moved on a skipped step"
    for name, before in snapshots[at - 1].items():  # the steps around it did train
        assert not torch.equal(before, snapshots[at][name]), f"{name} did not move on a clean step"
    # A skipped step is not an update "lost to rounding".
    assert all(s.lost_update_fraction is None for s in results[at].grad_stats)
    assert all(s.lost_update_fraction is not None for s in results[at - 1].grad_stats)


@pytest.mark.parametrize("param", ["fc1.weight", "fc2.bias"])
def test_skipped_step_event_names_the_parameter(param, no_leaked_threads):
    at = 7
    config = RunConfig(workload="digits_mlp", modes=("16-mixed",), steps=12, gradstats_every=0,
                       faults=(FaultSpec.parse(f"grad_inf:{param}@{at}"),))
    run = _finished(config)
    frame = run.frame()
    assert frame.loc[frame["skipped"], "step"].tolist() == [at]
    scale = frame.set_index("step")["scale"]
    assert scale[at + 1] == scale[at] / 2
    events = _events(run)
    table = debugger.skipped_steps_table(events, 0)
    assert table["step"].tolist() == [at]
    assert table.loc[0, "parameters"] == f"{param} (1 inf)"
    assert (table.loc[0, "inf"], table.loc[0, "NaN"]) == (1, 0)
    assert table.loc[0, "outcome"] == f"skipped; scale {scale[at]:g} → {scale[at] / 2:g}"
    assert list(table.columns) == ["step", "outcome", "inf", "NaN", "parameters"]
    changes = debugger.scale_changes(events, 0)
    backoff = changes[changes["kind"] == "backoff"]
    assert backoff["step"].tolist() == [at]
    # The skipped step is always sampled, with the inf where it was put.
    stats = {s.param: s for _, _, step, s in run.grad_stats() if step == at}
    assert stats[param].inf == 1 and all(s.inf == 0 for name, s in stats.items() if name != param)


def test_inf_in_an_unscaled_lane_is_applied_not_skipped():
    config = RunConfig(workload="mlp_regression", modes=("bf16-mixed",), steps=6, gradstats_every=0,
                       optimizer="sgd", lr=1e-3, faults=(FaultSpec.parse("grad_inf:layer2.bias@2"),))
    run = Run(config).start()
    run.join(60)
    table = debugger.skipped_steps_table(_events(run), 0)
    assert table.loc[0, "step"] == 2
    assert table.loc[0, "outcome"] == "applied: no scaler to catch it"
    assert table.loc[0, "parameters"] == "layer2.bias (1 inf)"
    assert run.lanes[0].status == "diverged"


# ---- a loss spike: 16-mixed skips and backs off, bf16-mixed does not -----------------------------------

def test_loss_spike_skips_fp16_not_bf16(no_leaked_threads):
    start, duration = 20, 3
    config = RunConfig(workload="digits_mlp", modes=("16-mixed", "bf16-mixed"), steps=60, gradstats_every=0,
                       scaler=ScalerConfig(growth_interval=10),
                       faults=(FaultSpec(kind="loss_scale", step=start, duration=duration, factor=1e6),))
    run = _finished(config)
    frame = run.frame()
    fp16, bf16 = (frame[frame["lane"] == i].set_index("step") for i in (0, 1))
    assert fp16.index[fp16["skipped"]].tolist() == list(range(start, start + duration))
    assert fp16.loc[start + duration, "scale"] == fp16.loc[start, "scale"] / 2**duration
    assert not bf16["skipped"].any()
    assert bf16["scale"].isna().all()
    # The same spike hit both lanes.
    for lane in (fp16, bf16):
        assert lane.loc[start, "loss"] > 1e4 * lane.loc[start - 1, "loss"]
    events = _events(run)
    fired = events[events["kind"] == "fault"]
    assert sorted(zip(fired["lane"], fired["step"], strict=True)) == [(0, start), (1, start)]
    lanes = [LaneInfo(lane=i, mode=m, status="finished") for i, m in enumerate(config.modes)]
    effects = debugger.fault_effects(frame, config.to_dict(), lanes).set_index("mode")
    assert effects.loc["16-mixed", "skipped_steps"] == duration
    assert effects.loc["16-mixed", "scale_before"] == fp16.loc[start - 1, "scale"]
    assert effects.loc["16-mixed", "scale_min"] == fp16.loc[start:, "scale"].min()
    assert effects.loc["16-mixed", "scale_min"] == fp16.loc[start + duration, "scale"]
    recovered = effects.loc["16-mixed", "recovered_step"]
    assert pd.notna(recovered) and fp16.loc[recovered, "scale"] >= effects.loc["16-mixed", "scale_before"]
    assert (fp16.loc[start + duration:recovered - 1, "scale"] < effects.loc["16-mixed", "scale_before"]).all()
    assert effects.loc["bf16-mixed", "skipped_steps"] == 0
    assert effects.loc["bf16-mixed", "outcome"].startswith("no GradScaler: 0 steps skipped")
    # Live, before the fault's steps (or before any step): where the lane is, not a verdict on its scaler.
    for early in (frame[frame["step"] < start - 5], frame.iloc[0:0]):
        live = debugger.fault_effects(early, config.to_dict(), lanes).set_index("mode")
        where = f"at step {start - 6}" if len(early) else "with no step recorded yet"
        assert (live["outcome"] == f"not reached yet: the fault acts from step {start}, the lane is {where}").all()
        assert (live["skipped_steps"] == 0).all()
    overview = debugger.lane_overview(frame, events, lanes)
    assert overview["skipped steps"].tolist() == [duration, 0]
    assert overview["scale now"].tolist() == [f"{fp16['scale'].iloc[-1]:g}", "no scaler"]
    assert (overview.loc[1, ["scale min", "scale max"]] == "no scaler").all()
    skipped = debugger.skipped_steps_table(events, 0)
    assert skipped["step"].tolist() == list(range(start, start + duration))
    assert (skipped["NaN"] > skipped["inf"]).all()  # the overflow reaches the parameters mostly as NaN: see below


def test_an_fp16_overflow_reaches_the_parameter_gradients_as_nan():
    """NAN_FROM_OVERFLOW's claim, in a real fp16 backward: the logits' gradient overflows to ±inf, and the matmuls
    after it (inf - inf, inf x 0) leave the parameters' gradients mostly NaN."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    inputs = torch.rand(32, 64) * (torch.rand(32, 64) > 0.3)  # exact zeros, like the digits' blank pixels
    targets = torch.randint(0, 10, (32,))
    seen = {}
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(inputs)
        logits.register_hook(lambda grad: seen.setdefault("logits", grad))
        loss = torch.nn.functional.cross_entropy(logits, targets) * 1e6  # the loss spike of the demo
    (loss * 65536.0).backward()  # GradScaler's default initial scale
    assert seen["logits"].dtype == torch.float16
    assert torch.isinf(seen["logits"]).all()  # every element overflowed, with both signs
    assert (seen["logits"] > 0).any() and (seen["logits"] < 0).any()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.isnan(grads).sum() > 10 * torch.isinf(grads).sum()
    assert debugger.NAN_FROM_OVERFLOW.startswith("Why NaN rather than inf?")


# ---- exact underflow figures of a hand-made gradient ----------------------------------------------------

POWERS = torch.tensor([2.0**-30, 2.0**-20, 2.0**-10, 1.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hand_made_gradient_fractions_and_histogram(dtype):
    grad = torch.cat([POWERS, torch.tensor([0.0, 0.0, math.inf, math.nan])]).to(dtype)
    stats = gradstats.grad_stats("w", grad, scale=2.0**16)
    assert stats.numel == 8 and (stats.zeros, stats.inf, stats.nan) == (2, 1, 1)
    assert stats.total == stats.numel == sum(stats.hist) + 4
    nonzero = {gradstats.HIST_LO + i: c for i, c in enumerate(stats.hist) if c}
    assert nonzero == {-30: 1, -20: 1, -10: 1, 0: 1}
    assert stats.fractions == {
        # unscaled: 2^-30 is below fp16's 2^-25 rounding floor -> 0; 2^-20 is an fp16 subnormal (2^-24..2^-14).
        "fp16.zero.unscaled": 0.25, "fp16.subnormal.unscaled": 0.25, "fp16.overflow.unscaled": 0.0,
        # x 2^16: 2^-14 (smallest normal), 2^-4, 2^6 fine; 1.0 -> 65536 >= 65520 overflows.
        "fp16.zero.scaled": 0.0, "fp16.subnormal.scaled": 0.0, "fp16.overflow.scaled": 0.25,
        "bf16.zero.unscaled": 0.0, "bf16.subnormal.unscaled": 0.0, "bf16.overflow.unscaled": 0.0,
        "bf16.zero.scaled": 0.0, "bf16.subnormal.scaled": 0.0, "bf16.overflow.scaled": 0.0,
    }
    hist = debugger.histogram_frame(stats)
    unscaled, scaled = (hist[hist["series"] == s] for s in ("unscaled", "scaled"))
    assert unscaled["x_lo"].tolist() == [-30, -20, -10, 0]
    assert scaled["x_lo"].tolist() == [-14, -4, 6, 16]
    assert unscaled["count"].sum() + sum(debugger.special_counts(stats)[k] for k in ("zero", "inf", "NaN")) == 8
    assert unscaled["share"].sum() == pytest.approx(0.5)
    table = debugger.fractions_frame(stats).set_index(["format", "gradient"])
    assert table.loc[("fp16", "unscaled"), "becomes 0"] == 0.25
    assert table.loc[("fp16", "unscaled"), "subnormal"] == 0.25
    assert table.loc[("fp16", "x 65536"), "overflows to inf"] == 0.25
    assert table.loc["bf16"].sum().sum() == 0.0


@pytest.mark.parametrize(("value", "fp16_class", "bf16_class"), [
    (2.0**-25, "zero", "normal"),          # the tie rounds to even: 0
    (3 * 2.0**-26, "subnormal", "normal"),  # 0.75 x 2^-24 rounds up to 2^-24
    (2.0**-24, "subnormal", "normal"),
    (2.0**-14, "normal", "normal"),
    (65519.0, "normal", "normal"),          # rounds down to 65504
    (65520.0, "overflow", "normal"),        # max + half an ulp: inf
    (2.0**-130, "zero", "subnormal"),
    (2.0**-135, "zero", "zero"),
])
def test_format_edges_are_the_real_rounding(value, fp16_class, bf16_class):
    stats = gradstats.grad_stats("w", torch.tensor([value], dtype=torch.float64))
    for fmt, expected in (("fp16", fp16_class), ("bf16", bf16_class)):
        got = {what: stats.fractions[f"{fmt}.{what}.unscaled"] for what in ("zero", "subnormal", "overflow")}
        assert got == {what: float(what == expected) for what in got}, (fmt, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 2.0**16, 3.0, 2.0**-10])
def test_fractions_are_each_value_cast_through_float64(dtype, scale):
    """The fractions are what the definition gives: every finite non-zero value (x scale, in float64, where the
    product is exact) cast to fp16 and bf16 and classed, over magnitudes from below bf16's subnormals to fp32's top."""
    generator = torch.Generator().manual_seed(0)
    values = torch.logspace(-45, 38, 4001, dtype=torch.float64) * (torch.rand(4001, generator=generator) - 0.5).sign()
    grad = torch.cat([values, torch.tensor([0.0, math.inf, -math.inf, math.nan], dtype=torch.float64)]).to(dtype)
    stats = gradstats.grad_stats("w", grad, scale)
    finite = grad.double()[torch.isfinite(grad.double()) & (grad.double() != 0)]
    for fmt, target in gradstats.FORMATS.items():
        tiny = torch.finfo(target).tiny
        for label, factor in (("unscaled", 1.0), ("scaled", scale)):
            stored = (finite * factor).to(target).abs()
            assert stats.fractions[f"{fmt}.zero.{label}"] == int((stored == 0).sum()) / len(finite)
            subnormal = int(((stored > 0) & (stored < tiny)).sum())
            assert stats.fractions[f"{fmt}.subnormal.{label}"] == subnormal / len(finite)
            assert stats.fractions[f"{fmt}.overflow.{label}"] == int(torch.isinf(stored).sum()) / len(finite)
    assert (stats.inf, stats.nan) == (int(torch.isinf(grad).sum()), 1) and stats.numel == len(grad)


def _mixed_gradients() -> list[tuple[str, torch.Tensor]]:
    """Gradients of every dtype a lane's parameters take, with zeros, inf, NaN, subnormals and overflows among them,
    one empty and one that fills several groups."""
    generator = torch.Generator().manual_seed(3)
    wide = torch.logspace(-45, 38, 41, dtype=torch.float64) * (torch.rand(41, generator=generator) - 0.5).sign()
    special = torch.tensor([0.0, 0.0, math.inf, -math.inf, math.nan, 2.0**-25, 65520.0, 2.0**-130], dtype=torch.float64)
    return [("a", torch.cat([wide, special]).float()), ("b", torch.randn(5, generator=generator).half() * 1e-4),
            ("c", torch.cat([wide[:30], special]).bfloat16()), ("empty", torch.zeros(0)),
            ("d", (torch.randn(3, 4, generator=generator, dtype=torch.float64) * 1e6)),
            ("e", torch.zeros(6)), ("f", torch.randn(23, generator=generator))]


@pytest.mark.parametrize("scale", [1.0, 2.0**16])
@pytest.mark.parametrize("group", [7, 16, 64])
@pytest.mark.parametrize("counting", ["bincount", "added up"])
def test_gradients_measured_together_are_each_measured_alone(monkeypatch, scale, group, counting):
    """Gradients are measured in groups (several parameters' elements, or slices of a large one, in one flat tensor and
    one host transfer); each parameter's figures are the same as when it is measured alone. Counted as on a CUDA device
    too (`_add_up`, no read back: run here on the CPU), against bincount's figures."""
    named = _mixed_gradients()
    alone = [gradstats.grad_stats(name, grad, scale) for name, grad in named]
    # Small groups: a gradient in slices over several groups, several gradients (and slices) sharing one.
    monkeypatch.setattr(gradstats, "GROUP_ELEMENTS", group)
    if counting == "added up":
        monkeypatch.setattr(gradstats, "BINCOUNT_DEVICES", frozenset())
    together = gradstats.named_grad_stats(named, scale)
    assert together == alone
    assert alone[3].numel == 0 and alone[3].fractions == {} and sum(alone[3].hist) == 0
    assert alone[0].total == alone[0].numel == 49 and (alone[0].inf, alone[0].nan, alone[0].zeros) == (2, 1, 2)
    assert alone[5].zeros == 6 and alone[5].fractions == {}
    kinds = ("zero", "subnormal", "overflow")
    assert set(alone[0].fractions) == {f"{fmt}.{what}.{label}" for fmt in ("fp16", "bf16") for what in kinds
                                       for label in ("unscaled", "scaled")}


def test_lost_updates_of_several_parameters_in_one_read():
    before = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 1.0]), torch.tensor([5.0])]
    after = [torch.tensor([1.0, 2.5, 3.0, 4.5]), torch.tensor([1.0, 0.5]), torch.tensor([5.0])]
    grads = [torch.tensor([0.1, 0.1, 0.0, math.nan]), torch.tensor([1e-3, 1.0]), torch.tensor([0.0])]
    fractions = gradstats.lost_update_fractions(list(zip(before, after, grads, strict=True)))
    # 1st: two live elements (0.1, 0.1), the first did not move; 2nd: one of two did not move; 3rd: no live element.
    assert fractions == [0.5, 0.5, None]
    assert gradstats.lost_update_fractions([]) == []


def test_format_bands_follow_from_the_bit_layouts():
    bands = debugger.format_bands().set_index(["format", "region"])
    fp16, bf16 = LAYOUTS["fp16"], LAYOUTS["bf16"]
    assert bands.loc[("fp16", "subnormal"), "lo_log2"] == -24 == math.log2(fp16.smallest_subnormal)
    assert bands.loc[("fp16", "normal"), "lo_log2"] == -14 == math.log2(fp16.smallest_normal)
    assert bands.loc[("fp16", "normal"), "hi_value"] == fp16.max == 65504
    assert bands.loc[("fp16", "overflow"), "lo_log2"] == math.log2(65504)
    assert "65520 rounds to inf" in bands.loc[("fp16", "overflow"), "rule"]
    assert "2^-25) rounds to 0" in bands.loc[("fp16", "flush to zero"), "rule"]
    assert bands.loc[("bf16", "normal"), "lo_log2"] == -126 == math.log2(bf16.smallest_normal)
    assert bands.loc[("bf16", "subnormal"), "lo_log2"] == -133 == math.log2(bf16.smallest_subnormal)
    assert ("bf16", "overflow") not in bands.index  # near 2^128: beyond the histogram's 2^20 end
    whole = debugger.format_bands(lo=-200, hi=200).set_index(["format", "region"])
    assert whole.loc[("bf16", "overflow"), "lo_log2"] == pytest.approx(128, abs=0.01)


def test_clamped_end_bins():
    stats = gradstats.grad_stats("w", torch.tensor([2.0**-149, 2.0**30], dtype=torch.float32))
    hist = debugger.histogram_frame(stats)
    assert hist[["bin", "clamped"]].values.tolist() == [[gradstats.HIST_LO, True], [gradstats.HIST_HI, True]]
    assert "scaled" not in set(hist["series"])  # scale 1: nothing to shift
    fractions = debugger.fractions_frame(stats)
    assert list(fractions.columns) == ["format", "gradient", "becomes 0", "subnormal", "overflows to inf"]
    assert fractions["gradient"].tolist() == ["unscaled", "unscaled"]  # one row per format


# ---- 16-true with a tiny LR loses updates ---------------------------------------------------------------

def test_fp16_true_loses_updates_with_a_tiny_lr(capsys):
    config = RunConfig(workload="mlp_regression", modes=("16-true", "32-true"), steps=5, optimizer="sgd", lr=1e-5,
                       gradstats_every=1)
    run = _finished(config)
    figures = {}
    for lane, mode in enumerate(config.modes):
        per_step = [gradstats.combine([s for _, ln, st, s in run.grad_stats() if ln == lane and st == step])
                    for step in range(config.steps)]
        figures[mode] = [s.lost_update_fraction for s in per_step]
        params = {s.param: s.lost_update_fraction for _, ln, st, s in run.grad_stats() if ln == lane and st == 0}
        figures[f"{mode} step 0 by parameter"] = params
    with capsys.disabled():
        print(f"\nlost-update fraction per step, mlp_regression, SGD lr 1e-5: {json.dumps(figures, indent=1)}")
    assert min(figures["16-true"]) > 0.5
    assert max(figures["32-true"]) < 0.05
    assert all(f16 > f32 for f16, f32 in zip(figures["16-true"], figures["32-true"], strict=True))


# ---- data shaping and figures ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_run():
    config = faults.demo_config(workload="digits_mlp", modes=("16-mixed", "bf16-mixed"), kind="loss_scale",
                                  step=30, duration=2, factor=1e6, steps=90, growth_interval=20)
    run = Run(config).start()
    run.join(120)
    assert run.status == "finished"
    return run


def test_scale_timeline_and_its_figure(demo_run):
    frame, events = demo_run.frame(), _events(demo_run)
    timeline = debugger.scale_timeline(frame, 0)
    assert len(timeline) == 90 and timeline["skipped"].sum() == 2
    assert np.array_equal(timeline["log2_scale"], np.log2(timeline["scale"]))
    assert debugger.scale_timeline(frame, 1).empty  # bf16-mixed: no scale
    windows = debugger.fault_windows(demo_run.config.to_dict(), "16-mixed")
    assert windows[["start", "end"]].values.tolist() == [[30, 32]]
    spec = json.loads(debugger.scale_timeline_figure(frame, events, 0, "16-mixed", windows).to_json())
    traces = {t["name"]: t for t in spec["data"] if t.get("name")}
    assert traces["scale (16-mixed)"]["line"]["color"] == "#d62728"  # the Train page's 16-mixed colour
    assert _array(traces["skipped step"]["x"]) == [30, 31]
    assert _array(traces["scale backoff"]["x"]) == [30, 31]
    assert _array(traces["scale (16-mixed)"]["y"]) == timeline["log2_scale"].tolist()
    growth_steps = debugger.scale_changes(events, 0).query("kind == 'growth'")["step"].tolist()
    assert _array(traces["scale growth"]["x"]) == growth_steps and growth_steps
    assert {"loss lane 0 (16-mixed)", "loss lane 1 (bf16-mixed)"} <= set(traces)
    assert traces["loss lane 1 (bf16-mixed)"]["line"]["color"] == "#2ca02c"
    texts = [a["text"] for a in spec["layout"]["annotations"]]
    assert any(t.startswith("↓ 2 backoffs") for t in texts)
    assert "loss x 1e+06 for steps 30-31" in texts
    layout = spec["layout"]
    assert layout["yaxis2"]["type"] == "log" and layout["yaxis2"]["minorloglabels"] == "complete"
    assert layout["xaxis"]["matches"] == "x2" and layout["xaxis2"]["anchor"] == "y2"
    assert layout["yaxis"]["domain"][0] > layout["yaxis2"]["domain"][1]  # scale above, loss below, apart
    assert all(t.get("yaxis") == "y2" for t in spec["data"] if t.get("name", "").startswith("loss lane"))
    (fault,) = layout["shapes"]
    assert (fault["x0"], fault["x1"], fault["yref"]) == (29.5, 31.5, "paper")  # steps 30-31, across both plots
    ticks = spec["layout"]["yaxis"]["ticktext"]
    assert all(t.startswith("2^") for t in ticks)
    bf16 = json.loads(debugger.scale_timeline_figure(frame, events, 1, "bf16-mixed").to_json())
    assert any("has no GradScaler" in a["text"] for a in bf16["layout"]["annotations"])


def test_gradient_histogram_figure(demo_run):
    step = 20  # a clean sampled step (a skipped one holds NaN from the spike: nothing finite to count)
    stats = debugger.stats_for([s for _, ln, st, s in demo_run.grad_stats() if ln == 0 and st == step])
    assert stats.param == "(all)" and stats.scale > 1
    spec = json.loads(debugger.gradient_histogram_figure(stats, "16-mixed").to_json())
    bars = {t["name"]: t for t in spec["data"] if t.get("orientation") != "h"}
    unscaled = bars["|g| (unscaled)"]
    hist = debugger.histogram_frame(stats)
    assert unscaled["x"] == (hist.loc[hist["series"] == "unscaled", "x_lo"] + 0.5).tolist()
    assert sum(unscaled["y"]) == sum(stats.hist)
    scaled = bars[f"|g| x {stats.scale:g} (scaled)"]
    shift = math.log2(stats.scale)
    assert np.allclose(np.array(scaled["x"]) - shift, unscaled["x"])
    strips = [t for t in spec["data"] if t.get("orientation") == "h"]
    assert {(t["y"][0], t["name"]) for t in strips} == {
        ("fp16", "flush to zero"), ("fp16", "subnormal"), ("fp16", "normal"), ("fp16", "overflow"),
        ("bf16", "flush to zero"), ("bf16", "subnormal"), ("bf16", "normal")}
    fp16_normal = next(t for t in strips if t["y"] == ["fp16"] and t["name"] == "normal")
    assert fp16_normal["base"] == [-14] and fp16_normal["x"][0] == pytest.approx(math.log2(65504) + 14)
    layout = spec["layout"]
    assert layout["yaxis"]["type"] == "log" and layout["yaxis"]["minorloglabels"] == "complete"
    assert layout["xaxis2"]["matches"] == layout["xaxis3"]["matches"] == "x"
    assert {t["yaxis"] for t in strips} == {"y2", "y3"} and {t["yaxis"] for t in bars.values()} == {"y"}
    assert layout["yaxis2"]["domain"][1] < layout["yaxis"]["domain"][0]
    # fp16's edges: dotted lines, labels horizontal above the plot, each reaching away from its neighbour.
    edges = [a for a in layout["annotations"] if a["text"].startswith("fp16 ")]
    assert [(a["x"], a["xanchor"]) for a in edges] == [(-24, "right"), (-14, "left"), (math.log2(65504), "right")]
    assert all(a["y"] == 1 and a["yref"] == "y domain" and a["yanchor"] == "bottom" and "textangle" not in a
               for a in edges)
    assert [shape["x0"] for shape in layout["shapes"]] == [a["x"] for a in edges]
    by_param = debugger.stats_for([s for _, ln, st, s in demo_run.grad_stats() if ln == 0 and st == step], "fc2.bias")
    assert by_param.param == "fc2.bias" and by_param.numel == 10
    assert debugger.stats_for([], None) is None


def test_step_labels_and_default_lane(demo_run):
    labels = debugger.stat_step_labels([20, 30, 31, 40], demo_run.frame(), 0)
    assert labels == {20: "step 20", 30: "step 30 · skipped", 31: "step 31 · skipped", 40: "step 40"}
    assert debugger.default_stat_step([20, 30, 31, 40], demo_run.frame(), 0) == 30  # the first skipped step
    assert debugger.default_stat_step([20, 40], demo_run.frame(), 0) == 40  # none skipped: the latest
    assert debugger.default_stat_step([20, 30, 40], demo_run.frame(), 1) == 40  # bf16 skips nothing
    assert debugger.default_stat_step([], demo_run.frame(), 0) is None
    assert debugger.default_lane([LaneInfo(lane=0, mode="bf16-mixed", status="finished"),
                                  LaneInfo(lane=1, mode="16-mixed", status="finished")]) == 1
    assert debugger.default_lane([LaneInfo(lane=0, mode="32-true", status="finished")]) == 0


# ---- the demo launcher ----------------------------------------------------------------------------------

@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_param_names_match_the_real_model(workload):
    config = RunConfig(workload=workload, modes=("32-true",))
    spec = WORKLOADS[workload]
    real = [name for name, _ in spec.build_model("small", spec.load_data(config)).named_parameters()]
    assert param_names(workload) == real


def test_demo_config_builds_the_fault_and_scaler():
    config = faults.demo_config(workload="mlp_regression", modes=("16-mixed", "bf16-mixed"), kind="grad_inf",
                                  step=5, param="layer2.weight", steps=40, growth_interval=25)
    assert config.faults == (FaultSpec(kind="grad_inf", step=5, param="layer2.weight"),)
    assert config.scaler.growth_interval == 25 and config.steps == 40
    assert config.name == "demo: inf into the gradient of layer2.weight at step 5"


@pytest.mark.parametrize(("changes", "field", "match"), [
    ({"step": 300}, "faults.step", "past the run's last step"),
    ({"kind": "grad_nan", "param": "nope"}, "faults.param", "has no parameter 'nope'"),
    ({"factor": 0.0}, "faults.factor", "must be > 0"),
    ({"modes": ()}, "modes", "at least one"),
    ({"growth_interval": 0}, "scaler.growth_interval", "must be > 0"),
    ({"workload": "nope"}, "workload", "unknown workload"),
])
def test_demo_config_refuses_bad_input(changes, field, match):
    kwargs = {"workload": "digits_mlp", "modes": ("16-mixed",), "kind": "loss_scale", "step": 50, "duration": 3,
              "factor": 1e6, "steps": 300} | changes
    with pytest.raises(ConfigError, match=match) as error:
        faults.demo_config(**kwargs)
    assert error.value.field == field


def test_param_names_refuses_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        param_names("nope")


def test_stored_run_reads_back_the_same(tmp_path):
    store = open_store(tmp_path / "runs.sqlite3")
    config = RunConfig(workload="digits_mlp", modes=("16-mixed",), steps=15, gradstats_every=0,
                       faults=(FaultSpec.parse("grad_nan:fc1.bias@9"),))
    run = _finished(config, store)
    manager = RunManager(store)  # a fresh manager: everything comes from SQLite
    events = manager.events(run.run_id)
    table = debugger.skipped_steps_table(events, 0)
    assert table[["step", "parameters"]].values.tolist() == [[9, "fc1.bias (1 NaN)"]]
    assert debugger.scale_changes(events, 0)["step"].tolist() == [9]
    assert debugger.fault_windows(manager.run_info(run.run_id).config, "16-mixed")["start"].tolist() == [9]


def test_a_long_parameters_cell_gives_way_and_the_numbers_stay_whole():
    params = [{"param": f"blocks.{i}.mlp.weight", "nan": 1000 + i} for i in range(30)]
    events = pd.DataFrame([{"kind": "skipped_step", "lane": 0, "step": 20, "message": "",
                            "data": {"params": params, "scale_before": 262144.0, "scale_after": 131072.0}}])
    table = debugger.skipped_steps_table(events, 0)
    widths = tables.content_widths(table, max_px=2000)
    assert sum(widths.values()) > tables.TABLE_WIDTH_PX  # thirty parameters: wider than the page
    fitted = tables.fit_widths(widths, "parameters")
    assert sum(fitted.values()) <= tables.TABLE_WIDTH_PX
    assert {c: w for c, w in fitted.items() if c != "parameters"} == {c: w for c, w in widths.items()
                                                                      if c != "parameters"}
    short = tables.content_widths(table.assign(parameters="fc1.weight (3 NaN)"))
    assert tables.fit_widths(short, "parameters") == short  # what fits is left alone
