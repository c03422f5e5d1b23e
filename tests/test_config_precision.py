"""RunConfig validation and the precision modes, on this CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from amp_core.config import ConfigError, FaultSpec, RunConfig, ScalerConfig
from amp_core.precision import (
    CPU_NATIVE_ENV,
    MODES,
    availability,
    cpu_line,
    default_modes,
    get_precision,
    is_mixed,
    low_precision_dtype,
    mode_from_dtypes,
    parse_modes,
)
from amp_core.precision.switches import lane_step_switches
from amp_core.race.runner import RunManager
from amp_core.workloads import check_launch

ROOT = Path(__file__).resolve().parents[1]
CPU_MODES = [m for m in MODES if availability(m, "cpu")[0]]


@pytest.mark.parametrize(("changes", "field"), [
    ({"workload": ""}, "workload"),
    ({"modes": ()}, "modes"),
    ({"modes": ("32-true", "32-true")}, "modes"),
    ({"modes": ("fp8",)}, "modes"),
    ({"steps": 0}, "steps"),
    ({"steps": 2.5}, "steps"),
    ({"batch_size": -1}, "batch_size"),
    ({"lr": 0.0}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"eps": 0.0}, "eps"),
    ({"optimizer": "lamb"}, "optimizer"),
    ({"scheduler": "cosine"}, "scheduler"),
    ({"size": "huge"}, "size"),
    ({"device": "tpu"}, "device"),
    ({"seed": -3}, "seed"),
    ({"grad_clip": -1.0}, "grad_clip"),
    ({"memory_every": 0}, "memory_every"),
    ({"gradstats_every": -1}, "gradstats_every"),
])
def test_every_invalid_field_is_refused_with_its_name(changes, field):
    with pytest.raises(ConfigError, match=f"^{field}: ") as info:
        RunConfig(**changes)
    assert info.value.field == field


@pytest.mark.parametrize(("changes", "field"), [
    ({"workload": "resnet9000"}, "workload"),
    ({"data_dir": "/nonexistent/mnist"}, "data_dir"),
    ({"workload": "mlp_regression", "data_dir": "/tmp"}, "data_dir"),
    ({"modes": ("32-true", "tf32"), "device": "cpu"}, "modes"),
])
def test_what_depends_on_this_process_is_refused_at_launch(changes, field):
    config = RunConfig(**changes)  # construction is pure: it asks neither the registry, the disk nor the device
    with pytest.raises(ConfigError, match=f"^{field}: ") as info:
        check_launch(config)
    assert info.value.field == field
    manager = RunManager(None)
    with pytest.raises(ConfigError, match=f"^{field}: "):
        manager.launch(config)
    assert manager.runs() == [], "a refused launch leaves no run behind"


@pytest.mark.parametrize(("changes", "field"), [
    ({"init_scale": 0.0}, "scaler.init_scale"),
    ({"growth_factor": 1.0}, "scaler.growth_factor"),
    ({"backoff_factor": 1.5}, "scaler.backoff_factor"),
    ({"growth_interval": 0}, "scaler.growth_interval"),
])
def test_scaler_settings_are_checked(changes, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        ScalerConfig(**changes)


def test_tf32_is_refused_on_cpu_with_the_reason():
    ok, reason = availability("tf32", "cpu")
    assert not ok and "compute capability" in reason
    with pytest.raises(ConfigError, match="modes: tf32 cannot run on this device: TF32"):
        check_launch(RunConfig(modes=("32-true", "tf32"), device="cpu"))
    with pytest.raises(ValueError, match="cannot run on cpu"):
        get_precision("tf32", "cpu")


def test_cuda_modes_are_refused_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert availability("32-true", "cuda") == (False, "no CUDA device on this machine")


def test_config_round_trips_through_a_dict():
    config = RunConfig(workload="mlp_regression", modes=("32-true", "16-mixed"), steps=7, scheduler="onecycle",
                       scaler=ScalerConfig(init_scale=1024.0, growth_interval=10),
                       faults=(FaultSpec.parse("loss_scale:1e6@3+2"),
                               FaultSpec(kind="grad_inf", step=4, modes=("16-mixed",))))
    assert RunConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match=r"^colour: unknown setting"):
        RunConfig.from_dict({**config.to_dict(), "colour": "red"})


@pytest.mark.parametrize(("text", "expected"), [
    ("loss_scale:1e6@50+10", FaultSpec(kind="loss_scale", factor=1e6, step=50, duration=10)),
    ("grad_inf:fc1.weight@30", FaultSpec(kind="grad_inf", param="fc1.weight", step=30)),
    ("grad_nan@7", FaultSpec(kind="grad_nan", step=7)),
    ("lr_scale:10@100+20", FaultSpec(kind="lr_scale", factor=10.0, step=100, duration=20)),
    ("init_scale:1024", FaultSpec(kind="init_scale", factor=1024.0)),
])
def test_fault_text_form(text, expected):
    assert FaultSpec.parse(text) == expected


@pytest.mark.parametrize(("text", "match"), [("explode@3", "faults.kind"), ("loss_scale:abc@3", "faults.factor"),
                                             ("loss_scale:2@x", "faults: cannot read")])
def test_bad_fault_text_names_the_problem(text, match):
    with pytest.raises(ConfigError, match=match):
        FaultSpec.parse(text)


@pytest.mark.parametrize("mode", CPU_MODES)
def test_each_mode_computes_in_its_dtype(mode):
    precision = get_precision(mode, "cpu")
    layer = precision.prepare_module(torch.nn.Linear(4, 4))
    assert layer.weight.dtype == precision.param_dtype
    with precision.forward_context():
        out = layer(precision.prepare_input(torch.randn(2, 4)))
    assert out.dtype == (precision.autocast_dtype or precision.param_dtype)
    scaler = precision.make_scaler()
    assert scaler.is_enabled() == (mode == "16-mixed")


def test_default_modes_pair_fp32_with_a_mixed_mode():
    modes = default_modes("cpu")
    assert modes[0] == "32-true" and modes[1] in ("bf16-mixed", "16-mixed")


@pytest.mark.parametrize(("text", "modes"), [
    ("32-true,bf16-mixed", ("32-true", "bf16-mixed")),
    (" 32-true , 16-mixed ,, ", ("32-true", "16-mixed")),
    ("", ()),
])
def test_mode_strings_parse_in_one_place(text, modes):
    assert parse_modes(text) == modes


@pytest.mark.parametrize("mode", [mode for mode in MODES if mode != "tf32"])
def test_a_mode_is_read_back_from_the_dtypes_it_trains_with(mode):
    """What a Monitor sees of a user's loop (autocast dtype, parameter dtype) names the mode it was built from."""
    precision = get_precision(mode, "cpu")
    assert mode_from_dtypes(precision.autocast_dtype, precision.param_dtype, "cpu") == mode
    assert is_mixed(mode) == (precision.autocast_dtype is not None)
    sixteen = precision.autocast_dtype or precision.param_dtype
    assert low_precision_dtype(mode) == (None if sixteen == torch.float32 else sixteen)


