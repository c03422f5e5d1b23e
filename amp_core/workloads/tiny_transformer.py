"""tiny_transformer: a char-level causal LM on Shakespeare's sonnets (shipped); where fp16 attention overflow lives."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from amp_core.workloads.base import Data, Workload

CORPUS = Path(__file__).with_name("data") / "sonnets.txt"


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, time, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, time, dim))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(positions))))


@dataclass(frozen=True, slots=True)
class TextData(Data):
    """`inputs` is the whole token stream; a batch is random windows of `block` tokens and the next ones."""

    block: int = 64
    vocab: int = 0

    def sample(self, generator, batch_size):
        starts = torch.randint(len(self.inputs) - self.block - 1, (batch_size,), generator=generator)
        offsets = torch.arange(self.block)
        idx = starts[:, None] + offsets[None, :]
        return self.inputs[idx], self.inputs[idx + 1]


@lru_cache(maxsize=1)
def _tokens() -> tuple[torch.Tensor, int]:
    text = CORPUS.read_text(encoding="utf-8")
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    return torch.tensor([lookup[c] for c in text], dtype=torch.long), len(chars)


class TinyTransformer(Workload):
    name = "tiny_transformer"
    title = "Tiny transformer (predicts the next letter)"
    description = ("A small GPT-style language model that learns Shakespeare's sonnets letter by letter: embedding, "
                   "causal self-attention, LayerNorm and a GELU MLP, cross-entropy loss.")
    sizes = {"small": {"block": 32, "dim": 64, "heads": 4, "layers": 2},
             "medium": {"block": 128, "dim": 128, "heads": 4, "layers": 4},
             "large": {"block": 256, "dim": 384, "heads": 6, "layers": 6},
             # For a GPU: GPT-2 small's shape (768 wide, 12 layers, 12 heads, 512-token context; ~85M parameters
             # without the embeddings), where the GPU is busy enough that the modes' speed gaps are the hardware's.
             "xl": {"block": 512, "dim": 768, "heads": 12, "layers": 12}}

    def load_data(self, config) -> Data:
        tokens, vocab = _tokens()
        block = self.sizes[config.size]["block"]
        return TextData(tokens, tokens, f"{len(tokens)} characters of Shakespeare's sonnets, {vocab} symbols",
                        block, vocab)

    def build_model(self, size: str, data: Data) -> nn.Module:
        s = self.sizes[size]
        return CharLM(data.vocab, s["block"], s["dim"], s["heads"], s["layers"])

    def loss(self, output, target):
        return F.cross_entropy(output.flatten(0, 1), target.flatten())
