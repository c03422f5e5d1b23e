"""The op trace: real torch on CPU, what autocast really did, op by op."""

from __future__ import annotations

import threading

import pandas as pd
import pytest
import torch
from stepped_run import SteppedRun
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from amp_core.cli import main
from amp_core.config import RunConfig
from amp_core.precision import get_precision
from amp_core.probes import optrace
from amp_core.views import optrace as trace_views
from amp_core.views import tables
from amp_core.workloads import WORKLOADS

LOW = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
MATMULS = {"addmm", "mm"}


def low_precision_dtypes(record: optrace.OpRecord) -> set[str]:
    return {d for d in (*record.in_dtypes, *record.out_dtypes) if d in ("bf16", "fp16")}


# --- the seed demo -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("autocast", "low"), [("float16", "float16"), ("bfloat16", "bfloat16")])
def test_autocast_demo_add_stays_fp32_and_matmul_goes_low_on_cpu(autocast, low):
    rows = [r for r in optrace.autocast_demo("cpu") if r["autocast"] == autocast]
    assert {r["y"] for r in rows} == {"float32", low}  # fp32 inputs, then y in half precision
    for row in rows:
        expected = "float32" if row["expression"] == "x + y" else low
        assert row["result"] == expected, row


# --- digits_mlp: where the matmuls, the loss and the casts ran ------------------------------------------------------

@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed"])
def test_mixed_linear_matmuls_run_low_in_both_passes_and_belong_to_their_linear(mode):
    trace = optrace.trace_workload("digits_mlp", mode)
    matmuls = [r for r in trace.records if r.op in MATMULS]
    assert {(r.module, r.phase) for r in matmuls} == {(m, p) for m in ("fc1", "fc2") for p in ("forward", "backward")}
    assert all(r.compute_dtype == LOW[mode] and set(r.in_dtypes) == {LOW[mode]} for r in matmuls)
    assert all(r.flops > 0 for r in matmuls)
    forward_fc1 = next(r for r in matmuls if r.module == "fc1" and r.phase == "forward")
    assert forward_fc1.op == "addmm" and forward_fc1.out_shapes == ((optrace.DEFAULT_TRACE_BATCH, 256),)


@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed"])
def test_mixed_loss_runs_in_fp32_forward_and_backward(mode):
    trace = optrace.trace_workload("digits_mlp", mode)
    loss_ops = [r for r in trace.records if r.module == optrace.LOSS and not r.is_view]
    computing = [r for r in loss_ops if not r.is_cast]
    assert {r.phase for r in computing} == {"forward", "backward"}
    assert {r.op for r in computing} >= {"_log_softmax", "nll_loss_forward", "nll_loss_backward"}
    assert all(r.compute_dtype == "fp32" for r in computing)
    # autocast widened fc2's low-precision logits into the fp32 loss; the producer is fc2's matmul
    widened = trace.widened_frame()
    first = widened.iloc[0]
    assert (first["phase"], first["module"], first["producer"], first["producer_module"]) == \
        ("forward", optrace.LOSS, "addmm", "fc2")
    assert first["produced"] == LOW[mode]


@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed"])
def test_mixed_weight_casts_are_counted(mode):
    trace = optrace.trace_workload("digits_mlp", mode)
    casts = [r for r in trace.records if r.is_cast]
    weight_casts = {(r.module, r.in_shapes[0]) for r in casts
                    if r.phase == "forward" and r.in_dtypes == ("fp32",) and r.out_dtypes == (LOW[mode],)}
    assert {("fc1", (256, 64)), ("fc1", (256,)), ("fc2", (10, 256)), ("fc2", (10,))} <= weight_casts
    summary = trace.summary()
    assert summary.casts == len(casts) >= 4
    assert summary.cast_bytes == sum(r.cast_bytes for r in casts)
    fc1_weight = next(r for r in casts if r.module == "fc1" and r.in_shapes == ((256, 64),))
    assert fc1_weight.cast_bytes == 256 * 64 * 2
    assert summary.flop_share(LOW[mode]) == pytest.approx(1.0)


