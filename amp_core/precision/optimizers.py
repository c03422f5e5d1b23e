"""The optimizers a recipe asks torchao for (low-bit Adam(W) states, bf16 states, stochastic rounding), and
whether torch has fused Adam kernels for a device."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from amp_core.imports import compiler_ready, heavy_import
from amp_core.precision.modes import resolve_device


def torchao_adam(params: Iterable[torch.nn.Parameter], decoupled: bool, state_format: str, stochastic_round: bool,
                  *, lr: float, eps: float) -> torch.optim.Optimizer:
    """torchao's Adam(W) with moments in `state_format` (8bit | 4bit | fp8 | bf16 | "" = the parameter's dtype) and
    bf16 stochastic rounding on or off. Weight decay follows torch's defaults (Adam 0, AdamW 0.01) so a recipe lane
    differs from its plain twin only by the recipe."""
    heavy_import("torchao.optim")
    import torchao.optim

    weight_decay = 1e-2 if decoupled else 0.0
    if state_format in ("8bit", "4bit", "fp8"):
        name = {"8bit": "8bit", "4bit": "4bit", "fp8": "Fp8"}[state_format]
        cls: Callable = getattr(torchao.optim, f"{'AdamW' if decoupled else 'Adam'}{name}")
    elif state_format == "bf16":
        cls = _bf16_state_adamw()
    else:
        # _AdamW with weight_decay=0 is Adam: the decay is decoupled, so with none the update is Adam's.
        cls = torchao.optim._AdamW
    return cls(params, lr=lr, eps=eps, weight_decay=weight_decay, bf16_stochastic_round=stochastic_round)


@functools.cache
def _bf16_state_adamw() -> type:
    """torchao's _AdamW whose moments are bf16 tensors (its update math stays fp32; each moment is rounded to bf16
    when stored), whatever the parameter's dtype."""
    heavy_import("torchao.optim")
    import torchao.optim

    class AdamWBf16States(torchao.optim._AdamW):
        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            return torch.zeros_like(p, dtype=torch.bfloat16)

    return AdamWBf16States


def fused_optimizer_support(device: str = "auto") -> tuple[bool, str]:
    """(ok, reason): whether torch has fused Adam/AdamW kernels for `device` (asked by building one)."""
    device = resolve_device(device)
    compiler_ready()
    try:
        torch.optim.Adam([torch.nn.Parameter(torch.zeros(1, device=device))], fused=True)
    except (RuntimeError, ValueError) as exc:
        return False, f"torch has no fused Adam/AdamW on {device}: {exc}"
    return True, "supported"
