"""Probes: the instruments. They measure what they are handed, beside training, on copies or sampled steps (op
traces, layer numerics, gradient statistics, layer watch, format facts, spikes, faults), and return data: printing
for the terminal is the CLI's (amp_core/cli.py); the tools that drive the engine are in amp_core/diagnostics.

May import: records, workloads, config, precision, formats and the utilities at amp_core's top. Never
telemetry/, race/, attach/ or diagnostics/ (they call the probes).

Its public surface (`__all__`) is what the pages use: the instruments they call as modules (`optrace.trace_workload`)
and a few names, each loaded on first use (amp_core.surface).
"""

from amp_core.surface import lazy_surface

__all__, __getattr__, __dir__ = lazy_surface(__name__, {
    "block_numerics": "block_numerics", "compiled_ops": "compiled_ops", "faults": "faults", "formats": "formats",
    "numerics": "numerics", "optrace": "optrace",
    "FORMAT_LIMITS": "headroom.FORMAT_LIMITS", "HEADROOM_LIMITS": "headroom.LIMITS",
    "SpikeRule": "spikes.SpikeRule", "trace_from_answer": "steptrace.from_answer",
})