def test_32_true_runs_nothing_in_low_precision_and_casts_nothing():
    trace = optrace.trace_workload("digits_mlp", "32-true")
    assert trace.records
    assert not [r for r in trace.records if low_precision_dtypes(r)]
    summary = trace.summary()
    assert (summary.casts, summary.cast_bytes, summary.widened) == (0, 0, 0)
    assert summary.flop_share("fp32") == pytest.approx(1.0)
    assert set(trace.module_frame().query("ops > 0")["compute_dtype"]) == {"fp32"}


def test_bf16_true_runs_the_loss_in_bf16_too():
    trace = optrace.trace_workload("digits_mlp", "bf16-true")
    modules = trace.module_frame().set_index("module")
    assert modules.loc[optrace.LOSS, "forward_dtype"] == "bf16"
    assert trace.summary().casts == 0


def test_flops_agree_with_torch_flop_counter():
    workload = WORKLOADS["digits_mlp"]
    data = workload.load_data(RunConfig(workload="digits_mlp", modes=("32-true",)))
    torch.manual_seed(0)
    model = workload.build_model("small", data)
    batch = data.sample(torch.Generator().manual_seed(0), 8)
    trace = optrace.trace_step(model, get_precision("32-true"), workload.loss, batch)
    with FlopCounterMode(display=False) as counter:
        workload.loss(model(batch[0]), batch[1]).backward()
    assert trace.summary().flops == counter.get_total_flops() > 0


def test_cpu_attention_is_counted_and_attributed_to_its_block():
    trace = optrace.trace_workload("tiny_transformer", "bf16-mixed", batch_size=2)
    attention = [r for r in trace.records if "attention" in r.op]
    assert {(r.module, r.phase) for r in attention} == {("blocks.0", "forward"), ("blocks.0", "backward"),
                                                        ("blocks.1", "forward"), ("blocks.1", "backward")}
    assert all(r.flops > 0 and r.compute_dtype == "bf16" for r in attention)


def test_cpu_autocast_keeps_layer_norm_and_softmax_of_a_bf16_input_in_bf16():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return torch.softmax(self.norm(self.proj(x)), dim=-1)

    trace = optrace.trace_step(Head(), get_precision("bf16-mixed"), lambda out, target: (out - target).pow(2).mean(),
                               (torch.randn(4, 8), torch.randn(4, 8)))
    forward = {r.op: r for r in trace.records if r.phase == "forward"}
    assert forward["native_layer_norm"].module == "norm"
    assert forward["native_layer_norm"].in_dtypes[0] == forward["native_layer_norm"].out_dtypes[0] == "bf16"
    assert forward["_softmax"].module == optrace.ROOT and forward["_softmax"].out_dtypes == ("bf16",)


# --- nothing on the hot path -----------------------------------------------------------------------------------------

