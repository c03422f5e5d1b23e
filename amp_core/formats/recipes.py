"""The block-scaled recipe options (`+mxfp8`, `+mxfp8-wgrad-hp`, `+nvfp4` and its ablations, `+fp8-blockwise`):
torchao's kernels where the GPU has them, else the emulated Linear (amp_core.formats.linear), so a race on any
device shows the format's numerics and says *emulated* where its speed would mislead.

`BlockScaledMatmuls` has precision.RecipeOption's interface without importing it: precision imports this module to
register the options in RECIPE_OPTIONS, so this one must not import precision at import time."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from amp_core.formats.linear import BlockScaledLinear, GemmRecipe
from amp_core.imports import heavy_import

NATIVE_CAPABILITY = {"mxfp8": (10, 0), "nvfp4": (10, 0), "fp8-blockwise": (9, 0)}
"""CUDA compute capability whose tensor cores (and torchao's kernels) run each format: MXFP8 and NVFP4 on Blackwell
(sm100), blockwise FP8 on Hopper (sm90, torchao's Triton GEMMs)."""
NATIVE_DIM_MULTIPLE = 128
"""torchao's NVFP4 and blockwise FP8 training kernels need every GEMM dim a multiple of 128."""

def kept_in_fp32(module: torch.nn.Module) -> bool:
    """precision.is_kept: whether `module` is kept in fp32 (`+keep:`), asked by precision.keep.KEEP_ATTRIBUTE's name
    because precision imports this module (tests/test_block_formats.py checks both answers agree)."""
    return "_amp_lab_keep" in vars(module)


BLOCK_SCALED_HELP: dict[str, str] = {
    "mxfp8": "MXFP8 matmuls: e4m3 values, one power-of-two (e8m0) scale per 32, RCEIL (torchao; Blackwell).",
    "mxfp8-wgrad-hp": "MXFP8 forward and grad-input matmuls; the weight-gradient matmul in bf16 (more accurate).",
    "nvfp4": "NVFP4 as published (arXiv 2509.25149): e2m1 values, e4m3 scale per 16 plus a tensor scale, 16x16 weight "
             "tiles, random Hadamard transform on the weight-gradient inputs, stochastic rounding of gradients.",
    "nvfp4-no-rht": "NVFP4 without the random Hadamard transform (what the transform buys).",
    "nvfp4-no-sr": "NVFP4 with gradients rounded to nearest, not stochastically (what stochastic rounding buys).",
    "nvfp4-1d": "NVFP4 with weights in 1x16 blocks instead of 16x16 tiles (what 2-D weight scaling buys).",
    "fp8-blockwise": "Blockwise FP8 (DeepSeek-V3): e4m3, fp32 scales per 1x128 activations/gradients, 128x128 weights.",
}
"""One line per block-scaled option, in the order the UI lists them."""


@dataclass(frozen=True, slots=True)
class BlockScaledMatmuls:
    """`+mxfp8` / `+nvfp4...` / `+fp8-blockwise`: the model's Linear layers compute their three GEMMs in a
    block-scaled format, under bf16 autocast; the weights stay fp32 (the optimizer's). A layer whose dims are not
    whole blocks, or that sits in a module kept out (`+keep:`), stays a plain Linear and is named with why."""

    name: str
    gemm: GemmRecipe
    help: str
    torchao_recipe: str = ""
    """torchao's recipe for this option where the GPU has the kernels ("" : always emulated)."""
    needs_torchao = False
    """The emulation is torch alone; torchao is imported only for its kernels on a GPU that has them."""
    fsdp_only = False

    @property
    def format(self) -> str:
        return self.gemm.format

    def refusal(self, mode: str, device: str | None) -> str:
        if mode != "bf16-mixed":
            return f"+{self.name} runs on top of bf16-mixed (its GEMMs read bf16 operands); use bf16-mixed+{self.name}"
        if device is not None and torch.device(device).type not in ("cpu", "cuda"):
            return f"+{self.name} cannot run on {device}, not even emulated (use cpu or cuda)"
        return ""

    def fsdp_refusal(self) -> str:
        return "block-scaled lanes under FSDP2 are not raced yet"

    def native(self, device: str) -> bool:
        """Whether `device` runs this option with torchao's kernels (else the emulation)."""
        if not self.torchao_recipe or torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability(torch.device(device)) >= NATIVE_CAPABILITY[self.format]

    def compile_refusal(self, compile_option: str, device: str) -> str:
        """Why `+compile...` is refused beside this option on `device` (empty: torchao's kernels run here, and
        torch.compile composes with them as torchao documents). Emulated, inductor would spend minutes compiling the
        emulation's quantisers (NVFP4's stochastic-rounding draws breaking its graph) for a step time that says
        nothing about the format."""
        if self.native(device):
            return ""
        return (f"+{compile_option} with +{self.name} is refused where {self.format} is emulated (here, on "
                f"{device}): inductor would compile the emulation, not the format's kernels, and its step time says "
                f"nothing about {self.format}; race +{self.name} eager here (with torchao's kernels, on a GPU that has "
                "them, the two compose)")

    def note(self, device: str) -> str:
        if self.native(device):
            return f"{self.help} torchao's {self.format} kernels."
        return (f"{self.help} Emulated here: each GEMM operand quantised and dequantised exactly as the recipe "
                "(the format's numerics), the product in fp32: no speed-up, and its step time is the emulation's.")

    def plan(self, module: torch.nn.Module, device: str, kept: Iterable[str] = ()) -> tuple[list[str], dict[str, str]]:
        """(Linear layers converted, {layer: why not}) for `module`: a layer in a kept module (`kept`, or carrying
        kept by `+keep:`) stays out, as do layers whose dims are not whole blocks (on a GPU with the kernels: not
        multiples of theirs)."""
        converted, skipped = [], {}
        kept = {*kept, *(name for name, layer in module.named_modules() if kept_in_fp32(layer))}
        native = self.native(device)
        for name, layer in module.named_modules():
            if type(layer) is torch.nn.Linear:
                # The outermost kept module that holds it (a glob can match a module and its children alike).
                holder = next((k for k in sorted(kept, key=len) if name == k or name.startswith(f"{k}.") or not k),
                              None)
                out_features, in_features = layer.weight.shape
                if holder is not None:
                    why = f"kept out (+keep: {holder or '(the model)'})"
                elif native and self.format != "mxfp8" and (in_features % NATIVE_DIM_MULTIPLE
                                                            or out_features % NATIVE_DIM_MULTIPLE):
                    why = f"misshaped: {in_features}->{out_features} is not a multiple of torchao's " \
                          f"{NATIVE_DIM_MULTIPLE} for {self.format} kernels"
                else:
                    why = self.gemm.misfit(in_features, out_features)
                if why:
                    skipped[name] = why
                else:
                    converted.append(name)
            elif type(layer).__name__ == "Conv1D":
                skipped[name] = "transformers' Conv1D (a Linear with its weight stored transposed), not an nn.Linear"
        return converted, skipped

    def refuses_model(self, module: torch.nn.Module, device: str, kept: Iterable[str] = ()) -> str:
        """Why this option cannot train `module` (empty: it can): none of its Linear layers converts."""
        converted, skipped = self.plan(module, device, kept)
        if converted:
            return ""
        reasons = "; ".join(f"{name}: {why}" for name, why in skipped.items()) or "it has no nn.Linear layer"
        return f"+{self.name} converts none of {type(module).__name__}'s Linear layers ({reasons})"

    def prepare_module(self, module: torch.nn.Module, device: str) -> torch.nn.Module:
        converted, skipped = self.plan(module, device)
        if not converted:
            if skipped and all(why.startswith("kept out") for why in skipped.values()):
                return module  # every Linear kept out (a bisect's trial keeping every module): nothing to convert
            raise ValueError(self.refuses_model(module, device))
        return self.convert(module, device, set(converted))

    def convert(self, module: torch.nn.Module, device: str, converted: set[str]) -> torch.nn.Module:
        """`module` with its Linear layers named in `converted` (whole blocks: see `plan`) in this format: torchao's
        kernels where the device has them, else the emulated Linear. A precision plan converts its own layers so."""
        if self.native(device):
            return self._native(module, converted)
        for name in converted:
            parent_name, _, child = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, child, BlockScaledLinear(getattr(parent, child), self.gemm, name))
        return module

    def _native(self, module: torch.nn.Module, converted: set[str]) -> torch.nn.Module:
        """torchao's training kernels on the layers `converted` (torchao's documented `quantize_` entry points)."""
        heavy_import("torchao.quantization")  # through the one gate: torchao imports in cycles (amp_core.imports)
        from torchao.quantization import quantize_

        if self.format == "mxfp8":
            from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

            config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(self.torchao_recipe))
        elif self.format == "nvfp4":
            from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig

            config = NVFP4TrainingConfig()
        else:
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinearConfig

            config = Float8BlockwiseLinearConfig()
        quantize_(module, config, filter_fn=lambda layer, fqn: fqn in converted)
        return module


