"""What do the block-scaled lanes cost to emulate, and how far do they train from bf16-mixed? One seeded race through
the runner on tiny_transformer: bf16-mixed beside every block-scaled option (+mxfp8, +mxfp8-wgrad-hp, +nvfp4 and its
ablations; +fp8-blockwise needs whole 128-blocks, so it races on the size given by --blockwise-size with its own
bf16-mixed).

For each option: its median ms/step against bf16-mixed's in the same interleaved race (the emulation's cost on this
CPU: goal <= 6x, so a workshop race stays interactive; on a GPU with the kernels, the speed-up), and its final loss
(mean of the last steps, mean over seeds) minus bf16-mixed's, judged against the spread across seeds
(amp_core.diagnostics.seednoise's rule).

    python3 -m bench.formats [--size small] [--steps 300] [--seeds 3] [--blockwise-size medium]
                             [--blockwise-steps 100] [--blockwise-seeds 2] [--blockwise-batch-size 8]
Last line: emulation_cost_worst=<the largest ms/step ratio to bf16-mixed> (goal <= 6)

The default fits about ten quiet minutes on two cores: the small race (7 lanes x 3 seeds x 300 steps) takes most of
it; medium is 13x small's step, so +fp8-blockwise races there for fewer steps, seeds and samples (its ms/step ratio is
what it is at any length; its loss gap is read after those steps).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from amp_core.config import RunConfig
from amp_core.diagnostics.seednoise import difference_verdict
from amp_core.formats.recipes import BLOCK_SCALED_OPTIONS
from amp_core.precision import get_precision
from amp_core.race.runner import Run

BASELINE = "bf16-mixed"
LOSS_TAIL = 20
"""Final loss = the mean of this many last steps (one step's loss is noisy)."""
EMULATION_GOAL = 6.0


def race(size: str, recipes: tuple[str, ...], args: argparse.Namespace, steps: int, seeds: int,
         batch_size: int) -> dict[str, dict[str, float | str]]:
    """One race of bf16-mixed and `recipes` at `size`: per recipe its ms/step ratio and loss gap to bf16-mixed."""
    config = RunConfig(workload="tiny_transformer", size=size, modes=(BASELINE, *recipes), steps=steps,
                       batch_size=batch_size, lr=args.lr, optimizer="adamw", device=args.device,
                       seeds=seeds, gradstats_every=0)
    run = Run(config).start()
    run.join()
    if run.status != "finished":
        raise SystemExit(f"run {run.status}: {[(lane.mode, lane.error) for lane in run.lanes if lane.error]}")
    frame = run.frame()
    final = frame.groupby(["mode", "lane"])["loss"].apply(lambda losses: losses.tail(LOSS_TAIL).mean())
    # The first steps warm caches and allocators: the median of the rest.
    step_ms = frame[frame["step"] >= 5].groupby("mode")["step_ms"].median()
    base = final[BASELINE].to_numpy()
    figures = {}
    for recipe in recipes:
        losses = final[recipe].to_numpy()
        verdict, threshold = difference_verdict(losses.mean(), losses.std(ddof=1) if len(losses) > 1 else np.nan,
                                                len(losses), base.mean(),
                                                base.std(ddof=1) if len(base) > 1 else np.nan, len(base))
        figures[recipe] = {"race": f"{size}, {steps} steps x {seeds} seeds, batch {batch_size}",
                           "ms_ratio": step_ms[recipe] / step_ms[BASELINE], "step_ms": step_ms[recipe],
                           "baseline_ms": step_ms[BASELINE], "loss": losses.mean(), "baseline_loss": base.mean(),
                           "gap": losses.mean() - base.mean(), "threshold": threshold, "verdict": verdict}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="tiny_transformer size (default small)")
    parser.add_argument("--blockwise-size", default="medium",
                        help="the size +fp8-blockwise races at (its blocks are 128 wide; default medium; '' skips it)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--blockwise-steps", type=int, default=100)
    parser.add_argument("--blockwise-seeds", type=int, default=2)
    parser.add_argument("--blockwise-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    recipes = tuple(f"{BASELINE}+{option.name}" for option in BLOCK_SCALED_OPTIONS)
    blockwise = tuple(r for r in recipes if r.endswith("fp8-blockwise"))
    figures = race(args.size, tuple(r for r in recipes if r not in blockwise), args, args.steps, args.seeds,
                   args.batch_size)
    if args.blockwise_size:
        figures |= race(args.blockwise_size, blockwise, args, args.blockwise_steps, args.blockwise_seeds,
                        args.blockwise_batch_size)
    print(f"tiny_transformer, AdamW lr {args.lr:g}, {args.device}; torch {torch.__version__}")
    print(f"{'recipe':<30}{'ms/step':>9}{'vs bf16':>9}{'final loss':>12}{'gap':>9}{'2 SE':>8}  verdict  (speed; race)")
    for recipe, row in figures.items():
        option = get_precision(recipe, args.device).block_scaled
        speed = "native" if option.native(args.device) else "emulated"
        print(f"{recipe:<30}{row['step_ms']:>9.1f}{row['ms_ratio']:>8.2f}x{row['loss']:>12.4f}{row['gap']:>+9.4f}"
              f"{row['threshold']:>8.4f}  {row['verdict']}  ({speed}; {row['race']})")
    for recipe, row in figures.items():
        name = recipe.split("+", 1)[1].replace("-", "_")
        print(f"{name}_ms_ratio={row['ms_ratio']:.2f}")
        print(f"{name}_loss_gap={row['gap']:+.4f}")
        print(f"{name}_seed_noise_2se={row['threshold']:.4f}")
    worst = max(figures.values(), key=lambda row: row["ms_ratio"])
    print(f"emulation_cost_worst={worst['ms_ratio']:.2f}")


if __name__ == "__main__":
    main()
