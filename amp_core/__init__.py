"""AMP Lab core: precision modes, workloads, a fair multi-lane runner, a SQLite store. No Streamlit.

This `__init__` is also the front ends' door to the small utilities at amp_core's top (who may control a shared
dashboard, the app's threads, the import gate, the first paint's catalogue, the optional extras) and to the fix as
code: `from amp_core import may_control` imports amp_core/access.py when first asked for (amp_core.surface), so
importing any amp_core module still costs only config.py (and the few lines of surface.py) here.
"""

from amp_core.config import ConfigError, FaultSpec, RunConfig, ScalerConfig
from amp_core.surface import lazy_surface

_LAZY, __getattr__, __dir__ = lazy_surface(__name__, {
    "PRESENTER_NOTE": "access.PRESENTER_NOTE", "Sharing": "access.Sharing", "is_loopback": "access.is_loopback",
    "may_control": "access.may_control", "sharing": "access.sharing", "visitor_count": "access.visitor_count",
    "was_proxied": "access.was_proxied",
    "background": "background", "catalog": "catalog", "imports": "imports",
    "missing_extras": "extras.missing_extras", "needs_line": "extras.needs_line",
    "fix_code": "fixes.fix_code",
})

__all__ = ["ConfigError", "FaultSpec", "RunConfig", "ScalerConfig", *_LAZY]