class Probe(nn.Module):
    """Looks, from inside a traced forward, at what is installed process-wide, and runs ops on another thread."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.seen: dict[str, int] = {}

    def forward(self, x):
        hooks = nn.modules.module
        self.seen["global_module_hooks"] = len(hooks._global_forward_pre_hooks) + len(hooks._global_forward_hooks)
        other = nn.Linear(4, 4)

        def training_thread():
            self.seen["other_thread_modes"] = torch._C._len_torch_dispatch_stack()
            other(torch.randn(3, 4)).cumsum(0).sum().backward()

        thread = threading.Thread(target=training_thread)
        thread.start()
        thread.join()
        self.seen["other_hooks"] = len(other._forward_pre_hooks) + len(other._forward_hooks)
        return self.fc(x)


def test_tracing_installs_nothing_process_wide_and_leaves_nothing_behind():
    model = Probe()
    trace = optrace.trace_step(model, get_precision("bf16-mixed"), nn.functional.mse_loss,
                               (torch.randn(3, 4), torch.randn(3, 2)), copy_model=False)
    assert model.seen == {"global_module_hooks": 0, "other_thread_modes": 0, "other_hooks": 0}
    assert not [r for r in trace.records if r.op == "cumsum"]  # the other thread's ops are not in the trace
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not (model._forward_pre_hooks or model._forward_hooks or model.fc._forward_hooks)


def test_trace_step_leaves_the_callers_model_optimizer_and_scaler_bit_identical():
    workload = WORKLOADS["digits_mlp"]
    precision = get_precision("16-mixed")
    data = workload.load_data(RunConfig(workload="digits_mlp", modes=("16-mixed",)))
    model = precision.prepare_module(workload.build_model("small", data))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = precision.make_scaler(init_scale=1024.0)
    batch = data.sample(torch.Generator().manual_seed(0), 16)
    for _ in range(2):
        optimizer.zero_grad()
        with precision.forward_context():
            loss = workload.loss(model(batch[0]), batch[1])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    before = state_bits(model, optimizer, scaler)
    optrace.trace_step(model, precision, workload.loss, batch)
    assert state_bits(model, optimizer, scaler) == before


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def state_bits(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> dict:
    params = {name: (bits(p), None if p.grad is None else bits(p.grad)) for name, p in model.named_parameters()}
    optim = {(i, k): bits(v) if isinstance(v, torch.Tensor) else v
             for i, state in optimizer.state_dict()["state"].items() for k, v in state.items()}
    return {"params": params, "optimizer": optim, "scaler": scaler.state_dict()}


# --- a live lane ------------------------------------------------------------------------------------------------------

def paused_run(modes: tuple[str, ...]) -> SteppedRun:
    """A real run that paused itself after every lane's third step: nothing is under way while the test looks."""
    run = SteppedRun(RunConfig(workload="digits_mlp", modes=modes, steps=100_000, batch_size=16, device="cpu",
                               gradstats_every=0), pause_after={3 * len(modes)}).start()
    run.wait_until(SteppedRun.parked)
    assert [lane.steps_done for lane in run.lanes] == [3] * len(modes)
    return run


def test_tracing_a_live_lane_leaves_it_bit_identical(no_leaked_threads):
    run = paused_run(("32-true", "16-mixed"))
    try:
        states = [lane.state for lane in run.lanes]
        before = [state_bits(s.model, s.optimizer, s.scaler) for s in states]
        traces = [optrace.trace_lane(run, lane.index) for lane in run.lanes]
        after = [state_bits(s.model, s.optimizer, s.scaler) for s in states]
    finally:
        run.stop()
    assert after == before
    assert traces[1].summary().casts > 0 and traces[0].summary().casts == 0
    assert "lane 1" in traces[1].label and "16-mixed" in traces[1].label


def test_tracing_a_running_lane_records_only_the_copy(no_leaked_threads):
    run = SteppedRun(RunConfig(workload="digits_mlp", modes=("bf16-mixed",), steps=100_000, batch_size=16,
                               device="cpu", gradstats_every=0)).start()
    try:
        run.wait_until(lambda r: r.lane_steps >= 2)
        traces = [optrace.trace_lane(run, 0) for _ in range(5)]  # while the thread keeps training
        steps = run.lane_steps
        run.wait_until(lambda r: r.lane_steps > steps)  # and it still does
    finally:
        run.stop()
    reference = optrace.trace_workload("digits_mlp", "bf16-mixed", batch_size=16)
    for trace in traces:
        assert [(r.phase, r.module, r.op) for r in trace.records] == \
            [(r.phase, r.module, r.op) for r in reference.records]
    assert run.lanes[0].status != "failed"


# --- tables, figures, CLI ------------------------------------------------------------------------------------------

def test_op_table_columns_and_filters():
    frame = optrace.trace_workload("digits_mlp", "bf16-mixed").to_frame()
    assert list(frame.columns[:4]) == ["index", "phase", "module", "op"]
    assert len(optrace.filter_ops(frame)) == len(frame)
    backward = optrace.filter_ops(frame, phases=["backward"])
    assert set(backward["phase"]) == {"backward"} and 0 < len(backward) < len(frame)
    assert set(optrace.filter_ops(frame, modules=["fc1"])["module"]) == {"fc1"}
    fp32_rows = optrace.filter_ops(frame, dtypes=["fp32"])
    assert fp32_rows["is_cast"].any() and "addmm" not in set(fp32_rows["op"])
    no_views = optrace.filter_ops(frame, hide_views=True)
    assert not no_views["is_view"].any() and {"t", "detach"}.isdisjoint(no_views["op"])


