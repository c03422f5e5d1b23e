"""A precision plan as code for the user's own job: torchao's float8 conversion and `quantize_` with one
`module_filter_fn` per format, AMP Lab's emulation where the device has no kernel for a block format, and the
`keep_in_fp32` list for what stays fp32. The printed code only needs `model` in scope (built, on its device, before
the optimizer) and trains in the loop's own `torch.autocast(dtype=torch.bfloat16)`."""

from __future__ import annotations

from torch import nn

from amp_core import precision  # importing it binds formats.plan's formats (plan.bind_precision)
from amp_core.formats.plan import DTYPE_FORMATS, PlannedLinear, is_float8, matmul_option, set_module
from amp_core.formats.recipes import NATIVE_CAPABILITY, BlockScaledMatmuls
from amp_core.probes.module_formats import linear_formats


def plan_code(formats: dict[str, str], *, title: str = "", autocast: str = "bf16") -> str:
    """The code that gives every Linear named in `formats` ({fqn: format}) its format in a plain loop."""
    listed = "".join(f"    {name!r}: {fmt!r},\n" for name, fmt in formats.items())
    keep = [name for name, fmt in formats.items() if fmt == "fp32"]
    used = list(dict.fromkeys(fmt for fmt in formats.values() if fmt not in ("fp32", autocast)))
    lines = [f"# {title}" if title else "# A precision plan (amp-lab plan)",
             "# `model`: built and on its device, before the optimizer; train under",
             f"# torch.autocast(device_type, dtype=torch.{ {'bf16': 'bfloat16', 'fp16': 'float16'}[autocast]}).",
             "import torch",
             "",
             "from amp_core.fixes import keep_in_fp32",
             "from amp_core.diagnostics.plan_code import convert_layers",
             "",
             "FORMATS = {  # every Linear layer's matmul format",
             listed + "}",
             f"KEEP_FP32 = {keep!r}  # computed in fp32: autocast off inside, inputs upcast",
             "",
             "",
             "def in_format(name):",
             "    \"\"\"torchao's module_filter_fn / filter_fn shape: (module, fqn) -> whether to convert it.\"\"\"",
             "    return lambda module, fqn: isinstance(module, torch.nn.Linear) and FORMATS.get(fqn) == name",
             "",
             "",
             "device = next(model.parameters()).device",
             "keep_in_fp32(model, KEEP_FP32)" if keep else "# no module stays fp32"]
    for fmt in used:
        option = matmul_option(fmt)
        lines.append("")
        if fmt in DTYPE_FORMATS:
            lines += [f"# {fmt}: the layer's matmul under its own torch.autocast({fmt})",
                      f"convert_layers(model, {fmt!r}, in_format({fmt!r}))"]
        elif is_float8(option):
            lines += [f"# {fmt}: torchao float8 training on these layers",
                      "from torchao.float8 import Float8LinearConfig, convert_to_float8_training",
                      "",
                      "convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("
                      f"{option.torchao_recipe!r}),",
                      f"                           module_filter_fn=in_format({fmt!r}))"]
        elif isinstance(option, BlockScaledMatmuls) and not option.torchao_recipe:
            lines += [f"# {fmt}: an ablation torchao has no kernel for: AMP Lab's emulation",
                      f"convert_layers(model, {fmt!r}, in_format({fmt!r}), device=str(device))"]
        elif isinstance(option, BlockScaledMatmuls):
            capability = NATIVE_CAPABILITY[option.format]
            lines += [f"# {fmt}: torchao's kernels on a GPU of compute capability {capability[0]}.{capability[1]}+, "
                      "else AMP Lab's emulation (the same numerics)",
                      f"if device.type == 'cuda' and torch.cuda.get_device_capability(device) >= {capability}:",
                      "    from torchao.quantization import quantize_",
                      *_torchao_config(option),
                      f"    quantize_(model, config, filter_fn=in_format({fmt!r}))",
                      "else:",
                      f"    convert_layers(model, {fmt!r}, in_format({fmt!r}), device=str(device))"]
    return "\n".join(lines) + "\n"


def _torchao_config(option: BlockScaledMatmuls) -> list[str]:
    """The lines that build torchao's config for a block-scaled option (as recipes.BlockScaledMatmuls._native)."""
    if option.format == "mxfp8":
        return ["    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe",
                f"    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe({option.torchao_recipe!r}))"]
    if option.format == "nvfp4":
        return ["    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig",
                "    config = NVFP4TrainingConfig()"]
    return ["    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinearConfig",
            "    config = Float8BlockwiseLinearConfig()"]


def convert_layers(model: nn.Module, format_name: str, filter_fn, device: str = "cpu") -> list[str]:
    """Put the nn.Linear layers of `model` that `filter_fn(module, fqn)` picks (torchao's module_filter_fn shape) in
    `format_name`, as a plan lane does: fp32 kept (`keep_in_fp32`), bf16/fp16 under their own autocast, a block
    format through torchao's kernels where the device has them, else emulated. For the user's own job (the printed
    plan uses it where torchao has no kernel for the device); returns the names converted."""
    names = [fqn for fqn, layer in model.named_modules() if type(layer) is nn.Linear and filter_fn(layer, fqn)]
    if format_name == "fp32":
        already = [name for name, layer in model.named_modules() if precision.is_kept(layer)]
        precision.keep_in_fp32(model, [*already, *names])
    elif format_name in DTYPE_FORMATS:
        for name in names:
            set_module(model, name, PlannedLinear(model.get_submodule(name), format_name))
    elif isinstance(matmul_option(format_name), BlockScaledMatmuls):
        matmul_option(format_name).convert(model, device, set(names))
    else:
        for name in names:
            set_module(model, name, matmul_option(format_name).prepare_module(model.get_submodule(name), device))
    return names


def formats_of(model: nn.Module) -> dict[str, str]:
    """The matmul format each Linear of a prepared `model` computes in, read from the layers themselves, in a
    bf16-mixed loop (a plain Linear: bf16): see probes.module_formats.linear_formats."""
    return linear_formats(model, "bf16")
