"""The layers hold (DESIGN.md, docs/architecture.md): amp_core's rooms (its packages, and the few modules at its top)
import only the rooms below them (ROOMS), the engine imports no plotly and no views, and nothing in amp_core imports
Streamlit.

The import graph is read from the source (every `import`, module-level or inside a function) and walked
transitively through amp_core's own modules; a second check imports the engine for real in a fresh interpreter.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "amp_core"
FRONT_ENDS = {"amp_core.cli", "amp_core.__main__"}
"""The CLI is a front end like the pages: it may print what views compute (summaries, workshop checks)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def direct_imports(path: Path) -> set[str]:
    """Every module named by an import statement in the file (absolute names; relative ones resolved)."""
    names = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
        names.update(gated_imports(node))
    return names


def gated_imports(node: ast.AST) -> set[str]:
    """The module a `heavy_import("name")` call imports (amp_core.imports' gate): an import like any other here."""
    if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "heavy_import"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return {node.args[0].value}
    return set()


def import_graph(with_packages: bool = False) -> dict[str, set[str]]:
    """Each module's imports; `with_packages`: with the packages above it too (importing `a.b.c` runs `a/__init__.py`
    and `a/b/__init__.py` first, so what a package's `__init__` imports is reached by every module inside it)."""
    graph = {module_name(path): direct_imports(path) for path in PACKAGE.rglob("*.py")}
    for module, names in graph.items() if with_packages else ():
        parts = module.split(".")
        names.update(".".join(parts[:end]) for end in range(2, len(parts)))
    return graph


