"""AMP Lab core: precision modes, workloads, a fair multi-lane runner, a SQLite store. No Streamlit."""

from amp_core.config import ConfigError, FaultSpec, RunConfig, ScalerConfig

__all__ = ["ConfigError", "FaultSpec", "RunConfig", "ScalerConfig"]
