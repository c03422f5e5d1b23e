"""The plan search (`amp-lab plan`): the cheapest format per module that still trains like the baseline. Start with
every Linear of the target recipe in its format; promote to the next format up the ones that hurt most — ordered by
what block numerics measured (the lowest quantisation SNR of each layer's GEMM operands, then its flush share) —
until a seeded race from the same weights trains within seed noise of the baseline
(amp_core.diagnostics.seednoise's rule); then demote each promoted layer back and keep it demoted when the race
still passes (1-minimal).

Each trial races one recipe (`MODE+plan:FILE`, every candidate layer listed) with seed replicates; the baseline is
raced once, first (a CPU race is deterministic, so its lanes would be the same in every trial). A trial the search
made already is read back, not raced again."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from amp_core.config import ConfigError, RunConfig
from amp_core.diagnostics.plan_report import LADDER, LAST_K, Figures, PlanReport, PlanSearchConfig, Trial
from amp_core.diagnostics.seednoise import DIFFERENCE_RULE, difference_verdict
from amp_core.formats.plan import matmul_formats, write_plan
from amp_core.precision import availability, low_precision_dtype, parse_recipe, recipe_mode, resolve_device


class Stopped(Exception):
    """The search was stopped from another thread."""


def lane_format(recipe: str) -> str:
    """The format a lane of `recipe` gives a Linear a plan does not name: its matmul option, else its mode's
    autocast dtype (fp32 for 32-true)."""
    _, options = parse_recipe(recipe)
    option = next((o for o in options if o.name in matmul_formats()), None)
    if option is not None:
        return option.name
    dtype = low_precision_dtype(recipe_mode(recipe))
    return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[dtype]


def _target_format(target: str) -> str:
    try:
        return lane_format(target)
    except ValueError as error:
        raise ConfigError("target", str(error)) from None


def check(config: PlanSearchConfig) -> tuple[RunConfig, str, list[str], dict[str, str]]:
    """(the race's base config, the target format, the candidate layers, the layers it skips) — ConfigError naming
    the field for a workload, target or baseline this device or model cannot use."""
    from amp_core.workloads import WORKLOADS

    if config.workload not in WORKLOADS:
        raise ConfigError("workload", f"unknown workload {config.workload!r}; choose from {', '.join(WORKLOADS)}")
    device = resolve_device(config.device)
    for name, recipe in (("target", config.target), ("baseline", config.baseline)):
        ok, why = availability(recipe, device)
        if not ok:
            raise ConfigError(name, f"{recipe} cannot run on {device}: {why}")
    if "+plan:" in config.target or "+keep:" in config.target:
        raise ConfigError("target", "name a recipe without +plan: or +keep: (the search writes the plan)")
    target_format = _target_format(config.target)
    if target_format not in LADDER:
        raise ConfigError("target", f"{config.target} leaves nothing to promote (it computes in {target_format})")
    base = RunConfig(workload=config.workload, size=config.size, device=device, modes=(config.baseline,),
                     seeds=config.seeds, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                     snapshot_every=0, name=f"plan · {config.workload}")
    model, _ = WORKLOADS[config.workload].seeded_model_and_batch(base)
    option = next((o for o in parse_recipe(config.target)[1] if o.name in matmul_formats()), None)
    if option is not None:
        converted, skipped = option.plan(model, device)
        if not converted:
            raise ConfigError("target", option.refuses_model(model, device))
    else:
        converted = [name for name, layer in model.named_modules() if type(layer) is torch.nn.Linear]
        skipped = {}
        if not converted:
            raise ConfigError("target", f"{type(model).__name__} has no nn.Linear layer to plan")
    return base, target_format, converted, skipped


def evidence_order(config: PlanSearchConfig, base: RunConfig, target_format: str,
                   candidates: list[str]) -> tuple[list[tuple[str, float, float, str]], float, str]:
    """The candidates, most hurt first: each layer's lowest operand SNR in the target's block format (MXFP8's for
    an FP8 or 16-bit target: the nearest block format measured), then its flush share. Returns (rows, threshold dB,
    the format measured)."""
    from amp_core.probes.block_numerics import FORMAT_NAMES, probe_workload_formats

    measured = target_format if target_format in FORMAT_NAMES else "mxfp8"
    report = probe_workload_formats(config.workload, (measured,), size=config.size, device=base.device,
                                    seed=base.seed, batch_size=config.batch_size)
    rows = []
    for name in candidates:
        mine = [o for o in report.operands if o.layer == name]
        worst = min(mine, key=lambda o: o.snr_db) if mine else None
        flush = max((o.flush_share for o in mine), default=0.0)
        rows.append((name, worst.snr_db if worst else math.inf, flush,
                     f"{worst.operand}: {worst.why}" if worst else "not measured"))
    rows.sort(key=lambda row: (row[1], -row[2]))
    return rows, report.thresholds_db[measured], measured


def matmul_flops(workload: str, base: RunConfig) -> dict[str, float]:
    """Matmul FLOPs of one training step per Linear layer (2·rows·in·out for the forward GEMM and each of the two
    backward ones), plus '(not a Linear)': the rest of the step's matmuls (attention's, say), counted by torch's
    FlopCounterMode over a forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from amp_core.workloads import WORKLOADS

    spec = WORKLOADS[workload]
    model, batch = spec.seeded_model_and_batch(base)
    rows: dict[str, float] = {}
    handles = []
    for name, layer in model.named_modules():
        if type(layer) is torch.nn.Linear:
            def count(layer, args, output, name=name):
                rows[name] = rows.get(name, 0.0) + args[0].numel() / layer.in_features
            handles.append(layer.register_forward_hook(count))
    inputs, target = batch
    with FlopCounterMode(display=False) as counter:
        spec.loss(model(inputs), target).backward()
    for handle in handles:
        handle.remove()
    flops = {name: 6.0 * n * layer.in_features * layer.out_features
             for name, layer in model.named_modules() if name in rows for n in (rows[name],)}
    rest = float(counter.get_total_flops()) - sum(flops.values())
    if rest > 0.01 * sum(flops.values()):
        flops["(not a Linear)"] = rest
    return flops


