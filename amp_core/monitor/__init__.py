"""`amp_core.monitor`: the import path users write for the Monitor (README, docs); it lives in amp_core.attach.

May import: attach.monitor only.
"""

from amp_core.attach.monitor import SOURCE, Monitor, MonitorConfig

__all__ = ["SOURCE", "Monitor", "MonitorConfig"]
