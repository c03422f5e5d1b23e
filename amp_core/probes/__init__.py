"""Probes: the instruments. They measure what they are handed, beside training, on copies or sampled steps (op
traces, layer numerics, gradient statistics, layer watch, format facts, spikes, faults), and return data: printing
for the terminal is the CLI's (amp_core/cli.py); the tools that drive the engine are in amp_core/diagnostics.

May import: records, workloads, config, precision, formats and the utilities at amp_core's top. Never
telemetry/, race/, attach/ or diagnostics/ (they call the probes).
"""
