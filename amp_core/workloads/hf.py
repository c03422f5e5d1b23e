"""Real architectures from transformers' own config and model classes (GPT-2, Llama, BERT, ViT), random init, shipped
data, byte-level vocabulary; transformers is imported only when one of them is built (the `hf` extra).

A model keeps its own class and module names (`transformer.h.0.attn.c_attn`): the workload builds a subclass of the
transformers model class whose forward takes the one input tensor the runner passes and returns the logits, so
every tool (op trace, layer numerics, the amax heatmap, the overflow debugger) names what `named_modules()` names.
`HFWorkload` is also the base of a user's own architecture (examples/hf_workload.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from amp_core.extras import missing_extras
from amp_core.workloads.base import Data, Workload
from amp_core.workloads.digits_mlp import load_shipped_digits
from amp_core.workloads.tiny_transformer import CORPUS, TextData

BYTE_VOCAB = 256
"""The language models' vocabulary: the sonnets' UTF-8 bytes, so no tokenizer is downloaded."""
IGNORE_INDEX = -100
"""A label the loss leaves out (cross_entropy's ignore_index): BERT's unmasked positions."""
ATTENTION = "sdpa"
"""The attention implementation every model is built with: torch's scaled_dot_product_attention, so the op trace shows
which SDPA kernel ran (on a CPU aten::_scaled_dot_product_flash_attention_for_cpu) and in which dtype, as a user's
model built with transformers' default would run. `eager` would spell the softmax out as separate ops."""
MASK_SHARE, MASK_AS_MASK, MASK_AS_RANDOM = 0.15, 0.8, 0.1
"""BERT's masking: 15 % of positions are predicted; of those 80 % show [MASK], 10 % a random byte, 10 % stay."""


def _transformers():
    """The transformers package (amp_core.workloads.hf_models: the one place it is imported, on first use)."""
    from amp_core.workloads.hf_models import transformers_module

    return transformers_module()


@functools.cache
def _logits_class(model_class: type) -> type:
    """`model_class` with a forward that takes the runner's one input tensor and returns the logits; every module,
    parameter and name is the model class's own."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return model_class.forward(self, inputs).logits

    return type(model_class.__name__, (model_class,), {"forward": forward, "__module__": __name__,
                                                       "__doc__": f"{model_class.__name__}, returning its logits."})


@functools.cache
def _byte_tokens() -> torch.Tensor:
    """The sonnets as UTF-8 bytes (int64): a vocabulary of 256, no tokenizer."""
    return torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()


@dataclass(frozen=True, slots=True)
class MaskedText(Data):
    """Windows of `block` bytes with BERT's masking drawn from the run's generator (every lane sees the same masks).
    A batch is (masked ids, labels): a label is the original byte where a position is predicted, IGNORE_INDEX
    elsewhere."""

    block: int = 64
    mask_id: int = BYTE_VOCAB

    def sample(self, generator, batch_size):
        starts = torch.randint(len(self.inputs) - self.block, (batch_size,), generator=generator)
        ids = self.inputs[starts[:, None] + torch.arange(self.block)[None, :]]
        chosen = torch.rand(ids.shape, generator=generator) < MASK_SHARE
        labels = torch.where(chosen, ids, IGNORE_INDEX)
        fate = torch.rand(ids.shape, generator=generator)
        random_bytes = torch.randint(BYTE_VOCAB, ids.shape, generator=generator)
        masked = torch.where(chosen & (fate < MASK_AS_MASK), self.mask_id, ids)
        masked = torch.where(chosen & (fate >= MASK_AS_MASK) & (fate < MASK_AS_MASK + MASK_AS_RANDOM), random_bytes,
                             masked)
        return masked, labels


SHAPES = {"small": {"block": 32, "width": 64, "layers": 2, "heads": 4},
          "medium": {"block": 128, "width": 256, "layers": 4, "heads": 8},
          "large": {"block": 512, "width": 768, "layers": 12, "heads": 12}}
"""Each size's text window, width, depth and attention heads, shared by the architectures: small and medium for a CPU;
large for a GPU, GPT-2 small's / BERT-base's / ViT-Base's shape."""


class HFWorkload(Workload):
    """A transformers architecture as a workload: `config_class` and `model_class` (names in the transformers
    package, resolved when a model is built), `task` (causal-lm, masked-lm or image-classification), and `sizes`:
    each size's config arguments (the config class's own names) plus `block` (the text window, for the LMs), on top
    of SHAPES where `shape_names` is set (`size_arguments` merges them).
    Random init; the LMs train on the shipped sonnets as bytes, image classification on the shipped 8x8 digits."""

    config_class: str = ""
    model_class: str = ""
    task: str = "causal-lm"
    requires = ("hf",)
    fixed: dict[str, Any] = {}
    """Config arguments every size shares (dropout off: every lane then computes the same function of the same
    weights and batch, so the lanes differ by precision only)."""
    shape_names: tuple[str, str, str] | None = None
    """The config's own names for SHAPES' width, depth and heads: each size is then SHAPES[size] under these names (and
    the MLP 4x the width under `mlp_name`, where named), `sizes[size]` on top. None: `sizes` holds every argument."""
    mlp_name = ""
    """The config's name for the MLP's width, where it is 4x the model's (BERT's and ViT's intermediate_size)."""

    def check_config(self, config) -> None:
        super().check_config(config)
        self.check_extras()

    def check_extras(self) -> None:
        """ConfigError naming the extra to install when one this workload needs is missing."""
        missing = missing_extras(self.requires)
        if missing:
            from amp_core.config import ConfigError

            raise ConfigError("workload", f"{self.name} needs the {' and '.join(e.name for e in missing)} extra "
                                          f"({', '.join(m for e in missing for m in e.modules)}), not installed "
                                          f"here: {' '.join(e.install for e in missing)}")

    def size_arguments(self, size: str) -> dict[str, Any]:
        """The config arguments of `size` (and `block`, the text window), from SHAPES where `shape_names` says so."""
        if self.shape_names is None:
            return dict(self.sizes[size])
        shape, (width, layers, heads) = SHAPES[size], self.shape_names
        arguments = {"block": shape["block"], width: shape["width"], layers: shape["layers"], heads: shape["heads"]}
        if self.mlp_name:
            arguments[self.mlp_name] = 4 * shape["width"]
        return arguments | self.sizes[size]

    def load_data(self, config) -> Data:
        self.check_extras()
        block = self.size_arguments(config.size).get("block", 0)
        if self.task == "image-classification":
            images, labels = load_shipped_digits()
            x = torch.from_numpy(images).float().div(16.0).unsqueeze(1)  # pixel counts 0..16 -> [0, 1], 1 channel
            return Data(x, torch.from_numpy(labels).long(), f"UCI 8x8 digits: {len(x)} images, 1 channel")
        tokens = _byte_tokens()
        text = f"{len(tokens)} bytes of Shakespeare's sonnets, a byte-level vocabulary of {BYTE_VOCAB}"
        if self.task == "masked-lm":
            return MaskedText(tokens, tokens, text + f" + [MASK] (id {BYTE_VOCAB}), 15 % masked (80/10/10)", block)
        return TextData(tokens, tokens, text, block, BYTE_VOCAB)

    def model_config(self, size: str) -> Any:
        """The transformers config of `size`: the size's arguments plus what the task and the data fix (vocabulary,
        positions, labels, channels), the attention implementation, no cache, no special tokens outside the bytes."""
        transformers = _transformers()
        sized = self.size_arguments(size)
        arguments = {**self.fixed, **{key: value for key, value in sized.items() if key != "block"}}
        if self.task == "image-classification":
            arguments = {"image_size": 8, "num_channels": 1, "num_labels": 10, **arguments}
        else:
            vocab = BYTE_VOCAB + (1 if self.task == "masked-lm" else 0)
            arguments = {"vocab_size": vocab, "max_position_embeddings": sized["block"],
                         "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "use_cache": False,
                         **arguments}
        return getattr(transformers, self.config_class)(attn_implementation=ATTENTION, **arguments)

    def build_model(self, size: str, data: Data) -> nn.Module:
        transformers = _transformers()
        return _logits_class(getattr(transformers, self.model_class))(self.model_config(size))

    def loss(self, output, target):
        return F.cross_entropy(output.flatten(0, -2), target.flatten(), ignore_index=IGNORE_INDEX)


class GPT2(HFWorkload):
    name = "gpt2"
    title = "GPT-2 (transformers, causal LM)"
    description = ("transformers' GPT2LMHeadModel from a GPT2Config, random init, learning the sonnets byte by byte: "
                   "learned positions, LayerNorm, Conv1D projections (c_attn, c_proj, c_fc), GELU, tied LM head. "
                   "Needs the hf extra.")
    config_class, model_class, task = "GPT2Config", "GPT2LMHeadModel", "causal-lm"
    requires = ("hf",)
    fixed = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    # small: a CPU step in tens of ms in 32-true at batch 64 (a 32-byte context 64 wide was ~100 ms on a 2-core AVX2
    # CPU, and 4-5x that in bf16-mixed/16-mixed, whose matmuls the CPU converts).
    shape_names = ("n_embd", "n_layer", "n_head")
    sizes = {"small": {"block": 16, "n_embd": 32}, "medium": {}, "large": {}}


class Llama(HFWorkload):
    name = "llama"
    title = "Llama (transformers, causal LM)"
    description = ("transformers' LlamaForCausalLM from a LlamaConfig, random init, learning the sonnets byte by byte: "
                   "RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention. Needs the hf extra.")
    config_class, model_class, task = "LlamaConfig", "LlamaForCausalLM", "causal-lm"
    requires = ("hf",)
    fixed = {"attention_dropout": 0.0, "tie_word_embeddings": False}
    # GQA: half as many key/value heads (a third at large: 12 query heads on 4), and SwiGLU's width near 8/3 x.
    shape_names = ("hidden_size", "num_hidden_layers", "num_attention_heads")
    sizes = {"small": {"intermediate_size": 176, "num_key_value_heads": 2},
             "medium": {"intermediate_size": 688, "num_key_value_heads": 4},
             "large": {"intermediate_size": 3072, "num_key_value_heads": 4}}


class Bert(HFWorkload):
    name = "bert"
    title = "BERT (transformers, masked LM)"
    description = ("transformers' BertForMaskedLM from a BertConfig, random init, on the sonnets as bytes with the "
                   "standard masking (15 % of positions: 80 % [MASK], 10 % a random byte, 10 % unchanged), the same "
                   "masks in every lane. Needs the hf extra.")
    config_class, model_class, task = "BertConfig", "BertForMaskedLM", "masked-lm"
    requires = ("hf",)
    fixed = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    shape_names, mlp_name = ("hidden_size", "num_hidden_layers", "num_attention_heads"), "intermediate_size"
    sizes = {"small": {}, "medium": {}, "large": {}}


class ViT(HFWorkload):
    name = "vit"
    title = "ViT (transformers, image classifier)"
    description = ("transformers' ViTForImageClassification from a ViTConfig, random init, classifying the shipped 8x8 "
                   "handwritten digits from 2x2 patches (16 patches + [CLS]). Needs the hf extra.")
    config_class, model_class, task = "ViTConfig", "ViTForImageClassification", "image-classification"
    requires = ("hf",)
    fixed = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "patch_size": 2}
    shape_names, mlp_name = ("hidden_size", "num_hidden_layers", "num_attention_heads"), "intermediate_size"
    sizes = {"small": {}, "medium": {}, "large": {}}
