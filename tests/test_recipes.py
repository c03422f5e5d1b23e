"""Precision recipes (MODE[+OPTION...]): parsing, refusals, every option training through the runner and the CLI with
real torchao, FP8 matmuls in the op trace, optimizer-state bytes read from the states' own tensors."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from amp_core.config import ConfigError, RunConfig
from amp_core.formats.recipes import BLOCK_SCALED_OPTIONS
from amp_core.precision import RECIPE_OPTIONS, availability, get_precision, parse_recipe, recipe_mode, uses_scaler
from amp_core.precision.switches import onednn_off
from amp_core.probes.memory import held_bytes, plain_tensors
from amp_core.probes.optrace import trace_workload
from amp_core.race.runner import Run
from amp_core.workloads import WORKLOADS, check_launch
from tests.cli_process import ROOT

EVERY_OPTION = ("bf16-mixed+fp8-tensorwise", "bf16-mixed+fp8-rowwise", "bf16-mixed+fp8-rowwise-gw-hp",
                "32-true+adamw-8bit", "32-true+adamw-4bit", "32-true+adamw-fp8", "32-true+states-bf16", "bf16-true+sr")


FSDP_OPTIONS = ("reduce-bf16", "reduce-fp32")
"""Options of a model sharded with FSDP2: raced under torchrun in test_fsdp.py."""
COMPILE_OPTIONS = ("compile", "compile-max-autotune", "compile-reduce-overhead")
"""Compiled lanes: raced with real inductor in test_compiled.py (reduce-overhead is CUDA graphs: refused on a CPU)."""
BLOCK_SCALED = tuple(option.name for option in BLOCK_SCALED_OPTIONS)
"""MXFP8, NVFP4 and blockwise FP8 lanes: raced in test_block_formats.py."""


def test_every_option_is_raced_by_the_test():
    raced = {recipe.split("+")[1] for recipe in EVERY_OPTION} | set(FSDP_OPTIONS) | set(COMPILE_OPTIONS)
    assert raced | set(BLOCK_SCALED) == set(RECIPE_OPTIONS)
    assert {name for name, option in RECIPE_OPTIONS.items() if option.fsdp_only} == set(FSDP_OPTIONS)


@pytest.mark.extra("recipes")
def test_a_recipe_parses_into_its_mode_and_option_objects():
    mode, options = parse_recipe("bf16-mixed+fp8-rowwise")
    assert mode == "bf16-mixed" and [o.name for o in options] == ["fp8-rowwise"]
    precision = get_precision("32-true+adamw-8bit", "cpu")
    assert precision.mode == "32-true" and precision.recipe == "32-true+adamw-8bit"
    assert recipe_mode("bf16-true+sr") == "bf16-true" and not uses_scaler("32-true+adamw-8bit")
    assert uses_scaler("16-mixed+adamw-8bit")


@pytest.mark.parametrize(("recipe", "why"), [
    ("bf16-mixed+fp8-bogus", r"unknown recipe option 'fp8-bogus'"),
    ("fp9-mixed+sr", r"unknown mode 'fp9-mixed'"),
    ("32-true+fp8-rowwise", r"runs on top of bf16-mixed"),
    ("bf16-mixed+sr", r"use it with bf16-true"),
    ("bf16-mixed+fp8-rowwise+fp8-tensorwise", r"2 matmul-format options"),
    ("32-true+adamw-8bit+adamw-4bit", r"2 optimizer-state options"),
    ("bf16-true+states-bf16", r"already keeps Adam's states in bf16"),
    ("32-true+", r"unknown recipe option ''"),
    ("32-true+compile+compile-max-autotune", r"2 compile options"),
])
def test_a_bad_recipe_is_refused_in_one_line_naming_why(recipe, why):
    with pytest.raises(ConfigError, match=why) as caught:
        RunConfig(modes=("32-true", recipe))
    assert caught.value.field == "modes" and "\n" not in str(caught.value)


def test_stored_configs_keep_the_recipe_in_full():
    config = RunConfig(modes=("32-true", "bf16-mixed+fp8-rowwise", "bf16-true+sr"))
    assert RunConfig.from_dict(config.to_dict()).modes == config.modes
    assert config.to_dict()["modes"] == ["32-true", "bf16-mixed+fp8-rowwise", "bf16-true+sr"]


@pytest.mark.extra("recipes")
def test_the_optimizer_a_recipe_needs_is_checked_at_launch():
    with pytest.raises(ConfigError, match=r"optimizer=sgd has no such state") as caught:
        check_launch(RunConfig(modes=("32-true+adamw-8bit",), optimizer="sgd", device="cpu"))
    assert caught.value.field == "optimizer"
    with pytest.raises(ConfigError, match=r"turn fused_optimizer off"):
        check_launch(RunConfig(modes=("bf16-true+sr",), fused_optimizer=True, device="cpu"))


@pytest.mark.extra("recipes")
def test_fp8_on_a_cpu_says_it_is_emulated():
    ok, note = availability("bf16-mixed+fp8-rowwise", "cpu")
    assert ok and "Emulated here: real float8 matmuls" in note and "no speed-up" in note


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_a_recipe_the_device_cannot_run_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"bf16-mixed\+fp8-rowwise cannot run on this device: no CUDA device"):
        check_launch(RunConfig(modes=("bf16-mixed+fp8-rowwise",), device="cuda"))


@pytest.mark.extra("recipes")
def test_fp8_on_cuda_follows_the_compute_capability():
    if not torch.cuda.is_available():  # skipped here, not by a skipif mark: a missing extra is said first
        pytest.skip("needs CUDA")
    ok, why = availability("bf16-mixed+fp8-rowwise", "cuda")
    assert ok == (torch.cuda.get_device_capability() >= (8, 9)), why


@pytest.mark.timeout(1500)  # a hang guard: torchao compiles its optimizer steps (minutes on a busy CPU)
@pytest.mark.extra("recipes")
def test_every_option_trains_through_the_runner():
    config = RunConfig(workload="tiny_transformer", modes=("32-true", *EVERY_OPTION), steps=3, batch_size=8,
                       optimizer="adamw", device="cpu", memory_every=1, gradstats_every=0)
    run = Run(config).start()
    run.join()
    assert run.status == "finished", [(lane.mode, lane.error) for lane in run.lanes]
    frame = run.frame()
    last = frame.groupby("mode").last()
    assert set(last.index) == {"32-true", *EVERY_OPTION}
    assert (frame.groupby("mode").size() == 3).all()
    assert torch.isfinite(torch.tensor(last["loss"].to_numpy())).all()
    fp32_states = last.loc["32-true", "optim_bytes"]
    # Bytes read from the states' own tensors (codes and scales), not from their apparent dtype.
    assert last.loc["32-true+adamw-8bit", "optim_bytes"] < 0.35 * fp32_states
    assert last.loc["32-true+adamw-4bit", "optim_bytes"] < last.loc["32-true+adamw-8bit", "optim_bytes"]
    assert last.loc["32-true+states-bf16", "optim_bytes"] < 0.51 * fp32_states
    started = next(e for e in run.events() if e.kind == "started")
    report = started.data["recipes"]["bf16-mixed+fp8-rowwise"]
    assert "blocks.0.qkv" in report["fp8_layers"] and report["fp8_skipped"] == {}
    assert "Linear layers in FP8" in started.message


@pytest.mark.extra("recipes")
def test_the_fp8_filter_names_the_misshaped_layers_it_skips():
    precision = get_precision("bf16-mixed+fp8-tensorwise", "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    converted, skipped = precision.float8.plan(model, "cpu")
    assert converted == ["0"] and "not a multiple of 16" in skipped["2"]
    prepared = precision.prepare_module(model)
    assert type(prepared[0]).__name__ == "Float8Linear" and type(prepared[2]) is torch.nn.Linear


@pytest.mark.extra("recipes")
def test_low_bit_state_bytes_are_the_codes_and_scales_torchao_holds():
    model = torch.nn.Linear(256, 64, bias=False)
    optimizer = get_precision("32-true+adamw-8bit").build_optimizer(model.parameters(), "adamw", lr=1e-3, eps=1e-8)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    state = optimizer.state[model.weight]
    inner = [t for name in ("exp_avg", "exp_avg_sq") for t in plain_tensors(state[name])]
    assert {t.dtype for t in inner} >= {torch.uint8, torch.float32}  # codes, scales (and the shared lookup table)
    codes = 2 * model.weight.numel()  # one byte per value per moment
    scales = 2 * 4 * model.weight.numel() // 256
    _, _, optim = held_bytes(list(model.parameters()), optimizer)
    assert codes + scales < optim <= codes + scales + 256 * 4 * 2 + 4  # + lookup tables (256 fp32) and the step
    assert optim < 0.3 * 2 * 4 * model.weight.numel()


@pytest.mark.extra("recipes")
def test_bf16_states_are_bf16_and_sr_keeps_bf16_weights():
    model = torch.nn.Linear(64, 64)
    optimizer = get_precision("32-true+states-bf16").build_optimizer(model.parameters(), "adam", lr=1e-3, eps=1e-8)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    assert optimizer.state[model.weight]["exp_avg"].dtype == torch.bfloat16
    assert optimizer.param_groups[0]["weight_decay"] == 0.0  # Adam: a race differs only by the recipe
    precision = get_precision("bf16-true+sr")
    model = precision.prepare_module(torch.nn.Linear(64, 64))
    optimizer = precision.build_optimizer(model.parameters(), "adamw", lr=1e-3, eps=1e-8)
    assert optimizer.bf16_stochastic_round and model.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(("recipe", "gradient_format"), [("bf16-mixed+fp8-tensorwise", "float8_e5m2"),
                                                        ("bf16-mixed+fp8-rowwise", "float8_e4m3fn")])
@pytest.mark.extra("recipes")
def test_the_op_trace_of_an_fp8_lane_shows_float8_matmuls(recipe, gradient_format):
    frame = trace_workload("tiny_transformer", recipe, device="cpu").to_frame()
    scaled = frame[frame["op"] == "_scaled_mm"]
    linears = sum(type(m) is torch.nn.Linear for m in WORKLOADS["tiny_transformer"].build_model(
        "small", WORKLOADS["tiny_transformer"].load_data(RunConfig(workload="tiny_transformer"))).modules())
    assert len(scaled) == 3 * linears  # output, grad-input and grad-weight matmul of every Linear
    forward = scaled[scaled["phase"] == "forward"]["in_dtypes"]
    backward = scaled[scaled["phase"] == "backward"]["in_dtypes"]
    assert forward.str.startswith("float8_e4m3fn, float8_e4m3fn, fp32, fp32").all()  # operands and their scales
    assert backward.str.contains(gradient_format).all()  # torchao: e5m2 gradients tensorwise, e4m3 rowwise
    casts = frame[frame["is_cast"] & frame["out_dtypes"].str.startswith("float8")]
    assert len(casts) >= len(scaled)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_float8_matmuls_with_onednn_off_are_the_same_products(rowwise):
    """An FP8 lane's steps may run with oneDNN off (Precision.cpu_context) so that ATen emulates its float8 matmuls
    instead of oneDNN's reference kernel: the products are the same, bit for bit, whichever kernel this CPU gives."""
    generator = torch.Generator().manual_seed(3)
    a = (torch.randn(32, 64, generator=generator) * 40).to(torch.float8_e4m3fn)
    b = (torch.randn(48, 64, generator=generator) * 40).to(torch.float8_e5m2).t()
    scale_a = torch.rand(32, 1, generator=generator) + 0.5 if rowwise else torch.tensor(0.25)
    scale_b = torch.rand(1, 48, generator=generator) + 0.5 if rowwise else torch.tensor(2.0)
    for out_dtype in (torch.float32, torch.bfloat16):
        as_it_is = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        with onednn_off():
            emulated = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        assert torch.equal(as_it_is, emulated)
        reference = (a.float() @ b.float()) * scale_a * scale_b
        # The product itself (ATen's rowwise emulation rounds within 0.05 % of it in fp32).
        torch.testing.assert_close(emulated.float(), reference, rtol=2e-3 if out_dtype is torch.float32 else 1.6e-2,
                                   atol=1e-2)


