"""Workload registry: name -> Workload (model + data + loss). Built-ins one file each; plugins are modules named at
start-up (`AMP_LAB_WORKLOADS=pkg.module,...` or the CLI's `--workload-module pkg.module`), never anything typed into
the browser.

May import: config, precision, catalog and extras; transformers only through hf_models, on first use. Nothing
that trains: race/, attach/ and diagnostics/ read workloads.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from amp_core.catalog import PLUGINS_ENV
from amp_core.config import SIZES, ConfigError, RunConfig
from amp_core.workloads.base import Data, Workload, contract_problems
from amp_core.workloads.checkerboard_cnn import CheckerboardCNN
from amp_core.workloads.digits_mlp import DigitsMLP
from amp_core.workloads.hf import GPT2, Bert, Llama, ViT
from amp_core.workloads.mlp_regression import MLPRegression
from amp_core.workloads.tiny_transformer import TinyTransformer

WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (MLPRegression(), DigitsMLP(), CheckerboardCNN(), TinyTransformer(), GPT2(), Llama(), Bert(),
                        ViT())
}
"""Every workload of this process, built-ins first, then plugins in the order they were loaded. Modules that read it
hold this one dict: plugins are added to it in place."""
BUILT_IN: frozenset[str] = frozenset(WORKLOADS)
PLUGIN_ORIGINS: dict[str, str] = {}
"""Plugin workload name -> the module that defined it."""


@dataclass(frozen=True, slots=True)
class PluginProblem:
    """A plugin module that could not be loaded, or one of its classes that breaks the contract."""

    module: str
    why: str

    def message(self) -> str:
        return f"workload plugin {self.module!r} not loaded: {self.why}"


def plugin_modules(environ: dict[str, str] | None = None) -> list[str]:
    """The module names in AMP_LAB_WORKLOADS (empty entries ignored)."""
    text = (os.environ if environ is None else environ).get(PLUGINS_ENV, "")
    return [name.strip() for name in text.split(",") if name.strip()]


def load_plugins(modules: Iterable[str]) -> list[PluginProblem]:
    """Import each module by name and register the Workload subclasses it defines (public ones: a name not starting
    with `_`). A module that fails to import, defines none, or whose class breaks the contract is a PluginProblem
    saying why; the built-ins and every other plugin stay. Loading a module again changes nothing."""
    problems = []
    for module_name in dict.fromkeys(modules):
        problems += _load_module(module_name)
    return problems


def _load_module(module_name: str) -> list[PluginProblem]:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return [PluginProblem(module_name, f"no module named {exc.name!r} on the Python path (install the "
                                               "package that holds it, or add its folder to PYTHONPATH)")]
        return [PluginProblem(module_name, f"importing it failed: {type(exc).__name__}: {exc}")]
    except (Exception, SystemExit) as exc:  # a plugin's own error must not stop the app or the CLI
        where = ""
        if isinstance(exc, SyntaxError) and exc.lineno:
            where = f" (line {exc.lineno})"
        return [PluginProblem(module_name, f"importing it failed: {type(exc).__name__}: {exc}{where}")]
    classes = [cls for _, cls in inspect.getmembers(module, inspect.isclass)
               if issubclass(cls, Workload) and cls.__module__ == module.__name__ and not cls.__name__.startswith("_")]
    if not classes:
        return [PluginProblem(module_name, "it defines no Workload subclass (class MyWorkload(Workload): ... from "
                                           "amp_core.workloads)")]
    problems = []
    for cls in classes:
        why = _register(cls, module_name)
        if why:
            problems.append(PluginProblem(module_name, f"class {cls.__name__}: {why}"))
    return problems


def _register(cls: type[Workload], module_name: str) -> str:
    """Register one plugin class; '' on success, else why not."""
    try:
        workload = cls()
    except Exception as exc:
        return f"cannot be created without arguments ({type(exc).__name__}: {exc})"
    problems = contract_problems(workload, SIZES)
    if problems:
        return "; ".join(problems)
    name = workload.name
    if name in BUILT_IN:
        return f"its name {name!r} is a built-in workload's; choose another"
    known = WORKLOADS.get(name)
    if known is not None:
        if PLUGIN_ORIGINS.get(name) == module_name and type(known).__qualname__ == cls.__qualname__:
            return ""  # loaded before
        return f"its name {name!r} is taken by {type(known).__qualname__} from {PLUGIN_ORIGINS.get(name, '?')}"
    WORKLOADS[name] = workload
    PLUGIN_ORIGINS[name] = module_name
    return ""


def param_names(workload: str, size: str = "small") -> list[str]:
    """The parameter names of a workload's model (built on the meta device: no weights are allocated)."""
    from amp_core.config import RunConfig

    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    spec = WORKLOADS[workload]
    data = spec.load_data(RunConfig(workload=workload, size=size))
    with torch.device("meta"):
        model = spec.build_model(size, data)
    return [name for name, _ in model.named_parameters()]


