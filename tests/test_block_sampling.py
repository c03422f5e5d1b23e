"""Block-scaled numerics over sampled steps, on real CPU training: a race's block-scaled lanes (RunConfig.amax_every)
and an attached loop (MonitorConfig.block_formats) record each Linear's GEMM operands in the format at the sampled
steps as `block_sample` events; a planted outlier channel's layer is named under NVFP4 and not under MXFP8; the
samples change nothing the run measures; the views draw the SNR over steps."""

from __future__ import annotations

import math

import pytest
import torch
from block_workloads import PLANTED_LAYER, PlantedChannels, PlantedChannelWorkload

from amp_core.config import ConfigError, RunConfig
from amp_core.formats.linear import BlockScaledLinear, GemmRecipe
from amp_core.formats.memory import layer_scale_bytes
from amp_core.formats.recipes import BLOCK_SCALED_OPTIONS
from amp_core.monitor import Monitor
from amp_core.probes.block_sampling import BlockSampleProbe, BlockWatchProbe
from amp_core.probes.block_watch import BLOCK_SAMPLE_EVENT, ROW_FIELDS
from amp_core.probes.layer_amax import LayerAmaxProbe
from amp_core.probes.layerwatch import LayerWatchProbe
from amp_core.race.runner import Run, RunHooks
from amp_core.records.opening import open_store
from amp_core.views.block_numerics import LOWEST, block_samples, latest_table, latest_verdicts, snr_over_steps
from amp_core.workloads import WORKLOADS

LANES = ("bf16-mixed", "bf16-mixed+nvfp4", "bf16-mixed+mxfp8")


@pytest.fixture()
def planted(monkeypatch):
    workload = PlantedChannelWorkload()
    monkeypatch.setitem(WORKLOADS, workload.name, workload)
    return workload


def race(store, **extra) -> Run:
    config = RunConfig(workload="planted_channel", modes=LANES, steps=7, batch_size=32, device="cpu",
                       gradstats_every=0, intra_op_threads=1, **extra)
    run = Run(config, open_store(store)).start()
    run.join(120)
    assert not run.alive
    return run


def test_a_race_samples_its_block_scaled_lanes_and_names_the_planted_layer_under_nvfp4_only(planted, fresh_store):
    plain = race(fresh_store)
    sampled = race(fresh_store, amax_every=3)
    # The samples run on a shadow copy after the timed step: every lane trains exactly as without them.
    assert list(sampled.frame()["loss"]) == list(plain.frame()["loss"])
    assert not [e for e in plain.events() if e.kind == BLOCK_SAMPLE_EVENT]
    events = [e for e in sampled.events() if e.kind == BLOCK_SAMPLE_EVENT]
    # Lane 0 (bf16-mixed) has no block-scaled GEMM: only lanes 1 and 2, at the sampled steps.
    assert sorted((e.lane, e.step) for e in events) == [(lane, step) for lane in (1, 2) for step in (0, 3, 6)]
    by_lane = {lane: [e for e in events if e.lane == lane] for lane in (1, 2)}
    for event in by_lane[1]:
        assert event.data["formats"] == ["nvfp4"] and event.data["fields"] == list(ROW_FIELDS)
        assert {(row[0], row[1]) for row in event.data["rows"]} == {
            (layer, operand) for layer in ("fc1", "fc2", "fc3") for operand in ("input", "weight", "grad_output")}
        assert event.data["first_below"]["nvfp4"] == PLANTED_LAYER
        assert "outlier channel" in event.data["verdicts"]["nvfp4"] and event.data["sample_ms"] > 0
    assert all(event.data["first_below"]["mxfp8"] != PLANTED_LAYER for event in by_lane[2])
    stored = open_store(fresh_store).events(sampled.run_id)
    samples = block_samples(stored)
    assert len(samples) == 2 * 3 * 9 and set(samples["format"]) == {"nvfp4", "mxfp8"}
    nvfp4 = samples[(samples["format"] == "nvfp4") & (samples["operand"] == "input")]
    fc2 = nvfp4[nvfp4["layer"] == PLANTED_LAYER]["snr_db"]
    fc1 = nvfp4[nvfp4["layer"] == "fc1"]["snr_db"]
    assert fc2.max() < 5 < 12 < fc1.min()
    figure = snr_over_steps(samples, 1, "bf16-mixed+nvfp4", "nvfp4", LOWEST).to_dict()
    heatmap = figure["data"][0]
    assert list(heatmap["x"]) == [0, 3, 6] and list(heatmap["y"]) == ["fc1", "fc2", "fc3"]
    assert max(heatmap["z"][1]) < 5 and min(heatmap["z"][0]) > 12  # the planted row is red at every step
    assert "no block-scaled samples" in str(snr_over_steps(samples, 0, "bf16-mixed", "nvfp4").to_dict()["layout"])
    step, verdicts = latest_verdicts(stored, 1)
    assert step == 6 and verdicts[0].startswith("nvfp4: first layer below 10 dB: fc2 (input,")
    assert list(latest_table(samples, 1)["layer"])[:3] == ["fc1", "fc1", "fc1"]


