"""The "Four bits" scenario: bf16-mixed, +mxfp8, +nvfp4 and +nvfp4-no-rht race on the tiny transformer with seed
replicates; after the run the block-scaled numerics of its model are recorded as an event; the checks read the loss
ordering against seed noise and each format's SNR from the records."""

from __future__ import annotations

import math

import numpy as np

from amp_core.config import RunConfig
from amp_core.diagnostics.seednoise import difference_verdict
from amp_core.workshop.evidence import Evidence, Part, Waiting, final_loss
from amp_core.workshop.verdicts import CannotTell

BASELINE, MXFP8, NVFP4, NO_RHT = ("bf16-mixed", "bf16-mixed+mxfp8", "bf16-mixed+nvfp4", "bf16-mixed+nvfp4-no-rht")
MODES = (BASELINE, MXFP8, NVFP4, NO_RHT)
SEEDS = 2
STEPS = 60
BLOCK_NUMERICS_EVENT = "block_numerics"
"""Event kind of a block-scaled numerics probe recorded in a run (data: formats, layer SNRs)."""
LOSS_SLACK = 0.05
"""Two final losses this close (relative) count as level whatever the seed spread (two seeds estimate it poorly)."""
SNR_GAP_DB = 8.0
"""NVFP4's median operand SNR is expected at least this far below MXFP8's (e2m1 keeps 1 mantissa bit to e4m3's 3, and
its blocks of 16 each spend one value on the scale's largest: ~15 dB measured)."""


def runs(device: str) -> tuple[RunConfig, ...]:
    return (RunConfig(workload="tiny_transformer", size="small", modes=MODES, steps=STEPS, seeds=SEEDS,
                      batch_size=8, optimizer="adamw", lr=3e-3, device=device, gradstats_every=0,
                      name="workshop: four bits"),)


def measure_formats(manager, run_id: str) -> None:
    """After the run: block-scaled numerics of its workload (seeded model, first batch: what every lane started
    from), in NVFP4 and MXFP8, recorded as a `block_numerics` event of the run (what the SNR check reads)."""
    from amp_core.probes.block_numerics import probe_workload_formats

    config = RunConfig.from_dict(manager.run_info(run_id).config)
    report = probe_workload_formats(config.workload, ("nvfp4", "mxfp8"), size=config.size, device=config.device,
                                    seed=config.seed, batch_size=config.batch_size)
    frame = report.frame()
    data = {name: {"median_snr_db": float(frame[frame["format"] == name]["snr_db"].median()),
                   "lowest": report.verdict(name)} for name in report.formats}
    manager.record_event(run_id, BLOCK_NUMERICS_EVENT, "; ".join(report.verdict(n) for n in report.formats),
                         formats=data)


def _finals(part: Part, mode: str) -> np.ndarray:
    """Each seed replicate's final loss of `mode` (Waiting until every lane has the window)."""
    lanes = [lane.lane for lane in part.info.lanes if lane.mode == mode]
    finals = []
    for lane in lanes:
        frame = part.steps[part.steps["lane"] == lane].sort_values("step")
        if len(frame) < STEPS and lane not in [entry.lane for entry in part.info.lanes
                                               if entry.status in ("diverged", "failed")]:
            raise Waiting(f"{STEPS} steps of every {mode} lane")
        finals.append(final_loss(frame))
    return np.array(finals, dtype=float)


def _gap(part: Part, mode: str, reference: str) -> tuple[float, float, float, str]:
    """(mode's mean final loss, reference's, threshold, verdict): the seed-noise rule, with LOSS_SLACK as a floor."""
    mine, theirs = _finals(part, mode), _finals(part, reference)
    verdict, threshold = difference_verdict(mine.mean(), mine.std(ddof=1), len(mine), theirs.mean(),
                                            theirs.std(ddof=1), len(theirs))
    threshold = max(threshold if math.isfinite(threshold) else 0.0, LOSS_SLACK * abs(theirs.mean()))
    verdict = "within the spread" if abs(mine.mean() - theirs.mean()) <= threshold else "different"
    return float(mine.mean()), float(theirs.mean()), threshold, verdict


def mxfp8_keeps_up(evidence: Evidence) -> tuple[bool, str, str]:
    mine, base, threshold, verdict = _gap(evidence.part(0), MXFP8, BASELINE)
    held = verdict == "within the spread"
    figure = f"final loss: +mxfp8 {mine:.4g}, bf16-mixed {base:.4g} (gap {mine - base:+.4f}, noise {threshold:.4f})"
    return held, figure, "" if held else ("MXFP8 drifted from bf16 beyond seed noise: run `amp-lab numerics "
                                          "--format mxfp8`.")


def four_bits_order(evidence: Evidence) -> tuple[bool, str, str]:
    mine, base, threshold, _ = _gap(evidence.part(0), NVFP4, BASELINE)
    held = mine >= base - threshold  # four bits do not train better than bf16 beyond the noise
    figure = f"final loss: +nvfp4 {mine:.4g}, bf16-mixed {base:.4g} (gap {mine - base:+.4f}, noise {threshold:.4f})"
    return held, figure, "" if held else ("NVFP4 beat bf16-mixed beyond seed noise: more seeds would tell whether "
                                          "that is luck.")


def transform_effect(evidence: Evidence) -> tuple[bool, str, str]:
    with_rht, without, threshold, verdict = _gap(evidence.part(0), NVFP4, NO_RHT)
    figure = f"final loss: +nvfp4 {with_rht:.4g}, +nvfp4-no-rht {without:.4g} (noise {threshold:.4f})"
    if verdict == "within the spread":
        raise CannotTell(figure, "on a model this small the transform's effect is within the seed noise; the paper "
                                 "measured it at 12B parameters and 10T tokens")
    held = with_rht < without
    return held, figure, "" if held else "Without the transform the lane trained better here, beyond the noise."


def snr_gap(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    events = evidence.reader.events(part.run_id)
    found = events[events["kind"] == BLOCK_NUMERICS_EVENT] if not events.empty else events
    if found.empty:
        raise Waiting("the block-scaled numerics, measured when the run has ended")
    formats = found.iloc[-1]["data"]["formats"]
    nvfp4, mxfp8 = formats["nvfp4"]["median_snr_db"], formats["mxfp8"]["median_snr_db"]
    held = mxfp8 - nvfp4 >= SNR_GAP_DB
    return held, f"median operand SNR: NVFP4 {nvfp4:.1f} dB, MXFP8 {mxfp8:.1f} dB; {formats['nvfp4']['lowest']}", \
        "" if held else "The formats kept about the same bits here: look at the per-layer table (Layer numerics)."
