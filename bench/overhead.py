"""Harness overhead: the runner (every per-step figure on, store writing) vs a bare PyTorch loop of the same model,
data, batch order, mode and optimizer, interleaved in one process in short chunks so machine noise hits both alike.

On a shared VM the same bare loop's median step moves by tens of percent from one second to the next (measured here:
0.81 to 1.51 ms between 0.3 s stretches of one process), so runs of whole loops one after the other compare different
machines. Here one runner and one bare loop (each on its own thread, with the intra-op threads the run chose) take turns
in chunks of `--chunk` steps (tens of ms): the runner makes a chunk and pauses itself (Run.pause_at, then
Run.wait_paused: every step it made recorded), the bare loop makes a chunk, the runner resumes, and so on, the order of
each pair alternating. The bench's own thread waits on events meanwhile, taking no GIL while either side steps: it used
to poll the step count every millisecond, and each poll that took the GIL while a loop was in a step's backward (which
releases it) made that step wait for it back: ~70 us more in 0.35 of the runner's steps and 0.14 of the bare loop's (an
AMX Xeon, getrusage's voluntary switches inside the window), which read as harness overhead. A pair's ratio is the
median interval between consecutive steps of the runner's chunk (between consecutive records: everything the harness
does between two steps) over the bare chunk's median; the first intervals of each chunk (caches warming after the other
loop ran) are left out on both sides. The figure is the median of the pairs' ratios. The runner's medians are of its
plain steps: a sampled step's interval and the next one (memory and gradient norm every 25 steps, gradient statistics
every 50, snapshots every 25: their probes and records, whose cost the runner reports apart as `probe_ms`) are left out
by the run's own schedule, and so are the steps made past the chunk asked (none, with the run pausing itself; the
pause's flush falls outside every chunk). Two such intervals in a chunk of ~26 are not "left out" by a median: they move
it up by a rank or two, tens of microseconds where steps spread as here (measured under load: 136 -> 76 us). The means
that include the sampled probes are printed too, and `added_us` over every interval of the run's chunks beside the
figure.

How finely this resolves a ratio on a shared VM is itself measured: `--control` also takes turns between two identical
bare loops, exactly as between the runner and the bare loop, and prints their ratio (`control_ratio=`: an exact
harness reads 1). On the 2-core AVX2 VM of this project: 0.977–1.058 over 9 runs of 80 pairs (a pair's ratio
0.57–1.74), 0.992–1.020 over 3 runs of 320 pairs — hence 320 pairs by default, where a 5 % target is not lost in the
bench's own noise.

Every thread of the bench allocates from one malloc heap (`one_heap`: glibc's M_ARENA_MAX=1, set before the bench starts
a thread; `--own-heaps` leaves glibc's heap per thread). With a heap per thread, where each side's tensors land depends
on its thread's own allocation history, and that alone moved two identical bare loops apart: control_ratio 0.968, 0.999
and 0.979 in three runs of 160 pairs (32-true, an AMX Xeon), against 1.001, 0.997 and 0.999 with one heap; the runner's
figure moved with it (inside the window +15.0, +13.9, +11.3 us a step in those runs with a heap per thread, -1.0, +4.4,
+1.2 with one). A user's own loop runs on its process's main heap, shared with everything else the process does: so do
both sides here.

- CPU (default): digits_mlp small, 32-true and bf16-mixed. Target: overhead_ratio_max <= 1.05.
- CUDA (--device cuda): tiny_transformer large (batch 32) and digits_mlp small, 32-true, bf16-mixed and 16-mixed;
  targets <= 1.02 and <= 1.10. The bare loop reads no loss per step (a per-step .item() is a sync the runner does
  not make); the step interval is the host's (the launch queue paces it to the device in steady state); `probe_ms`
  is the probes' host time (their device time shows in the means). Host syncs per ordinary step are counted with
  torch.cuda.set_sync_debug_mode for the runner and the bare loop, which must be equal: `syncs_per_step=`.
  Anything off (no GPU, a run that did not finish, unequal syncs, a counter that sees nothing where GradScaler
  must sync) fails the bench with exit status 1 after the figures are printed.

    python3 -m bench.overhead [--device cpu|cuda] [--workloads digits_mlp:small:64,...] [--modes ...] [--fused]
                              [--snapshot-every N] [--pairs 320] [--chunk 30] [--control] [--own-heaps]
    (from the repository root)
Second-to-last line: added_us_per_step=<number>, in microseconds, the largest over the cases: on a CPU what the harness
adds inside the timed window (the median over pairs of the runner's median step_ms minus the bare loop's same span,
batch to the device to the optimizer's update: issue 28's figure), with the line before it
interval_added_us_per_step=<number> (the median over pairs of the runner's median step interval minus the bare
loop's: everything the harness does between two steps); on CUDA, where step_ms is the device's time, the interval's.
Last line: overhead_ratio_max=<number>
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from amp_core.config import RunConfig
from amp_core.precision.switches import pin_intra_op_threads, process_intra_op_threads
from amp_core.race.runner import Run
from amp_core.race.step import sampling_schedule
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from amp_core.workloads import WORKLOADS

WARMUP = 50
SKIP = 3
"""Intervals left out at the start of each chunk, on both sides: the caches warm again after the other loop ran."""
AUTOCAST = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
DEFAULTS = {"cpu": ("digits_mlp:small:64", "32-true,bf16-mixed"),
            "cuda": ("tiny_transformer:large:32,digits_mlp:small:64", "32-true,bf16-mixed,16-mixed")}
TARGETS = {("cpu", "digits_mlp", "small"): 1.05, ("cuda", "tiny_transformer", "large"): 1.02,
           ("cuda", "digits_mlp", "small"): 1.10}
SYNC_STEPS = 100
"""Syncs per step = (syncs of a 2N-step loop - syncs of an N-step loop) / N: set-up and first-step syncs cancel."""


class BareLoop:
    """The seed notes' loop, nothing else (plus GradScaler in 16-mixed), steps made on request: `steps(n)` returns
    perf_counter after each step."""

    def __init__(self, config: RunConfig, mode: str):
        self.device = device = torch.device(config.device)
        self.workload = WORKLOADS[config.workload]
        self.data = self.workload.load_data(config)
        torch.manual_seed(config.seed)
        self.model = self.workload.build_model(config.size, self.data).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr,
                                          fused=True if config.fused_optimizer else None)
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode == "16-mixed")
        self.generator = torch.Generator().manual_seed(config.seed)
        self.dtype = AUTOCAST[mode]
        self.batch_size = config.batch_size

    def steps(self, count: int) -> tuple[list[float], list[float]]:
        """`count` steps: (perf_counter after each, each step's window in ms: the span a runner's step window times on
        a host meter, batch to the device to the optimizer's update)."""
        device, model, optimizer, scaler, workload = self.device, self.model, self.optimizer, self.scaler, self.workload
        stamps, windows = [], []
        clock = time.perf_counter
        for _ in range(count):
            x, y = self.data.sample(self.generator, self.batch_size)
            began = clock()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=self.dtype) if self.dtype is not None else contextlib.nullcontext():
                loss = workload.loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            # One clock read ends the window and stamps the step (an interval between two steps' stamps is the same
            # from any fixed point of the step: the loss read comes after it in every step).
            stamps.append(ended := clock())
            windows.append((ended - began) * 1e3)
            if device.type == "cpu":
                loss.item()  # the seed prints it; the runner records it (on a CPU there is nothing to wait for)
        return stamps, windows