def search(config: PlanSearchConfig, store, *, progress: Callable[[str, float], None] | None = None,
           stop: threading.Event | None = None) -> PlanReport:
    """Find the plan (see the module's docstring) within `config.budget_s`, every race kept in `store`."""
    from amp_core.race.runner import RunManager

    began = time.monotonic()
    say = progress or (lambda message, fraction: None)
    stop = stop or threading.Event()
    base, target_format, candidates, _ = check(config)
    rungs = LADDER[target_format]
    mode = recipe_mode(config.target)
    out = Path(config.plan_path or f"plan-{config.workload}-{target_format}.toml").resolve()
    trial_dir = out.with_suffix(".trials")
    say(f"block numerics of {len(candidates)} layers in {target_format}", 0.02)
    evidence, threshold, measured = evidence_order(config, base, target_format, candidates)
    order = [row[0] for row in evidence]
    report = PlanReport(config=config, target_format=target_format, candidates=candidates, evidence=evidence,
                        threshold_db=threshold, evidence_format=measured, device=base.device,
                        flops=matmul_flops(config.workload, base))
    option = next((o for o in parse_recipe(config.target)[1] if o.name in matmul_formats()), None)
    report.native = bool(option is not None and base.device.startswith("cuda") and
                         (option.native(base.device) if hasattr(option, "native") else True))
    manager = RunManager(store, max_running=1)
    cache: dict[tuple[frozenset, str], Trial] = {}

    def race(recipe: str, label: str) -> Figures:
        if stop.is_set():
            raise Stopped("stopped")
        run = manager.launch(replace(base, modes=(recipe,), name=f"plan · {config.workload} · {label}"))
        while run.alive:
            run.join(0.5)
            if stop.is_set():
                run.stop()
                raise Stopped("stopped")
        return figures_of(manager, run.run_id, recipe)

    def judge(figures: Figures) -> str:
        reference = report.baseline
        if figures.finite < len(figures.losses):
            return f"fails: {len(figures.losses) - figures.finite} of {len(figures.losses)} seeds lost their loss"
        verdict, threshold_loss = difference_verdict(figures.mean, figures.sd, figures.finite, reference.mean,
                                                     reference.sd, reference.finite)
        gap = figures.mean - reference.mean
        if verdict == "different" and gap > 0:
            return f"fails: loss {figures.mean:.4f} vs {reference.mean:.4f} (+{gap:.4f} > {threshold_loss:.4f})"
        return "passes"

    def trial(promoted: tuple[str, ...], rung: str, what: str) -> Trial:
        key = (frozenset(promoted), rung)
        if key in cache:
            return cache[key]
        if time.monotonic() - began > config.budget_s:
            raise TimeoutError
        number = len(report.trials) + 1
        say(f"trial {number}: {what}", min(0.1 + 0.8 * (time.monotonic() - began) / config.budget_s, 0.9))
        formats = {name: (rung if name in promoted else target_format) for name in candidates}
        path = write_plan(trial_dir / f"trial-{number}.toml", formats, header=(f"amp-lab plan trial {number}: {what}",))
        t0 = time.monotonic()
        figures = race(f"{mode}+plan:{path}", f"trial {number}")
        done = Trial(number=number, promoted=tuple(promoted), rung=rung, what=what, figures=figures,
                     verdict=judge(figures), seconds=time.monotonic() - t0)
        report.trials.append(done)
        cache[key] = done
        return done

    try:
        say(f"baseline {config.baseline} × {config.seeds} seeds × {config.steps} steps", 0.05)
        report.baseline = race(config.baseline, "baseline")
        promoted: tuple[str, ...] = ()
        rung = rungs[0]
        if trial((), rung, f"the target as it is ({config.target})").passed:
            report.found, report.why = True, f"{config.target} trains within seed noise of {config.baseline} as it is"
        else:
            for rung in rungs:  # the lowest rung at which promoting every layer passes
                if trial(tuple(order), rung, f"every layer in {rung}").passed:
                    break
            else:
                report.why = (f"promoting every layer to {rungs[-1]} still trains worse than {config.baseline}: what "
                              "fails is outside the Linear layers")
                rung = ""
            if rung:
                below = sum(1 for row in evidence if row[1] < threshold)
                size = max(1, below)
                while True:
                    promoted = tuple(order[:size])
                    if size >= len(order) or trial(promoted, rung, f"the {size} most hurt in {rung}").passed:
                        break
                    size = min(len(order), size * 2)
                for name in reversed(promoted):  # least evidence first: the likeliest to go
                    fewer = tuple(n for n in promoted if n != name)
                    outcome = trial(fewer, rung, f"without {name}")
                    if outcome.passed:
                        promoted = fewer
                    else:
                        report.minimal.append(f"without {name}: {outcome.verdict.removeprefix('fails: ')}")
                report.plan = {name: rung for name in order if name in promoted}
                report.found = True
                report.why = (f"{len(promoted)} of {len(candidates)} layers promoted to {rung}: trains within seed "
                              f"noise of {config.baseline}")
    except TimeoutError:
        report.stopped = f"the budget of {config.budget_s:.0f} s ran out after {len(report.trials)} trials"
        passing = [t for t in report.trials if t.passed]
        if passing:
            best = min(passing, key=lambda t: len(t.promoted))
            report.plan = {name: best.rung for name in order if name in best.promoted}
            report.found = True
            report.why = f"the smallest passing set so far ({len(best.promoted)} layers), perhaps not minimal"
        else:
            report.why = "no passing plan within the budget"
    if report.found:
        _finish(report, manager, mode, out, race, say)
    report.seconds = time.monotonic() - began
    say(report.why, 1.0)
    return report