def reached(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every name reachable from `start` -> the amp_core module that imports it (for the failure message)."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        module = todo.pop()
        for name in graph.get(module, ()):
            if name not in seen:
                seen[name] = module
                if name in graph:
                    todo.append(name)
    return seen


def is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_sees_every_module_and_its_lazy_imports():
    graph = import_graph()
    assert {"amp_core.race.runner", "amp_core.views.plots", "amp_core.records.store", "amp_core.cli"} <= set(graph)
    assert "amp_core.precision" in graph["amp_core.workloads"], "a function-level import is part of the graph"


ROOMS = (
    "imports", "torch_private", "background", "extras", "access", "catalog",  # utilities at amp_core's top
    "formats",  # block-scaled formats: quantisers, the emulated Linear, their recipe options
    "precision",  # modes, recipe options, keep, device capability, compiler, torchao optimizers, switches
    "config",  # RunConfig: the one configuration tree and its defaults
    "workloads",  # model + data + loss, built-in and plugins
    "records",  # records, sink, store
    "runs",  # runs as typed sources (RunInfo)
    "probes",  # instruments: measure what they are handed
    "telemetry",  # how a step is measured and recorded (the StepDriver)
    "race",  # the Run: K lanes stepped in turn
    "diagnostics",  # tools that drive a Run (cost, replay, bisect, advise)
    "attach",  # the Monitor in a user's own loop
    "integrations",  # the trainers' callbacks, on the Monitor
    "fixes",  # the fix for the user's own job
    "monitor",  # the users' import path of the Monitor
    "workshop",  # prepared races and their checks
    "views",  # pandas + plotly over records
    "cli", "__main__",  # the front end in a terminal (the pages are the other)
)
"""amp_core's rooms (a package, or a module at its top), lowest first: a room imports only rooms listed before it.
Each package's docstring says what it owns and what it may import; this order is the one that is checked."""


def room(module: str) -> str:
    """The room a module lives in: its package right under amp_core, or the module itself at amp_core's top."""
    return module.split(".")[1] if module.count(".") else module


def room_arrows(graph: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """(room, room it imports) -> one import that draws the arrow (for the failure message)."""
    arrows = {}
    for module, names in graph.items():
        for name in names:
            if name in graph and module != "amp_core" and name != "amp_core" and room(module) != room(name):
                arrows.setdefault((room(module), room(name)), f"{module} imports {name}")
    return arrows


def test_every_module_lives_in_a_stated_room():
    graph = import_graph()
    assert {room(module) for module in graph} - {"amp_core"} == set(ROOMS)


def test_a_room_imports_only_the_rooms_below_it():
    """Counting what a package's `__init__` imports (importing `amp_core.workloads.hf` runs `workloads/__init__.py`):
    the workloads once reached the Monitor through `integrations/__init__.py`, a loop the module graph did not see."""
    graph = import_graph(with_packages=True)
    assert "amp_core.workloads" in graph["amp_core.workloads.hf_models"], "a package's __init__ is counted"
    upward = [f"{source} -> {target}: {why}" for (source, target), why in room_arrows(graph).items()
              if ROOMS.index(target) > ROOMS.index(source)]
    assert not upward, "\n".join(upward)


def test_no_loop_between_rooms():
    """Whatever the order above says, the rooms' own arrows hold no circle (checked apart, so a reordered ROOMS can
    not hide one)."""
    arrows = room_arrows(import_graph(with_packages=True))
    internal = {name: {target for source, target in arrows if source == name} for name in ROOMS}
    circles = [name for name in internal if name in reached(internal, name)]
    assert not circles, "rooms on an import circle: " + ", ".join(circles)


def test_each_package_says_what_it_owns_and_may_import():
    silent = [path.parent.name for path in sorted(PACKAGE.glob("*/__init__.py"))
              if "May import" not in (ast.get_docstring(ast.parse(path.read_text())) or "")]
    assert not silent, f"packages whose docstring does not say what they may import: {silent}"


def test_the_public_import_paths_keep_working():
    """The paths README and users' code write stay importable however the engine's rooms are arranged."""
    code = ("from amp_core.monitor import Monitor, MonitorConfig\nfrom amp_core.fixes import keep_in_fp32\n"
            "import importlib.util\n"  # (found, not imported: each imports its optional trainer)
            "assert all(importlib.util.find_spec(f'amp_core.integrations.{name}') for name in ('transformers', "
            "'lightning'))\n"
            "from amp_core.workloads import WORKLOADS\nfrom amp_core.precision import get_precision, MODES\n"
            "from amp_core.attach.monitor import Monitor as Attached\nassert Monitor is Attached\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_engine_imports_no_plotly_streamlit_or_views():
    graph = import_graph()
    engine = [m for m in graph if not is_under(m, "amp_core.views") and m not in FRONT_ENDS]
    problems = []
    for module in engine:
        for name, via in reached(graph, module).items():
            if any(is_under(name, bad) for bad in ("plotly", "streamlit", "amp_core.views")):
                problems.append(f"{module} reaches {name} (imported by {via})")
    assert not problems, "\n".join(problems)


def test_no_amp_core_module_imports_streamlit():
    graph = import_graph()
    problems = [f"{module} reaches {name} (imported by {via})" for module in graph
                for name, via in reached(graph, module).items() if is_under(name, "streamlit")]
    assert not problems, "\n".join(problems)


def test_importing_the_engine_loads_no_plotly_or_streamlit():
    graph = import_graph()
    # (amp_core.integrations.<trainer> import their trainer by design: only where the user hands one in.)
    engine = sorted(m for m in graph if not is_under(m, "amp_core.views") and m not in FRONT_ENDS
                    and m not in ("amp_core.integrations.transformers", "amp_core.integrations.lightning"))
    code = (f"import importlib, sys\nfor name in {engine!r}: importlib.import_module(name)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'plotly', 'streamlit', 'transformers', 'lightning', 'torchao'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_page_scripts_hold_no_bare_strings_that_magic_would_draw():
    """Streamlit's "magic" draws a bare expression in a page script: a constant's docstring there appears on the
    page as text (it did, above the Train page's title). Only the module docstring may stand alone."""
    drawn = []
    scripts = [path for path in sorted((ROOT / "pages").glob("*.py")) if path.name != "common.py"]  # (a module)
    for path in [ROOT / "app.py", *scripts]:
        for node in ast.parse(path.read_text(), str(path)).body[1:]:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                drawn.append(f"{path.name}:{node.lineno}: {str(node.value.value)[:50]}")
    assert not drawn


def arrows_broken(graph: dict[str, set[str]], source: str, forbidden: str) -> list[str]:
    """The modules under `source` that reach a module under `forbidden` (and through what)."""
    return [f"{module} reaches {name} (imported by {via})" for module in graph if is_under(module, source)
            for name, via in reached(graph, module).items() if is_under(name, forbidden)]


def test_records_import_no_probe():
    """The record types (GradStats included) live with the records: a probe writes records, never the reverse."""
    problems = arrows_broken(import_graph(), "amp_core.records", "amp_core.probes")
    assert not problems, "\n".join(problems)


def test_views_read_run_sources_never_the_run_manager():
    graph = import_graph()
    problems = arrows_broken(graph, "amp_core.views", "amp_core.race.runner")
    assert not problems, "\n".join(problems)


def test_the_monitor_drives_the_telemetry_never_the_runner():
    graph = import_graph()
    assert "amp_core.telemetry" in graph["amp_core.attach.monitor"] or any(
        is_under(name, "amp_core.telemetry") for name in graph["amp_core.attach.monitor"])
    problems = [*arrows_broken(graph, "amp_core.attach", "amp_core.race"),
                *arrows_broken(graph, "amp_core.telemetry", "amp_core.race")]
    assert not problems, "\n".join(problems)


def test_probes_are_instruments_that_drive_nothing():
    """probes/ holds instruments: they measure what they are handed. The tools that drive the engine (a Run, a step,
    the telemetry's driver) are in diagnostics/, above them; so no probe reaches the runner, the step, the telemetry,
    the Monitor or diagnostics/."""
    graph = import_graph()
    above = ("amp_core.race", "amp_core.telemetry", "amp_core.attach", "amp_core.diagnostics")
    problems = [problem for forbidden in above for problem in arrows_broken(graph, "amp_core.probes", forbidden)]
    assert not problems, "\n".join(problems)


def test_the_runner_reaches_nothing_in_diagnostics():
    """diagnostics/ sits above the runner (the cost probe and replay drive a Run): the runner, and every module it
    reaches (the step, the telemetry, the snapshot ring), imports nothing from it."""
    graph = import_graph()
    problems = [*arrows_broken(graph, "amp_core.race.runner", "amp_core.diagnostics"),
                *arrows_broken(graph, "amp_core.race.step", "amp_core.diagnostics"),
                *arrows_broken(graph, "amp_core.telemetry", "amp_core.diagnostics")]
    assert not problems, "\n".join(problems)
    assert "amp_core.race.runner" in reached(graph, "amp_core.diagnostics.cost"), "the graph sees diagnostics above"


def test_config_imports_no_workload():
    """The workloads read RunConfig; config.py (the one source of defaults) reaches no workload (no circle)."""
    problems = arrows_broken(import_graph(), "amp_core.config", "amp_core.workloads")
    assert not problems, "\n".join(problems)


def test_instruments_and_tools_return_data_and_print_nothing():
    """Printing for the terminal lives in the CLI (amp_core/cli.py) and the views: probes/ and diagnostics/ return
    what they measured."""
    printing = []
    for package in ("probes", "diagnostics"):
        for path in sorted((PACKAGE / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                    printing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not printing, "\n".join(printing)


def test_the_import_graph_has_no_circle():
    """No amp_core module reaches itself through amp_core's own imports (config <-> workloads was one)."""
    graph = import_graph()
    internal = {module: {name for name in names if name in graph} for module, names in graph.items()}
    circles = [module for module in internal if module in reached(internal, module)]
    assert not circles, "modules on an import circle: " + ", ".join(sorted(circles))


def test_only_torch_private_names_private_torch_apis():
    """Private torch names (a leading underscore after `torch.`, or an attribute of a torch object) are wrapped in
    amp_core/torch_private.py alone; aten ops (`torch.ops.aten._to_copy`) are operator names, not Python APIs; the
    import gate (amp_core/imports.py) names the compiler stack's packages as modules to import, using none of their
    APIs."""
    private_attribute = re.compile(r"\b(torch(?:\.[a-z_]+)*\._(?!_)[A-Za-z]\w*)|\b(scaler|optimizer)\._[a-z]\w*|"
                                   r"_step_supports_amp_scaling|_get_scale_async|_found_inf_per_device|_get_mod_name")
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in ("torch_private.py", "imports.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for match in private_attribute.finditer(code):
                if not match.group(0).startswith("torch.ops."):
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert not problems, "\n".join(problems)

TRAINERS = ("transformers", "accelerate", "lightning", "pytorch_lightning")
LAZY_TRAINER_USERS = ("amp_core.workloads.hf_models",)
"""Modules that import transformers only inside the function that hands it to the `hf` extra's workloads: the engine
reaches them, never transformers at import time."""


def top_level_imports(path: Path) -> set[str]:
    """The modules a file imports when it is imported (module-level statements only, not inside functions)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.update(name for part in ast.walk(node) for name in gated_imports(part))
    return names


def test_only_the_integrations_import_the_trainers():
    """transformers, accelerate and lightning are optional extras: only amp_core.integrations.<trainer> imports them
    (so `import amp_core...` works without them), and the core never reaches those modules; the hf workloads import
    transformers lazily, inside the functions that build a model."""
    graph = import_graph()
    for lazy in LAZY_TRAINER_USERS:
        path = ROOT / (lazy.replace(".", "/") + ".py")
        eager = [name for name in top_level_imports(path) if any(is_under(name, bad) for bad in TRAINERS)]
        assert not eager, f"{lazy} imports {eager} at import time"
        graph[lazy] = {name for name in graph[lazy] if not any(is_under(name, bad) for bad in TRAINERS)}
    problems = [f"{module} reaches {name} (imported by {via})" for module in graph
                if module not in ("amp_core.integrations.transformers", "amp_core.integrations.lightning")
                for name, via in reached(graph, module).items()
                if any(is_under(name, bad) for bad in TRAINERS) or name in (
                    "amp_core.integrations.transformers", "amp_core.integrations.lightning")]
    assert not problems, "\n".join(problems)
    assert "transformers" in graph["amp_core.integrations.transformers"]
    assert "lightning.pytorch.callbacks" in graph["amp_core.integrations.lightning"]


def test_the_first_paint_imports_no_torch_pandas_or_numpy():
    """The Train page draws its form before torch is imported (the warm-up imports it on a thread): what app.py and
    the page import at the top, the RunConfig defaults built at import among them, stays off torch, pandas and numpy
    (Streamlit imports plotly's top package itself). A fresh interpreter, since this one has them all."""
    heavy = ("torch", "pandas", "numpy")
    code = ("import sys, streamlit, pages.common, amp_core.catalog, amp_core.config; "
            f"print(','.join(name for name in {heavy!r} if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"the first paint imports {done.stdout.strip()}"


PAGE_ENGINE_SURFACE = {
    "amp_core.access", "amp_core.background", "amp_core.catalog", "amp_core.config", "amp_core.extras",
    "amp_core.fixes", "amp_core.imports", "amp_core.precision", "amp_core.runs", "amp_core.workloads",
    "amp_core.workshop",
    "amp_core.diagnostics.advise", "amp_core.diagnostics.answers", "amp_core.diagnostics.bisect",
    "amp_core.diagnostics.cost",
    "amp_core.diagnostics.forecast_fix", "amp_core.diagnostics.plan_report", "amp_core.diagnostics.plan_search",
    "amp_core.diagnostics.maxbatch", "amp_core.diagnostics.replay", "amp_core.diagnostics.replay_modes",
    "amp_core.probes.block_numerics", "amp_core.probes.compiled_ops", "amp_core.probes.faults",
    "amp_core.probes.formats", "amp_core.probes.headroom", "amp_core.probes.numerics",
    "amp_core.probes.optrace", "amp_core.probes.spikes",
    "amp_core.probes.steptrace",
    "amp_core.race.compiled", "amp_core.race.runner",
    "amp_core.records.opening", "amp_core.records.requests", "amp_core.records.store",
}
"""The engine modules a page (app.py, pages/*.py) may import besides amp_core.views: the engine's surface as the pages
see it. A page that needs another asks a view, or the list grows here, where a reviewer sees it."""


def page_imports(path: Path) -> set[str]:
    """The amp_core modules a page script imports (`from pkg import module` counted as the module)."""
    names = set()
    for name in direct_imports(path):
        if not name.startswith("amp_core"):
            continue
        as_module = ROOT / (name.replace(".", "/") + ".py")
        as_package = ROOT / name.replace(".", "/") / "__init__.py"
        if as_module.exists() or as_package.exists():
            names.add(name)
    return {name for name in names if not any(other.startswith(name + ".") for other in names)}


def test_pages_import_the_views_and_a_named_engine_surface_only():
    scripts = [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py"))]
    beyond = sorted(f"{path.name}: {name}" for path in scripts for name in page_imports(path)
                    if not is_under(name, "amp_core.views") and name not in PAGE_ENGINE_SURFACE)
    assert not beyond, "\n".join(beyond)
    assert "amp_core.race.runner" in page_imports(ROOT / "pages" / "common.py"), "the check sees what pages import"


def test_pages_shape_no_tables():
    """A table a page shows is shaped in amp_core/views (the cost table, step estimates and the largest-batch result
    once were shaped in pages/train.py): a page builds no DataFrame."""
    built = [f"{path.name}:{node.lineno}" for path in sorted((ROOT / "pages").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "DataFrame"]
    assert not built, "\n".join(built)
