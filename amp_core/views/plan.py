"""The plan search's report in words (the CLI prints it; a page can show it): the plan, every trial, the final race
against the target and the baseline, the share of matmul FLOPs in each format, the price (measured where the formats
run natively, else *modelled* from published peak throughputs) and the plan as code."""

from __future__ import annotations

import math

from amp_core.diagnostics.plan_code import plan_code, trainer_usage
from amp_core.diagnostics.plan_price import GPUS, flop_shares, modelled_gemm_ms
from amp_core.diagnostics.plan_report import PlanReport
from amp_core.diagnostics.seednoise import DIFFERENCE_RULE, difference_verdict

NOT_LINEAR = "(not a Linear)"


def full_formats(report: PlanReport) -> dict[str, str]:
    """Every Linear layer's format under the plan: the candidates' (promoted or the target's), the rest at the
    autocast dtype (the layers the target's format cannot take)."""
    formats = report.formats()
    return {name: formats.get(name, "bf16") for name in report.flops if name != NOT_LINEAR}


def _loss(figures) -> str:
    sd = f" ± {figures.sd:.4f}" if math.isfinite(figures.sd) else ""
    return f"{figures.mean:.4f}{sd} ({figures.finite} seeds)"


def _time(ms: float) -> str:
    return f"{ms:.3f} ms" if ms >= 1 else f"{ms * 1e3:.3f} µs" if ms >= 1e-3 else f"{ms * 1e6:.1f} ns"


def plan_text(report: PlanReport) -> str:
    config = report.config
    lines = [f"plan · {config.workload} ({config.size}) · target {config.target} · baseline {config.baseline} · "
             f"{report.device}",
             f"{len(report.trials)} trials in {report.seconds:.0f} s over {len(report.candidates)} Linear layers; "
             f"each a race of {config.seeds} seeds × {config.steps} steps from the same weights",
             "",
             f"evidence (block numerics in {report.evidence_format}, lowest operand SNR; threshold "
             f"{report.threshold_db:g} dB):"]
    for name, snr, flush, why in report.evidence:
        lines.append(f"  {name:<28} {snr:6.1f} dB  flush {flush:5.1%}  {why}")
    lines += ["", f" trial  {'promoted':<44} {'format':<8} {'final loss':<26} outcome"]
    base = report.baseline
    if base is not None:
        lines.append(f" {'ref':>5}  {'(baseline ' + config.baseline + ')':<44} {'':<8} {_loss(base):<26}")
    for trial in report.trials:
        promoted = ", ".join(trial.promoted) if trial.promoted else "(none)"
        if len(promoted) > 44:
            promoted = f"{len(trial.promoted)} layers ({trial.promoted[0]}, …)"
        lines.append(f" {trial.number:>5}  {promoted:<44} {trial.rung if trial.promoted else '':<8} "
                     f"{_loss(trial.figures):<26} {trial.verdict}")
    lines += ["", f"seed noise: {DIFFERENCE_RULE}", ""]
    if report.plan:
        lines.append("plan:")
        for name, fmt in report.plan.items():
            lines.append(f"  {name} -> {fmt}")
        lines.append(f"  every other Linear the target converts -> {report.target_format}")
        for line in report.minimal:
            lines.append(f"  1-minimal: {line}")
    if report.plan_file:
        lines.append(f"plan file: {report.plan_file}")
    if report.plan_recipe:
        lines.append(f"plan lane: {report.plan_recipe}")
    if report.stopped:
        lines.append(f"stopped: {report.stopped}")
    if report.final:
        lines += ["", "final race (same weights, same seeds)" + ("" if report.native else
                                                                   ": the trials' races, each from the same weights "
                                                                   "and seeds (deterministic here)") + ":"]
        ref = report.final.get(config.baseline)
        for recipe, figures in report.final.items():
            versus = ""
            if ref is not None and recipe != config.baseline:
                verdict, _ = difference_verdict(figures.mean, figures.sd, figures.finite, ref.mean, ref.sd, ref.finite)
                versus = f"  vs baseline: {verdict}"
            speed = f"{figures.ms:.2f} ms/step" + ("" if report.native or recipe == config.baseline else " (emulated)")
            lines.append(f"  {recipe:<60} loss {_loss(figures):<26} {speed}{versus}")
    formats = full_formats(report)
    target_all = {name: report.target_format if name in report.candidates else "bf16" for name in formats}
    shares = flop_shares(report.flops, formats)
    lines += ["", "matmul FLOPs per step by format (plan): "
              + ", ".join(f"{fmt} {share:.1%}" for fmt, share in shares.items())]
    lines.append(f"kept in the target format ({report.target_format}): {shares.get(report.target_format, 0.0):.1%}")
    lines += ["", "price of the matmuls per step, *modelled* from published dense peak TFLOP/s (a floor; not "
                  "measured):"]
    for gpu in GPUS:
        plan_ms = modelled_gemm_ms(report.flops, formats, gpu)
        target_ms = modelled_gemm_ms(report.flops, target_all, gpu)
        bf16_ms = modelled_gemm_ms(report.flops, {}, gpu)
        saving = (f"the plan keeps {(bf16_ms - plan_ms) / (bf16_ms - target_ms):.0%} of the target's saving over bf16"
                  if bf16_ms > target_ms else f"no native speed-up for {report.target_format} on {gpu}")
        lines.append(f"  {gpu} *modelled*: plan {_time(plan_ms)}, target {_time(target_ms)}, all bf16 "
                     f"{_time(bf16_ms)}: {saving}")
    if not report.native:
        lines.append(f"  measured here ({report.device}): the block-scaled formats are emulated, so the ms/step above "
                     "is the emulation's, not the format's")
    if report.found:
        lines += ["", plan_code(formats, title=f"Precision plan for {config.workload}: {config.target} with "
                                                 f"{len(report.plan)} layers promoted (amp-lab plan)")]
        for trainer, where in (("hf", "a Hugging Face Trainer"), ("lightning", "Lightning")):
            lines += [f"# ... or, instead of the plain loop's last line, in {where}:",
                      *trainer_usage(trainer, title=f"plan for {config.workload}"), ""]
    lines.append(f"{'found' if report.found else 'not found'}: {report.why}")
    return "\n".join(lines)