def parameter_count(workload: str, size: str) -> int:
    """How many parameters a workload's model has at `size`, counted on the meta device (no weights allocated, so
    a GPU-sized model is counted on a laptop). Tied weights count once."""
    from amp_core.config import RunConfig

    spec = WORKLOADS[workload]
    data = spec.load_data(RunConfig(workload=workload, size=size))
    with torch.device("meta"):
        model = spec.build_model(size, data)
    return sum(p.numel() for p in model.parameters())


__all__ = ["BUILT_IN", "PLUGINS_ENV", "PLUGIN_ORIGINS", "WORKLOADS", "Data", "PluginProblem", "Workload",
           "load_plugins", "param_names", "parameter_count", "plugin_modules"]


def check_launch(config: RunConfig) -> None:
    """What a RunConfig cannot check on its own, asked at launch: the workload is registered here, its own settings
    hold (a data folder exists), and this device runs every mode. ConfigError naming the field."""
    from amp_core.precision import availability, get_precision

    if config.workload not in WORKLOADS:
        raise ConfigError("workload", f"unknown workload {config.workload!r}; choose from {', '.join(WORKLOADS)}")
    sizes = WORKLOADS[config.workload].sizes
    if config.size not in sizes:
        raise ConfigError("size", f"{config.workload} has no size {config.size!r}; it has {', '.join(sizes)}")
    for mode in config.modes:
        ok, reason = availability(mode, config.device)
        if not ok:
            raise ConfigError("modes", f"{mode} cannot run on this device: {reason}")
        why = get_precision(mode, config.device).refuses_optimizer(config.optimizer, config.fused_optimizer)
        if why:
            raise ConfigError("optimizer", f"{mode}: {why}")
    if config.fused_optimizer:
        from amp_core.precision import fused_optimizer_support

        ok, reason = fused_optimizer_support(config.device)
        if not ok:
            raise ConfigError("fused_optimizer", reason)
    WORKLOADS[config.workload].check_config(config)
    _check_kept_modules(config)


def _check_kept_modules(config: RunConfig) -> None:
    """`+keep:PATTERN` and `+plan:FILE` name modules of the workload's model: one that matches none is refused at
    launch, as is a block-scaled recipe (`+mxfp8`, `+nvfp4`, ...) none of whose Linear layers converts."""
    from amp_core.precision import get_precision, kept_module_names

    recipes = [recipe for recipe in config.modes if get_precision(recipe, config.device).keep_patterns
               or get_precision(recipe, config.device).block_scaled or "+plan:" in recipe]
    if not recipes:
        return
    model, _ = WORKLOADS[config.workload].seeded_model_and_batch(config)
    for recipe in recipes:
        precision = get_precision(recipe, config.device)
        try:
            kept = kept_module_names(model, precision.keep_patterns)
            for option in precision.options:  # +plan:FILE: an entry that matches no module is refused here
                if hasattr(option, "assign"):
                    kept += list(option.assign(model, precision.device).linear)
        except ValueError as error:
            raise ConfigError("modes", f"{recipe}: {error}") from None
        # A block-scaled recipe none of whose layers converts would race a plain bf16 lane under its name.
        why = precision.block_scaled.refuses_model(model, precision.device, kept) if precision.block_scaled else ""
        if why:
            raise ConfigError("modes", f"{recipe}: {why}")
