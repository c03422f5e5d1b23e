"""Attach mode: AMP Lab's records from a user's own training loop (and each rank of a torchrun job).

Owns: the Monitor (monitor.py; `amp_core.monitor` re-exports it, the path users write), its diagnostics below the
surface hooked onto the user's loop (desk.py), what it saves of the loop when its run opens (saved.py) and the guard
that keeps the Monitor's own failures out of the user's loop (guard.py). The Hugging Face and Lightning callbacks
that hand a trainer's loop to a Monitor live in amp_core.integrations (each imports its optional trainer).

May import: config, precision, telemetry, probes, records, diagnostics.attached_replay and the small utilities at
amp_core's top. Never race/ (the Monitor drives the telemetry's StepDriver itself, never a Run), views/ or a front
end. This `__init__` imports nothing.
"""
