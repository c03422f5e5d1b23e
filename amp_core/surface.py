"""A package's public surface, loaded on first use (PEP 562): the names a front end imports from a package, each
bound to the module that defines it, imported only when the name is first asked for.

Why: the pages import the engine through a short list of packages (`tests/test_layers.py`'s `PAGE_ENGINE_SURFACE`)
rather than thirty modules, and a package's `__init__` that imported every module it names would make
`from amp_core.diagnostics import start_bisect` build the advisor, the plan search and the replay too: the pages'
cold start would grow. Here `__init__` only maps names to modules; `start_bisect` imports `diagnostics/bisect.py` and
what that imports, as `from amp_core.diagnostics.bisect import start_bisect` did.

A name is looked up in its module at each access and never copied onto the package, so the package always shows what
the module holds (a test that replaces `bisect.start_bisect` is seen through `amp_core.diagnostics` too).
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_surface(package: str, names: Mapping[str, str]) -> tuple[list[str], Callable[[str], Any],
                                                                   Callable[[], list[str]]]:
    """`__all__, __getattr__, __dir__` for the package named `package`. `names` maps each public name to where it
    lives, relative to the package: `"bisect.start_bisect"` (an attribute of a module), or `"formats"` (a submodule
    itself, for the pages that use one as a namespace). A public name may differ from the attribute's
    (`"PLAN_LADDER": "plan_report.LADDER"`) where the attribute's own name is too short to say what it is beside the
    package's other names."""
    for name, where in names.items():
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", where):
            raise ValueError(f"{package}.{name}: {where!r} is not 'module' or 'module.attribute' of {package}")

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = where.partition(".")
        found = importlib.import_module(f"{package}.{module}")
        return getattr(found, attribute) if attribute else found

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return list(names), __getattr__, __dir__
