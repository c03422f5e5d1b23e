"""What do the recipes cost and save? One race through the runner on tiny_transformer: 32-true (the baseline, torch's
Adam with fp32 states), bf16-mixed, bf16-mixed+fp8-rowwise, 32-true+adamw-8bit and bf16-true+sr.

For each lane: its final loss (mean of the last steps) and the gap to 32-true's, and its optimizer-state bytes against
32-true's. The bytes are the runner's own figure, read from the optimizer's state tensors after a step (torchao's
low-bit states by their inner tensors: codes, block scales, lookup table), not computed from dtypes. torchao quantizes
only states of >= 4096 values that divide into its blocks (256 values for 8-bit); the rest stay fp32: the bench says
how much of the model that covers at the size it runs.

    python3 -m bench.recipes [--size medium] [--steps 150] [--batch-size 16]
Last line: adamw_8bit_state_ratio=<8-bit lane's optimizer bytes / 32-true's> (target <= 0.3)
"""

from __future__ import annotations

import argparse

import torch

from amp_core.config import RunConfig
from amp_core.precision import BASELINE_MODE
from amp_core.race.runner import Run
from amp_core.workloads import WORKLOADS

RECIPES = (BASELINE_MODE, "bf16-mixed", "bf16-mixed+fp8-rowwise", "32-true+adamw-8bit", "bf16-true+sr")
LOSS_TAIL = 10
"""Final loss = the mean of this many last steps (one step's loss is noisy)."""
EIGHT_BIT_BLOCK, EIGHT_BIT_MIN_VALUES = 256, 4096
"""torchao's AdamW8bit quantizes a state only with at least this many values, in blocks of this many."""


def quantized_share(size: str) -> tuple[int, int, int, int]:
    """(values, all values, tensors, all tensors) of tiny_transformer at `size` whose 8-bit states torchao quantizes."""
    workload = WORKLOADS["tiny_transformer"]
    model = workload.build_model(size, workload.load_data(RunConfig(workload="tiny_transformer", size=size)))
    sizes = [p.numel() for p in model.parameters()]
    kept = [n for n in sizes if n >= EIGHT_BIT_MIN_VALUES and n % EIGHT_BIT_BLOCK == 0]
    return sum(kept), sum(sizes), len(kept), len(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium", help="tiny_transformer size (default medium)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    values, total, tensors, all_tensors = quantized_share(args.size)
    print(f"tiny_transformer {args.size}: torchao's 8-bit states cover {values}/{total} values "
          f"({values / total:.1%}) in {tensors}/{all_tensors} tensors; the rest stay fp32")
    config = RunConfig(workload="tiny_transformer", size=args.size, modes=RECIPES, steps=args.steps,
                       batch_size=args.batch_size, lr=args.lr, optimizer="adamw", device="cpu", gradstats_every=0)
    run = Run(config).start()
    run.join()
    frame = run.frame()
    if run.status != "finished":
        raise SystemExit(f"run {run.status}: {[(lane.mode, lane.error) for lane in run.lanes]}")
    final = frame.groupby("mode")["loss"].apply(lambda losses: losses.tail(LOSS_TAIL).mean())
    states = frame.groupby("mode")["optim_bytes"].last()
    baseline_loss, baseline_states = final[BASELINE_MODE], states[BASELINE_MODE]
    print(f"{args.steps} steps, batch {args.batch_size}, AdamW lr {args.lr:g}, cpu (final loss = mean of the last "
          f"{LOSS_TAIL} steps)")
    print(f"{'recipe':<26}{'final loss':>11}{'gap to 32-true':>16}{'optim bytes':>13}{'vs fp32 Adam':>14}")
    for recipe in RECIPES:
        print(f"{recipe:<26}{final[recipe]:>11.4f}{final[recipe] - baseline_loss:>+16.4f}{states[recipe]:>13,d}"
              f"{states[recipe] / baseline_states:>14.3f}")
    print(f"torch {torch.__version__}")
    print(f"adamw_8bit_state_ratio={states['32-true+adamw-8bit'] / baseline_states:.3f}")


if __name__ == "__main__":
    main()
