"""Print amp_core's rooms (each package, or a module at amp_core's top) with their modules and lines, then the import
arrows between rooms, from the same import graph tests/test_layers.py checks: the before/after figures of a move.

Run as `python3 scripts/layer_table.py`; the last line is the headline: rooms, arrows and whether a loop remains.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_layers import PACKAGE, import_graph, module_name  # noqa: E402


def room(module: str) -> str:
    """The room a module lives in: its package right under amp_core, or the module itself when it sits at the top."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def main() -> None:
    modules: dict[str, int] = defaultdict(int)
    lines: dict[str, int] = defaultdict(int)
    for path in PACKAGE.rglob("*.py"):
        name = room(module_name(path))
        if name == "amp_core":
            continue
        modules[name] += 1
        lines[name] += len(path.read_text().splitlines())
    graph = import_graph(with_packages=True)
    arrows: dict[tuple[str, str], int] = defaultdict(int)
    for module, names in graph.items():
        for name in names:
            if name in graph and room(name) != room(module) and "amp_core" not in (room(name), room(module)):
                arrows[(room(module), room(name))] += 1
    for name in sorted(modules, key=lambda n: (-lines[n], n)):
        print(f"room {name.removeprefix('amp_core.'):<16} modules={modules[name]:<3} lines={lines[name]}")
    for (source, target), count in sorted(arrows.items()):
        print(f"arrow {source.removeprefix('amp_core.')} -> {target.removeprefix('amp_core.')} imports={count}")
    pairs = set(arrows)
    loops = sorted({tuple(sorted(pair)) for pair in pairs if pair[::-1] in pairs})
    print(f"two_way_arrows={' '.join('<->'.join(p).replace('amp_core.', '') for p in loops) or 'none'}")
    print(f"rooms={len(modules)} arrows={len(pairs)} two_way={len(loops)}")


if __name__ == "__main__":
    main()