def _finish(report: PlanReport, manager, mode: str, out: Path, race, say) -> None:
    """Write the plan file (only the promoted layers: the rest take the target's recipe) and race it beside the
    target and the baseline from the same weights."""
    config = report.config
    comments = {name: f"{snr:.1f} dB ({why})" for name, snr, _, why in report.evidence}
    header = (f"amp-lab plan --workload {config.workload} --size {config.size} --target {config.target} "
              f"--baseline {config.baseline}", f"unlisted Linear layers: {report.target_format} ({config.target})",
              DIFFERENCE_RULE)
    if len(report.plan) == len(report.candidates):  # nothing left for the target's option to convert
        formats, recipe = report.formats(), mode
    else:
        formats, recipe = report.plan, config.target
    if formats:
        report.plan_file = str(write_plan(out, formats, comments, header))
        report.plan_recipe = f"{recipe}+plan:{report.plan_file}"
    else:
        report.plan_recipe = config.target
    if not report.native:
        # Emulated formats: their step time is the emulation's, so an interleaved race would add no figure the
        # trials lack; each trial raced from the same weights and seeds, and a CPU race is deterministic.
        chosen = next(t for t in reversed(report.trials) if t.passed and set(t.promoted) == set(report.plan))
        report.final = {config.baseline: report.baseline, config.target: report.trials[0].figures,
                        report.plan_recipe: replace(chosen.figures, recipe=report.plan_recipe)}
        return
    say(f"final race: {config.baseline}, {config.target}, {report.plan_recipe}", 0.92)
    modes = tuple(dict.fromkeys((config.baseline, config.target, report.plan_recipe)))
    run = manager.launch(replace(_base_of(report), modes=modes, name=f"plan · {config.workload} · final race"))
    run.join()
    report.final = {recipe: figures_of(manager, run.run_id, recipe) for recipe in modes}