def bare_loop(config: RunConfig, mode: str, steps: int) -> list[float]:
    """A fresh BareLoop's `steps` steps, then (CUDA) everything it launched finished."""
    stamps, _ = BareLoop(config, mode).steps(steps)
    if config.device == "cuda":
        torch.cuda.synchronize()
    return stamps


# --- taking turns (also bench.race's compiled overhead): the run paused between its chunks, a bare loop between
# them on a thread of its own, so a shared machine's speed falls on both alike.

WAIT_S = 1.0
"""How long the bench's own thread blocks on an event at a time before it looks whether the other side died."""
PATIENCE_S = 600.0


class TurnTaker:
    """A bare loop (`make()`'s object, whose `steps(n)` makes n steps and returns what it measured) built and stepped
    on a thread of its own with `threads` intra-op threads, a chunk when asked."""

    def __init__(self, make: Callable[[], object], threads: int):
        self._asked, self.done = threading.Event(), threading.Event()
        self._count, self.result, self.error = 0, None, None
        self._thread = threading.Thread(target=self._serve, args=(make, threads), daemon=True)
        self._thread.start()

    def _serve(self, make: Callable[[], object], threads: int) -> None:
        pin_intra_op_threads(threads)
        loop = None
        try:
            loop = make()
        except Exception as exc:  # reported by the first chunk asked
            self.error = exc
        while True:
            self._asked.wait()
            self._asked.clear()
            if self._count < 0:
                return
            if loop is not None:
                try:
                    self.result = loop.steps(self._count)
                except Exception as exc:
                    self.error = exc
            self.done.set()

    def chunk(self, count: int):
        """`count` steps of the bare loop; what its `steps` returned."""
        self.done.clear()
        self._count = count
        self._asked.set()
        until(lambda: self.done.wait(WAIT_S))
        if self.error is not None:
            raise SystemExit(f"FAIL: the bare loop failed: {type(self.error).__name__}: {self.error}")
        return self.result

    def close(self) -> None:
        self._count = -1
        self._asked.set()
        self._thread.join()


