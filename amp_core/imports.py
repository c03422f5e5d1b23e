"""The one gate for heavy imports: torch's compiler stack, torchao, transformers and Lightning are imported through
`heavy_import`, never from two threads at once, and a module an earlier import left broken is mended or named.

Why: those packages import each other in cycles (torch._dynamo <-> torch._inductor, torchao -> torch._dynamo), and a
server runs every browser session's script on its own thread. Two threads that enter the cycle at different modules
for the first time at once deadlock (Python breaks it with _DeadlockError) or see a module half made ("partially
initialized module 'torch._dynamo' has no attribute 'utils'"). Worse, the failed import leaves the submodules that
did finish in sys.modules while their package is dropped from it: the next import of the package runs it again, does
not bind those submodules on it, and fails the same way until the process ends. Under one process-wide lock the
cycle is only ever entered by one thread; `heavy_import` also finds those orphans and mends them.

torch imports torch._dynamo by itself, lazily, the first time an optimizer is built or a model compiled:
`compiler_ready()` (an import through the gate) goes before those, so torch's own import is then a lookup.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types

GATED = ("torch._dynamo", "torch._inductor", "torchao", "transformers", "lightning")
"""The packages whose first import goes through the gate (each with all its submodules)."""
WARM = ("torch._dynamo", "torch._inductor.compile_fx", "torchao.float8", "torchao.optim")
"""What a server's warm-up imports through the gate once its pages can draw: what the pages and their probes touch
(every optimizer, every compiled lane, every recipe). transformers and Lightning wait for the code that uses them."""

_GATE = threading.RLock()
_WHOLE: set[str] = set()
"""Names imported whole through the gate: asked again, they are a lookup with no lock."""
_importing: list[str] = []
"""What the gate imports now (innermost last), for a page's "loading …" note."""


RESTART = "restart the process (the dashboard: stop `amp-lab ui` and start it again)"


class ImportBroken(RuntimeError):
    """A gated module could not be imported even after its broken leftovers were mended: only a restart mends it."""


def importing() -> str | None:
    """The module the gate imports now, or None (read without the lock: a note, never a decision)."""
    names = list(_importing)
    return names[0] if names else None


def heavy_import(name: str) -> types.ModuleType:
    """Import `name` through the gate and return it. A module that is not installed raises ModuleNotFoundError as a
    plain import does; one that fails to import, or leaves its family broken, is mended and imported once more, then
    raises ImportBroken (the process must restart) if it still fails."""
    module = sys.modules.get(name)
    if module is not None and name in _WHOLE:
        return module
    with _GATE:
        _importing.append(name)
        try:
            try:
                module = importlib.import_module(name)
                if not broken_modules(family(name)):
                    _WHOLE.add(name)
                    return module
                why = "an earlier import left its package half-imported"
            except ModuleNotFoundError as missing:
                if missing.name is not None and (name == missing.name or name.startswith(missing.name + ".")):
                    raise  # not installed here: the caller says which extra brings it
                why = _in_brief(missing)
            except Exception as error:  # a cycle entered by another thread outside the gate, or an earlier failure
                why = _in_brief(error)
            try:
                module = _import_mended(name)
            except Exception as error:
                raise ImportBroken(f"{name} cannot be imported in this process ({_in_brief(error)}; first: {why}): "
                                   f"{RESTART}") from error
            left = broken_modules(family(name))
            if left:
                raise ImportBroken(f"{name} stays half-imported in this process ({', '.join(left[:3])}; first: "
                                   f"{why}): {RESTART}")
            _WHOLE.add(name)
            return module
        finally:
            _importing.pop()


def _in_brief(error: BaseException) -> str:
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def compiler_ready() -> None:
    """Import torch's compiler stack through the gate: call it before building an optimizer or compiling, where torch
    would otherwise import torch._dynamo itself on whichever thread gets there first."""
    heavy_import("torch._dynamo")


def warm() -> None:
    """Import WARM through the gate, in order (a server's warm-up thread: the pages that need them wait briefly)."""
    for name in WARM:
        if not threading.main_thread().is_alive():  # the process is ending: an import now fails half-way
            return
        try:
            heavy_import(name)
        except ModuleNotFoundError:  # an extra not installed here: the pages that need it say so
            continue


def family(name: str) -> str | None:
    """The gated package `name` belongs to (None: not gated)."""
    return next((root for root in GATED if name == root or name.startswith(root + ".")), None)


def broken_modules(root: str | None = None) -> list[str]:
    """Modules of the gated packages (of `root` only, if given) that an import left broken: each finished, but its
    package failed after it and was dropped from sys.modules (an import in progress keeps its package there, so it is
    never taken for one)."""
    return sorted(name for name, module in list(sys.modules.items())
                  if module is not None and family(name) is not None and (root is None or family(name) == root)
                  and family(parent := name.rpartition(".")[0]) is not None and parent not in sys.modules)


class _Rebind(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Hands back modules that finished importing, without running them again, so that importing their package anew
    binds them on it as a first import would. Running them again is no mend: some register process-wide state once
    (torch._inductor's operator libraries refuse a second registration)."""

    def __init__(self, kept: dict[str, types.ModuleType]):
        self.kept = kept

    def find_spec(self, fullname, path, target=None):
        module = self.kept.get(fullname)
        if module is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=hasattr(module, "__path__"))

    def create_module(self, spec):
        return self.kept[spec.name]

    def exec_module(self, module):
        """Nothing to run: the module finished importing before."""


def _import_mended(name: str) -> types.ModuleType:
    """Import `name` again with the orphaned modules taken out of sys.modules: they come back through _Rebind, bound on
    their packages as those are imported afresh."""
    kept = {orphan: sys.modules.pop(orphan) for orphan in broken_modules()}
    specs = {orphan: module.__spec__ for orphan, module in kept.items()}
    rebind = _Rebind(kept)
    sys.meta_path.insert(0, rebind)
    try:
        return importlib.import_module(name)
    finally:
        sys.meta_path.remove(rebind)
        for orphan, module in kept.items():
            if module.__spec__ is not specs[orphan]:  # the import machinery set ours; a config module refuses setattr
                types.ModuleType.__setattr__(module, "__spec__", specs[orphan])
            sys.modules.setdefault(orphan, module)
        for orphan in sorted(kept, key=lambda orphan: orphan.count(".")):  # ones their package did not import anew:
            parent, _, child = orphan.rpartition(".")  # bound on it as their first import did (outer ones first)
            if parent in sys.modules and not hasattr(sys.modules[parent], child):
                setattr(sys.modules[parent], child, sys.modules[orphan])


_AST_LOCK = threading.RLock()
_PARSE = ast.parse
"""The standard library's own parse (`serialize_every_parse` puts a locked one in its place)."""


def parse_python(source, *args, **kwargs) -> ast.AST:
    """`ast.parse`, one thread at a time: CPython 3.11 keeps the AST constructor's recursion depth per interpreter, not
    per thread, so two sessions' threads parsing at once (a room opening the dashboard) can fail with "SystemError:
    AST constructor recursion depth mismatch". Every parse AMP Lab makes at run time goes through here."""
    with _AST_LOCK:
        return _PARSE(source, *args, **kwargs)


def serialize_every_parse() -> None:
    """Make `ast.parse` itself `parse_python`, for every caller in this process: a server's other parsers (Streamlit's
    page scripts, torch reading source) race AMP Lab's own and each other's the same way (CI: the Op inspector page
    failed with the mismatch while a room opened every page). The dashboard's process calls it once, first."""
    ast.parse = parse_python