BLOCK_SCALED_OPTIONS: tuple[BlockScaledMatmuls, ...] = (
    BlockScaledMatmuls(name="mxfp8", gemm=GemmRecipe("mxfp8"), help=BLOCK_SCALED_HELP["mxfp8"],
                       torchao_recipe="mxfp8_rceil"),
    BlockScaledMatmuls(name="mxfp8-wgrad-hp", gemm=GemmRecipe("mxfp8", wgrad_hp=True),
                       help=BLOCK_SCALED_HELP["mxfp8-wgrad-hp"], torchao_recipe="mxfp8_rceil_wgrad_with_hp"),
    BlockScaledMatmuls(name="nvfp4", gemm=GemmRecipe("nvfp4", weight_tiles=True, hadamard=True,
                                                     stochastic_gradients=True),
                       help=BLOCK_SCALED_HELP["nvfp4"], torchao_recipe="nvfp4"),
    BlockScaledMatmuls(name="nvfp4-no-rht", gemm=GemmRecipe("nvfp4", weight_tiles=True, stochastic_gradients=True),
                       help=BLOCK_SCALED_HELP["nvfp4-no-rht"]),
    BlockScaledMatmuls(name="nvfp4-no-sr", gemm=GemmRecipe("nvfp4", weight_tiles=True, hadamard=True),
                       help=BLOCK_SCALED_HELP["nvfp4-no-sr"]),
    BlockScaledMatmuls(name="nvfp4-1d", gemm=GemmRecipe("nvfp4", hadamard=True, stochastic_gradients=True),
                       help=BLOCK_SCALED_HELP["nvfp4-1d"]),
    BlockScaledMatmuls(name="fp8-blockwise", gemm=GemmRecipe("fp8-blockwise", weight_tiles=True),
                       help=BLOCK_SCALED_HELP["fp8-blockwise"], torchao_recipe="blockwise"),
)
"""Every block-scaled option, in the order the UI lists them."""
