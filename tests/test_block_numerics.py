"""Block-scaled numerics per layer: real tensors of a real bf16-mixed step quantised by the emulated recipes' own code;
a planted outlier channel is named under NVFP4 and not under MXFP8; the CLI prints the table and the verdicts last,
refusing bad input in one line; the views draw it."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from amp_core.config import ConfigError
from amp_core.formats.linear import GemmRecipe
from amp_core.probes.block_numerics import measure_operand, probe_model, probe_workload_formats
from amp_core.views.block_numerics import display_frame, report_text, snr_heatmap
from tests.cli_process import ROOT


class PlantedChannels(nn.Module):
    """Three Linear layers on one input: fc1 sees it plain; fc2 with three outlier channels x300 in three different
    blocks of 16 (NVFP4 flushes their neighbours; MXFP8's 32-blocks keep them: e4m3 has the range); fc3 with one
    channel at 2^17 (beyond what e4m3 holds beside the others: MXFP8 loses its whole block of 32, NVFP4 only its 16).
    The plants are added constants, so the output gradients stay plain."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        outliers, far = torch.zeros(64), torch.zeros(64)
        outliers[[5, 20, 40]] = 300.0
        far[40] = 2.0**17
        self.register_buffer("outliers", outliers)
        self.register_buffer("far", far)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(x) + self.fc2(x + self.outliers) + self.fc3(x + self.far)


def test_a_planted_outlier_channels_layer_is_the_lowest_snr_under_nvfp4_and_not_under_mxfp8():
    torch.manual_seed(0)
    model = PlantedChannels()
    batch = (torch.randn(64, 64), torch.randn(64, 64))
    report = probe_model(model, nn.functional.mse_loss, batch, ["nvfp4", "mxfp8"])
    nvfp4, mxfp8 = report.lowest("nvfp4"), report.lowest("mxfp8")
    assert (nvfp4.layer, nvfp4.operand) == ("fc2", "input")
    assert "outlier channel" in nvfp4.why and nvfp4.snr_db < 5
    assert mxfp8.layer != "fc2"
    frame = report.frame().set_index(["layer", "operand", "format"])
    assert frame.loc[("fc2", "input", "mxfp8"), "snr_db"] > 25  # MXFP8 keeps fc2's neighbours
    assert frame.loc[("fc1", "input", "nvfp4"), "snr_db"] > 12  # plain values keep NVFP4's usual ~16 dB
    assert report.verdict("nvfp4").startswith("nvfp4: first layer below 10 dB: fc2 (input,")
    assert report.verdict("mxfp8").startswith("mxfp8: first layer below 25 dB: fc3 (input,")
    assert frame.loc[("fc2", "input", "nvfp4"), "flush_share"] > 0.3
    assert frame.loc[("fc3", "input", "nvfp4"), "underflow_share"] > 0.5  # e4m3 block scales bottom out beside 2^17
    assert math.isfinite(report.loss)
    assert list(model.fc1.weight.shape) == [64, 64] and model.fc1.weight.grad is None  # the probe ran on a copy


def test_snr_counts_the_values_beside_each_blocks_largest():
    values = torch.randn(8, 64)
    values[:, 3] = 1000.0
    measured = measure_operand(values, GemmRecipe("nvfp4"), "input")
    # All the signal of a block of 16 is its outlier; its 15 neighbours flush: about a quarter of the rest is lost.
    assert measured.snr_db < 7 and measured.flush_share > 0.2
    exact = measure_operand(torch.ones(4, 32), GemmRecipe("mxfp8"), "input")
    assert exact.snr_db == math.inf and exact.flush_share == 0


def test_a_workload_probe_names_layers_the_format_cannot_measure_and_refuses_bad_input():
    report = probe_workload_formats("tiny_transformer", ["fp8-blockwise", "mxfp8"], batch_size=4)
    assert "misshaped" in report.skipped["blocks.0.qkv (fp8-blockwise)"]
    assert report.verdict("fp8-blockwise").startswith("fp8-blockwise: no Linear layer measured")
    assert "blocks.0.qkv" in set(report.frame()["layer"])
    assert list(display_frame(report).columns)[:4] == ["layer", "operand", "format", "SNR dB"]
    figure = snr_heatmap(report)
    assert figure.data[0].type == "heatmap" and "mxfp8 · input" in list(figure.data[0].x)
    assert report_text(report).splitlines()[-1].startswith("mxfp8: ")
    with pytest.raises(ConfigError, match="unknown block-scaled format 'fp4'; choose from mxfp8"):
        probe_workload_formats("tiny_transformer", ["fp4"])
    with pytest.raises(ConfigError, match="name a block-scaled format"):
        probe_workload_formats("tiny_transformer", [])


def test_the_cli_prints_the_table_and_the_verdicts_last_and_refuses_in_one_line(tmp_path):
    csv = tmp_path / "formats.csv"
    done = subprocess.run([sys.executable, "-m", "amp_core", "numerics", "--workload", "tiny_transformer",
                           "--batch-size", "4", "--format", "nvfp4,mxfp8", "--csv", str(csv)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-2].startswith("nvfp4: ") and lines[-1].startswith("mxfp8: ")
    assert any(line.split()[:3] == ["head", "grad_output", "nvfp4"] for line in lines)
    assert "snr_db" in csv.read_text().splitlines()[0]
    refused = subprocess.run([sys.executable, "-m", "amp_core", "numerics", "--workload", "tiny_transformer",
                              "--format", "nvfp5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith("error: format: unknown block-scaled format 'nvfp5'")
