"""One-line callbacks for the trainers users already run (Hugging Face Transformers, Lightning), built on Monitor.

Each lives in its own module and imports its trainer only there: `from amp_core.integrations.transformers import
AmpLabCallback` needs the `hf` extra, `amp_core.integrations.lightning` the `lightning` extra; what both share is in
`amp_core.integrations.shared`.

Sits above attach/ (the callbacks hand a trainer's loop to a Monitor). May import: attach, config, precision, records
and the utilities at amp_core's top. Nothing in the engine imports it: the real-architecture workloads reach
transformers through amp_core.workloads.hf_models, below. This package's own import is empty on purpose, so that
importing one callback never imports the other's trainer.
"""
