"""The layer bisect's cost and aim: trials and wall time against the module count, on CPU-sized transformers (4, 6 and
12 blocks; each block's leaves: two LayerNorms, qkv, proj, fc1, GELU, fc2 and a boost module) with 1 to 3 planted fp16
overflows — a boost whose own output leaves fp16's range (x1e5), scaled back by plain code after it — and one decoy per
model (a boost x300: large but safe).

Each case trains a 16-mixed lane (it fails at step 0), then bisects it from its snapshot in the same process. The set
found should be exactly the planted one, and the trials (the lane as it is, every module kept, the search and the
1-minimality check) at most 2·k·log2(n) + 4 for k planted modules among n.

    python3 -m bench.bisect [--blocks 4,6,12] [--planted 1,2,3]
Last line: bisect_12_blocks_s=<wall seconds of the 12-block bisect with the most planted modules>
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from amp_core.config import RunConfig, ScalerConfig
from amp_core.diagnostics.bisect import bisect_run
from amp_core.race.runner import RunManager
from amp_core.workloads import WORKLOADS, Data, Workload
from amp_core.workshop.planted import Boost

WIDTH, HEADS, CONTEXT, VOCAB = 64, 4, 32, 64
PLANTED, DECOY = 1e5, 300.0
"""A planted boost's factor (beyond fp16 after GELU's values near 1) and the decoy's (large, inside fp16)."""


class Block(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc1, self.act, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        self.boost = Boost(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, length, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, WIDTH))
        return x + self.fc2(self.boost(self.act(self.fc1(self.ln2(x)))) / self.boost.factor)


class Model(nn.Module):
    def __init__(self, blocks: int, planted: set[int], decoy: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(*(Block(PLANTED if index in planted else DECOY if index == decoy else 1.0)
                                      for index in range(blocks)))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.ln_f(self.blocks(x)))


def workload(blocks: int, planted: set[int], decoy: int) -> Workload:
    class Planted(Workload):
        name = f"bench_bisect_{blocks}_{len(planted)}"
        title = "planted transformer (bench)"
        description = "bench only"
        sizes = {"small": {}}

        def load_data(self, config) -> Data:
            tokens = torch.randint(0, VOCAB, (256, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
            return Data(tokens[:, :-1], tokens[:, 1:], "random tokens")

        def build_model(self, size: str, data: Data) -> nn.Module:
            return Model(blocks, planted, decoy)

        def loss(self, output, target):
            return nn.functional.cross_entropy(output.float().flatten(0, 1), target.flatten())

    return Planted()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", default="4,6,12")
    parser.add_argument("--planted", default="1,2,3")
    args = parser.parse_args()
    manager = RunManager()
    last, exact, within, slowest = math.nan, 0, 0, math.nan
    cases = 0
    for blocks in (int(text) for text in args.blocks.split(",")):
        for count in (int(text) for text in args.planted.split(",")):
            if count >= blocks:
                print(f"blocks={blocks:<3} planted={count}: skipped (no block left for the decoy)")
                continue
            planted = set(range(blocks - 1, -1, -max(1, blocks // count)))
            planted = set(sorted(planted)[:count])
            decoy = next(index for index in range(blocks) if index not in planted)
            spec = workload(blocks, planted, decoy)
            WORKLOADS[spec.name] = spec
            config = RunConfig(workload=spec.name, modes=("32-true", "16-mixed"), steps=3, batch_size=8,
                               snapshot_every=1, scaler=ScalerConfig(init_scale=256.0))
            run = manager.launch(config)
            run.join(300)
            began = time.perf_counter()
            report = bisect_run(manager, run.run_id, "16-mixed")
            wall = time.perf_counter() - began
            expected = sorted(f"blocks.{index}.boost" for index in planted)
            same = report.verdict == "fixed" and sorted(report.kept) == expected
            bound = 2 * count * math.log2(report.candidates) + 4
            cases, exact, within = cases + 1, exact + same, within + (len(report.trials) <= bound)
            print(f"blocks={blocks:<3} modules={report.candidates:<4} planted={count} decoy=blocks.{decoy}.boost "
                  f"trials={len(report.trials):<3} bound={bound:5.1f} wall_s={wall:6.1f} "
                  f"set==planted={same}" + ("" if same else f" (found {report.kept}, verdict {report.verdict})"))
            print(f"  {report.price_line()}")
            last = wall
            if blocks == 12:
                slowest = wall if math.isnan(slowest) else max(slowest, wall)
    print(f"bisect_cases_exact={exact}/{cases}")
    print(f"bisect_cases_within_bound={within}/{cases}")
    print(f"bisect_12_blocks_max_s={slowest:.1f}")
    print(f"bisect_12_blocks_s={last:.1f}")


if __name__ == "__main__":
    main()
