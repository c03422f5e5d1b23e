"""Every private torch API AMP Lab relies on, wrapped once: the only module in amp_core that names one.

torch may rename or drop a private name in any release. Each wrapper checks that the name is there and raises
TorchAPIChanged naming it (and the torch version) when it is not, and tests/test_torch_private.py calls every wrapper
on a real object, so a torch that changed fails one test that says which API, instead of a lane failing mid-run.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Sequence

import torch
from torch.utils.module_tracker import ModuleTracker

from amp_core.imports import compiler_ready, heavy_import

try:
    from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode
except ImportError as exc:  # pragma: no cover - only on a torch that moved it
    raise ImportError(f"torch {torch.__version__}: torch.utils._python_dispatch.TorchDispatchMode is gone "
                      "(the op inspector's dispatch mode needs it)") from exc

__all__ = ["ScopedModuleTracker", "TorchAPIChanged", "TorchDispatchMode", "aot_autograd_cache_off",
           "compilation_metrics", "compiled_call", "current_compile_id", "foreach_copy_", "foreach_norm",
           "forward_hooks", "found_inf_flag", "graph_break_counts", "has_triton", "inductor_backend",
           "inductor_cxx_names", "is_recompile_limit_warning", "recompile_limit", "remove_forward_hooks",
           "scale_tensor", "scaler_settings", "scaler_tensors", "set_compiled_call", "supports_amp_scaling",
           "watch_dynamo_compiles"]

_SCALER_SETTINGS = {"init_scale": "_init_scale", "growth_factor": "_growth_factor",
                    "backoff_factor": "_backoff_factor", "growth_interval": "_growth_interval"}


class TorchAPIChanged(RuntimeError):
    """A private torch API AMP Lab wraps is not what it was (names the API and the torch version)."""

    def __init__(self, api: str, why: str = "is gone"):
        super().__init__(f"torch {torch.__version__}: private API {api} {why}; amp_core/torch_private.py must follow "
                         "the change")
        self.api = api


class TorchDispatchMode(_TorchDispatchMode):
    """torch's dispatch mode, made only after torch's compiler stack is imported through the gate: torch wraps a
    mode's `__torch_dispatch__` in its lazy `_disable_dynamo`, which imports torch._dynamo on whichever thread runs
    it first. A page's probe running there while the server's warm-up imports the stack saw it half
    made ("cannot import name 'IndentedBuffer' from partially initialized module 'torch._inductor.utils'")."""

    def __init__(self, *args, **kwargs):
        compiler_ready()
        super().__init__(*args, **kwargs)


PYTREE_LOGGER = "torch.utils._pytree"
"""The logger of torch's private pytree module (its register_constant deprecation for Enums goes there)."""


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


_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def forward_hooks(module: torch.nn.Module) -> list[object]:
    """The forward pre-hooks and forward hooks registered on `module` (a deep copy of a module carries copies of its
    hooks, but no handle to remove them by)."""
    pre = _attribute(module, "_forward_pre_hooks", "Module._forward_pre_hooks")
    post = _attribute(module, "_forward_hooks", "Module._forward_hooks")
    return [*pre.values(), *post.values()]


def remove_forward_hooks(module: torch.nn.Module, kind: type) -> int:
    """Remove the forward (pre-)hooks of `module` that are instances of `kind`; returns how many."""
    removed = 0
    for hooks_name in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = _attribute(module, hooks_name, f"Module.{hooks_name}")
        for key in [key for key, hook in hooks.items() if isinstance(hook, kind)]:
            for name in _FORWARD_HOOK_DICTS:
                _attribute(module, name, f"Module.{name}").pop(key, None)
            removed += 1
    return removed


# --- torch.compile's own accounting (dynamo, inductor): compiled lanes (amp_core.race.compiled) and their op view ----
def _private_module(name: str):
    try:  # through the gate: torch's compiler stack imports in cycles, one thread at a time (amp_core.imports)
        return heavy_import(name)
    except ImportError:
        raise TorchAPIChanged(name) from None


def watch_dynamo_compiles(started, ended):
    """Register `started(args)` / `ended(args)` with dynamo's compile callbacks (args: callback_trigger, compile_id;
    they fire only when dynamo or a lazy backward compiles); returns a function that removes both."""
    handler = _attribute(_private_module("torch._dynamo.callback"), "callback_handler",
                         "torch._dynamo.callback.callback_handler")
    handler.register_start_callback(started)
    handler.register_end_callback(ended)

    def remove() -> None:
        for callbacks, callback in ((handler.start_callbacks, started), (handler.end_callbacks, ended)):
            if callback in callbacks:
                callbacks.remove(callback)
    return remove


def compilation_metrics() -> list:
    """Dynamo's record of its recent compiles (compile_id, co_name, recompile_reason, times, failure)."""
    return _attribute(_private_module("torch._dynamo.utils"), "get_compilation_metrics",
                      "torch._dynamo.utils.get_compilation_metrics")()


