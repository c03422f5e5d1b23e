"""Diagnostics: tools that drive the engine (the cost probe, replay and its modes, attached replay, the largest
batch, the layer bisect, the advisor). They sit above the runner and may use probes, the step and the runner; nothing
below them imports them.

May import: race/ (they drive a Run), telemetry, probes, records, runs, workloads, config, precision and
the utilities at amp_core's top. Never attach/, views/ or a front end.
"""
