"""Harness overhead: the runner (every per-step figure on, store writing) vs a bare PyTorch loop of the same model,
data, batch order, mode and optimizer, interleaved in one process (bare, runner, bare, runner ...) so machine noise
hits both alike.

Each round runs the runner, then the bare loop, with the same intra-op threads (the run's measured choice; the bare
loop runs on a background thread too). A round's ratio is the median time between consecutive steps of the runner
(between consecutive records, so it holds everything the harness does between two steps: records, events,
contexts, flushes) over the bare loop's; the figure is the median of the rounds' ratios. Medians leave out the
sampled probes (memory every 25 steps, gradient statistics every 50), whose cost the runner reports apart
(`probe_ms`); the means that include them are printed too, and so are the medians of all rounds pooled.

- CPU (default): digits_mlp small, 32-true and bf16-mixed. Target: overhead_ratio_max <= 1.05.
- CUDA (--device cuda): tiny_transformer large (batch 32) and digits_mlp small, 32-true, bf16-mixed and 16-mixed;
  targets <= 1.02 and <= 1.10. The bare loop reads no loss per step (a per-step .item() is a sync the runner does
  not make); the step interval is the host's (the launch queue paces it to the device in steady state); `probe_ms`
  is the probes' host time (their device time shows in the means). Host syncs per ordinary step are counted with
  torch.cuda.set_sync_debug_mode for the runner and the bare loop, which must be equal: `syncs_per_step=`.
  Anything off (no GPU, a run that did not finish, unequal syncs, a counter that sees nothing where GradScaler
  must sync) fails the bench with exit status 1 after the figures are printed.

    python3 -m bench.overhead [--device cpu|cuda] [--workloads digits_mlp:small:64,...] [--modes ...] [--fused]
                              [--snapshot-every N]
    (from the repository root)
Second-to-last line: added_us_per_step=<number> (the largest over the cases of the runner's median step interval
minus the bare loop's, in microseconds: what the harness adds per step). Last line: overhead_ratio_max=<number>
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from amp_core.config import RunConfig
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from amp_core.runner import Run
from amp_core.switches import pin_intra_op_threads, process_intra_op_threads
from amp_core.workloads import WORKLOADS

WARMUP = 50
AUTOCAST = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
DEFAULTS = {"cpu": ("digits_mlp:small:64", "32-true,bf16-mixed"),
            "cuda": ("tiny_transformer:large:32,digits_mlp:small:64", "32-true,bf16-mixed,16-mixed")}
TARGETS = {("cpu", "digits_mlp", "small"): 1.05, ("cuda", "tiny_transformer", "large"): 1.02,
           ("cuda", "digits_mlp", "small"): 1.10}
SYNC_STEPS = 100
"""Syncs per step = (syncs of a 2N-step loop - syncs of an N-step loop) / N: set-up and first-step syncs cancel."""


def bare_loop(config: RunConfig, mode: str, steps: int) -> list[float]:
    """The seed notes' loop, nothing else (plus GradScaler in 16-mixed): perf_counter after each step."""
    device = torch.device(config.device)
    workload = WORKLOADS[config.workload]
    data = workload.load_data(config)
    torch.manual_seed(config.seed)
    model = workload.build_model(config.size, data).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, fused=True if config.fused_optimizer else None)
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "16-mixed")
    generator = torch.Generator().manual_seed(config.seed)
    dtype = AUTOCAST[mode]
    stamps = []
    for _ in range(steps):
        x, y = data.sample(generator, config.batch_size)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = workload.loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if device.type == "cpu":
            loss.item()  # the seed prints it; the runner records it (on a CPU there is nothing to wait for)
        stamps.append(time.perf_counter())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return stamps


def on_a_thread(function, threads: int, *args):
    """Run `function(*args)` on a fresh thread with `threads` intra-op threads (the runner's conditions)."""
    out = []

    def target() -> None:
        pin_intra_op_threads(threads)
        out.append(function(*args))

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return out[0]