def graph_break_counts() -> Counter:
    """Dynamo's own count of graph breaks by message, so far in this process."""
    counters = _attribute(_private_module("torch._dynamo.utils"), "counters", "torch._dynamo.utils.counters")
    return Counter(counters["graph_break"])


def recompile_limit() -> int:
    """How many compiled versions of one frame dynamo keeps before it runs the frame eagerly."""
    return int(_attribute(_private_module("torch._dynamo.config"), "recompile_limit",
                          "torch._dynamo.config.recompile_limit"))


def compiled_call(module: torch.nn.Module):
    """What `module(...)` calls once `module.compile()` compiled it in place (None: it is eager)."""
    return _attribute(module, "_compiled_call_impl", "nn.Module._compiled_call_impl")


def set_compiled_call(module: torch.nn.Module, call) -> None:
    compiled_call(module)  # it is there (or the API moved)
    module._compiled_call_impl = call


def inductor_cxx_names() -> tuple:
    """The C++ compilers inductor tries on a CPU, in order (None: its own conda-installed g++, never used here)."""
    cpp = _attribute(_attribute(_private_module("torch._inductor.config"), "cpp", "torch._inductor.config.cpp"),
                     "cxx", "torch._inductor.config.cpp.cxx")
    return tuple(cpp) if isinstance(cpp, (list, tuple)) else (cpp,)


def has_triton() -> bool:
    return bool(_attribute(_private_module("torch.utils._triton"), "has_triton", "torch.utils._triton.has_triton")())


def inductor_backend(inner, mode: str = "default", *, bind=None):
    """A torch.compile backend that is inductor with `inner(graph, example_inputs, compile_inner, **kwargs)` in the
    place of its inner compile: handed each post-AOT graph (forward, then backward with is_backward=True) and
    inductor's own inner compile to call.

    `bind`: instead of one `inner` for every compile, `bind()` is called each time dynamo hands the backend a graph
    (on the compiling thread) and returns the inner for that graph's forward and backward (the backward may compile
    later, on another thread), or None: inductor's own inner compile, its caches as usual. While a graph compiles
    behind a capturing inner, AOT autograd's cache is off (`aot_autograd_cache_off`): a hit there would hand inductor
    no graph, so there would be nothing to capture."""
    compile_fx = _private_module("torch._inductor.compile_fx")
    outer = _attribute(compile_fx, "compile_fx", "torch._inductor.compile_fx.compile_fx")
    compile_inner = _attribute(compile_fx, "compile_fx_inner", "torch._inductor.compile_fx.compile_fx_inner")
    options = _attribute(_private_module("torch._inductor"), "list_mode_options", "torch._inductor.list_mode_options")
    patches = None if mode == "default" else options(mode)

    def backend(graph, example_inputs):
        chosen = inner if bind is None else bind()
        if chosen is None:
            return outer(graph, example_inputs, config_patches=patches)
        with aot_autograd_cache_off():
            return outer(graph, example_inputs, config_patches=patches,
                         inner_compile=lambda g, inputs, **kwargs: chosen(g, inputs, compile_inner, **kwargs))
    return backend


_aot_cache_lock = threading.Lock()
_aot_cache_users = 0
_aot_cache_was: bool | None = None


@contextlib.contextmanager
def aot_autograd_cache_off():
    """AOT autograd's local cache off while any caller is inside (a process-wide switch: counted, so that two
    threads inside at once leave it as they found it)."""
    global _aot_cache_users, _aot_cache_was
    config = _private_module("torch._functorch.config")
    _attribute(config, "enable_autograd_cache", "torch._functorch.config.enable_autograd_cache")
    with _aot_cache_lock:
        if _aot_cache_users == 0:
            _aot_cache_was = config.enable_autograd_cache
            config.enable_autograd_cache = False
        _aot_cache_users += 1
    try:
        yield
    finally:
        with _aot_cache_lock:
            _aot_cache_users -= 1
            if _aot_cache_users == 0:
                config.enable_autograd_cache = _aot_cache_was


def current_compile_id() -> str:
    """The id of the compile dynamo is making on this thread ("frame/attempt", as its logs and callbacks say it), or
    "" outside one."""
    guards = _private_module("torch._guards")
    context = _attribute(guards, "CompileContext", "torch._guards.CompileContext")
    compile_id = _attribute(context, "current_compile_id", "torch._guards.CompileContext.current_compile_id")()
    return "" if compile_id is None else str(compile_id)


DYNAMO_FRAME_LOGGER = "torch._dynamo.convert_frame"
"""The logger dynamo warns on when a frame hits its recompile limit (it then runs that frame eagerly)."""


def is_recompile_limit_warning(record) -> bool:
    """Whether a log record of DYNAMO_FRAME_LOGGER is dynamo's recompile-limit warning."""
    return str(record.msg).startswith("torch._dynamo hit config.")
