"""Layer numerics: real torch on CPU — ranges from real casts, the first inf/NaN, error against fp32, live lanes."""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import pytest
import torch
from stepped_run import SteppedRun
from torch import nn

from amp_core.config import ConfigError, RunConfig, ScalerConfig
from amp_core.precision import get_precision
from amp_core.probes import numerics
from amp_core.race.runner import Run
from amp_core.workloads import WORKLOADS, Data, Workload

FP16_MAX = torch.finfo(torch.float16).max


# --- test workloads with a planted overflow / underflow --------------------------------------------------------------

class Scale(nn.Module):
    """Multiplies its input by a constant: 1e5 plants an fp16 overflow, 1e-9 an fp16 underflow."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class PlantedNet(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.planted = Scale(factor)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.planted(self.fc1(x))))


class Planted(Workload):
    """A workload nobody registered: the probe takes the object itself."""

    title = "planted"
    description = "fc1 -> planted scale -> ReLU -> fc2"
    sizes = {"small": {}}

    def __init__(self, name: str, factor: float):
        self.name = name
        self.factor = factor

    def load_data(self, config) -> Data:
        generator = torch.Generator().manual_seed(1)
        return Data(torch.randn(256, 8, generator=generator) * 2, torch.randint(4, (256,), generator=generator), "")

    def build_model(self, size: str, data: Data) -> nn.Module:
        return PlantedNet(self.factor)

    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target)


OVERFLOW = Planted("planted_overflow", 1e5)
UNDERFLOW = Planted("planted_underflow", 1e-9)


def row(report: numerics.NumericsReport, module: str):
    frame = report.module_frame()
    return frame[frame["module"] == module].iloc[0]


def test_planted_overflow_is_the_first_non_finite_module_forward():
    report = numerics.probe_workload(OVERFLOW, "16-mixed")
    first = report.first_nonfinite
    assert first is not None
    assert (first.module, first.phase) == ("planted", "forward")
    assert report.first_line() == "first non-finite: planted (forward)"
    assert first.inf > 0
    # what came before it in execution order is finite, and its input (fc1's fp16 output) was finite too
    order = [m.module for m in report.modules]
    assert order.index("fc1") < order.index("planted")
    fc1 = report.modules[order.index("fc1")]
    assert fc1.output.nonfinite == 0
    assert first.inputs is not None and first.inputs.nonfinite == 0 and first.inputs.dtype == "fp16"
    assert "65504" in first.why and "fp32" in first.why
    # the fp32 reference really holds values above fp16's max there, and the share that a cast overflows is real
    planted = row(report, "planted")
    assert planted["out_ref_abs_max"] > FP16_MAX
    assert 0 < planted["out_fp16_overflow"] < 1
    assert planted["out_inf"] == first.inf


def test_planted_overflow_is_finite_in_32_true_and_bf16_mixed():
    for mode in ("32-true", "bf16-mixed"):
        report = numerics.probe_workload(OVERFLOW, mode)
        assert report.first_nonfinite is None
        assert report.first_line() == "first non-finite: none"
        assert row(report, "planted")["out_abs_max"] > FP16_MAX  # fp32 and bf16 hold it


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed", "16-mixed"])
def test_planted_underflow_is_flagged_as_flushed_to_zero_in_fp16(mode):
    report = numerics.probe_workload(UNDERFLOW, mode)
    planted = row(report, "planted")
    assert planted["out_fp16_zero"] == 1.0  # every non-zero value of the true output flushes to 0 in fp16
    assert planted["out_bf16_zero"] == 0.0  # bf16 keeps fp32's range
    for other in ("fc1", "fc2"):
        assert row(report, other)["out_fp16_zero"] < 0.01
    if mode == "16-mixed":  # and the fp16 run really flushed it: all zeros, 100% error
        assert planted["out_abs_max"] == 0.0 and planted["output_error"] == 1.0
    else:
        assert 0 < planted["out_abs_max"] < 1e-7


def test_a_registered_workload_is_probed_by_name(monkeypatch):
    monkeypatch.setitem(WORKLOADS, OVERFLOW.name, OVERFLOW)
    report = numerics.probe_workload(OVERFLOW.name, "16-mixed")
    assert report.first_line() == "first non-finite: planted (forward)"
    assert report.label == "planted_overflow · 16-mixed"


# --- error against fp32 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workload", ["digits_mlp", "tiny_transformer"])
def test_32_true_against_32_true_is_exactly_zero_everywhere(workload):
    report = numerics.probe_workload(workload, "32-true", batch_size=16)
    assert report.modules and report.params
    assert all(m.output_error == 0.0 for m in report.modules if m.output is not None)
    assert all(p.error == 0.0 for p in report.params)
    assert report.loss == report.reference_loss


def test_bf16_mixed_on_digits_mlp_has_error_in_every_layer():
    report = numerics.probe_workload("digits_mlp", "bf16-mixed")
    errors = report.error_frame()
    assert set(errors["module"]) == {"fc1", "fc2", "(root)", "(loss)"}
    assert (errors["output_error"] > 0).all() and errors["output_error"].map(math.isfinite).all()
    assert list(errors["output_error"]) == sorted(errors["output_error"], reverse=True)  # ranked, worst first
    params = report.param_frame()
    assert set(params["param"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert (params["grad_error"] > 0).all()
    assert row(report, "fc1")["dtype"] == "bf16"


def test_error_of_an_output_is_the_relative_norm_of_the_difference():
    model = PlantedNet(1.0)
    batch = (torch.randn(16, 8), torch.randint(4, (16,)))
    report = numerics.probe_step(model, get_precision("bf16-mixed"), nn.functional.cross_entropy, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model.fc1(batch[0])
    reference = model.fc1(batch[0])
    expected = (torch.linalg.vector_norm(low.double() - reference.double())
                / torch.linalg.vector_norm(reference.double())).item()
    assert row(report, "fc1")["output_error"] == pytest.approx(expected, rel=1e-12)


# --- ranges: each figure against an independent measurement ----------------------------------------------------------

def hooked_abs_max(model: nn.Module, precision, loss, batch, scale: float | None):
    """Abs max of every module's output, input and output gradient, measured with plain hooks on a copy."""
    model = precision.prepare_module(copy.deepcopy(model))
    seen: dict[str, dict[str, float]] = {}
    names = {module: name or numerics.ROOT for name, module in model.named_modules()}

    def largest(tensors) -> float:
        values = [t.detach().abs().max().item() for t in tensors if t.is_floating_point() and t.numel()]
        return max(values) if values else math.nan

    def hook(module, args, output):
        name = names[module]
        seen[name] = {"out": largest([output]), "in": largest(list(args))}
        output.register_hook(lambda grad: seen[name].__setitem__("grad", largest([grad])))

    for module in names:
        module.register_forward_hook(hook)
    inputs, target = (precision.prepare_input(t) for t in batch)
    with precision.forward_context():
        value = loss(model(inputs), target)
    (value * scale if scale else value).backward()
    return seen


