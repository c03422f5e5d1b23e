"""The layer bisect: the smallest set of modules that, kept in fp32 (`+keep:`), makes a lane's failure go away, found
by a search that replays the failing step (or window) on copies, and priced by a short race.

Shaped like Polygraphy's `debug precision`: a *marker* object (`KeepSetMarker`: `select()`, `step(passed)`,
`remaining()`) decides what to try next and never sees how a trial runs; the trial (`TrialBench.run`) is a replay
of the lane's recipe plus `+keep:` for the selected modules, from the lane's state before the step, on its own copy,
off the training thread. Unlike Polygraphy (a prefix of layers, for inference), the marker looks for a *set*: the
candidates are ordered by what layer numerics measures on the failing step (the first inf/NaN module, then modules
whose values are not finite, overflow or flush to zero when cast, or differ most from fp32); the search follows the
first inf/NaN module trial by trial, then grows prefixes of that order until one passes, and delta debugging (Zeller's
ddmin, complement-first) then minimises it; a last check drops each member of the set alone and sees the step fail
again (1-minimal, shown in the report).

Each trial keeps its set as `+keep:` does (`precision.keep_in_fp32`): in a mixed mode a kept module's output stays
fp32, so keeping the module whose output leaves the 16-bit range is enough; in a true 16-bit mode it is cast back to
the model's dtype, and the report says that such an output needs its consumer kept too.

A trial passes when every step it replays has a finite loss and finite gradients, no step is skipped after the
GradScaler's warm-up, and the loss is not above the fp32 reference's band (the reference: 32-true replayed from the
same state on the same batches) for `BisectConfig.over_band_steps` steps in a row.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Generator, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from amp_core.config import ConfigError, RunConfig
from amp_core.diagnostics.configs import BisectConfig
from amp_core.diagnostics.jobs import start_job
from amp_core.diagnostics.replay import (
    _fork,
    _from_snapshot,
    _run_threads,
    _step_once,
    resolve_lane,
    start_from_seed,
)
from amp_core.diagnostics.replay_modes import set_rng
from amp_core.precision import (
    BASELINE_MODE,
    KEEP_PREFIX,
    get_precision,
    is_mixed,
    keep_output_note,
    low_precision_dtype,
    recipe_mode,
    resolve_device,
)
from amp_core.precision.switches import pin_intra_op_threads
from amp_core.probes.memory import held_bytes
from amp_core.probes.numerics import probe_step
from amp_core.race.snapshots import ReplayError
from amp_core.race.step import LaneState
from amp_core.runs import SourceKind
from amp_core.workloads import WORKLOADS, Data

BISECTED_EVENT = "bisected"
"""Event kind: a bisect's report (`BisectReport.to_data`), recorded in the run it bisected."""


# --- the marker: what to try next, given the last outcome -----------------------------------------------------------

Outcome = tuple[bool, str]
"""What the marker hears of a trial: whether it passed, and the first inf/NaN module it named ('' for none)."""


def _search(ordered: list[str]) -> Generator[tuple[str, ...], Outcome, list[str]]:
    """Yields keep-sets to try and receives each one's Outcome. Every candidate kept is known to pass and none kept to
    fail. Three phases:
    1. follow the evidence: keep the first suspect; while a trial fails naming a new first inf/NaN module, add it
       (an overflow hides the next one downstream until it is kept);
    2. if that stops short of a pass: growing prefixes of the evidence order (the modules chosen so far first),
       doubling until one passes;
    3. delta debugging on the passing set (ddmin's complement step, for a property that only holds more as more is
       kept): drop a chunk when the rest still passes, else split the chunk in halves and try each; a single module
       that cannot be dropped stays. About 2·k·log2(n) trials for k modules that must stay among n (ddmin's own
       subset-first order needs about n when they are spread out). Returns a 1-minimal passing set."""
    chosen = [ordered[0]]
    passed, named = yield tuple(chosen)
    while not passed and named and named not in chosen:
        chosen.append(named)
        passed, named = yield tuple(chosen)
    pool = chosen
    if not passed:
        pool = [*chosen, *(name for name in ordered if name not in chosen)]
        size = 2 * len(chosen)
        while size < len(pool):
            if (yield tuple(pool[:size]))[0]:
                break
            size *= 2
        pool = pool[:size]
    current = list(pool)
    groups = [current] if len(current) > 1 else []
    while groups:
        group = groups.pop(0)
        rest = [name for name in current if name not in group]
        if (yield tuple(rest))[0]:
            current = rest  # the whole group can go
        elif len(group) > 1:
            middle = len(group) // 2
            groups += [group[:middle], group[middle:]]
    return current


