"""Does a race tell the truth? Each mode's speed and memory in a K-lane race through the runner, against the same
mode measured alone.

- Speed: a bare PyTorch loop per mode (the seed notes' loop, GradScaler in 16-mixed) times N steps end to end
  (one sync at the end on CUDA); its speedup is 32-true's time per step over the mode's. The race's speedup is what
  the Train page shows (`summarize`: median step time of the 32-true lane over the lane's). Bare loops and the race
  alternate for up to `--rounds` rounds in one process, taking turns to go first; medians of the rounds. The work
  scales with the workload: a round is as many steps per lane as `--steps` asks (plus a bare loop's warm-up, a
  tenth of them, at most WARMUP), and no round starts that would end past `--budget-s` (one round always runs; the
  first line says how many did and how long one took).
- Memory: each lane's figure (`lane_peak_bytes`) in the race against a run of that lane alone, ALONE_STEPS long.

Lanes are modes or recipes (`--modes 32-true,bf16-mixed,bf16-mixed+fp8-rowwise`): the bare loop builds each from
the same Precision object the race does (model preparation, optimizer, autocast, scaler). 32-true is always raced
(the speedups' baseline); an FP8 lane also gets bf16-mixed, and a line with its speedup against bf16-mixed.

    python3 -m bench.race [--device cuda] [--workload tiny_transformer] [--size large] [--batch-size 32] [--modes M,..]
First line: rounds=<run> of <--rounds>.
Last lines: speedup_error_max=<max |race speedup / bare speedup - 1|>, memory_change_max=<max |race / alone - 1|>;
with a compiled lane (`--modes bf16-mixed,bf16-mixed+compile`; its eager twin is always raced): its speedup against
eager in the race and in bare loops, its compile time, and last compiled_overhead_ratio=<the harness overhead on the
compiled lane: the median over `--pairs` pairs of (the lane's median step time in a chunk of a race / the same
recipe's median step time in a chunk of a bare race)>. A bare race (BareRace) is the race's lanes as bare loops
taking turns step by step as the race's lanes do, so both sides see the same caches; the race (paused between its
chunks) and the bare race take turns in chunks of `--chunk` steps (bench.overhead's turns: a machine's speed moves by
tens of percent from one second to the next; and one malloc heap for every thread, `--own-heaps` for glibc's heap per
thread). Both time the span a lane's step window does (batch on the device to optimizer update), compiled the same
way (inductor, the recipe's mode, static shapes, autocast around the compiled module, the recipe's optimizer). Target
<= 1.05 on a CPU, <= 1.02 at the large size on CUDA (both sides timed by CUDA events there).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from amp_core.config import RunConfig
from amp_core.precision import (
    BASELINE_MODE,
    availability,
    compile_option,
    get_precision,
    is_fp8_recipe,
    parse_modes,
)
from amp_core.race.compiled import COMPILED_EVENT, compile_in_place, eager_recipe, is_compiled_recipe
from amp_core.race.runner import Run
from amp_core.views.summary import summarize
from amp_core.workloads import WORKLOADS
from bench.overhead import TurnTaker, one_heap, paused_start, run_threads, steps_for, take_turns

WARMUP = 20
SKIP = 3
"""Steps left out at the start of each chunk of the compiled overhead's turns (the caches warm again)."""
"""A bare loop's warm-up steps at most: a tenth of its steps, at least 2 (the MLP default's 200 steps keep all 20)."""
ALONE_STEPS = 3
"""Steps of a lane raced alone for its memory: memory is measured on steps 0 and 1 (then every memory_every), and a
step's figure is the same from step 1 on, so a longer run would measure nothing more."""
FP8_BASELINE = "bf16-mixed"
"""What an FP8 lane's speedup is also given against: the same autocast without FP8 matmuls."""