def test_onednn_off_counts_its_threads_and_gives_back_the_users_setting():
    saved = torch.backends.mkldnn.enabled
    entered, leave = threading.Barrier(2), threading.Event()
    seen = []

    def step_on_a_thread():
        with onednn_off():
            entered.wait()
            leave.wait()
            seen.append(torch.backends.mkldnn.enabled)

    try:
        for users_setting in (True, False):
            torch.backends.mkldnn.enabled = users_setting
            leave.clear()
            thread = threading.Thread(target=step_on_a_thread)
            thread.start()
            with onednn_off():
                entered.wait()
                assert torch.backends.mkldnn.enabled is False
            assert torch.backends.mkldnn.enabled is False  # the other thread's step is still in its block
            leave.set()
            thread.join()
            assert seen.pop() is False
            assert torch.backends.mkldnn.enabled is users_setting
    finally:
        torch.backends.mkldnn.enabled = saved


@pytest.mark.extra("recipes")
def test_an_fp8_lanes_steps_alone_run_with_onednn_off_where_its_float8_kernel_is_the_reference(monkeypatch):
    """Where switches.float8_matmuls_need_onednn_off decides so (an AMX Xeon here: 14 s a step of tiny_transformer in
    oneDNN's reference kernel), every forward and backward of an FP8 lane, plain steps and full ones, the op trace's
    and the thread choice's included, runs with oneDNN off, and nothing else does; elsewhere nothing is switched."""
    import amp_core.precision as precision_module  # (its lane and options modules read the answer)

    seen: dict[str, set] = {}

    def note(module, args, output):
        kind = "fp8" if type(module).__name__ == "Float8Linear" else "plain"
        if kind == "plain" and type(module) is not torch.nn.Linear:
            return
        seen.setdefault(kind, set()).add(torch.backends.mkldnn.enabled)

    for reference_kernel in (True, False):
        for module in (precision_module.lane, precision_module.options):  # the step context and the lane's note
            monkeypatch.setattr(module, "float8_matmuls_need_onednn_off", lambda answer=reference_kernel: answer)
        seen.clear()
        handle = torch.nn.modules.module.register_module_forward_hook(note)
        try:
            if reference_kernel:
                config = RunConfig(workload="tiny_transformer", modes=("bf16-mixed", "bf16-mixed+fp8-tensorwise"),
                                   steps=6, batch_size=8, device="cpu", grad_norm_every=3, gradstats_every=0)
                run = Run(config).start()
                run.join()
                assert run.status == "finished", [(lane.mode, lane.error) for lane in run.lanes]
            # One step where nothing is switched (on an AMX Xeon, in oneDNN's reference kernel: seconds).
            trace_workload("tiny_transformer", "bf16-mixed" if reference_kernel else "bf16-mixed+fp8-tensorwise",
                           device="cpu", batch_size=4)
        finally:
            handle.remove()
        assert seen == ({"fp8": {False}, "plain": {True}} if reference_kernel else {"fp8": {True}})
        assert torch.backends.mkldnn.enabled