def test_block_sampling_is_a_sampled_probe_carried_on_block_scaled_lanes_and_beside_the_layer_watch(planted,
                                                                                                   fresh_store):
    """The race's block sampling and the Monitor's block watch are sampled probes (probes.sampled) their step drivers
    carry: a block-scaled lane carries one after its layer amax, a lane of another recipe none; a Monitor with
    block_formats carries the block watch after the layer watch it rides on, one without it the layer watch alone."""
    carried = {}

    def seen(run, lane, step):
        carried[lane.index] = [type(probe) for probe in lane.state.driver.sampled]

    seen.every = 2
    config = RunConfig(workload="planted_channel", modes=LANES, steps=3, batch_size=32, device="cpu",
                       gradstats_every=0, intra_op_threads=1, amax_every=2)
    run = Run(config, open_store(fresh_store), hooks=RunHooks(after_lane_step=[seen])).start()
    run.join(120)
    assert run.status == "finished", [e.message for e in run.events()]
    assert carried == {0: [LayerAmaxProbe], 1: [LayerAmaxProbe, BlockSampleProbe],
                       2: [LayerAmaxProbe, BlockSampleProbe]}
    for formats, probes in (((), [LayerWatchProbe]), (("nvfp4",), [LayerWatchProbe, BlockWatchProbe])):
        model = PlantedChannels()
        with Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=open_store(fresh_store),
                     layers_every=2, block_formats=formats) as monitor:
            assert [type(probe) for probe in monitor._driver.sampled] == probes


def attached_loop(store, steps: int, device: str = "cpu", **settings) -> list[float]:
    """The user's own bf16 autocast loop on the planted model, watched by a Monitor when `settings` are given."""
    torch.manual_seed(0)
    model = PlantedChannels().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randn(32, 64, generator=generator).to(device) for _ in range(2))
    losses = []
    monitor = Monitor(model, optimizer, store=store, probe_budget=0, **settings) if settings else None
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if monitor is not None:
            monitor.step(loss)
    if monitor is not None:
        monitor.close()
        assert not any(layer._forward_hooks for layer in model.modules())
        return losses, monitor.run_id
    return losses, None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_an_attached_loop_records_block_numerics_on_its_watched_steps_and_trains_as_unwatched(fresh_store, device):
    store = open_store(fresh_store)
    plain, _ = attached_loop(store, 5, device)
    watched, run_id = attached_loop(store, 5, device, layers_every=2, block_formats=("nvfp4", "mxfp8"))
    assert watched == plain  # hooks that only read: the user's step computes what it computed unwatched
    events = store.events(run_id)
    blocks = events[events["kind"] == BLOCK_SAMPLE_EVENT]
    assert sorted(blocks["step"]) == [0, 2, 4]
    for data in blocks["data"]:
        assert data["formats"] == ["nvfp4", "mxfp8"] and data["why"] == "sampled"
        assert data["first_below"]["nvfp4"] == PLANTED_LAYER and data["first_below"]["mxfp8"] != PLANTED_LAYER
        assert len(data["rows"]) == 3 * 3 * 2 and data["sample_ms"] > 0
    samples = block_samples(events)
    assert set(samples["lane"]) == {0} and set(samples["step"]) == {0, 2, 4}
    grads = samples[(samples["operand"] == "grad_output") & (samples["format"] == "mxfp8")]
    assert len(grads) == 3 * 3 and all(math.isinf(v) or v > 20 for v in grads["snr_db"])
    layer_amax = events[events["kind"] == "layer_amax"]
    assert sorted(layer_amax["step"]) == [0, 2, 4]  # the layer watch it rides on, unchanged