def test_submodule_filter_takes_children():
    frame = optrace.trace_workload("tiny_transformer", "32-true", batch_size=2).to_frame()
    chosen = set(optrace.filter_ops(frame, modules=["blocks.0"])["module"])
    assert {"blocks.0", "blocks.0.ln1", "blocks.0.mlp.0"} <= chosen
    assert not {m for m in chosen if m.startswith("blocks.1")}


def test_treemap_colours_each_module_by_its_dtype():
    trace = optrace.trace_workload("digits_mlp", "bf16-mixed")
    figure = trace_views.module_treemap(trace)
    treemap = figure.data[0]
    colour = dict(zip(treemap.ids, treemap.marker.colors, strict=True))
    assert colour["fc1"] == trace_views.DTYPE_COLOURS["bf16"]
    assert colour[optrace.LOSS] == trace_views.DTYPE_COLOURS["fp32"]
    assert dict(zip(treemap.ids, treemap.parents, strict=True))["fc1"] == optrace.ROOT
    with pytest.raises(ValueError, match="size_by"):
        trace_views.module_treemap(trace, "bytes")


def test_treemap_labels_say_what_the_special_boxes_hold():
    trace = optrace.trace_workload("digits_mlp", "16-mixed")
    treemap = trace_views.module_treemap(trace).data[0]
    labels = dict(zip(treemap.ids, treemap.labels, strict=True))
    hover = dict(zip(treemap.ids, treemap.customdata, strict=True))
    assert labels[optrace.OUTSIDE].startswith("(outside): ") and labels[optrace.ROOT].startswith("(root): ")
    assert labels["fc1"] == "fc1"
    # 16-mixed: the scaler's multiply really is in (outside), as its hover says.
    outside_ops = set(optrace.filter_ops(trace.to_frame(), modules=[optrace.OUTSIDE])["op"])
    assert outside_ops == {"ones_like", "mul.Tensor"} and "GradScaler" in hover[optrace.OUTSIDE]
    root_ops = set(optrace.filter_ops(trace.to_frame(), modules=[optrace.ROOT], hide_views=True)["op"])
    assert root_ops == {"relu", "threshold_backward"}  # digits_mlp's forward calls torch.relu itself


def test_op_table_puts_each_shape_beside_its_dtype():
    trace = optrace.trace_workload("checkerboard_cnn", "16-mixed")
    raw = trace.to_frame()
    table = trace_views.op_table(raw)
    assert list(table.columns) == list(trace_views.OP_TABLE_COLUMNS) and len(table) == len(raw)
    rows = table.set_index("#")
    norm_backward = raw[raw["op"] == "native_batch_norm_backward"].iloc[0]
    assert rows.loc[norm_backward["index"], "inputs"] == "fp16[16,64,16,16]×2, fp32[64]×5"
    first_cast = raw[raw["is_cast"]].iloc[0]
    assert rows.loc[first_cast["index"], "note"] == f"cast {optrace.format_bytes(first_cast['cast_bytes'])}"
    widened = raw[raw["widened_from"].notna() & raw["is_cast"]].iloc[0]  # the loss's fp16 -> fp32 cast
    assert rows.loc[widened["index"], "note"] == (f"cast {optrace.format_bytes(widened['cast_bytes'])}; "
                                                   f"widens #{widened['widened_from']}")
    seed = raw[raw["op"] == "ones_like"].iloc[0]
    assert rows.loc[seed["index"], "inputs"] == "fp32: []"
    widths = tables.content_widths(table, max_px=10_000)
    assert widths["inputs"] == round(max(map(tables.text_px, table["inputs"])) + tables.PADDING_PX)
    assert widths["#"] == 40  # the floor: "#" and short numbers


def test_text_width_estimate_is_close_to_chromium():
    # Widths canvas.measureText gave for Streamlit's table font (14 px Source Sans) in Chromium.
    measured = {"bf16: [256], [16,64], [64,256]": 160.5, "_log_softmax_backward_data": 176.4,
                "fp32[], fp32[16,10], int64[16], fp32[]": 205.1, "final loss (mean of last 20)": 150.7,
                "bf16-mixed · 1b5dea": 118.2, "0123456789": 69.6}
    for text, px in measured.items():
        assert px <= tables.text_px(text) <= 1.1 * px, text  # never short (a cut cell), at most 10 % wide