class KeepSetMarker:
    """Polygraphy's marker, for a set: `select()` names the modules to keep in the next trial (None: done), `step(
    passed, named)` takes its outcome (and the first inf/NaN module the failing trial named, if any), `remaining()`
    estimates the trials left. It never runs a trial; a set already tried is answered from memory."""

    def __init__(self, ordered: Iterable[str]):
        self.ordered = list(ordered)
        self.outcomes: dict[frozenset[str], Outcome] = {frozenset(): (False, ""), frozenset(self.ordered): (True, "")}
        self._search = _search(self.ordered)
        self._pending: tuple[str, ...] | None = None
        self.result: list[str] | None = None
        self.best: list[str] = list(self.ordered)
        """The smallest passing set seen so far."""
        self._advance(None)

    def _advance(self, outcome: Outcome | None) -> None:
        try:
            proposal = next(self._search) if outcome is None else self._search.send(outcome)
            while frozenset(proposal) in self.outcomes:  # known: answer from memory, no trial
                proposal = self._search.send(self.outcomes[frozenset(proposal)])
            self._pending = proposal
        except StopIteration as done:
            self._pending, self.result = None, list(done.value)

    def select(self) -> tuple[str, ...] | None:
        return self._pending

    def step(self, passed: bool, named: str = "") -> None:
        if self._pending is None:
            raise RuntimeError("the search is over: nothing was selected")
        chosen = self._pending
        self.outcomes[frozenset(chosen)] = (passed, named)
        if passed and len(chosen) < len(self.best):
            self.best = [name for name in self.ordered if name in chosen]
        self._advance((passed, named))

    def remaining(self) -> int:
        """An estimate of the trials left: about 2·log2 of the modules in the set under trial (ddmin's usual cost for
        one module; more when several must be kept)."""
        if self._pending is None:
            return 0
        return max(1, 2 * math.ceil(math.log2(max(2, len(self._pending)))))


# --- evidence: the order of the candidates --------------------------------------------------------------------------

def candidate_modules(model: torch.nn.Module) -> list[str]:
    """The modules a bisect may keep: every leaf of `named_modules()` (a module with no children). A container is
    kept by keeping its leaves, so the set names the modules that compute."""
    return [name for name, module in model.named_modules() if name and not any(True for _ in module.children())]


def first_candidate(report, candidates: list[str]) -> str:
    """The candidate a NumericsReport's first inf/NaN names: the module itself, or the first leaf inside it whose
    output or gradient held inf/NaN ('' when it names none)."""
    found = report.first_nonfinite
    if found is None:
        return ""
    if found.module in candidates:
        return found.module
    inside = [m.module for m in report.modules if m.module.startswith(f"{found.module}.") and m.module in candidates
              and any(r is not None and r.nonfinite for r in (m.output, m.grad))]
    return inside[0] if inside else ""


def evidence_order(report, candidates: list[str]) -> tuple[list[str], dict[str, str]]:
    """Candidates by what layer numerics measured on the failing step (a NumericsReport): the first inf/NaN module,
    then modules whose output or gradient held inf/NaN (in execution order), then by the largest share of values a cast
    overflows or flushes to zero, then by output error against fp32; modules with no evidence keep the model's order.
    Returns (order, {module: the evidence in words}) for the modules that had any."""
    first = first_candidate(report, candidates)
    low = "bf16" if "bf16" in report.mode else "fp16"
    scores: dict[str, tuple] = {}
    words: dict[str, str] = {}
    for numerics in report.modules:
        name = numerics.module
        if name not in candidates or name in scores:
            continue
        forward = numerics.output is not None and numerics.output.nonfinite > 0
        nonfinite = sum(r.nonfinite for r in (numerics.output, numerics.grad) if r is not None)
        shares = []
        for ranges in (numerics.reference_output, numerics.reference_grad):
            if ranges is None:
                continue
            shares += [ranges.fp16_overflow or 0.0, ranges.fp16_zero or 0.0] if low == "fp16" else \
                [ranges.bf16_zero or 0.0]
        share = max(shares, default=0.0)
        error = numerics.output_error if numerics.output_error is not None and math.isfinite(numerics.output_error) \
            else 0.0
        # Smaller sorts first: the first inf/NaN, then inf/NaN in execution order, then the largest share and error.
        scores[name] = (name != first, 0 if forward else 1 if nonfinite else 2, numerics.order if nonfinite else 0,
                        -share, -error)
        said = []
        if name == first:
            said.append(f"first inf/NaN ({report.first_nonfinite.phase}: {report.first_nonfinite.module})")
        elif nonfinite:
            said.append(f"{nonfinite} inf/NaN values")
        if share > 0:
            said.append(f"{share:.1%} of values overflow or flush to 0 in {low}")
        if error > 0.01:
            said.append(f"output error {error:.1%} against fp32")
        if said:
            words[name] = ", ".join(said)
    position = {name: index for index, name in enumerate(candidates)}
    nothing = (True, 2, 0, 0.0, 0.0)
    ordered = sorted(candidates, key=lambda name: (*scores.get(name, nothing), position[name]))
    return ordered, words