def bare_loop(config: RunConfig, recipe: str, steps: int) -> tuple[float, list[float]]:
    """A plain loop in `recipe`, its warm-up steps (`warmup_steps`) then `steps` timed ones: (milliseconds per step
    end to end, the loop synchronised once at the end on CUDA; each step's milliseconds over the span a race lane's
    step window times — its batch put on the device through the optimizer's update, not the batch's sampling — on
    CUDA between events, read after that one sync)."""
    precision = get_precision(recipe, config.device)
    workload = WORKLOADS[config.workload]
    data = workload.load_data(config)
    torch.manual_seed(config.seed)
    model = precision.prepare_module(workload.build_model(config.size, data))
    compiled = compile_option(precision)
    if compiled is not None:  # the bare compiled loop: torch.compile as a user writes it; WARMUP holds its compile
        torch._dynamo.reset()  # compiled afresh, not served by the entries the race's lane left for the same forward
        compile_in_place(model, compiled.compile_mode)  # the options the race's lane is compiled with
    eps = 1e-8 if precision.param_dtype == torch.float32 else 1e-4
    optimizer = precision.build_optimizer(model.parameters(), config.optimizer, lr=config.lr, eps=eps)
    scaler = precision.make_scaler()
    generator = torch.Generator().manual_seed(config.seed)
    cuda = precision.device_type == "cuda"
    spans: list[tuple[float, float] | tuple[torch.cuda.Event, torch.cuda.Event]] = []
    started = 0.0
    warmup = warmup_steps(steps)
    with precision.step_context():  # on CUDA the lane's TF32 flags, set once for the whole loop
        for step in range(warmup + steps):
            if step == warmup:
                if cuda:
                    torch.cuda.synchronize()
                started = time.perf_counter()
            batch = data.sample(generator, config.batch_size)
            if cuda:  # events, read after the one sync at the end (no per-step host sync)
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            else:
                begin = time.perf_counter()
            x, y = (precision.prepare_input(t) for t in batch)
            optimizer.zero_grad(set_to_none=True)
            with precision.forward_context():
                loss = workload.loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if step >= warmup:
                if cuda:
                    end.record()
                    spans.append((begin, end))
                else:
                    spans.append((begin, time.perf_counter()))
        if cuda:
            torch.cuda.synchronize()  # the figure: the steps' wall time
    total_ms = (time.perf_counter() - started) / steps * 1e3
    step_ms = [begin.elapsed_time(end) if cuda else (end - begin) * 1e3 for begin, end in spans]
    return total_ms, step_ms


