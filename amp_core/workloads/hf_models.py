"""transformers for the real-architecture workloads (amp_core.workloads.hf): imported on first use only, so the
engine works without the `hf` extra; a ConfigError naming the extra when it is not installed."""

from __future__ import annotations

import functools


@functools.cache
def transformers_module():
    """The transformers package, imported on first use; a ConfigError naming the extra when it is not installed."""
    from amp_core.imports import heavy_import

    try:
        transformers = heavy_import("transformers")
    except ImportError as exc:
        from amp_core.config import ConfigError

        raise ConfigError("workload", f"needs the hf extra (transformers is not installed: {exc}): "
                                      f"pip install -e '.[hf]'") from None
    return transformers
