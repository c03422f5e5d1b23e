"""Does a race tell the truth? Each mode's speed and memory in a K-lane race through the runner, against the same
mode measured alone.

- Speed: a bare PyTorch loop per mode (the seed notes' loop, GradScaler in 16-mixed) times N steps end to end
  (one sync at the end on CUDA); its speedup is 32-true's time per step over the mode's. The race's speedup is what
  the Train page shows (`summarize`: median step time of the 32-true lane over the lane's). Bare loops and the race
  alternate for `--rounds` rounds in one process; medians of the rounds.
- Memory: each lane's figure (`lane_peak_bytes`) in the race against a run of that lane alone.

    python3 -m bench.race [--device cuda] [--workload tiny_transformer] [--size large] [--batch-size 32]
Last lines: speedup_error_max=<max |race speedup / bare speedup - 1|>, memory_change_max=<max |race / alone - 1|>
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from amp_core.config import RunConfig
from amp_core.runner import Run
from amp_core.views.summary import summarize
from amp_core.workloads import WORKLOADS

AUTOCAST = {"32-true": None, "tf32": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
PARAM_DTYPE = {"16-true": torch.float16, "bf16-true": torch.bfloat16}
WARMUP = 20


def bare_ms_per_step(config: RunConfig, mode: str, steps: int) -> float:
    """Seconds per step of a plain loop in `mode`, after WARMUP steps, device-synchronised once at the end."""
    device = torch.device("cuda" if config.device == "cuda" else "cpu")
    workload = WORKLOADS[config.workload]
    data = workload.load_data(config)
    torch.manual_seed(config.seed)
    model = workload.build_model(config.size, data).to(device, dtype=PARAM_DTYPE.get(mode, torch.float32))
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, eps=1e-4 if mode in PARAM_DTYPE else 1e-8)
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "16-mixed")
    generator = torch.Generator().manual_seed(config.seed)
    dtype = AUTOCAST.get(mode)
    if device.type == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32" if mode == "tf32" else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if mode == "tf32" else "ieee"
    started = 0.0
    for step in range(WARMUP + steps):
        if step == WARMUP:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        x, y = data.sample(generator, config.batch_size)
        if x.is_floating_point():
            x = x.to(dtype=PARAM_DTYPE.get(mode, torch.float32))
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = workload.loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps * 1e3


def race(config: RunConfig) -> tuple[dict[str, float], dict[str, float]]:
    """(speedup vs 32-true, lane_peak_bytes) per mode, from a real race through the runner."""
    run = Run(config).start()
    run.join()
    if run.status != "finished":
        raise SystemExit(f"FAIL: race ended {run.status}: {[lane.error for lane in run.lanes if lane.error]}")
    frame = run.frame()
    summary = summarize(frame).set_index("mode")
    peaks = frame.groupby("mode")["lane_peak_bytes"].max()
    return summary["speedup"].to_dict(), peaks.to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workload", default="digits_mlp")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--modes", default="")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    modes = tuple(args.modes.split(",")) if args.modes else (
        ("32-true", "tf32", "16-mixed", "bf16-mixed", "bf16-true") if args.device == "cuda"
        else ("32-true", "bf16-mixed", "16-mixed"))
    # On a CPU both sides get one intra-op thread: the race's thread picks its count by measuring, the bare loop
    # would take the process's, and on few cores that difference alone moves a small model's speed by 2-3x.
    threads = 1 if args.device == "cpu" else 0
    if threads:
        torch.set_num_threads(threads)
    config = RunConfig(workload=args.workload, size=args.size, batch_size=args.batch_size, modes=modes,
                       steps=args.steps, device=args.device, gradstats_every=0, eps=1e-4, intra_op_threads=threads)
    bare: dict[str, list[float]] = {mode: [] for mode in modes}
    raced: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        times = {mode: bare_ms_per_step(config, mode, args.steps) for mode in modes}
        for mode in modes:
            bare[mode].append(times["32-true"] / times[mode])
        speedups, race_peaks = race(config)
        for mode in modes:
            raced[mode].append(speedups[mode])
    alone = {mode: race(RunConfig.from_dict({**config.to_dict(), "modes": [mode]}))[1][mode] for mode in modes}
    errors, changes = [], []
    for mode in modes:
        bare_speedup, race_speedup = statistics.median(bare[mode]), statistics.median(raced[mode])
        change = race_peaks[mode] / alone[mode] - 1
        errors.append(abs(race_speedup / bare_speedup - 1))
        changes.append(abs(change))
        print(f"{args.workload}/{args.size}/b{args.batch_size} {args.device} {mode:<11} bare_speedup={bare_speedup:.3f}"
              f" race_speedup={race_speedup:.3f} | lane_peak_MiB race={race_peaks[mode] / 2**20:.1f}"
              f" alone={alone[mode] / 2**20:.1f} ({change:+.2%})", flush=True)
    print(f"speedup_error_max={max(errors):.4f}")
    print(f"memory_change_max={max(changes):.4f}")


if __name__ == "__main__":
    main()