def until(condition: Callable[[], bool]) -> None:
    """Call `condition` (which blocks on an event, up to WAIT_S) until it holds, or fail after PATIENCE_S."""
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL: a chunk did not finish within {PATIENCE_S:.0f} s")


def run_chunk(run: Run, upto: int) -> int:
    """Resume `run` until every lane has made `upto` steps, where it pauses itself, and wait until it stands; the steps
    its first lane made."""
    lane = run.lanes[0]
    run.pause_at(upto)
    until(lambda: run.wait_paused(WAIT_S) or not run.alive)
    if lane.steps_done < upto:
        errors = [event.message for event in run.events() if event.kind == "error"] or [lane.error]
        raise SystemExit(f"FAIL: the run ended {run.status} after {lane.steps_done} steps: {errors}")
    return lane.steps_done


@dataclass
class Turns:
    """What taking turns gave: the run's chunks as (first step, end step), and the bare loop's chunks' results, in
    pairs (the i-th of each side were made one right after the other)."""

    run_chunks: list[tuple[int, int]] = field(default_factory=list)
    bare_chunks: list = field(default_factory=list)


def steps_for(pairs: int, chunk: int, warmup: int) -> int:
    """Steps to ask of the run: a chunk of the run overshoots by the steps it makes while the pause lands."""
    return warmup + 3 * pairs * chunk


def take_turns(run: Run, bare: TurnTaker, pairs: int, chunk: int, warmup: int) -> Turns:
    """Both sides' warm-up (`warmup` steps each), then `pairs` pairs of chunks of `chunk` steps. `run` (asked for
    `steps_for` steps) has been started and paused; it is stopped at the end (and the bare loop closed), whatever
    happened."""
    turns = Turns()
    try:
        bare.chunk(warmup)
        made = run_chunk(run, warmup)
        for pair in range(pairs):
            for side in (("run", "bare") if pair % 2 == 0 else ("bare", "run")):
                if side == "run":
                    start, made = made, run_chunk(run, made + chunk)
                    turns.run_chunks.append((start, made))
                else:
                    turns.bare_chunks.append(bare.chunk(chunk))
    finally:
        run.stop()
        bare.close()
    return turns


def paused_start(run: Run) -> Run:
    """Start `run` paused: its thread sets up (data, models, a compiled lane's compile) and stands before its first
    step."""
    run.start()
    run.pause()
    if not run.wait_paused(PATIENCE_S):
        raise SystemExit(f"FAIL: the run did not start: {run.status}")
    return run


def run_threads(run: Run) -> int:
    """The intra-op threads the run chose (its `started` event)."""
    return next(event for event in run.events() if event.kind == "started").data["intra_op_threads"]


