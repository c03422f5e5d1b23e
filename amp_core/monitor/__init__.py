"""`amp_core.monitor`: the import path users write for the Monitor (README, docs); it lives in amp_core.attach."""

from amp_core.attach.monitor import SOURCE, Monitor, MonitorConfig

__all__ = ["SOURCE", "Monitor", "MonitorConfig"]
