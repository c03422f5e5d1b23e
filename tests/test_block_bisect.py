"""The bisect on a block-scaled lane: an NVFP4 lane whose planted layer (every block of 16 of its inputs shares one
with an outlier: NVFP4 flushes the signal) trains far above the fp32 band; the bisect replays its window, its fp32
reference computing plain fp32 (a copy of the lane's model made plain again), and finds exactly that layer to keep out
of NVFP4; the fixed recipe trains within the band."""

from __future__ import annotations

import pytest
from block_workloads import BLOCKED_LAYER, PlantedBlocksWorkload

from amp_core.config import RunConfig
from amp_core.diagnostics.bisect import bisect_run
from amp_core.race.runner import RunManager
from amp_core.views.bisect import bisect_text
from amp_core.workloads import WORKLOADS

LANE = "bf16-mixed+nvfp4"


@pytest.fixture()
def planted(monkeypatch):
    workload = PlantedBlocksWorkload()
    monkeypatch.setitem(WORKLOADS, workload.name, workload)
    return workload


def race(manager: RunManager, modes: tuple[str, ...], steps: int = 8):
    run = manager.launch(RunConfig(workload="planted_blocks", modes=modes, steps=steps, batch_size=32, lr=1e-2,
                                   snapshot_every=4, gradstats_every=0, device="cpu"))
    run.join(180)
    assert not run.alive
    return run


def test_the_bisect_finds_the_planted_layer_to_keep_out_of_nvfp4_and_the_fix_trains(planted):
    manager = RunManager()
    run = race(manager, ("32-true", LANE))
    frame = run.frame().pivot(index="step", columns="mode", values="loss")
    assert (frame[LANE] > 2 * frame["32-true"]).all()  # far above fp32 from the first step
    report = bisect_run(manager, run.run_id, LANE, record=True)
    assert report.verdict == "fixed" and report.kept == [BLOCKED_LAYER] and report.minimal, report.trials
    assert "above the fp32 band" in report.trials[0].outcome  # the lane as it is fails its window
    assert [trial.passed for trial in report.trials[:2]] == [False, True]  # every module kept passes
    assert report.fixed_recipe == f"{LANE}+keep:{BLOCKED_LAYER}"
    text = bisect_text(report)
    assert f"keep:{BLOCKED_LAYER}" in text and text.splitlines()[-1] == report.price_line()
    fixed = race(manager, ("32-true", report.fixed_recipe))
    started = next(e for e in fixed.events() if e.kind == "started")
    recipe = started.data["recipes"][report.fixed_recipe]
    assert recipe["block_layers"] == ["inp", "out"]
    assert recipe["block_skipped"] == {BLOCKED_LAYER: f"kept out (+keep: {BLOCKED_LAYER})"}
    losses = fixed.frame().pivot(index="step", columns="mode", values="loss")
    assert (losses[report.fixed_recipe] < 1.1 * losses["32-true"]).all()  # inside the fp32 band at every step