def figures_of(reader, run_id: str, recipe: str) -> Figures:
    """`recipe`'s lanes in a run: each seed's final loss (NaN for a lane that diverged), their median ms/step."""
    series = {lane.lane: lane for lane in reader.lane_series(run_id) if lane.rank == 0}
    lanes = [lane for lane in reader.run_info(run_id).lanes if lane.mode == recipe and lane.lane in series]
    losses = tuple(series[lane.lane].final_loss(LAST_K) if lane.status != "diverged" else math.nan for lane in lanes)
    ms = [series[lane.lane].stats.median_step_ms for lane in lanes]
    return Figures(recipe=recipe, losses=losses, ms=float(np.median(ms)) if ms else math.nan, run_id=run_id)


def _base_of(report: PlanReport) -> RunConfig:
    config = report.config
    return RunConfig(workload=config.workload, size=config.size, device=report.device, modes=(config.baseline,),
                     seeds=config.seeds, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                     snapshot_every=0)


def plan_hint(recipe: str, workload: str, size: str, baseline: str) -> str:
    """For a recipe with a matmul format that trains worse than `baseline` (the advisor's rejection): the plan search
    that may save it, as a command ("" for a recipe a plan cannot help: no matmul format, or one with a keep or plan
    already)."""
    try:
        options = parse_recipe(recipe)[1]
    except ValueError:
        return ""
    if "+plan:" in recipe or "+keep:" in recipe or not any(o.name in matmul_formats() for o in options):
        return ""
    return (f"a per-layer plan may save it — amp-lab plan --workload {workload} --size {size} --target {recipe} "
            f"--baseline {baseline}: promotes the layers that hurt most until it trains like {baseline} "
            "(docs/plans.md)")


class PlanJob:
    """`search` off the caller's thread (a page's *Find a plan* button): the input is checked at once (ConfigError);
    `progress` lists what it did, `stop()` ends it within a lane step, `done` says when `report` (or `error`, one
    line) is there."""

    def __init__(self, config: PlanSearchConfig, store):
        from amp_core import background

        check(config)
        self.config, self.store = config, store
        self.progress: list[tuple[float, str, float]] = []
        """(seconds since start, message, fraction done)."""
        self.report: PlanReport | None = None
        self.error = ""
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = background.start(self._work, "amp-plan", stop=self.stop)

    def _say(self, message: str, fraction: float) -> None:
        self.progress.append((time.monotonic() - self._started, message, fraction))

    def _work(self) -> None:
        try:
            self.report = search(self.config, self.store, progress=self._say, stop=self._stop)
        except Stopped:
            self.error = "stopped: the races made so far are in the store"
        except Exception as error:  # a page shows one line, not a traceback
            self.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def stop(self) -> None:
        self._stop.set()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()
