"""Diagnostics: tools that drive the engine (the cost probe, replay and its modes, attached replay, the largest
batch, the layer bisect, the advisor). They sit above the runner and may use probes, the step and the runner; nothing
below them imports them.

May import: race/ (they drive a Run), telemetry, probes, records, runs, workloads, config, precision and
the utilities at amp_core's top. Never attach/, views/ or a front end.

Its public surface (`__all__`) is what the pages drive, each name loaded from its module on first use
(amp_core.surface): `from amp_core.diagnostics import start_bisect` imports bisect.py alone.
"""

from amp_core.surface import lazy_surface

__all__, __getattr__, __dir__ = lazy_surface(__name__, {
    "AdviceJob": "advise.AdviceJob", "Answer": "answers.Answer", "AnswerBoard": "answers.AnswerBoard",
    "AdviseConfig": "configs.AdviseConfig", "BisectConfig": "configs.BisectConfig",
    "fixed_race_config": "bisect.fixed_race_config", "recorded_bisects": "bisect.recorded_bisects",
    "start_bisect": "bisect.start_bisect",
    "MIN_TIMED_S": "cost.MIN_TIMED_S", "SLOW_FACTOR": "cost.SLOW_FACTOR", "TIME_CAP_S": "cost.TIME_CAP_S",
    "TIMED_STEPS": "cost.TIMED_STEPS", "WARMUP_STEPS": "cost.WARMUP_STEPS", "ProbeBoard": "cost.ProbeBoard",
    "ProbeResult": "cost.ProbeResult", "estimate_step": "cost.estimate_step", "relative_costs": "cost.relative_costs",
    "acted_forecast": "forecast_fix.acted_forecast", "forecast_fixes": "forecast_fix.forecast_fixes",
    "recorded_fix_races": "forecast_fix.recorded_fix_races", "start_fix_race": "forecast_fix.start_fix_race",
    "MAXBATCH_PROBE_BATCHES": "maxbatch.PROBE_BATCHES", "MaxBatchJob": "maxbatch.MaxBatchJob",
    "PLAN_LADDER": "plan_report.LADDER", "PlanSearchConfig": "plan_report.PlanSearchConfig",
    "PlanJob": "plan_search.PlanJob",
    "replay_run": "replay.replay_run", "recorded_replays": "replay_modes.recorded_replays",
})