@pytest.mark.parametrize(("workload", "mode"), [("digits_mlp", "bf16-mixed"), ("digits_mlp", "16-mixed"),
                                                ("tiny_transformer", "16-mixed"), ("checkerboard_cnn", "32-true")])
def test_each_modules_abs_max_equals_a_plain_hook_measurement(workload, mode):
    spec = WORKLOADS[workload]
    data = spec.load_data(RunConfig(workload=workload))
    torch.manual_seed(0)
    model = spec.build_model("small", data)
    batch = data.sample(torch.Generator().manual_seed(0), 8)
    precision = get_precision(mode)
    report = numerics.probe_step(model, precision, spec.loss, batch)
    expected = hooked_abs_max(model, precision, spec.loss, batch, report.scale)
    measured = {m.module: m for m in report.modules if m.module != numerics.LOSS}
    assert set(measured) == set(expected)
    for name, figures in expected.items():
        m = measured[name]
        assert m.output.abs_max == figures["out"], name
        if not math.isnan(figures["in"]):
            assert m.input.abs_max == figures["in"], name
        assert m.grad.abs_max == figures["grad"], name


def independent_figures(values: torch.Tensor, factor: float = 1.0) -> dict:
    """The same figures by plain boolean comparisons on real casts (the probe reads bits instead)."""
    magnitude = values.float().abs()
    finite_nonzero = torch.isfinite(magnitude) & (magnitude != 0)
    kept = magnitude[finite_nonzero] * factor
    half, brain = kept.to(torch.float16), kept.to(torch.bfloat16)
    return {"numel": values.numel(), "zeros": int((magnitude == 0).sum()), "nonzero": int(finite_nonzero.sum()),
            "inf": int(torch.isinf(magnitude).sum()), "nan": int(torch.isnan(magnitude).sum()),
            "abs_max": magnitude[torch.isfinite(magnitude)].max().item() if torch.isfinite(magnitude).any() else 0.0,
            "min_nonzero": magnitude[finite_nonzero].min().item() if finite_nonzero.any() else math.nan,
            "fp16_inf": int(torch.isinf(half).sum()),
            "fp16_subnormal": int(((half != 0) & (half < torch.finfo(torch.float16).tiny)).sum()),
            "fp16_zero": int((half == 0).sum()), "bf16_zero": int((brain == 0).sum())}


