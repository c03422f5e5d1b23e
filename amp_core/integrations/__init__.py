"""One-line callbacks for the trainers users already run (Hugging Face Transformers, Lightning), built on Monitor.

Each lives in its own module and imports its trainer only there: `from amp_core.integrations.transformers import
AmpLabCallback` needs the `hf` extra, `amp_core.integrations.lightning` the `lightning` extra; what both share is in
`amp_core.integrations.shared`. This package's own import is empty on purpose: the real-architecture workloads reach
`amp_core.integrations.hf_models` through it, and an import of the Monitor here would run back up the layers
(workloads -> integrations -> monitor -> ... -> workloads).
"""