@pytest.mark.timeout(1500)  # a hang guard: torchao compiles its optimizer steps (minutes on a busy CPU)
@pytest.mark.extra("recipes")
def test_the_cli_trains_every_option_and_refuses_in_one_line(tmp_path):
    store = tmp_path / "runs.db"
    command = [sys.executable, "-m", "amp_core", "--store", str(store), "run", "--workload", "tiny_transformer",
               "--steps", "2", "--batch-size", "8", "--device", "cpu", "--optimizer", "adamw"]
    done = subprocess.run([*command, "--modes", ",".join(("32-true", *EVERY_OPTION))], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()[2:] if line.strip()}
    assert {rows[recipe] for recipe in EVERY_OPTION} == {"finished"}
    assert "note: bf16-mixed+fp8-rowwise: " in done.stderr and "Emulated here" in done.stderr
    refused = subprocess.run([*command, "--modes", "32-true,32-true+fp8-rowwise"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.strip() == ("error: modes: +fp8-rowwise runs on top of bf16-mixed (torchao's float8 "
                                      "training); use bf16-mixed+fp8-rowwise")


@pytest.mark.extra("recipes")
def test_the_fp8_workshop_scenario_follows_the_device():
    """What the scenario expects follows the device. Its run on this device, every check held, is in
    tests/test_workshop.py, which runs every scenario once in a process of its own."""
    from amp_core.workshop import SCENARIOS
    from amp_core.workshop.checks import fp8_expected_here

    scenario = SCENARIOS["fp8"]
    assert "Native FP8 tensor cores" in fp8_expected_here("cuda") and "Emulated" in fp8_expected_here("cpu")
    if not torch.cuda.is_available():
        assert scenario.configs("auto")[0].device == "cpu"  # emulated here, said so


@pytest.mark.extra("recipes")
def test_bench_race_takes_recipe_lanes_and_gives_fp8_its_speedup_against_bf16_mixed():
    command = [sys.executable, "-m", "bench.race", "--workload", "digits_mlp", "--steps", "5", "--rounds", "1",
               "--batch-size", "16"]
    done = subprocess.run([*command, "--modes", "bf16-mixed+fp8-rowwise"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rounds, *lines = done.stdout.splitlines()
    assert rounds.startswith("rounds=1 of 1 (5 steps per lane; ")
    # 32-true (the speedups' baseline) and bf16-mixed (the FP8 lane's) are raced beside the recipe asked for.
    assert [line.split()[2] for line in lines[:3]] == ["32-true", "bf16-mixed", "bf16-mixed+fp8-rowwise"]
    assert lines[3].startswith("bf16-mixed+fp8-rowwise vs bf16-mixed: bare_speedup=")
    assert lines[4].startswith("speedup_error_max=") and lines[5].startswith("memory_change_max=")
    assert len(lines) == 6
    refused = subprocess.run([*command, "--modes", "32-true,bf16-true+fp8-rowwise"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and not refused.stdout
    assert refused.stderr.strip() == ("error: --modes: 'bf16-true+fp8-rowwise' cannot race on cpu: +fp8-rowwise "
                                      "runs on top of bf16-mixed (torchao's float8 training); use "
                                      "bf16-mixed+fp8-rowwise")


@pytest.mark.extra("recipes")
def test_a_low_bit_lane_keeps_its_replay_snapshots_in_torchaos_own_state_tensors():
    # A snapshot copies the optimizer's state; torchao's low-bit states have no aten.clone (the run used to fail at
    # its first snapshot after step 0, step 25 by default).
    run = Run(RunConfig(workload="tiny_transformer", modes=("32-true+adamw-8bit",), steps=4, snapshot_every=2,
                        batch_size=8, optimizer="adamw", device="cpu", gradstats_every=0)).start()
    run.join(600)
    assert run.status == "finished", [lane.error for lane in run.lanes]
    assert run.snapshots.steps(0) == [0, 2]
    states = [value for state in run.snapshots.nearest(0, 3).optimizer["state"].values() for value in state.values()]
    low_bit = [value for value in states if type(value) is not torch.Tensor]
    assert low_bit and all(type(value).__name__ == "OptimState8bit" and value.device.type == "cpu"
                           for value in low_bit)