def measure(config: RunConfig, mode: str, store: RunStore, pairs: int, chunk: int) -> dict:
    """One case, its runner and bare loop taking turns (see the module's docstring)."""
    config = RunConfig.from_dict({**config.to_dict(), "steps": steps_for(pairs, chunk, WARMUP)})
    run = paused_start(Run(config, store))
    threads = run_threads(run)
    turns = take_turns(run, TurnTaker(lambda: BareLoop(config, mode), threads), pairs, chunk, WARMUP)
    frame = run.frame()
    stamps = dict(zip(frame["step"], frame["t_wall_s"], strict=True))
    step_ms = dict(zip(frame["step"], frame["step_ms"], strict=True))
    sampled = sampled_steps(run, len(frame))
    runner_all, runner_intervals, runner_windows = [], [], []
    for start, end in turns.run_chunks:
        intervals = {s: (stamps[s] - stamps[s - 1]) * 1e3 for s in range(start + 1 + SKIP, end)}
        runner_all.append(list(intervals.values()))
        # What the medians compare is a plain step of each loop: left out are a sampled step's interval and the next
        # (its probes, before and after its window, and its record: `probe_ms`) and the steps past the chunk asked,
        # made while this thread was pausing the run (its own control traffic beside them; the bare chunk has none).
        plain = [s for s in intervals if s < start + chunk and s not in sampled and s - 1 not in sampled]
        runner_intervals.append([intervals[s] for s in plain])
        # The timed windows of the same plain steps (a step's own record: its step_ms; the step after a sampled one
        # is ~370 us slower in its window alone, the next two 70 and 25 us).
        runner_windows.append([float(step_ms[s]) for s in plain])
        if not runner_intervals[-1]:
            raise SystemExit(f"FAIL: a chunk of the run ({chunk} steps) holds no plain step to compare: a larger "
                             "--chunk, or a lane-step hook that acts on every step")
    bare_intervals = [list(np.diff(stamps)[SKIP:] * 1e3) for stamps, _ in turns.bare_chunks]
    pairs_of = list(zip(runner_intervals, bare_intervals, strict=True))
    pair_ratios = [statistics.median(r) / statistics.median(b) for r, b in pairs_of]
    added = [(statistics.median(r) - statistics.median(b)) * 1e3 for r, b in pairs_of]
    added_all = [(statistics.median(r) - statistics.median(b)) * 1e3
                 for r, b in zip(runner_all, bare_intervals, strict=True)]
    # Inside the timed window: the runner's step_ms against the bare loop's same span, pair by pair (the steps of
    # the intervals above). On a host meter only: a CUDA lane's step_ms is its events' device time.
    added_window = [(statistics.median(r) - statistics.median(windows[SKIP + 1:])) * 1e3
                    for r, (_, windows) in zip(runner_windows, turns.bare_chunks, strict=True)
                    ] if config.device == "cpu" else [float("nan")]
    measured = frame[frame["step"] >= WARMUP]
    return {"ratio": statistics.median(pair_ratios), "ratios": pair_ratios, "added_us": statistics.median(added),
            "added_us_all": statistics.median(added_all), "window_added_us": statistics.median(added_window),
            "runner_ms": statistics.median([statistics.median(r) for r in runner_intervals]),
            "bare_ms": statistics.median([statistics.median(b) for b in bare_intervals]),
            "runner_mean_ms": statistics.fmean(v for r in runner_all for v in r),
            "bare_mean_ms": statistics.fmean(v for b in bare_intervals for v in b),
            "probe_ms": float(measured["probe_ms"].mean()), "threads": threads}


def control(config: RunConfig, mode: str, pairs: int, chunk: int, threads: int) -> list[float]:
    """The bench's resolution where it runs: two identical bare loops of a case taking turns as the runner and the
    bare loop do (warm-up, then `pairs` pairs of chunks, the order alternating); the pairs' ratios of median step
    intervals, which an exact bench would read as 1."""
    loops = [TurnTaker(lambda: BareLoop(config, mode), threads) for _ in range(2)]
    chunks: tuple[list, list] = ([], [])
    try:
        for loop in loops:
            loop.chunk(WARMUP)
        for pair in range(pairs):
            for side in ((0, 1) if pair % 2 == 0 else (1, 0)):
                chunks[side].append(loops[side].chunk(chunk))
    finally:
        for loop in loops:
            loop.close()
    medians = [[statistics.median(np.diff(stamps)[SKIP:]) for stamps, _ in side] for side in chunks]
    return [a / b for a, b in zip(*medians, strict=True)]


