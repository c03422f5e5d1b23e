"""The layer bisect's cost: trials and wall time against the module count, on CPU-sized transformers (3, 6 and 12
blocks; each block's leaves: two LayerNorms, qkv, proj, fc1, GELU, fc2 and a scale module) with 1 to 3 planted fp16
overflows (a scale module multiplying by 1e6 and dividing again) beside large-but-safe ones (x300).

Each case trains a 16-mixed lane (it fails at step 0), then bisects it from its snapshot in the same process; the
bisect's trials should grow like the set size times log2 of the module count, not like the module count.

    python3 -m bench.bisect [--blocks 3,6,12] [--planted 1,2,3]
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
from amp_core.runner import RunManager
from amp_core.workloads import WORKLOADS, Data, Workload
from amp_core.workshop.planted import Gain

WIDTH, HEADS, CONTEXT, VOCAB = 64, 4, 32, 64


class Block(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc1, self.act, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        self.scale = Gain(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, length, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, WIDTH))
        return x + self.fc2(self.scale(self.act(self.fc1(self.ln2(x)))))


class Model(nn.Module):
    def __init__(self, blocks: int, planted: set[int]):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(*(Block(1e6 if index in planted else 300.0) for index in range(blocks)))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.ln_f(self.blocks(x)))


def workload(blocks: int, planted: set[int]) -> Workload:
    class Planted(Workload):
        name = f"bench_bisect_{blocks}_{len(planted)}"
        title = "planted transformer (bench)"
        description = "bench only"
        sizes = {"small": {}}

        def load_data(self, config) -> Data:
            tokens = torch.randint(0, VOCAB, (256, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
            return Data(tokens[:, :-1], tokens[:, 1:], "random tokens")

        def build_model(self, size: str, data: Data) -> nn.Module:
            return Model(blocks, planted)

        def loss(self, output, target):
            return nn.functional.cross_entropy(output.float().flatten(0, 1), target.flatten())

    return Planted()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", default="3,6,12")
    parser.add_argument("--planted", default="1,2,3")
    args = parser.parse_args()
    manager = RunManager()
    last = math.nan
    for blocks in (int(text) for text in args.blocks.split(",")):
        for count in (int(text) for text in args.planted.split(",")):
            planted = set(range(blocks - 1, -1, -max(1, blocks // count)))
            planted = set(sorted(planted)[:count])
            spec = workload(blocks, planted)
            WORKLOADS[spec.name] = spec
            config = RunConfig(workload=spec.name, modes=("32-true", "16-mixed"), steps=3, batch_size=8,
                               snapshot_every=1, scaler=ScalerConfig(init_scale=256.0))
            run = manager.launch(config)
            run.join(300)
            began = time.perf_counter()
            report = bisect_run(manager, run.run_id, "16-mixed")
            wall = time.perf_counter() - began
            expected = sorted(f"blocks.{index}.scale" for index in planted)
            found = "exact" if sorted(report.kept) == expected else f"found {report.kept}"
            print(f"blocks={blocks:<3} modules={report.candidates:<4} planted={count} trials={len(report.trials):<3} "
                  f"k*log2(n)={count * math.log2(report.candidates):5.1f} wall_s={wall:6.1f} set={found}")
            print(f"  {report.price_line()}")
            last = wall
    print(f"bisect_12_blocks_s={last:.1f}")


if __name__ == "__main__":
    main()
