"""A precision plan as code for the user's own job: torchao's float8 conversion and `quantize_` with one
`module_filter_fn` per format, AMP Lab's emulation where the device has no kernel for a block format, and the
`keep_in_fp32` list for what stays fp32, all in one `apply_plan(model)`; then its use in a plain loop (the loop's own
`torch.autocast(dtype=torch.bfloat16)`), a Hugging Face Trainer (`bf16=True`) or Lightning (`precision="bf16-mixed"`,
a callback that applies the plan in `setup`), each with AMP Lab's callback for that trainer."""

from __future__ import annotations

from torch import nn

from amp_core import precision  # importing it binds formats.plan's formats (plan.bind_precision)
from amp_core.formats.plan import DTYPE_FORMATS, PlannedLinear, is_float8, matmul_option, set_module
from amp_core.formats.recipes import NATIVE_CAPABILITY, BlockScaledMatmuls
from amp_core.probes.module_formats import linear_formats

TRAINERS = ("loop", "hf", "lightning")
"""Where the printed plan is applied: a plain loop, a Hugging Face Trainer, a Lightning Trainer."""


def plan_code(formats: dict[str, str], *, title: str = "", autocast: str = "bf16", trainer: str = "loop") -> str:
    """The code that gives every Linear named in `formats` ({fqn: format}) its format: `apply_plan(model)`, then its
    use in `trainer` (TRAINERS; `trainer_usage`). The loop's form needs `model` in scope (built, on its device,
    before the optimizer); the trainers' forms name what else they need in their first comment."""
    if trainer not in TRAINERS:
        raise ValueError(f"unknown trainer {trainer!r}; choose from {', '.join(TRAINERS)}")
    listed = "".join(f"    {name!r}: {fmt!r},\n" for name, fmt in formats.items())
    keep = [name for name, fmt in formats.items() if fmt == "fp32"]
    used = list(dict.fromkeys(fmt for fmt in formats.values() if fmt not in ("fp32", autocast)))
    lines = [f"# {title}" if title else "# A precision plan (amp-lab plan)",
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
             "def apply_plan(model):",
             "    \"\"\"Every Linear of `model` named in FORMATS in its format, in place; returns the model. Call it",
             "    before the optimizer is built (AMP Lab's layers keep their Parameters, torchao's may not).\"\"\"",
             "    device = next(model.parameters()).device",
             "    keep_in_fp32(model, KEEP_FP32)" if keep else "    # no module stays fp32"]
    for fmt in used:
        lines += ["", *(f"    {line}" if line else "" for line in _convert_lines(fmt))]
    lines += ["    return model", "", "", *trainer_usage(trainer, title=title, autocast=autocast)]
    return "\n".join(lines) + "\n"


def _convert_lines(fmt: str) -> list[str]:
    """The lines (inside apply_plan) that put the layers `in_format(fmt)` picks in `fmt`."""
    option = matmul_option(fmt)
    if fmt in DTYPE_FORMATS:
        return [f"# {fmt}: the layer's matmul under its own torch.autocast({fmt})",
                f"convert_layers(model, {fmt!r}, in_format({fmt!r}))"]
    if is_float8(option):
        return [f"# {fmt}: torchao float8 training on these layers",
                "from torchao.float8 import Float8LinearConfig, convert_to_float8_training",
                "",
                "convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("
                f"{option.torchao_recipe!r}),",
                f"                           module_filter_fn=in_format({fmt!r}))"]
    if isinstance(option, BlockScaledMatmuls) and not option.torchao_recipe:
        return [f"# {fmt}: an ablation torchao has no kernel for: AMP Lab's emulation",
                f"convert_layers(model, {fmt!r}, in_format({fmt!r}), device=str(device))"]
    capability = NATIVE_CAPABILITY[option.format]
    return [f"# {fmt}: torchao's kernels on a GPU of compute capability {capability[0]}.{capability[1]}+, "
            "else AMP Lab's emulation (the same numerics)",
            f"if device.type == 'cuda' and torch.cuda.get_device_capability(device) >= {capability}:",
            "    from torchao.quantization import quantize_",
            *_torchao_config(option),
            f"    quantize_(model, config, filter_fn=in_format({fmt!r}))",
            "else:",
            f"    convert_layers(model, {fmt!r}, in_format({fmt!r}), device=str(device))"]


def trainer_usage(trainer: str, *, title: str = "", autocast: str = "bf16") -> list[str]:
    """How `apply_plan` (printed above it) is used in `trainer` (TRAINERS), as lines of code: in each the plan goes
    on the model before the optimizer is built, the trainer's own autocast is the plan's `autocast` dtype, and
    AMP Lab's callback for that trainer records the run like any other."""
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[autocast]
    name = repr(title or "precision plan")
    if trainer == "loop":
        return ["# A plain loop: `model` built and on its device; then build the optimizer and train under",
                f"# torch.autocast(device_type, dtype=torch.{dtype}).",
                "apply_plan(model)"]
    if trainer == "hf":
        flag = {"bf16": "bf16=True", "fp16": "fp16=True"}[autocast]
        return ["# A Hugging Face Trainer: `model` is yours (built, not yet handed to a Trainer), `args` your",
                f"# TrainingArguments with {flag} (the Trainer's autocast), `train_dataset` yours. The plan goes",
                "# on before the Trainer builds its optimizer; AMP Lab's callback records the run.",
                "from transformers import Trainer",
                "",
                "from amp_core.integrations.transformers import AmpLabCallback",
                "",
                "trainer = Trainer(model=apply_plan(model), args=args, train_dataset=train_dataset,",
                f"                  callbacks=[AmpLabCallback(name={name})])",
                "trainer.train()"]
    precision = {"bf16": "bf16-mixed", "fp16": "16-mixed"}[autocast]
    return ["# Lightning: `module` is your LightningModule, PLAN_ON the attribute holding the network the plan",
            "# names, `train_loader` yours, `trainer_settings` your Trainer's other settings (max_steps, ...).",
            "# A callback's setup runs before Lightning calls configure_optimizers: the plan goes on there.",
            "import lightning",
            "",
            "from amp_core.integrations.lightning import AmpLabCallback",
            "",
            "PLAN_ON = 'model'",
            "",
            "",
            "class ApplyPlan(lightning.Callback):",
            "    def setup(self, trainer, pl_module, stage):",
            "        apply_plan(getattr(pl_module, PLAN_ON))",
            "",
            "",
            f"trainer = lightning.Trainer(precision={precision!r},",
            f"                            callbacks=[ApplyPlan(), AmpLabCallback(name={name})], **trainer_settings)",
            "trainer.fit(module, train_loader)"]


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
