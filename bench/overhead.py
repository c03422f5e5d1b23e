"""Harness overhead: the runner's median ms/step (all per-step metrics on, store writing) vs a bare PyTorch loop.

Same model, data, batch order and mode; bare loops and runs are interleaved in one process (bare, runner, bare,
runner ...) so machine noise hits both alike. The runner's step interval is taken between consecutive records,
so it holds everything the harness does between two steps (records, events, sampled probes, store flushes).

Two bare loops are timed:
- `bare_thread`: the loop on a background thread with the intra-op thread count the run measured and chose,
  i.e. the same conditions as the runner; the ratio to it is the harness's own cost (the target);
- `bare_main`: the loop as a user writes it, on the main thread with the process's threads (for reference:
  on few cores, OpenMP teams started from a second thread cost ~25 us per parallel op, which is why the run
  measures whether one intra-op thread is faster for its model).

    python3 -m bench.overhead [--size small] [--rounds 6] [--steps 600]   (from the repository root)
Last line: overhead_ratio_max=<number>   (runner vs bare_thread, worst mode; target <= 1.02)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from amp_core.config import RunConfig
from amp_core.records.store import RunStore
from amp_core.runner import PROCESS_THREADS, Run
from amp_core.workloads import WORKLOADS

WARMUP = 50
AUTOCAST = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def bare_loop(config: RunConfig, mode: str) -> list[float]:
    """The seed notes' loop, nothing else: ms between consecutive steps."""
    workload = WORKLOADS[config.workload]
    data = workload.load_data(config)
    torch.manual_seed(config.seed)
    model = workload.build_model(config.size, data)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    generator = torch.Generator().manual_seed(config.seed)
    dtype = AUTOCAST[mode]
    stamps = []
    for _ in range(config.steps):
        x, y = data.sample(generator, config.batch_size)
        optimizer.zero_grad(set_to_none=True)
        ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with ctx:
            loss = workload.loss(model(x), y)
        loss.backward()
        optimizer.step()
        loss.item()  # the seed prints it; the runner records it
        stamps.append(time.perf_counter())
    return list(np.diff(stamps)[WARMUP:] * 1e3)


def bare_loop_on_thread(config: RunConfig, mode: str, threads: int) -> list[float]:
    out: list[float] = []

    def target() -> None:
        torch.set_num_threads(threads)
        try:
            out.extend(bare_loop(config, mode))
        finally:
            torch.set_num_threads(PROCESS_THREADS)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return out


def runner_loop(config: RunConfig, store: RunStore) -> tuple[list[float], int]:
    run = Run(config, store).start()
    run.join()
    assert run.status == "finished", run.status
    stamps = run.frame()["t_wall_s"].to_numpy()
    return list(np.diff(stamps)[WARMUP:] * 1e3), run.events()[0].data["intra_op_threads"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="digits_mlp")
    parser.add_argument("--modes", default="32-true,bf16-mixed")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(Path(tmp) / "bench.sqlite3")
        for mode in args.modes.split(","):
            config = RunConfig(workload=args.workload, modes=(mode,), steps=args.steps, batch_size=args.batch_size,
                               size=args.size, device="cpu")
            bare_main, bare_thread, harness, chosen = [], [], [], []
            for _ in range(args.rounds):
                bare_main += bare_loop(config, mode)
                steps, threads = runner_loop(config, store)
                harness += steps
                chosen.append(threads)
                bare_thread += bare_loop_on_thread(config, mode, threads)
            main_ms, thread_ms, runner_ms = (statistics.median(v) for v in (bare_main, bare_thread, harness))
            ratios[mode] = runner_ms / thread_ms
            print(f"{args.workload}/{args.size} {mode:<11} runner_median_ms={runner_ms:.4f} "
                  f"bare_thread_median_ms={thread_ms:.4f} ratio={ratios[mode]:.4f} | "
                  f"bare_main_median_ms={main_ms:.4f} runner/bare_main={runner_ms / main_ms:.4f} | "
                  f"run threads chosen {sorted(set(chosen))} (process: {PROCESS_THREADS}) | "
                  f"means incl. flushes and sampled probes: runner {statistics.fmean(harness):.4f} ms, "
                  f"bare_thread {statistics.fmean(bare_thread):.4f} ms")
    print(f"overhead_ratio_max={max(ratios.values()):.4f}")


if __name__ == "__main__":
    main()