def test_autocast_demo_table_names_the_notes_column_and_fills_bf16_rows():
    table = trace_views.autocast_demo_table(optrace.autocast_demo("cpu"))
    notes = table.set_index(["autocast", "expression"])[trace_views.NOTES_COLUMN]
    assert set(notes.loc["float16"]) == {"float32", "float16"}
    assert set(notes.loc["bfloat16"]) == {"not in the notes (fp16 only)"}


def test_compare_modules_side_by_side():
    table = optrace.compare_modules(optrace.trace_workload("digits_mlp", "32-true"),
                                    optrace.trace_workload("digits_mlp", "bf16-mixed"))
    row = table.set_index("module").loc["fc1"]
    assert (row["forward_dtype [32-true]"], row["forward_dtype [bf16-mixed]"]) == ("fp32", "bf16")
    assert len(trace_views.flop_share_figure([]).data) == 3


def test_trace_workload_refuses_bad_input():
    with pytest.raises(ValueError, match="unknown workload"):
        optrace.trace_workload("nope", "32-true")
    with pytest.raises(ValueError, match="tf32 cannot run"):
        optrace.trace_workload("digits_mlp", "tf32", device="cpu")
    with pytest.raises(ValueError, match="size"):
        optrace.trace_workload("digits_mlp", "32-true", size="huge")


def bf16_autocast_casts(model: nn.Module, batch_size: int) -> tuple[int, int]:
    """The casts (count, bytes written) bf16 autocast must make in one forward + backward of an fp32 Linear stack
    ending in cross-entropy, from autocast's rules rather than from a trace:

    - forward: a Linear (a lower-precision op) casts its fp32 weight and bias to bf16, and its input where that is
      fp32 (only the first layer's: later ones get bf16 activations); cross-entropy (an fp32 op) casts the bf16
      logits up to fp32;
    - backward: each cast's backward casts the gradient back — the logits' gradient down to bf16, each parameter's
      bf16 gradient up to fp32 (the input needs no gradient).
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    params = [p for m in linears for p in m.parameters()]
    logits = batch_size * linears[-1].out_features
    count = 2 * len(params) + 1 + 2
    written = sum(p.numel() * (2 + 4) for p in params)  # bf16 copies forward, fp32 gradients backward
    written += batch_size * linears[0].in_features * 2 + logits * (4 + 2)
    return count, written


def test_cli_trace_prints_the_summary_and_writes_the_table(tmp_path, capsys):
    path = tmp_path / "ops.csv"
    assert main(["trace", "--workload", "digits_mlp", "--mode", "bf16-mixed", "--csv", str(path)]) == 0
    out = capsys.readouterr().out
    workload = WORKLOADS["digits_mlp"]
    model = workload.build_model("small", workload.load_data(RunConfig(workload="digits_mlp")))
    casts, cast_bytes = bf16_autocast_casts(model, optrace.DEFAULT_TRACE_BATCH)
    assert f"casts: {casts} (_to_copy changing dtype)" in out and "bf16 100.0%" in out and "fc1" in out
    table = pd.read_csv(path)
    assert len(table) == optrace.trace_workload("digits_mlp", "bf16-mixed").summary().ops
    assert int(table["is_cast"].sum()) == casts and int(table["cast_bytes"].sum()) == cast_bytes
    assert set(table.loc[table["op"] == "addmm", "compute_dtype"]) == {"bf16"}


@pytest.mark.parametrize(("args", "message"), [
    (("nope", "32-true"), "unknown workload"),
    (("digits_mlp", "fp8"), "unknown mode"),
    (("digits_mlp", "tf32"), "tf32 cannot run"),
])
def test_cli_trace_refuses_bad_input_in_one_line(args, message, capsys):
    assert main(["trace", "--workload", args[0], "--mode", args[1], "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_trace_refuses_an_unwritable_csv_path(tmp_path, capsys):
    assert main(["trace", "--mode", "32-true", "--csv", str(tmp_path / "missing" / "ops.csv")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot write")