def test_a_watched_steps_hooks_hold_no_activation_after_the_step():
    """The recorder in a user's step keeps small figure vectors, never the layers' outputs (their activations)."""
    import gc
    import weakref

    from amp_core.probes.block_watch import OperandRecorder

    model = PlantedChannels()
    recorder = OperandRecorder(model, ("nvfp4",))
    with recorder:
        out = model.fc1(torch.randn(32, 64))
        out.sum().backward()
    seen = weakref.ref(out)
    del out
    gc.collect()
    assert seen() is None and not recorder.outputs
    assert [(k.layer, k.operand) for k in recorder.kept] == [("fc1", "input"), ("fc1", "weight"),
                                                              ("fc1", "grad_output")]
    assert all(k.figures.numel() == 10 for k in recorder.kept)


@pytest.mark.parametrize("formats", [("fp4",), ("nvfp4", "int8"), 3])
def test_a_monitor_refuses_an_unknown_block_format_in_one_line(formats, fresh_store):
    model = PlantedChannels()
    with pytest.raises(ConfigError, match=r"^block_formats: must name block-scaled formats from mxfp8, "):
        Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=open_store(fresh_store),
                block_formats=formats)


def test_the_layer_numerics_page_draws_a_block_scaled_lanes_snr_over_steps(no_leaked_threads):
    import json
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from pages.common import get_manager

    run = get_manager().launch(RunConfig(workload="tiny_transformer", size="small", steps=4, amax_every=2,
                                         modes=("bf16-mixed", "bf16-mixed+nvfp4"), device="cpu", gradstats_every=0))
    run.join(120)
    page = str(Path(__file__).resolve().parents[1] / "pages" / "layer_numerics.py")
    app = AppTest.from_file(page, default_timeout=120).run()
    app.selectbox(key=f"lnum_amax_lane_{run.run_id}").set_value(1).run()
    assert not app.exception and not app.error

    def over_steps() -> dict:
        [found] = [spec for spec in (json.loads(c.proto.spec) for c in app.get("plotly_chart"))
                   if "SNR over steps" in spec["layout"]["title"]["text"]]
        return found

    heatmap = over_steps()["data"][0]
    assert heatmap["x"] == [0, 2] and "blocks.0.qkv" in heatmap["y"]
    assert "lowest operand" in over_steps()["layout"]["title"]["text"]
    assert any(c.value.startswith("nvfp4: ") for c in app.caption)
    assert any("latest sample: step 2" in m.value for m in app.markdown)
    app.radio(key=f"lnum_block_operand_{run.run_id}").set_value("weight").run()
    assert "· weight ·" in over_steps()["layout"]["title"]["text"]
    table = [df.value for df in app.dataframe if "SNR dB" in df.value.columns][-1]  # below the one-step probe's
    assert set(table["format"]) == {"nvfp4"} and len(table) == 3 * len(heatmap["y"])
    # The bf16-mixed lane has no block-scaled GEMM: no such section.
    app.selectbox(key=f"lnum_amax_lane_{run.run_id}").set_value(0).run()
    assert not any("SNR over steps" in json.loads(c.proto.spec)["layout"]["title"]["text"]
                   for c in app.get("plotly_chart"))


QUANTISED: list = []
"""What the counting recipe's quantisations returned (test_scale_bytes_are_what_the_emulated_gemms_quantise)."""


class CountedRecipe(GemmRecipe):
    """A GemmRecipe that keeps what each of its quantisations returned: the emulated Linear's own calls, counted."""

    __slots__ = ()

    def quantize(self, tensor, operand, *, generator=None):
        blocked = GemmRecipe.quantize(self, tensor, operand, generator=generator)
        QUANTISED.append((operand, tuple(tensor.shape), blocked))
        return blocked


