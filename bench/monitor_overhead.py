"""Monitor overhead: the same training loop with and without a Monitor, interleaved step by step in one process
(bare, monitored, monitored, bare, ...: the order alternates every step) so machine noise hits both alike: on a
shared machine, segments of tens of steps drift by a few percent against each other even with no Monitor at all.

Two copies of the model, optimizer and scaler start from the same weights. Each step is timed alone (perf_counter
around the whole iteration, `monitor.step()` included), so the monitored time holds everything the Monitor does: its
step(), its sampled probes (gradient norm every 25 steps, statistics every 50, memory every 25, layer diagnostics
every 200: --layers-every) and its store flushes (every second, MonitorConfig.flush_every_s, to a SQLite file). A
round's ratio is its monitored steps' total time / its bare steps' total; the figure is the median of the rounds'
ratios. The ratio of the steps' median times (which leaves the sampled probes and flushes out) is printed beside it.

The flushes (and the layer watch's reads and the dashboard's requests, every half flush) keep the wall clock, and the
bench's wall clock runs two loops: the monitored one has half of it, so with the Monitor's own setting it would flush
twice per second of its own loop, twice as often as alone (counted: 1.04 flushes per second of the loop's own time
alone, 2.06 alternated). The bench gives it LOOPS x flush_every_s, so it flushes as often per second of its own loop
as a loop alone does (1.05 alternated); `--wall-flush` keeps the setting as it is, for comparison.

Cases (name:mode): `mlp` is a 512-384-384-1 MLP at batch 128 (about 3 ms per step on one core: the target's
workload); `digits_mlp` is the runner's digits_mlp small at batch 64 (a few tenths of a millisecond, where the
Monitor's fixed per-step cost shows). One intra-op thread by default (--threads): on a shared machine with few
cores, an OpenMP team waiting for busy cores makes every step's time swing by tens of percent.

    python3 -m bench.monitor_overhead [--cases mlp:32-true,digits_mlp:16-mixed] [--rounds 20] [--steps 50]
    (from the repository root)
Last line: monitor_overhead_ratio=<the first case's ratio>
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from amp_core.attach.monitor import Monitor, MonitorConfig
from amp_core.config import RunConfig
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from amp_core.workloads import WORKLOADS

WARMUP = 30
LOOPS = 2
"""Loops sharing the wall clock (bare and monitored, step by step)."""
AUTOCAST = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
TARGET = 1.02


def build(case: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, callable]:
    """(model, inputs, targets, loss function) of a case; one fixed batch (the data pipeline is not what is timed)."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if case == "mlp":
        model = nn.Sequential(nn.Linear(512, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 1))
        x = torch.randn(128, 512, generator=generator)
        return model, x, x[:, :1] * 3 + 1, nn.functional.mse_loss
    workload = WORKLOADS[case]
    config = RunConfig(workload=case, size="small", batch_size=64)
    data = workload.load_data(config)
    x, y = data.sample(generator, config.batch_size)
    return workload.build_model("small", data), x, y, workload.loss


class Loop:
    """One copy of the user's loop (model, Adam, GradScaler in 16-mixed), monitored or not."""

    def __init__(self, case: str, mode: str, store: RunStore | None, layers_every: int | None = None,
                 flush_every_s: float | None = None):
        model, self.x, self.y, self.loss_fn = build(case)
        self.model = copy.deepcopy(model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.scaler = torch.amp.GradScaler("cpu", enabled=mode == "16-mixed", init_scale=256.0)
        self.autocast = AUTOCAST[mode]
        settings = {} if layers_every is None else {"layers_every": layers_every}
        if flush_every_s is not None:
            settings["flush_every_s"] = flush_every_s
        self.monitor = Monitor(self.model, self.optimizer, self.scaler, store=store, mode=mode,
                               name=f"bench {case}", **settings) if store is not None else None

    def step(self) -> float:
        """One iteration's time (s)."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            loss = self.loss_fn(self.model(self.x), self.y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.monitor is not None:
            self.monitor.step(loss, samples=len(self.x))
        return time.perf_counter() - started


def measure(case: str, mode: str, rounds: int, steps: int, store: RunStore,
            layers_every: int | None = None, flush_every_s: float | None = None) -> dict[str, float]:
    bare, monitored = Loop(case, mode, None), Loop(case, mode, store, layers_every, flush_every_s)
    for _ in range(WARMUP):
        bare.step()
        monitored.step()
    ratios, bare_medians, monitored_medians = [], [], []
    for _ in range(rounds):
        plain, watched = [], []
        for index in range(steps):
            if index % 2 == 0:
                plain.append(bare.step())
                watched.append(monitored.step())
            else:
                watched.append(monitored.step())
                plain.append(bare.step())
        ratios.append(sum(watched) / sum(plain))
        bare_medians.append(statistics.median(plain))
        monitored_medians.append(statistics.median(watched))
    monitored.monitor.close()
    frame = store.steps(monitored.monitor.run_id)
    return {"ratio": statistics.median(ratios), "median_ratio": statistics.median(
                [m / b for m, b in zip(monitored_medians, bare_medians, strict=True)]),
            "bare_ms": statistics.median(bare_medians) * 1e3, "records": len(frame),
            "probe_ms_mean": float(frame["probe_ms"].mean()),
            "rounds_min": min(ratios), "rounds_max": max(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="mlp:32-true,digits_mlp:32-true,digits_mlp:16-mixed",
                        help="comma-separated name:mode (name: mlp or a workload; mode: 32-true, bf16-mixed, 16-mixed)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100, help="steps of each loop per round")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    parser.add_argument("--layers-every", type=int, default=None,
                        help="the Monitor's layer diagnostics every N steps (default: MonitorConfig's; 0: off)")
    parser.add_argument("--wall-flush", action="store_true",
                        help="flush every MonitorConfig.flush_every_s of the wall clock that both loops share (twice "
                             "per second of the monitored loop's own time) instead of LOOPS times that")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = MonitorConfig().layers_every if args.layers_every is None else args.layers_every
    flush_every_s = MonitorConfig().flush_every_s * (1 if args.wall_flush else LOOPS)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; {args.rounds} rounds x "
          f"{args.steps} steps per loop, interleaved step by step; layer diagnostics every {layers} steps; a flush "
          f"every {flush_every_s:g} s of the wall clock {LOOPS} loops share")
    figures = []
    with tempfile.TemporaryDirectory() as folder:
        store = open_store(Path(folder) / "runs.sqlite3")
        for case_mode in args.cases.split(","):
            case, mode = case_mode.split(":")
            result = measure(case, mode, args.rounds, args.steps, store, args.layers_every, flush_every_s)
            figures.append(result["ratio"])
            print(f"{case}_{mode}_bare_ms_per_step={result['bare_ms']:.3f}")
            print(f"{case}_{mode}_monitor_probe_ms_mean={result['probe_ms_mean']:.4f}")
            print(f"{case}_{mode}_median_step_ratio={result['median_ratio']:.4f}")
            print(f"{case}_{mode}_rounds_ratio_range={result['rounds_min']:.4f}..{result['rounds_max']:.4f}")
            print(f"{case}_{mode}_ratio={result['ratio']:.4f}  (target <= {TARGET} for a few-ms step)")
    print(f"monitor_overhead_ratio={figures[0]:.4f}")


if __name__ == "__main__":
    main()
