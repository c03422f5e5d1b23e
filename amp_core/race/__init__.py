"""The race: AMP Lab's own training loop, K precision lanes stepped in turn on one thread (DESIGN.md).

Owns: the Run and its thread (runner.py), its lanes (lanes.py), one lane's step (step.py), what a Run offers to read
while it trains (reading.py), the engine's own hooks a RunConfig asks for (hooks.py: replay snapshots, layer amax,
compiled lanes), the snapshot ring (snapshots.py), the race's layer amax sampling (layer_amax.py), compiled lanes
(compiled.py) and the race under torchrun (distributed.py).

May import: config, precision, workloads, formats, telemetry, probes, records, runs and the small utilities at
amp_core's top (background, imports, torch_private). Never attach/ (the Monitor is beside the race, not above or
below it), diagnostics/ (which drive a Run), views/ or a front end. This `__init__` imports no module of the race,
so importing one module here does not build the whole race: its public surface (`__all__`, what the pages call) is
loaded a name at a time on first use (amp_core.surface), and `from amp_core.race import RunManager` imports the
runner and what it needs.
"""

from amp_core.surface import lazy_surface

__all__, __getattr__, __dir__ = lazy_surface(__name__, {
    "RunManager": "runner.RunManager",
    "compiled_one_line": "compiled.one_line", "eager_recipe": "compiled.eager_recipe",
    "is_compiled_recipe": "compiled.is_compiled_recipe", "lane_compiles": "compiled.lane_compiles",
})
