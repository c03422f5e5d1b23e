"""Every private torch API AMP Lab relies on, wrapped once: the only module in amp_core that names one.

torch may rename or drop a private name in any release. Each wrapper checks that the name is there and raises
TorchAPIChanged naming it (and the torch version) when it is not, and tests/test_torch_private.py calls every wrapper
on a real object, so a torch that changed fails one test that says which API, instead of a lane failing mid-run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.module_tracker import ModuleTracker

try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError as exc:  # pragma: no cover - only on a torch that moved it
    raise ImportError(f"torch {torch.__version__}: torch.utils._python_dispatch.TorchDispatchMode is gone "
                      "(the op inspector's dispatch mode needs it)") from exc

__all__ = ["ScopedModuleTracker", "TorchAPIChanged", "TorchDispatchMode", "foreach_copy_", "foreach_norm",
           "found_inf_flag", "scale_tensor", "scaler_settings", "scaler_tensors", "supports_amp_scaling"]

_SCALER_SETTINGS = {"init_scale": "_init_scale", "growth_factor": "_growth_factor",
                    "backoff_factor": "_backoff_factor", "growth_interval": "_growth_interval"}


class TorchAPIChanged(RuntimeError):
    """A private torch API AMP Lab wraps is not what it was (names the API and the torch version)."""

    def __init__(self, api: str, why: str = "is gone"):
        super().__init__(f"torch {torch.__version__}: private API {api} {why}; amp_core/torch_private.py must follow "
                         "the change")
        self.api = api


def _attribute(owner: object, name: str, api: str):
    try:
        return getattr(owner, name)
    except AttributeError:
        raise TorchAPIChanged(api) from None


def scale_tensor(scaler: torch.amp.GradScaler | None) -> torch.Tensor | float | None:
    """The scaler's current scale without a host sync: the device tensor it keeps (a CPU tensor for a CPU scaler),
    or, before its first step (when it has no tensor yet), the initial scale as a float, read from the host; None
    for no scaler or a disabled one."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale = scaler._get_scale_async()  # checked at import (below): a step calls this, so it stays one call
    return scaler.get_scale() if scale is None else scale


def scaler_settings(scaler: torch.amp.GradScaler) -> dict[str, float]:
    """init_scale, growth_factor, backoff_factor, growth_interval of a scaler (torch has no public getter for all)."""
    return {key: _attribute(scaler, name, f"GradScaler.{name}") for key, name in _SCALER_SETTINGS.items()}


def scaler_tensors(scaler: torch.amp.GradScaler) -> dict[str, torch.Tensor]:
    """The scale and growth tracker of an enabled scaler, without a wait (GradScaler.state_dict() reads the scale to
    the host: a sync on CUDA): the scaler's own tensors (copy them before its next step), or, before its first step,
    new CPU tensors of its initial values."""
    scale = _attribute(scaler, "_scale", "GradScaler._scale")
    if scale is None:
        return {"scale": torch.tensor(float(_attribute(scaler, "_init_scale", "GradScaler._init_scale"))),
                "growth_tracker": torch.tensor(int(_attribute(scaler, "_init_growth_tracker",
                                                              "GradScaler._init_growth_tracker")))}
    return {"scale": scale, "growth_tracker": _attribute(scaler, "_growth_tracker", "GradScaler._growth_tracker")}


def supports_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer unscales and skips on the device (fused Adam/AdamW/SGD): GradScaler then hands it the
    found-inf flag (`found_inf_flag`) instead of skipping its step on the host."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def found_inf_flag(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """Inside a GradScaler step of an optimizer that `supports_amp_scaling` (an optimizer step pre-hook): the
    found-inf flag GradScaler hands it as the attribute `found_inf` (a device tensor); None elsewhere."""
    return getattr(optimizer, "found_inf", None)


def foreach_norm(tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Every tensor's L2 norm in `dtype`, in one fused kernel (torch._foreach_norm)."""
    return _attribute(torch, "_foreach_norm", "torch._foreach_norm")(list(tensors), 2, dtype=dtype)


def foreach_copy_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy every source into its target in one fused call (torch._foreach_copy_)."""
    _attribute(torch, "_foreach_copy_", "torch._foreach_copy_")(list(targets), list(sources))


for _owner, _name in ((ModuleTracker, "_fw_pre_hook"), (ModuleTracker, "_fw_post_hook"),
                      (ModuleTracker, "_get_append_fn"), (ModuleTracker, "_get_mod_name"),
                      (torch.amp.GradScaler, "_get_scale_async")):
    if not hasattr(_owner, _name):
        raise TorchAPIChanged(f"{_owner.__name__}.{_name}")


class ScopedModuleTracker(ModuleTracker):
    """torch's ModuleTracker, with its hooks on the given modules only, which it names by `names` (dotted paths)
    instead of the tracker's "ClassName.child" form.

    The stock tracker registers process-wide module hooks; those would also fire in a training thread that runs
    while a live lane is traced. Here the tracker's own hook functions (private) are attached to each module.
    `parents` (public) is the set of modules running now.
    """

    def __init__(self, names: dict[torch.nn.Module, str]):
        super().__init__()
        self._names = names
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._grad_hooks: list[torch.utils.hooks.RemovableHandle] = []

    def _get_mod_name(self, mod: torch.nn.Module) -> str:
        return self._names[mod]

    def enter_on_grad(self, tensor: torch.Tensor, name: str) -> None:
        """Enter `name` when the backward reaches `tensor`. Needed for the module whose output is the root of the
        backward: torch's multi-grad hook counts no call for the root node, so the stock tracker never enters it."""
        self._grad_hooks.append(tensor.register_hook(self._get_append_fn(name, True)))

    def _fw_post_hook(self, mod: torch.nn.Module, input: object, output: object) -> None:
        """The stock hook, except for a module that returned its input itself (Dropout at p=0, nn.Identity: every
        transformers model holds some): it ran no op, and its backward enter hook would sit on the same tensor as its
        exit hook, firing after it, so the module would stay "running" for the rest of the backward and be named for
        every op there."""
        inputs = {id(t) for t in torch.utils._pytree.tree_leaves(input) if isinstance(t, torch.Tensor)}
        outputs = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        if outputs and all(id(t) in inputs for t in outputs):
            self._get_pop_fn(self._get_mod_name(mod), False)()
            return
        super()._fw_post_hook(mod, input, output)

    def __enter__(self) -> ScopedModuleTracker:
        for module in self._names:
            self._handles.append(module.register_forward_pre_hook(self._fw_pre_hook))
            self._handles.append(module.register_forward_hook(self._fw_post_hook))
        return self

    def __exit__(self, *args: object) -> None:
        for handle in (*self._handles, *self._grad_hooks):
            handle.remove()
        self._handles.clear()
        self._grad_hooks.clear()
        hooks = _attribute(self, "_hooks", "ModuleTracker._hooks")
        for hook in hooks:
            hook.remove()
        hooks.clear()
