"""Probes: measurements beside training, on copies or sampled steps (op traces, gradient statistics, faults,
format facts, the cost probe, layer numerics)."""
