"""The fix for the user's own job: keep named modules in fp32 in a plain loop, a torchao float8 conversion, a Hugging
Face Trainer or a Lightning Trainer, and the same as code to paste (what the bisect found, printed by the CLI and shown
on the pages with a copy button)."""

from __future__ import annotations

import fnmatch
import textwrap
from collections.abc import Callable, Iterable

import torch

from amp_core import precision


def keep_in_fp32(model: torch.nn.Module, patterns: Iterable[str]) -> list[str]:
    """Make the modules of `model` whose names (`model.named_modules()`) match `patterns` (globs) compute in fp32,
    whatever the loop does around them, PyTorch's way (`autocast(enabled=False)` inside, inputs upcast): under
    `torch.autocast` with fp32 weights their outputs stay fp32 and autocast decides what follows; in a model cast to
    bf16/fp16 (their parameters are made fp32 again) their outputs are cast back to the model's dtype, for the next
    layer's 16-bit weights. Call it after any `model.to(dtype)` and before building the optimizer. Returns the names
    kept; ValueError for a pattern that matches nothing, naming the closest modules."""
    return precision.keep_in_fp32(model, patterns)


def float8_module_filter(patterns: Iterable[str],
                         base: Callable[[torch.nn.Module, str], bool] | None = None
                         ) -> Callable[[torch.nn.Module, str], bool]:
    """A `module_filter_fn` for torchao's `convert_to_float8_training`: False (leave it a plain nn.Linear) for a
    module whose name, or the name of a module it is inside, matches `patterns`; otherwise `base`'s answer (True when
    there is none)."""
    patterns = tuple(patterns)

    def keep_out(module: torch.nn.Module, fqn: str) -> bool:
        parts = fqn.split(".")
        names = {".".join(parts[:end]) for end in range(1, len(parts) + 1)}
        if any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns):
            return False
        return base(module, fqn) if base is not None else True

    return keep_out


def fix_code(kept: Iterable[str], recipe: str = "") -> str:
    """The fix as code to paste into the user's job: the plain loop, torchao's float8 conversion (for an FP8 recipe),
    the Hugging Face Trainer and the Lightning Trainer."""
    names = list(kept)
    listed = "[" + ", ".join(repr(name) for name in names) + "]"
    lines = [f"# Keep {len(names)} module{'s' if len(names) != 1 else ''} in fp32 (found by amp-lab bisect"
             + (f" on {recipe}" if recipe else "") + ")",
             "from amp_core.fixes import keep_in_fp32",
             f"KEEP = {listed}",
             "",
             "# A plain loop: after model.to(dtype) (true 16-bit modes), before building the optimizer;",
             "# the loop's torch.autocast / GradScaler stay as they are."]
    if recipe:
        lines += textwrap.wrap(precision.keep_output_note(recipe), 116, initial_indent="# ",
                               subsequent_indent="# ")
    lines += ["keep_in_fp32(model, KEEP)"]
    if precision.is_fp8_recipe(recipe):
        lines += ["",
                  "# torchao float8 training: leave the kept modules plain nn.Linear",
                  "from amp_core.fixes import float8_module_filter",
                  "from torchao.float8 import convert_to_float8_training",
                  "model = convert_to_float8_training(model, module_filter_fn=float8_module_filter(KEEP))"]
    lines += ["",
              "# Hugging Face Trainer: on the model before Trainer(...) (AMPLabCallback works as before)",
              "keep_in_fp32(model, KEEP)",
              "trainer = Trainer(model=model, args=args, callbacks=[AMPLabCallback()])",
              "",
              "# Lightning: once the Trainer has set the model up (a true-precision plugin casts it there)",
              "from lightning.pytorch.callbacks import Callback",
              "",
              "class KeepInFp32(Callback):",
              "    def on_fit_start(self, trainer, pl_module):",
              "        keep_in_fp32(pl_module, KEEP)",
              "",
              "trainer = Trainer(precision=..., callbacks=[KeepInFp32(), AMPLabCallback()])"]
    return "\n".join(lines)