EDGES = [0.0, -0.0, 1e-13, 1e-11, 1e-9, 2.0**-25, 2.0**-25 * 1.0001, 1e-6, 2.0**-14, 65504.0, 65519.0, 65520.0,
         7e4, 3e38, 1e-40, 1e-44, float("inf"), -float("inf"), float("nan"), -3.0, 1.0]
"""Around fp16's and bf16's edges: 2^-25 rounds to 0 (a tie, to even), just above it to the smallest subnormal;
65519 rounds to 65504, 65520 to inf; 1e-40 and 1e-44 are fp32 subnormals, the second below bf16's smallest."""


@pytest.mark.parametrize("factor", [1.0, 65536.0, 1000.0])
def test_figures_match_plain_casts_at_the_format_edges(factor):
    values = torch.tensor(EDGES)
    [figures] = numerics._figures([values], factor)
    expected = independent_figures(values, factor)
    assert {k: figures[k] for k in expected} == pytest.approx(expected, nan_ok=True)
    # the edges reach every class (1e-44 flushes in bf16 only unscaled)
    assert expected["fp16_inf"] and expected["fp16_zero"] and expected["fp16_subnormal"] and expected["nan"]
    assert expected["bf16_zero"] >= (factor == 1.0)


def test_figures_of_many_tensors_across_chunks_and_dtypes():
    generator = torch.Generator().manual_seed(3)
    tensors = [torch.randn(300_000, generator=generator) * 1e4,  # several chunks
               (torch.randn(64, 33, generator=generator) * 1e-5).to(torch.float16),
               torch.randn(1000, generator=generator).to(torch.bfloat16), torch.zeros(10), torch.empty(0)]
    tensors[0][[0, 65535, 65536, 299_999]] = torch.tensor([float("nan"), float("inf"), 0.0, 1e-30])
    for factor in (1.0, 1024.0):
        measured = numerics._figures(tensors, factor)
        for tensor, figures in zip(tensors[:-1], measured, strict=False):
            expected = independent_figures(tensor, factor)
            assert {k: figures[k] for k in expected} == pytest.approx(expected, nan_ok=True)
        assert measured[-1]["numel"] == 0 and math.isnan(measured[-1]["min_nonzero"])


def test_tensor_range_dynamic_range_and_description():
    [figures] = numerics._figures([torch.tensor([0.25, 4.0, 0.0])], 1.0)
    measured = numerics._combine([figures], ["fp32"], 1.0)
    assert measured.dynamic_range_log2 == 4.0 and measured.zeros == 1
    assert "4 binades" in measured.describe().replace("4.0", "4")


def test_an_output_changed_in_place_later_keeps_the_values_it_produced():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    batch = (torch.randn(32, 4), torch.randn(32, 2))
    report = numerics.probe_step(model, get_precision("32-true"), nn.functional.mse_loss, batch)
    linear = report.modules[0]
    assert linear.module == "0"
    assert linear.output.abs_max == model[0](batch[0]).abs().max().item()
    assert report.modules[1].output.zeros > 0 and linear.output.zeros == 0  # ReLU's zeros are not the Linear's


# --- copies only ------------------------------------------------------------------------------------------------------

def bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def state_bits(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> dict:
    params = {name: (bits(p), None if p.grad is None else bits(p.grad)) for name, p in model.named_parameters()}
    buffers = {name: bits(b) for name, b in model.named_buffers()}
    optim = {(i, k): bits(v) if isinstance(v, torch.Tensor) else v
             for i, state in optimizer.state_dict()["state"].items() for k, v in state.items()}
    return {"params": params, "buffers": buffers, "optimizer": optim, "scaler": scaler.state_dict()}


def test_probe_step_leaves_the_callers_model_and_buffers_bit_identical_and_hook_free():
    spec = WORKLOADS["checkerboard_cnn"]  # BatchNorm: a forward updates running statistics
    data = spec.load_data(RunConfig(workload="checkerboard_cnn"))
    precision = get_precision("16-mixed")
    model = spec.build_model("small", data)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = precision.make_scaler(init_scale=1024.0)
    batch = data.sample(torch.Generator().manual_seed(0), 4)
    with precision.forward_context():
        loss = spec.loss(model(batch[0]), batch[1])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    before = state_bits(model, optimizer, scaler)
    rng = torch.get_rng_state()
    numerics.probe_step(model, precision, spec.loss, batch)
    assert state_bits(model, optimizer, scaler) == before
    assert torch.equal(torch.get_rng_state(), rng)
    for module in model.modules():
        assert not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def paused_run(modes: tuple[str, ...], **settings) -> Run:
    """A real run parked by itself after 3 steps of each lane: no lane step under way, however slow the machine."""
    run = SteppedRun(RunConfig(workload="digits_mlp", modes=modes, steps=100_000, batch_size=16, device="cpu",
                               gradstats_every=0, **settings), pause_after={3 * len(modes)}).start()
    run.wait_until(lambda r: r.parked())
    return run


def test_probing_a_live_lane_leaves_it_bit_identical(no_leaked_threads):
    run = paused_run(("32-true", "16-mixed"), scaler=ScalerConfig(init_scale=1024.0))
    try:
        states = [lane.state for lane in run.lanes]
        before = [state_bits(s.model, s.optimizer, s.scaler) for s in states]
        reports = [numerics.probe_lane(run, lane.index) for lane in run.lanes]
        after = [state_bits(s.model, s.optimizer, s.scaler) for s in states]
        scale = states[1].scaler.get_scale()
    finally:
        run.stop()
    assert after == before
    assert reports[0].scale is None and reports[1].scale == scale == 1024.0  # the lane's own, not a fresh one's
    assert "lane 1" in reports[1].label and "16-mixed" in reports[1].label
    assert all(m.output_error == 0.0 for m in reports[0].modules)


def test_probing_a_running_lane_does_not_disturb_it(no_leaked_threads):
    run = Run(RunConfig(workload="digits_mlp", modes=("bf16-mixed",), steps=100_000, batch_size=16, device="cpu",
                        gradstats_every=0)).start()
    try:
        wait_for(lambda: run.lanes[0].steps_done >= 2)
        reports = [numerics.probe_lane(run, 0) for _ in range(5)]  # while the thread keeps training
        steps = run.lanes[0].steps_done
        wait_for(lambda: run.lanes[0].steps_done > steps)
        model = run.lanes[0].state.model
        assert all(not m._forward_hooks for m in model.modules())
    finally:
        run.stop()
    assert run.lanes[0].status != "failed"
    assert all([m.module for m in r.modules] == ["fc1", "fc2", "(root)", "(loss)"] for r in reports)


def test_probe_refuses_bad_input_naming_the_field():
    with pytest.raises(ConfigError, match=r"^workload: unknown workload 'nope'"):
        numerics.probe_workload("nope", "32-true")
    with pytest.raises(ConfigError, match=r"^mode: unknown mode 'fp8'"):
        numerics.probe_workload("digits_mlp", "fp8")
    with pytest.raises(ConfigError, match=r"^mode: tf32 cannot run"):
        numerics.probe_workload("digits_mlp", "tf32", device="cpu")
    with pytest.raises(ConfigError, match=r"^size: "):
        numerics.probe_workload("digits_mlp", "32-true", size="huge")
    with pytest.raises(ConfigError, match=r"^size: planted_overflow has sizes small"):
        numerics.probe_workload(OVERFLOW, "32-true", size="large")
    with pytest.raises(ConfigError, match=r"^batch_size: "):
        numerics.probe_workload("digits_mlp", "32-true", batch_size=0)


# --- sampled amax over a run ----------------------------------------------------------------------------------------

def test_sampled_amax_equals_a_plain_hook_measurement():
    spec = WORKLOADS["tiny_transformer"]
    data = spec.load_data(RunConfig(workload="tiny_transformer"))
    torch.manual_seed(0)
    model = spec.build_model("small", data)
    batch = data.sample(torch.Generator().manual_seed(0), 4)
    precision = get_precision("16-mixed")
    sample = numerics.sample_layer_amax(model, precision, spec.loss, batch, 1024.0)
    expected = hooked_abs_max(model, precision, spec.loss, batch, 1024.0)
    by_module = dict(zip(sample.modules, zip(sample.output_amax, sample.grad_amax, strict=True), strict=True))
    for name, figures in expected.items():
        assert by_module[name] == (figures["out"], figures["grad"]), name
    assert sample.scale == 1024.0 and sample.modules[-1] == numerics.LOSS
    assert all(not m._forward_hooks for m in model.modules())


def test_a_sampler_follows_the_models_weights_as_they_train():
    spec = WORKLOADS["checkerboard_cnn"]  # BatchNorm: buffers the shadow must follow too
    data = spec.load_data(RunConfig(workload="checkerboard_cnn"))
    model = spec.build_model("small", data)
    precision = get_precision("32-true")
    sampler = numerics.LayerAmaxSampler(model, precision, spec.loss)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(3):
        batch = data.sample(generator, 4)
        optimizer.zero_grad()
        spec.loss(model(batch[0]), batch[1]).backward()
        optimizer.step()
        samples.append(sampler.sample(batch))
        assert samples[-1] == numerics.sample_layer_amax(model, precision, spec.loss, batch)  # a fresh copy's
    assert samples[0].output_amax != samples[-1].output_amax
    assert all(not m._forward_hooks for m in model.modules())


def test_amax_sampling_changes_nothing_the_run_measures(no_leaked_threads):
    # Both runs on one intra-op thread: the same kernels, the same sums.
    base = RunConfig(workload="digits_mlp", modes=("32-true", "16-mixed"), steps=30, batch_size=16, device="cpu",
                     gradstats_every=0, intra_op_threads=1)
    plain = Run(base).start()
    plain.join()
    sampled = Run(RunConfig.from_dict({**base.to_dict(), "amax_every": 7})).start()
    sampled.join()
    assert list(sampled.frame()["loss"]) == list(plain.frame()["loss"])
    # grad_norm is NaN on the steps that do not measure it, the same steps in both runs
    np.testing.assert_array_equal(sampled.frame()["grad_norm"].to_numpy(), plain.frame()["grad_norm"].to_numpy())
    events = [e for e in sampled.events() if e.kind == numerics.LAYER_AMAX_EVENT]
    assert sorted((e.lane, e.step) for e in events) == [(lane, step) for lane in (0, 1) for step in (0, 7, 14, 21, 28)]
    assert not [e for e in plain.events() if e.kind == numerics.LAYER_AMAX_EVENT]
    first = events[0].data
    assert first["modules"] == ["fc1", "fc2", "(root)", "(loss)"]
    assert all(v > 0 for v in first["output_amax"]) and first["sample_ms"] > 0
    scaled = next(e for e in events if e.lane == 1)
    assert scaled.data["scale"] == 2.0**16 and scaled.data["grad_amax"][-1] == 2.0**16


def test_amax_every_is_off_by_default_and_refuses_negative():
    assert RunConfig().amax_every == 0
    with pytest.raises(ConfigError, match=r"^amax_every: must be a whole number"):
        RunConfig(amax_every=-1)


# --- on a GPU (the lead runs these on one) ---------------------------------------------------------------------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
@pytest.mark.parametrize("factor", [1.0, 65536.0])
def test_figures_on_cuda_match_plain_casts(factor):
    values = torch.tensor(EDGES * 1000, device="cuda")
    [figures] = numerics._figures([values], factor)
    expected = independent_figures(values.cpu(), factor)
    assert {k: figures[k] for k in expected} == pytest.approx(expected, nan_ok=True)


@CUDA
def test_probe_on_cuda_finds_the_planted_overflow_and_matches_plain_hooks():
    report = numerics.probe_workload(OVERFLOW, "16-mixed", device="cuda")
    assert report.device == "cuda" and report.first_line() == "first non-finite: planted (forward)"
    spec = WORKLOADS["digits_mlp"]
    data = spec.load_data(RunConfig(workload="digits_mlp"))
    model = spec.build_model("small", data)
    batch = data.sample(torch.Generator().manual_seed(0), 32)
    precision = get_precision("bf16-mixed", "cuda")
    report = numerics.probe_step(model, precision, spec.loss, batch)
    expected = hooked_abs_max(model, precision, spec.loss, batch, None)
    for m in report.modules:
        if m.module != numerics.LOSS:
            assert (m.output.abs_max, m.grad.abs_max) == (expected[m.module]["out"], expected[m.module]["grad"])
    assert all(m.output_error > 0 for m in report.modules)


@CUDA
def test_amax_sampling_on_cuda(no_leaked_threads):
    run = Run(RunConfig(workload="digits_mlp", modes=("16-mixed",), steps=12, device="cuda", amax_every=5)).start()
    run.join(120)
    events = [e for e in run.events() if e.kind == numerics.LAYER_AMAX_EVENT]
    assert [e.step for e in events] == [0, 5, 10]
    assert events[0].data["scale"] == 2.0**16 and all(v > 0 for v in events[0].data["output_amax"])