def warmup_steps(steps: int) -> int:
    """A bare loop's warm-up before `steps` timed steps: a tenth of them, at least 2, at most WARMUP (a compiled
    loop compiles in its first warm-up step)."""
    return min(WARMUP, max(2, steps // 10))


class BareRace:
    """The race's lanes as bare loops taking turns step by step as the race's lanes do, each built as `bare_loop`
    builds it (a compiled recipe compiled the same way), every lane on the same batch; `steps(n)` returns each
    recipe's step times (ms, the span a race lane's step window times: batch on the device to optimizer update)."""

    def __init__(self, config: RunConfig, recipes: tuple[str, ...]):
        self.workload = workload = WORKLOADS[config.workload]
        self.data = workload.load_data(config)
        self.batch_size = config.batch_size
        self.cuda = torch.device(config.device).type == "cuda"
        self.generator = torch.Generator().manual_seed(config.seed)
        torch.manual_seed(config.seed)
        base = workload.build_model(config.size, self.data)
        self.lanes = []
        for recipe in recipes:
            precision = get_precision(recipe, config.device)
            model = precision.prepare_module(copy.deepcopy(base))
            compiled = compile_option(precision)
            if compiled is not None:
                compile_in_place(model, compiled.compile_mode)  # compiles at its first step, in the warm-up
            eps = 1e-8 if precision.param_dtype == torch.float32 else 1e-4
            optimizer = precision.build_optimizer(model.parameters(), config.optimizer, lr=config.lr, eps=eps)
            self.lanes.append((recipe, precision, model, optimizer, precision.make_scaler()))

    def steps(self, count: int) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {recipe: [] for recipe, *_ in self.lanes}
        spans: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {recipe: [] for recipe in times}
        for _ in range(count):
            batch = self.data.sample(self.generator, self.batch_size)
            for recipe, precision, model, optimizer, scaler in self.lanes:
                if self.cuda:  # events, as a race lane's step window times on CUDA: read after the chunk
                    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    began.record()
                else:
                    began = time.perf_counter()
                x, y = (precision.prepare_input(t) for t in batch)
                optimizer.zero_grad(set_to_none=True)
                with precision.forward_context():
                    loss = self.workload.loss(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                if self.cuda:
                    ended.record()
                    spans[recipe].append((began, ended))
                else:
                    times[recipe].append((time.perf_counter() - began) * 1e3)
        if self.cuda:
            torch.cuda.synchronize()  # after the chunk, outside every timed span: the events' times are ready
            times = {recipe: [began.elapsed_time(ended) for began, ended in pairs] for recipe, pairs in spans.items()}
        return times


def compiled_overhead(config: RunConfig, pairs: int, chunk: int) -> dict[str, list[float]]:
    """Per compiled lane, the ratios of pairs of chunks (bench.overhead's turns): the lane's median step in a chunk of a
    race over the same recipe's median step time in the next (or previous) chunk of a BareRace of the same lanes (on
    CUDA both sides' step times are CUDA events around the same span)."""
    config = RunConfig.from_dict({**config.to_dict(), "steps": steps_for(pairs, chunk, WARMUP)})
    torch._dynamo.reset()
    run = paused_start(Run(config))
    taker = TurnTaker(lambda: BareRace(config, config.modes), run_threads(run))
    turns = take_turns(run, taker, pairs, chunk, WARMUP)
    frame = run.frame()
    ratios: dict[str, list[float]] = {}
    for recipe in (m for m in config.modes if is_compiled_recipe(m)):
        lane = frame[frame["mode"] == recipe]
        step_ms = dict(zip(lane["step"], lane["step_ms"], strict=True))
        # The run pauses itself before a step's first lane (Run.pause_at): every lane made the chunk's steps.
        ratios[recipe] = [statistics.median(step_ms[s] for s in range(start + SKIP, end))
                          / statistics.median(bare[recipe][SKIP:])
                          for (start, end), bare in zip(turns.run_chunks, turns.bare_chunks, strict=True)]
    return ratios


def race(config: RunConfig, compile_s: dict[str, float] | None = None
         ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(speedup vs 32-true, lane_peak_bytes, median ms/step) per mode, from a real race through the runner; fills
    `compile_s` (a compiled lane's first compile, from its `compiled` event) when given."""
    torch._dynamo.reset()  # a compiled lane compiles afresh (the bare loop compiled the same forward before it)
    run = Run(config).start()
    run.join()
    if run.status != "finished":
        raise SystemExit(f"FAIL: race ended {run.status}: {[lane.error for lane in run.lanes if lane.error]}")
    frame = run.frame()
    summary = summarize(frame).set_index("mode")
    peaks = frame.groupby("mode")["lane_peak_bytes"].max()
    if compile_s is not None:
        compile_s.update({run.lanes[e.lane].mode: e.data["compile_ms"] / 1e3 for e in run.events()
                          if e.kind == COMPILED_EVENT})
    return summary["speedup"].to_dict(), peaks.to_dict(), summary["median_ms"].to_dict()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; `modes` becomes the lanes to race (recipes checked here: a bad one exits 2 in one line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workload", default="digits_mlp")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--modes", default="", help="comma-separated modes or recipes (MODE[+OPTION...])")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds at most (bare loops and a race, taking turns going first)")
    parser.add_argument("--pairs", type=int, default=240,
                        help="a compiled lane's overhead: pairs of chunks of the race and a bare race taking turns "
                             "(bench.overhead --control: at 60 pairs a shared VM's noise alone moves the ratio by "
                             "about 5 %%)")
    parser.add_argument("--chunk", type=int, default=30, help="steps per chunk (the compiled overhead)")
    parser.add_argument("--budget-s", type=float, default=40.0,
                        help="no round starts that would end past this many seconds (one round always runs)")
    parser.add_argument("--own-heaps", action="store_true",
                        help="leave glibc's malloc heap per thread (default: one for every thread, as bench.overhead)")
    args = parser.parse_args(argv)
    modes = parse_modes(args.modes) or (
        ("32-true", "tf32", "16-mixed", "bf16-mixed", "bf16-true") if args.device == "cuda"
        else ("32-true", "bf16-mixed", "16-mixed"))
    needed = (BASELINE_MODE, *((FP8_BASELINE,) if any(is_fp8_recipe(m) for m in modes) else ()),
              *(eager_recipe(m) for m in modes if is_compiled_recipe(m)))
    args.modes = tuple(dict.fromkeys((*(m for m in needed if m not in modes), *modes)))
    for recipe in args.modes:
        ok, why = availability(recipe, args.device)
        if not ok:
            print(f"error: --modes: {recipe!r} cannot race on {args.device}: {why}", file=sys.stderr)
            raise SystemExit(2)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    heaps = "per thread (--own-heaps)" if args.own_heaps else one_heap()  # before the process starts a thread
    modes = args.modes
    # On a CPU both sides get one intra-op thread: the race's thread picks its count by measuring, the bare loop
    # would take the process's, and on few cores that difference alone moves a small model's speed by 2-3x.
    threads = 1 if args.device == "cpu" else 0
    if threads:
        torch.set_num_threads(threads)
    config = RunConfig(workload=args.workload, size=args.size, batch_size=args.batch_size, modes=modes,
                       steps=args.steps, device=args.device, gradstats_every=0, eps=1e-4, intra_op_threads=threads)
    bare: dict[str, list[float]] = {mode: [] for mode in modes}
    raced: dict[str, list[float]] = {mode: [] for mode in modes}
    bare_ms: dict[str, list[float]] = {mode: [] for mode in modes}
    bare_step_ms: dict[str, list[float]] = {mode: [] for mode in modes}
    race_ms: dict[str, list[float]] = {mode: [] for mode in modes}
    compile_s: dict[str, list[float]] = {mode: [] for mode in modes}
    began, round_s, rounds = time.perf_counter(), 0.0, 0
    while rounds < args.rounds and (rounds == 0 or time.perf_counter() - began + round_s <= args.budget_s):
        round_began = time.perf_counter()
        # Bare loops and the race take turns going first, so a drift of the machine's speed over a round (another
        # process, the clock) falls on both sides alike over the rounds instead of always on the side that runs last.
        compiles: dict[str, float] = {}
        if rounds % 2:
            speedups, race_peaks, medians = race(config, compiles)
        loops = {mode: bare_loop(config, mode, args.steps) for mode in modes}
        if not rounds % 2:
            speedups, race_peaks, medians = race(config, compiles)
        for mode in modes:
            bare[mode].append(loops[BASELINE_MODE][0] / loops[mode][0])
            bare_ms[mode].append(loops[mode][0])
            bare_step_ms[mode].append(statistics.median(loops[mode][1]))
            raced[mode].append(speedups[mode])
            race_ms[mode].append(medians[mode])
            if mode in compiles:
                compile_s[mode].append(compiles[mode])
        rounds += 1
        round_s = max(round_s, time.perf_counter() - round_began)  # the slowest round: the next one's estimate
    print(f"rounds={rounds} of {args.rounds} ({args.steps} steps per lane; the slowest round took {round_s:.1f} s, "
          f"--budget-s {args.budget_s:g})", flush=True)
    alone = {mode: race(RunConfig.from_dict({**config.to_dict(), "modes": [mode],
                                             "steps": min(args.steps, ALONE_STEPS)}))[1][mode] for mode in modes}
    errors, changes = [], []
    for mode in modes:
        bare_speedup, race_speedup = statistics.median(bare[mode]), statistics.median(raced[mode])
        change = race_peaks[mode] / alone[mode] - 1
        errors.append(abs(race_speedup / bare_speedup - 1))
        changes.append(abs(change))
        print(f"{args.workload}/{args.size}/b{args.batch_size} {args.device} {mode:<11} bare_speedup={bare_speedup:.3f}"
              f" race_speedup={race_speedup:.3f} | lane_peak_MiB race={race_peaks[mode] / 2**20:.1f}"
              f" alone={alone[mode] / 2**20:.1f} ({change:+.2%}) | ms_per_step"
              f" race={statistics.median(race_ms[mode]):.2f} bare={statistics.median(bare_ms[mode]):.2f}", flush=True)
    for mode in modes:
        if is_fp8_recipe(mode):
            bare_fp8 = statistics.median(bare[mode]) / statistics.median(bare[FP8_BASELINE])
            race_fp8 = statistics.median(raced[mode]) / statistics.median(raced[FP8_BASELINE])
            print(f"{mode} vs {FP8_BASELINE}: bare_speedup={bare_fp8:.3f} race_speedup={race_fp8:.3f}", flush=True)
    print(f"speedup_error_max={max(errors):.4f}")
    print(f"memory_change_max={max(changes):.4f}")
    compiled = [m for m in modes if is_compiled_recipe(m)]
    pair_ratios = compiled_overhead(config, args.pairs, args.chunk) if compiled else {}
    overheads = []
    for mode in compiled:
        eager = eager_recipe(mode)
        race_vs_eager = statistics.median(race_ms[eager]) / statistics.median(race_ms[mode])
        bare_vs_eager = statistics.median(bare_ms[eager]) / statistics.median(bare_ms[mode])
        line = (f"{mode}: speedup_vs_eager race={race_vs_eager:.3f} bare={bare_vs_eager:.3f} | median ms/step race="
                f"{statistics.median(race_ms[mode]):.3f} bare_compiled_loop={statistics.median(bare_step_ms[mode]):.3f}"
                f" | compile_s={statistics.median(compile_s[mode]) if compile_s[mode] else float('nan'):.2f} "
                f"(first compile per round, inductor's caches warm after round 1)")
        if mode in pair_ratios:
            # The overhead: the race lane's median step over a bare race's, in pairs of chunks taking turns.
            ratios = pair_ratios[mode]
            overheads.append(statistics.median(ratios))
            line += (f" | overhead {overheads[-1]:.4f} (median of {len(ratios)} pairs, {min(ratios):.3f}.."
                     f"{max(ratios):.3f}; malloc heaps: {heaps})")
        print(line, flush=True)
    if overheads:
        print(f"compiled_overhead_ratio={max(overheads):.4f}")


if __name__ == "__main__":
    main()