# --- trials ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Trial:
    """One replay with a keep-set."""

    kept: tuple[str, ...]
    passed: bool
    outcome: str
    """What happened, in words ("passes", "step 12: loss inf", "3 steps above the fp32 band")."""
    seconds: float
    first_nonfinite: str = ""
    """The first candidate module that held inf/NaN in the failing step of a trial that failed so (layer numerics'
    probe with the set kept), else ''."""


@dataclass(frozen=True, slots=True)
class PriceRow:
    """One lane of the price race, from the same state on the same batches."""

    recipe: str
    ms_per_step: float
    """Median wall time of a training step."""
    memory_bytes: int
    """Parameters + gradients + optimizer state held after the race (bytes, read from the tensors)."""
    loss: float
    """The last step's loss."""
    skipped: int
    """Optimizer steps skipped (GradScaler) in the race."""
    failure: str = ""
    """The first step of the race that failed as a trial fails (a non-finite loss or gradients, a skip after the
    GradScaler's warm-up), in words; '' when none did."""

    @property
    def loss_text(self) -> str:
        """The last loss as a table shows it: "inf/NaN" where it is not finite (a failing lane's)."""
        return f"{self.loss:.4g}" if math.isfinite(self.loss) else "inf/NaN"


@dataclass(slots=True)
class BisectReport:
    run_id: str
    lane: int
    recipe: str
    first_step: int
    last_step: int
    """The steps replayed: first_step..last_step (one step, or a window)."""
    source: str
    candidates: int
    kept: list[str]
    """The set (empty when there is none: see `verdict`)."""
    minimal: bool
    """Whether no single module of `kept` can be dropped (False: the budget ran out first)."""
    verdict: str
    """fixed | data | not-fixed | not-reproduced."""
    why: str
    trials: list[Trial]
    seconds: float
    evidence: dict[str, str] = field(default_factory=dict)
    price: list[PriceRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    without: dict[str, str] = field(default_factory=dict)
    """The 1-minimality check: for each member of `kept`, the outcome of the trial that kept the set without it."""

    @property
    def fixed_recipe(self) -> str:
        """The lane's recipe with the set kept: `16-mixed+keep:blocks.3.amp`."""
        return "+".join([self.recipe, *(f"{KEEP_PREFIX}{name}" for name in self.kept)])

    def price_line(self) -> str:
        """'keeping 2 of 48 modules in fp32 fixes it and costs 4 % of the speed' (measured), or why there is none."""
        if self.verdict != "fixed":
            return self.why
        rows = {row.recipe: row for row in self.price}
        own, fixed = rows.get(self.recipe), rows.get(self.fixed_recipe)
        count = f"keeping {len(self.kept)} of {self.candidates} modules in fp32 fixes it"
        if own is None or fixed is None or not own.ms_per_step > 0:
            return count
        slower = fixed.ms_per_step / own.ms_per_step - 1
        speed = f"costs {slower:.0%} of the speed" if slower > 0.005 else \
            "costs no measurable speed" if slower > -0.005 else \
            f"runs {-slower:.0%} faster than the failing lane here"
        memory = fixed.memory_bytes - own.memory_bytes
        held = f", {memory / 2**20:+.2f} MiB held" if memory else ""
        if memory and own.skipped:  # a skipped step never reaches the optimizer, which makes its state on its first
            held += f", the failing lane skipped {own.skipped} steps and made no optimizer state"
        reference = rows.get(BASELINE_MODE)
        versus = ""
        if reference is not None and reference.ms_per_step > 0:
            versus = f"; 32-true runs at {reference.ms_per_step / own.ms_per_step:.2f}x the original's ms/step"
        return f"{count} and {speed} ({own.ms_per_step:.2f} -> {fixed.ms_per_step:.2f} ms/step{held}){versus}" \
               " (measured)"

    def to_data(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in BisectReport.__slots__ if name not in ("trials", "price")}
        data["trials"] = [asdict(trial) for trial in self.trials]
        data["price"] = [asdict(row) for row in self.price]
        return data

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> BisectReport:
        fields = {key: value for key, value in data.items() if key in cls.__slots__}
        fields["trials"] = [Trial(**{**trial, "kept": tuple(trial["kept"])}) for trial in data.get("trials", [])]
        # A NaN or inf loss went into the store's JSON as null: back as NaN, what the race read.
        fields["price"] = [PriceRow(**{**row, "loss": math.nan if row.get("loss") is None else row["loss"]})
                           for row in data.get("price", [])]
        return cls(**fields)


class TrialBench:
    """Runs trials: the lane's recipe plus `+keep:` for a set, forked from the state before the first step, stepped
    over the same batches from the same random state. The marker never sees it."""

    def __init__(self, config: RunConfig, pre: LaneState, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 first_step: int, rng: list[torch.Tensor], check: BisectConfig, warmup_end: int,
                 judged_from: int | None = None):
        self.config, self.pre, self.batches, self.first_step = config, pre, batches, first_step
        self.judged_from = first_step if judged_from is None else judged_from
        """The loss is held to the fp32 band from this step (a window's first); every replayed step must be finite."""
        self.rng, self.check, self.warmup_end = rng, check, warmup_end
        self.recipe = pre.precision.recipe
        self.device = pre.precision.device
        self.reference: list[float] = []

    def fork(self, recipe: str) -> LaneState:
        precision = get_precision(recipe, self.device)
        scale = self.pre.scaler.get_scale() if self.pre.scaler.is_enabled() and precision.uses_scaler else None
        return _fork(self.config, self.pre, precision, scale)

    def recipe_with(self, kept: Iterable[str]) -> str:
        return "+".join([self.recipe, *(f"{KEEP_PREFIX}{name}" for name in kept)])

    def steps(self, state: LaneState) -> list[tuple[float, bool, bool]]:
        """(loss, gradients finite, skipped) of each replayed step."""
        out = []
        set_rng(self.rng, self.device)
        for offset, batch in enumerate(self.batches):
            result = _step_once(state, batch, self.first_step + offset)
            grads = [p.grad for p in state.params if p.grad is not None]
            finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
            out.append((float(result.loss), finite, bool(result.skipped)))
        return out

    def measure_reference(self) -> str:
        """Replay 32-true over the steps (the band's reference); returns '' or why fp32 itself fails (data)."""
        rows = self.steps(self.fork(BASELINE_MODE))
        self.reference = [loss for loss, _, _ in rows]
        for offset, (loss, finite, _) in enumerate(rows):
            if not math.isfinite(loss) or not finite:
                return f"step {self.first_step + offset}: fp32 too has loss {loss:.4g}" + \
                       ("" if finite else " and inf/NaN gradients")
        return ""

    def judge(self, rows: list[tuple[float, bool, bool]]) -> str:
        """'' (passes) or the first reason it fails."""
        above = 0
        needed = min(self.check.over_band_steps, len(rows) - (self.judged_from - self.first_step))
        for offset, (loss, finite, skipped) in enumerate(rows):
            step = self.first_step + offset
            if not math.isfinite(loss):
                return f"step {step}: loss {loss}"
            if not finite:
                return f"step {step}: inf/NaN gradients"
            if skipped and step >= self.warmup_end:
                return f"step {step}: skipped by the GradScaler after its warm-up"
            reference = self.reference[offset] if offset < len(self.reference) else math.nan
            if step >= self.judged_from and math.isfinite(reference) and \
                    loss > reference + self.check.band_rel * abs(reference):
                above += 1
                if above >= needed:
                    return f"{above} step{'s' if above > 1 else ''} to {step} above the fp32 band (loss {loss:.4g} " \
                           f"vs fp32 {reference:.4g})"
            else:
                above = 0
        return ""

    def run(self, kept: Iterable[str], candidates: list[str] | None = None) -> Trial:
        """One trial with `kept` kept in fp32. A trial that fails with inf/NaN is probed (layer numerics, the set
        kept) on the step that failed, for the first candidate module that held inf/NaN there."""
        kept = tuple(kept)
        began = time.perf_counter()
        rows = self.steps(self.fork(self.recipe_with(kept)))
        why = self.judge(rows)
        named = ""
        broken = next((offset for offset, (loss, finite, _) in enumerate(rows)
                       if not (math.isfinite(loss) and finite)), None)
        if why and candidates and broken is not None and broken == 0:
            named = self.first_nonfinite(self.recipe_with(kept), candidates)
        return Trial(kept=kept, passed=not why, outcome=why or "passes", seconds=time.perf_counter() - began,
                     first_nonfinite=named)

    def first_nonfinite(self, recipe: str, candidates: list[str]) -> str:
        """The first candidate that held inf/NaN in the first step under `recipe` (a container names its first leaf
        that did; the loss or the model as a whole name none)."""
        precision = get_precision(recipe, self.device)
        scale = self.pre.scaler.get_scale() if self.pre.scaler.is_enabled() and precision.uses_scaler else None
        set_rng(self.rng, self.device)
        report = probe_step(copy.deepcopy(self.pre.model).float(), precision, self.pre.workload.loss,
                            self.batches[0], scale=scale)
        return first_candidate(report, candidates)

    def price(self, fixed_recipe: str, data: Data, order: torch.Generator, steps: int) -> list[PriceRow]:
        """A short race from the same state: the lane as it is, the fixed lane, 32-true; interleaved step by step so
        machine noise hits them alike."""
        recipes = list(dict.fromkeys([self.recipe, fixed_recipe, BASELINE_MODE]))
        states = [self.fork(recipe) for recipe in recipes]
        batches = [*self.batches, *(data.sample(order, self.config.batch_size)
                                    for _ in range(max(0, steps - len(self.batches))))][:steps]
        times: list[list[float]] = [[] for _ in recipes]
        last = [math.nan] * len(recipes)
        skipped = [0] * len(recipes)
        failure = [""] * len(recipes)
        rng = [self.rng[0].clone(), *self.rng[1:]]
        for offset, batch in enumerate(batches):
            for index, state in enumerate(states):
                set_rng(rng, self.device)
                began = time.perf_counter()
                result = _step_once(state, batch, self.first_step + offset)  # resolved: on CUDA a sync per step here
                times[index].append((time.perf_counter() - began) * 1e3)
                last[index] = float(result.loss)
                skipped[index] += bool(result.skipped)
                step = self.first_step + offset
                if not failure[index]:
                    failure[index] = (f"step {step}: loss {last[index]:.4g}" if not math.isfinite(last[index]) else
                                      f"step {step}: skipped by the GradScaler after its warm-up"
                                      if result.skipped and step >= self.warmup_end else "")
        return [PriceRow(recipe=recipe, ms_per_step=statistics.median(times[index]),
                         memory_bytes=sum(held_bytes(states[index].params, states[index].optimizer)),
                         loss=last[index], skipped=skipped[index], failure=failure[index])
                for index, recipe in enumerate(recipes)]


# --- finding the step, and the whole search --------------------------------------------------------------------------

def failing_step(frame, lane: int) -> int | None:
    """The lane's first failed step in its records: a non-finite loss, or a skipped step after the GradScaler's warm-up
    (its first skips with a finite loss, before any step was applied). None: no such step."""
    mine = frame[frame["lane"] == lane].sort_values("step")
    applied = False
    for step, loss, skipped in zip(mine["step"], mine["loss"], mine["skipped"].fillna(False), strict=True):
        if not math.isfinite(float(loss)):
            return int(step)
        if bool(skipped):
            if applied:
                return int(step)
        else:
            applied = True
    return None


def warmup_end(frame, lane: int) -> int:
    """The first step the lane applied (the GradScaler's warm-up skips come before it; 0 without a scaler)."""
    mine = frame[frame["lane"] == lane].sort_values("step")
    applied = mine[~mine["skipped"].fillna(False).astype(bool) & mine["loss"].astype(float).map(math.isfinite)]
    return int(applied["step"].iloc[0]) if len(applied) else 0


def divergence_window(frame, lane: int, reference_lane: int, check: BisectConfig) -> tuple[int, int] | None:
    """(A, B): the first `over_band_steps` steps in a row where the lane's loss is above the reference lane's band
    (A inclusive, B exclusive), or None."""
    mine = frame[frame["lane"] == lane].set_index("step")["loss"].astype(float)
    theirs = frame[frame["lane"] == reference_lane].set_index("step")["loss"].astype(float)
    run = 0
    for step in sorted(set(mine.index) & set(theirs.index)):
        reference = theirs[step]
        if math.isfinite(reference) and mine[step] > reference + check.band_rel * abs(reference):
            run += 1
            if run >= check.over_band_steps:
                return step - run + 1, step + 1
        else:
            run = 0
    return None


def _parse_window(window: str) -> tuple[int, int]:
    try:
        first, last = (int(part) for part in window.split(":"))
    except ValueError:
        raise ConfigError("window", f"write A:B (steps A to B-1), got {window!r}") from None
    if first < 0 or last <= first:
        raise ConfigError("window", f"needs 0 <= A < B, got {window!r}")
    return first, last


def bisect_run(manager: Any, run_id: str, lane: str | int, *, step: int | None = None, window: str | None = None,
               check: BisectConfig | None = None, record: bool = False) -> BisectReport:
    """Find the smallest set of modules of lane `lane` of run `run_id` that, kept in fp32, makes its failure go away
    (at `step`, over `window` 'A:B', or at the first failure its records show), with every trial and the price.
    ReplayError / ConfigError naming the field for a run, lane or step it cannot bisect; `record`: the report becomes
    a `bisected` event of the run."""
    check = check or BisectConfig()
    if step is not None and window is not None:
        raise ConfigError("window", "give --step or --window, not both")
    info = manager.run_info(run_id)
    if info is None:
        raise ReplayError("run", f"no run {run_id!r} in this process or the store")
    index = resolve_lane(info, lane)
    entry = next(e for e in info.lanes if e.lane == index)
    if info.kind in (SourceKind.MONITOR, SourceKind.INTEGRATION):
        raise ReplayError("run", f"run {run_id} is an attached run: a bisect re-runs the failing step with modules "
                                 "kept in fp32 and needs the state before it (weights, optimizer, scaler), its batch "
                                 "and the loss, which live in the process that wrote it, not in the store. Its first "
                                 "inf/NaN events name the module of the failing step: keep it there with "
                                 "amp_core.fixes.keep_in_fp32(model, [name])")
    config = RunConfig.from_dict(info.config)
    if config.workload not in WORKLOADS:
        raise ReplayError("run", f"workload {config.workload!r} is not registered in this process (load its plugin "
                                 "module to bisect it)")
    if low_precision_dtype(recipe_mode(entry.mode)) is None:
        raise ReplayError("lane", f"lane {index} is {entry.mode}: it computes in fp32, so there is nothing to keep")
    done = entry.steps_done
    frame = manager.steps(run_id, 0, done)
    reference_lane = next((e.lane for e in info.lanes if e.mode == BASELINE_MODE
                           and e.meta.get("seed") == entry.meta.get("seed")), None)
    if window is not None:
        first, stop = _parse_window(window)
    elif step is not None:
        first, stop = step, step + 1
    else:
        failed = failing_step(frame, index)
        if failed is not None:
            first, stop = failed, failed + 1
        else:
            found = divergence_window(frame, index, reference_lane, check) if reference_lane is not None else None
            if found is None:
                against = "the 32-true lane's band" if reference_lane is not None else "(no 32-true lane to compare)"
                raise ReplayError("lane", f"lane {index} ({entry.mode}) did not fail: no inf/NaN loss, no skipped "
                                          f"step after the scaler's warm-up, no {check.over_band_steps} steps above "
                                          f"{against} in steps 0-{done - 1}; name --step S or --window A:B to bisect "
                                          "anyway")
            first, stop = found
    if stop > done:
        asked = f"window {first}:{stop}" if stop > first + 1 else f"step {first}"
        raise ReplayError("step", f"lane {index} ({entry.mode}) has recorded steps 0-{done - 1}; {asked} is out of "
                                  "them")
    workload = WORKLOADS[config.workload]
    run = manager.get(run_id)
    device = resolve_device(config.device)
    mode, seed = entry.mode, entry.meta.get("seed", config.seed)
    if run is not None:
        device, data = run.device, run.data
        if data is None:
            raise ReplayError("run", f"run {run_id} has not loaded its data yet")
        usable = [s for s in run.snapshots.steps(index) if s <= first]
        if not usable:
            held = run.snapshots.steps(index)
            raise ReplayError("step", f"no snapshot of lane {index} at or before step {first}; it holds snapshots of "
                                      f"steps {', '.join(map(str, held)) or 'none'} (one every "
                                      f"{run.snapshots.every}): bisect a step at or after {held[0] if held else 0}"
                                      if held else f"no snapshot of lane {index} at or before step {first} (it keeps "
                                      "none: snapshot_every is 0 or the lane has not reached one)")
        with run.snapshots.lease(index, first) as snapshot:  # on CUDA its pinned buffers stay its own meanwhile
            start = _from_snapshot(config, index, mode, snapshot, workload, data, device)
    else:
        data, start = start_from_seed(config, index, mode, seed, workload, device)
    threads = _run_threads(manager.events(run_id))
    report = bisect_from(config, start, data, first, stop, check, run_id=run_id, lane=index,
                         warmup=warmup_end(frame, index), threads=threads)
    if record:
        record_bisect(manager, report)
    return report


def bisect_from(config: RunConfig, start, data: Data, first: int, stop: int, check: BisectConfig, *, run_id: str,
                lane: int, warmup: int, threads: int | None = None) -> BisectReport:
    """The search from `start` (the lane's state at start.step <= first): re-train the lane's recipe to `first`,
    order the candidates by the failing step's numerics, run the marker's trials, price the answer."""
    began = time.perf_counter()
    own_threads = torch.get_num_threads()
    if threads:
        pin_intra_op_threads(threads)
    devices = [torch.device(start.state.precision.device)] if start.state.precision.device_type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):  # the trials' draws leave the process's RNG as it was
            set_rng(start.rng, start.state.precision.device)
            state, batch = start.state, start.batch
            # One failing step: re-train to it once, and each trial replays that step alone. A window: each trial
            # replays from the snapshot through the window (a slow divergence builds up over the steps before it).
            replay_from = first if stop == first + 1 else start.step
            for s in range(start.step, replay_from):
                _step_once(state, batch, s)
                batch = data.sample(start.data_order, config.batch_size)
            batches = [batch, *(data.sample(start.data_order, config.batch_size)
                                for _ in range(replay_from + 1, stop))]
            rng = [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
            bench = TrialBench(config, state, batches, replay_from, rng, check, warmup, judged_from=first)
            report = _search_and_price(bench, start.source, data, start.data_order, check, run_id, lane, stop)
    finally:
        if threads:
            pin_intra_op_threads(own_threads)
    report.seconds = time.perf_counter() - began
    return report


def _search_and_price(bench: TrialBench, source: str, data: Data, order: torch.Generator, check: BisectConfig,
                      run_id: str, lane: int, stop: int) -> BisectReport:
    pre, recipe = bench.pre, bench.recipe
    candidates = candidate_modules(pre.model)
    base = dict(run_id=run_id, lane=lane, recipe=recipe, first_step=bench.judged_from, last_step=stop - 1,
                source=source, candidates=len(candidates), seconds=0.0)
    trials: list[Trial] = []
    data_says = bench.measure_reference()
    if data_says:
        return BisectReport(**base, kept=[], minimal=False, verdict="data", trials=trials,
                            why=f"the failure is data, not precision: {data_says} on replay, so no set of modules "
                                "kept in fp32 can fix it")
    as_is = bench.run(())
    trials.append(as_is)
    if as_is.passed:
        return BisectReport(**base, kept=[], minimal=False, verdict="not-reproduced", trials=trials,
                            why=f"the lane does not fail when its step{'s' if stop - bench.first_step > 1 else ''} "
                                "are replayed from its snapshot (nothing to fix here; a model that draws random "
                                "numbers, or another step, may be the cause)")
    every = bench.run(candidates)
    trials.append(every)
    if not every.passed:
        inside = ("what fails is outside the modules (the loss, the scaler, the optimizer state)" if is_mixed(
            recipe_mode(recipe)) else f"{keep_output_note(recipe)} — here the code after a module (in the forward of "
            "the module that holds it) may be what needs the fp32 output: keep that container (+keep:NAME)")
        return BisectReport(**base, kept=[], minimal=False, verdict="not-fixed", trials=trials,
                            why=f"keeping every module in fp32 does not fix it ({every.outcome}), though 32-true "
                                f"passes: {inside}")
    scale = pre.scaler.get_scale() if pre.scaler.is_enabled() else None
    set_rng(bench.rng, bench.device)
    numerics = probe_step(copy.deepcopy(pre.model).float(), pre.precision, pre.workload.loss, bench.batches[0],
                          scale=scale)
    ordered, evidence = evidence_order(numerics, candidates)
    marker = KeepSetMarker(ordered)
    while (chosen := marker.select()) is not None and len(trials) < check.budget:
        trial = bench.run(chosen, candidates)
        trials.append(trial)
        marker.step(trial.passed, trial.first_nonfinite)
    kept = marker.result if marker.result is not None else marker.best
    kept, without = _one_minimal(kept, ordered, trials, bench, candidates, check.budget)
    minimal = without is not None
    notes = [] if minimal else [f"the trial budget ({check.budget}) ran out before the set was minimal: this is the "
                                f"smallest passing set found ({len(kept)} modules), perhaps not the smallest"]
    report = BisectReport(**base, kept=list(kept), minimal=minimal, verdict="fixed", trials=trials, why="",
                          evidence={name: evidence[name] for name in ordered if name in evidence}, notes=notes,
                          without=without or {})
    report.price = bench.price(report.fixed_recipe, data, order, check.price_steps)
    fixed = next(row for row in report.price if row.recipe == report.fixed_recipe)
    if fixed.failure:  # a set that passes the bisected step but not the race after it is no fix: never printed as one
        report.verdict = "not-fixed"
        report.why = (f"keeping {', '.join(kept)} passes the bisected step{'s' if stop - bench.first_step > 1 else ''}"
                      f" but not the price race after it ({fixed.failure}): not a fix; bisect that later step "
                      "(--step) or a window (--window A:B) that holds both")
    return report


def _one_minimal(kept: list[str], ordered: list[str], trials: list[Trial], bench: TrialBench,
                 candidates: list[str], budget: int) -> tuple[list[str], dict[str, str] | None]:
    """The 1-minimality check of a passing set: for each member, the trial that keeps the set without it (one the
    search made already is read back, not run again) must fail. A member whose removal passes is dropped and the
    check starts over. Returns (the set, {member: outcome without it}), or (the set, None) when the budget ran out
    before every member was checked."""
    def known(chosen: frozenset[str]) -> Trial | None:
        return next((trial for trial in reversed(trials) if frozenset(trial.kept) == chosen), None)

    current = list(kept)
    while True:
        without: dict[str, str] = {}
        for name in current:
            rest = frozenset(current) - {name}
            if not rest:
                without[name] = trials[0].outcome  # the lane as it is (trial 1) keeps nothing
                continue
            trial = known(rest)
            if trial is None:
                if len(trials) >= budget:
                    return current, None
                trial = bench.run([m for m in ordered if m in rest], candidates)
                trials.append(trial)
            if trial.passed:
                current = [m for m in current if m != name]
                break
            without[name] = trial.outcome
        else:
            return current, without


def record_bisect(manager: Any, report: BisectReport) -> None:
    """The report as a `bisected` event of its run: the pages, the CLI and a workshop scenario read it back."""
    manager.record_event(report.run_id, BISECTED_EVENT, f"steps {report.first_step}-{report.last_step} bisected: "
                                                        f"{report.price_line()}", report.lane, report.first_step,
                         report=report.to_data())


def recorded_bisects(events, lane: int | None = None) -> list[BisectReport]:
    """The bisects recorded in a run's events (of `lane`, or every lane), oldest first."""
    if events.empty:
        return []
    mine = events[events["kind"] == BISECTED_EVENT]
    if lane is not None:
        mine = mine[mine["lane"] == lane]
    return [BisectReport.from_data(data["report"]) for data in mine["data"]
            if isinstance(data, dict) and "report" in data]


@dataclass(eq=False)
class BisectJob:
    """A bisect running on a thread of its own (a page starts it and polls `done`; the training thread and the
    page's script are never held up). `report` when it ended with one, else `error` (a ConfigError's field and why,
    or an unexpected exception's words)."""

    run_id: str
    lane: int | str
    report: BisectReport | None = None
    error: str = ""
    done: bool = False


def start_bisect(manager: Any, run_id: str, lane: int | str, *, step: int | None = None, window: str | None = None,
                 check: BisectConfig | None = None) -> BisectJob:
    """Run `bisect_run(..., record=True)` on a background thread (amp_core.background: stopped at exit)."""
    return start_job(BisectJob(run_id, lane), "report",
                     lambda: bisect_run(manager, run_id, lane, step=step, window=window, check=check, record=True),
                     f"amp-bisect-{run_id}-{lane}")


def fixed_race_config(config: dict, report: BisectReport, steps: int | None = None) -> RunConfig:
    """The run's config with its lanes replaced by the original recipe, the fixed one and 32-true (the live race of
    the fix: same workload, seed and settings)."""
    data = dict(config)
    data["modes"] = list(dict.fromkeys([report.recipe, report.fixed_recipe, BASELINE_MODE]))
    data["seeds"] = 1
    data["name"] = f"fix of run {report.run_id} lane {report.lane}: {report.fixed_recipe}"
    if steps is not None:
        data["steps"] = steps
    data.pop("source", None)
    return RunConfig.from_dict(data)