def sampled_steps(run: Run, steps: int) -> set[int]:
    """The steps of `run` (of `steps`) that sampled a figure or that a lane-step hook acted on (replay snapshots), by
    the run's own schedule (SamplingSchedule.next_full_step); every step when a hook watches every step."""
    everies = run.hooks.plain_steps()
    if everies is None:
        return set(range(steps))
    schedule = sampling_schedule(run.config)
    return {step for step in range(steps) if schedule.next_full_step(step, everies) == step}


def run_steps(config: RunConfig, store: RunStore | None) -> tuple[list[float], int, float]:
    """A real run to its end: (record stamps, intra-op threads it chose, mean probe ms per step)."""
    run = Run(config, store).start()
    run.join()
    if run.status != "finished" or len(run.frame()) != config.steps:
        raise SystemExit(f"FAIL: the run ended {run.status} with {len(run.frame())} of {config.steps} records: "
                         f"{[e.message for e in run.events() if e.kind == 'error']}")
    frame = run.frame()
    return list(frame["t_wall_s"]), run.events()[0].data["intra_op_threads"], float(frame["probe_ms"].mean())


@contextlib.contextmanager
def counting_syncs():
    """Counts host syncs (torch.cuda.set_sync_debug_mode's warnings) on every thread while the block runs."""
    count = [0]
    previous_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                count[0] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)


