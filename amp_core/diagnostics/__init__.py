"""Diagnostics: tools that drive the engine (the cost probe, replay and its modes, attached replay, the largest
batch, the layer bisect, the advisor). They sit above the runner and may use probes, the step and the runner; nothing
below them imports them."""