def test_tf32_is_read_back_where_tf32_matmuls_are_on_and_only_on_cuda():
    with lane_step_switches(True):  # TF32 flags on, as a user's `torch.backends.cuda.matmul` setting would be
        assert mode_from_dtypes(None, torch.float32, "cuda") == "tf32"
        assert mode_from_dtypes(None, torch.float32, "cpu") == "32-true"
    with lane_step_switches(False):
        assert mode_from_dtypes(None, torch.float32, "cuda") == "32-true"


def test_the_ci_log_starts_with_this_cpu_in_one_line(monkeypatch):
    """.ci/run prints, before anything else, the CPU and what torch sees of it, so a red run can be read."""
    monkeypatch.delenv(CPU_NATIVE_ENV, raising=False)
    line = cpu_line()
    capabilities = torch.cpu.get_capabilities()
    assert "\n" not in line and line.startswith(f"CPU: {capabilities['cpu_name']} · ")
    assert f"kernels for {torch.backends.cpu.get_cpu_capability()}" in line
    assert all(flag in line.split(" sees ")[1] for flag in ("avx2", "avx512_bf16", "amx_bf16") if capabilities[flag])
    assert line.endswith("(detected)")
    script = (ROOT / ".ci" / "run").read_text()
    assert script.index("cpu_line()") < min(script.index("apt-get"), script.index("pytest"))