def run_steps(config: RunConfig, store: RunStore | None) -> tuple[list[float], int, float]:
    """A real run to its end: (record stamps, intra-op threads it chose, mean probe ms per step)."""
    run = Run(config, store).start()
    run.join()
    if run.status != "finished" or len(run.frame()) != config.steps:
        raise SystemExit(f"FAIL: the run ended {run.status} with {len(run.frame())} of {config.steps} records: "
                         f"{[e.message for e in run.events() if e.kind == 'error']}")
    frame = run.frame()
    return list(frame["t_wall_s"]), run.events()[0].data["intra_op_threads"], float(frame["probe_ms"].mean())


def intervals_ms(stamps: list[float]) -> list[float]:
    return list(np.diff(stamps)[WARMUP:] * 1e3)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workloads", help="workload:size:batch,... (default: the device's)")
    parser.add_argument("--modes", help="comma-separated (default: the device's)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--fused", action="store_true", help="fused Adam in the runner and the bare loop")
    parser.add_argument("--snapshot-every", type=int, default=RunConfig().snapshot_every,
                        help="the runner's replay snapshots every N steps (default: RunConfig's; 0 = off)")
    args = parser.parse_args()
    failures: list[str] = []
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("FAIL: --device cuda, but torch sees no CUDA device here")
    workloads = [item.split(":") for item in (args.workloads or DEFAULTS[args.device][0]).split(",")]
    modes = (args.modes or DEFAULTS[args.device][1]).split(",")
    process_threads = process_intra_op_threads()
    ratios, added_us = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(Path(tmp) / "bench.sqlite3")
        for workload, size, batch_size in workloads:
            for mode in modes:
                config = RunConfig(workload=workload, modes=(mode,), steps=args.steps, batch_size=int(batch_size),
                                   size=size, device=args.device, fused_optimizer=args.fused,
                                   snapshot_every=args.snapshot_every)
                bare, harness, chosen, probe_ms, round_ratios = [], [], [], [], []
                bare_means, harness_means = [], []
                for _ in range(args.rounds):
                    stamps, threads, probe = run_steps(config, store)
                    runner_round = intervals_ms(stamps)
                    harness_means.append((stamps[-1] - stamps[WARMUP]) * 1e3 / (len(stamps) - 1 - WARMUP))
                    chosen.append(threads)
                    probe_ms.append(probe)
                    stamps = on_a_thread(bare_loop, threads, config, mode, args.steps)
                    bare_round = intervals_ms(stamps)
                    bare_means.append((stamps[-1] - stamps[WARMUP]) * 1e3 / (len(stamps) - 1 - WARMUP))
                    # A round is a pair run back to back with the same intra-op threads (the run's measured choice,
                    # which can differ between rounds on a busy machine): its ratio compares like with like.
                    round_ratios.append(statistics.median(runner_round) / statistics.median(bare_round))
                    harness += runner_round
                    bare += bare_round
                runner_ms, bare_ms = statistics.median(harness), statistics.median(bare)
                key = f"{workload}/{size}/b{batch_size}/{mode}"
                ratios[key] = statistics.median(round_ratios)
                added_us[key] = (runner_ms - bare_ms) * 1e3
                line = (f"{key:<34} ratio={ratios[key]:.4f} (median of rounds {min(round_ratios):.3f}.."
                        f"{max(round_ratios):.3f}) | pooled medians: runner_ms={runner_ms:.4f} bare_ms={bare_ms:.4f} "
                        f"ratio={runner_ms / bare_ms:.4f} added_us={added_us[key]:.1f} | means incl. sampled probes: "
                        f"runner "
                        f"{statistics.fmean(harness_means):.4f} ms, bare {statistics.fmean(bare_means):.4f} ms, "
                        f"ratio={statistics.fmean(harness_means) / statistics.fmean(bare_means):.4f} | "
                        f"probe_ms_per_step={statistics.fmean(probe_ms):.4f} | run threads chosen "
                        f"{sorted(set(chosen))} (process: {process_threads})")
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
    print(f"added_us_per_step={added_us[largest]:.1f} ({largest}: the pooled median step interval, runner minus bare)")
    print(f"overhead_ratio_max={max(ratios.values()):.4f}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