@pytest.mark.parametrize("option", list(BLOCK_SCALED_OPTIONS), ids=lambda o: o.name)
def test_scale_bytes_are_what_the_emulated_gemms_quantise(option):
    """One training step of a BlockScaledLinear: the bytes of the scales its quantisations returned equal the layout's
    figure (a tiled weight is quantised twice by the emulation, its transpose too: the same tiles, counted once)."""
    gemm = option.gemm
    in_features, out_features, tokens = (256, 384, 256) if gemm.format == "fp8-blockwise" else (64, 96, 64)
    layer = BlockScaledLinear(torch.nn.Linear(in_features, out_features),
                              CountedRecipe(**{f: getattr(gemm, f) for f in GemmRecipe.__dataclass_fields__}), "fc")
    QUANTISED.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(tokens, in_features, requires_grad=True))  # all three GEMMs
    out.float().square().mean().backward()
    held = 0
    for _, _, blocked in QUANTISED:
        held += blocked.stored_scales.numel() * blocked.stored_scales.element_size()
        held += blocked.tensor_scale.numel() * 4 if blocked.tensor_scale is not None else 0
    if gemm.weight_tiles:
        weights = [b for operand, _, b in QUANTISED if operand == "weight"]
        assert len(weights) == 2 and torch.equal(weights[0].stored_scales.float(),
                                                 weights[1].stored_scales.float().t())
        held -= weights[1].stored_scales.numel() * weights[1].stored_scales.element_size()
        held -= 4 if weights[1].tensor_scale is not None else 0
    figures = layer_scale_bytes(gemm, in_features, out_features)
    assert held == figures["weight"] + tokens * figures["per_token"] + figures["tensor"]
    assert (figures["tensor"] > 0) == (gemm.format == "nvfp4")


def test_a_block_scaled_lanes_started_event_names_its_scales(planted, fresh_store):
    run = race(fresh_store)
    started = next(e for e in run.events() if e.kind == "started")
    scales = started.data["recipes"]["bf16-mixed+nvfp4"]["block_scales"]
    # Three 64x64 Linear layers: 16 tiles of 16x16 each (1 B), 2 x (64 + 64) / 16 B per token each, 5 fp32 tensor
    # scales each (the weight, and the input and output gradient for two GEMMs).
    assert scales == {"layout": "E4M3 (1 B) per 16 values + an fp32 tensor scale; weights per 16x16 tile",
                      "weight_bytes": 3 * 16, "per_token_bytes": 3 * 16, "tensor_scale_bytes": 3 * 5 * 4}
    assert "bf16-mixed+nvfp4: 3 Linear layers in nvfp4, skipped none, scales 48 B for the weights + 48 B per " \
           "token + 60 B of tensor scales (E4M3" in started.message
    mx = started.data["recipes"]["bf16-mixed+mxfp8"]["block_scales"]
    assert mx["weight_bytes"] == 3 * 2 * 64 * 64 // 32 and mx["tensor_scale_bytes"] == 0
    assert "block_scales" not in started.data["recipes"].get("bf16-mixed", {})


def test_the_train_page_names_a_block_scaled_lanes_scales_under_its_memory(planted, fresh_store):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    run = race(fresh_store)
    page = str(Path(__file__).resolve().parents[1] / "pages" / "train.py")
    app = AppTest.from_file(page, default_timeout=120).run()
    assert not app.exception and app.selectbox(key="train_run_pick").value == run.run_id
    [caption] = [c.value for c in app.caption if "block scales" in c.value]
    assert caption.startswith("bf16-mixed+nvfp4 · block scales: 48 B for the weights + 48 B per token + 60 B of "
                              "tensor scales (E4M3 (1 B) per 16 values")
    assert " · bf16-mixed+mxfp8 · block scales: 768 B for the weights + 24 B per token (E8M0 (1 B) per 32" in caption


def test_the_layer_numerics_page_launches_a_sampled_block_scaled_race_and_refuses_one_that_converts_nothing(
        no_leaked_threads):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from pages.common import get_manager

    page = str(Path(__file__).resolve().parents[1] / "pages" / "layer_numerics.py")
    app = AppTest.from_file(page, default_timeout=120).run()
    app.multiselect(key="lnum_run_modes").set_value(["bf16-mixed+fp8-blockwise"])
    app.button(key="FormSubmitter:lnum_launch_form-Launch").click().run()
    [error] = [e.value for e in app.error]
    assert error.startswith("Cannot launch: modes: ") and "+fp8-blockwise converts none of CharLM's Linear" in error
    assert not get_manager().runs()
    app.multiselect(key="lnum_run_modes").set_value(["bf16-mixed+nvfp4"])
    app.number_input(key="lnum_run_steps").set_value(4)
    app.number_input(key="lnum_run_every").set_value(2)
    app.button(key="FormSubmitter:lnum_launch_form-Launch").click().run()
    assert not app.exception and not app.error
    [run] = get_manager().runs()
    run.join(120)
    app.run()
    assert any("Block-scaled GEMM operands over steps" in m.value for m in app.markdown)