def syncs_per_step(loop, config: RunConfig) -> float:
    """Host syncs per ordinary step of `loop(config)` (no sampled probes: they may sync, outside the timed window):
    (syncs of 2N steps - syncs of N) / N, after an uncounted short loop (first CUDA work in a process syncs once)."""
    loop(RunConfig.from_dict({**config.to_dict(), "steps": SYNC_STEPS // 10}))
    counts = []
    for steps in (SYNC_STEPS, 2 * SYNC_STEPS):
        with counting_syncs() as count:
            loop(RunConfig.from_dict({**config.to_dict(), "steps": steps}))
        counts.append(count[0])
    return (counts[1] - counts[0]) / SYNC_STEPS


M_ARENA_MAX = -8
"""glibc's mallopt parameter: how many malloc heaps (arenas) the process's threads may get."""


def one_heap() -> str:
    """Every thread started from now on allocates from the process's main malloc heap (glibc's mallopt M_ARENA_MAX=1:
    a thread takes a heap of its own only while fewer than that many exist), so a runner's thread and a bare loop's
    put their tensors in one heap (see the module's docstring). Call it before the process starts a thread. Says what
    it did; elsewhere than glibc, nothing."""
    try:
        done = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(M_ARENA_MAX, 1) == 1
    except (OSError, AttributeError):  # not glibc
        return "per thread (no glibc mallopt here)"
    return "one for every thread (glibc mallopt M_ARENA_MAX=1)" if done else "per thread (mallopt refused M_ARENA_MAX)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workloads", help="workload:size:batch,... (default: the device's)")
    parser.add_argument("--modes", help="comma-separated (default: the device's)")
    parser.add_argument("--pairs", type=int, default=320, help="chunks of each loop per case")
    parser.add_argument("--chunk", type=int, default=30, help="steps per chunk")
    parser.add_argument("--fused", action="store_true", help="fused Adam in the runner and the bare loop")
    parser.add_argument("--control", action="store_true",
                        help="also two identical bare loops taking turns the same way: the bench's own resolution")
    parser.add_argument("--snapshot-every", type=int, default=RunConfig().snapshot_every,
                        help="the runner's replay snapshots every N steps (default: RunConfig's; 0 = off)")
    parser.add_argument("--own-heaps", action="store_true",
                        help="leave glibc's malloc heap per thread (default: one heap for every thread, see above)")
    args = parser.parse_args()
    print(f"heaps: {'per thread (--own-heaps)' if args.own_heaps else one_heap()}", flush=True)
    failures: list[str] = []
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("FAIL: --device cuda, but torch sees no CUDA device here")
    workloads = [item.split(":") for item in (args.workloads or DEFAULTS[args.device][0]).split(",")]
    modes = (args.modes or DEFAULTS[args.device][1]).split(",")
    process_threads = process_intra_op_threads()
    ratios, added_us, window_us = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(Path(tmp) / "bench.sqlite3")
        for workload, size, batch_size in workloads:
            for mode in modes:
                config = RunConfig(workload=workload, modes=(mode,), batch_size=int(batch_size),
                                   size=size, device=args.device, fused_optimizer=args.fused,
                                   snapshot_every=args.snapshot_every)
                result = measure(config, mode, store, args.pairs, args.chunk)
                key = f"{workload}/{size}/b{batch_size}/{mode}"
                ratios[key], added_us[key] = result["ratio"], result["added_us"]
                window_us[key] = result["window_added_us"]
                pair_ratios = result["ratios"]
                line = (f"{key:<34} ratio={ratios[key]:.4f} (median of {len(pair_ratios)} pairs, "
                        f"{min(pair_ratios):.3f}..{max(pair_ratios):.3f}) | medians: runner_ms="
                        f"{result['runner_ms']:.4f} bare_ms={result['bare_ms']:.4f} added_us={added_us[key]:.1f} "
                        f"(every interval of the run's chunks: {result['added_us_all']:.1f}; inside the timed "
                        f"window: window_added_us={result['window_added_us']:.1f}) | "
                        f"means incl. sampled probes: runner {result['runner_mean_ms']:.4f} ms, bare "
                        f"{result['bare_mean_ms']:.4f} ms, "
                        f"ratio={result['runner_mean_ms'] / result['bare_mean_ms']:.4f}"
                        f" | probe_ms_per_step={result['probe_ms']:.4f} | run threads {result['threads']} "
                        f"(process: {process_threads})")
                if args.control:
                    control_ratios = control(config, mode, args.pairs, args.chunk, result["threads"])
                    line += (f" | control_ratio={statistics.median(control_ratios):.4f} "
                             f"({min(control_ratios):.3f}..{max(control_ratios):.3f})")
                if args.device == "cuda":
                    quiet = RunConfig.from_dict({**config.to_dict(), "gradstats_every": 0, "memory_every": 10**9})
                    runner_syncs = syncs_per_step(lambda c: run_steps(c, None), quiet)
                    bare_syncs = syncs_per_step(lambda c, m=mode: bare_loop(c, m, c.steps), quiet)
                    line += f" | syncs_per_step= runner {runner_syncs:.2f} bare {bare_syncs:.2f}"
                    # Counts over N and 2N steps: one sync more or less in a loop moves the figure by 1/N.
                    if abs(runner_syncs - bare_syncs) >= 0.05:
                        failures.append(f"{key}: the runner makes {runner_syncs:.2f} host syncs per step, "
                                        f"the bare loop {bare_syncs:.2f}")
                    if mode == "16-mixed" and not args.fused and bare_syncs < 0.95:
                        failures.append(f"{key}: the sync counter saw {bare_syncs:.2f} syncs per bare step, but "
                                        "GradScaler.step reads found-inf every step: the counting is broken")
                print(line, flush=True)
                target = TARGETS.get((args.device, workload, size))
                if target is not None and ratios[key] > target:
                    print(f"{key}: above its target {target}", flush=True)
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    largest = max(added_us, key=added_us.get)
    interval = (f"{added_us[largest]:.1f} ({largest}: the median over pairs of the median step interval, runner "
                "minus bare)")
    if args.device == "cpu":  # what issue 28 names: inside the timed window; the interval's beside it
        inside = max(window_us, key=window_us.get)
        print(f"interval_added_us_per_step={interval}")
        print(f"added_us_per_step={window_us[inside]:.1f} ({inside}: inside the timed window, the median over pairs "
              "of the runner's median step_ms minus the bare loop's same span)")
    else:  # a CUDA step's step_ms is the device's time: the interval is the host's figure
        print(f"added_us_per_step={interval}")
    print(f"overhead_ratio_max={max(ratios.values()):.4f}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
