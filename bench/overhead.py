"""Harness overhead: the runner's median ms/step (all per-step metrics on, store writing) vs a bare PyTorch loop.

Same model, data, batch order and mode; the two are interleaved in one process (bare, runner, bare, runner ...)
so machine noise hits both alike. The runner's step interval is taken between consecutive records, so it holds
everything the harness does between two steps (records, events, sampled probes, store flushes).

    python bench/overhead.py [--size small] [--rounds 5] [--steps 600]
Last line: overhead_ratio_max=<number>   (target <= 1.02)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amp_core.config import RunConfig
from amp_core.runner import Run
from amp_core.store import RunStore
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


def runner_loop(config: RunConfig, store: RunStore) -> list[float]:
    run = Run(config, store).start()
    run.join()
    assert run.status == "finished", run.status
    stamps = run.frame()["t_wall_s"].to_numpy()
    return list(np.diff(stamps)[WARMUP:] * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="digits_mlp")
    parser.add_argument("--modes", default="32-true,bf16-mixed")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(Path(tmp) / "bench.sqlite3")
        for mode in args.modes.split(","):
            config = RunConfig(workload=args.workload, modes=(mode,), steps=args.steps, batch_size=args.batch_size,
                               size=args.size, device="cpu")
            bare, harness = [], []
            for _ in range(args.rounds):
                bare += bare_loop(config, mode)
                harness += runner_loop(config, store)
            bare_ms, harness_ms = statistics.median(bare), statistics.median(harness)
            ratios[mode] = harness_ms / bare_ms
            print(f"{args.workload}/{args.size} {mode:<11} bare_median_ms={bare_ms:.4f} "
                  f"runner_median_ms={harness_ms:.4f} ratio={ratios[mode]:.4f} "
                  f"(runner mean incl. flushes and sampled probes: {statistics.fmean(harness):.4f} ms, "
                  f"bare mean {statistics.fmean(bare):.4f} ms)")
    print(f"overhead_ratio_max={max(ratios.values()):.4f}")


if __name__ == "__main__":
    main()
