"""The optional extras (pyproject's optional-dependencies): which modules each brings, whether they are here, and the
line that installs them. Asks the import path only (importlib.util.find_spec): nothing is imported."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Extra:
    """One optional extra of the amp-lab package."""

    name: str
    """Its name in pyproject.toml (`pip install -e '.[NAME]'`)."""
    modules: tuple[str, ...]
    """The top-level modules it brings that AMP Lab imports (all must be importable)."""
    what: str
    """What it adds, in a few words."""

    @property
    def install(self) -> str:
        """The line that installs it into a source checkout."""
        return f"pip install -e '.[{self.name}]'"

    @property
    def installed(self) -> bool:
        return all(_importable(module) for module in self.modules)


_FOUND: set[str] = set()
"""Modules found importable in this process: found once, they stay (a page asks for every extra on each of its runs,
and a search of the import path for a module not imported yet is a few hundred stat calls)."""


def _importable(module: str) -> bool:
    if module in sys.modules:  # imported, or set to None (an import that must fail): no search, no cache
        return sys.modules[module] is not None
    if module in _FOUND:
        return True
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that cannot be imported; a module set to None
        return False
    if found:
        _FOUND.add(module)
    return found


EXTRAS: dict[str, Extra] = {extra.name: extra for extra in (
    Extra(name="recipes", modules=("torchao",), what="precision recipes: FP8 matmuls, low-bit optimizer states, "
                                                      "stochastic rounding (torchao)"),
    Extra(name="hf", modules=("transformers", "accelerate"), what="the Hugging Face Trainer callback and the "
                                                                   "transformers workloads"),
    Extra(name="lightning", modules=("lightning",), what="the Lightning callback"),
    Extra(name="postgres", modules=("psycopg",), what="the PostgreSQL store"),
)}


def missing_extras(names: tuple[str, ...] | list[str]) -> list[Extra]:
    """The extras among `names` that are not installed here (an unknown name raises KeyError: a typo in a
    declaration, not a missing extra)."""
    return [EXTRAS[name] for name in names if not EXTRAS[name].installed]


def needs_line(names: tuple[str, ...] | list[str]) -> str:
    """One line for people: what `names` need and how to install it, with 'not installed here' where it is missing
    ("" for none)."""
    parts = []
    for name in names:
        extra = EXTRAS[name]
        here = "" if extra.installed else ", not installed here"
        parts.append(f"needs the {name} extra ({', '.join(extra.modules)}{here}): {extra.install}")
    return "; ".join(parts)
