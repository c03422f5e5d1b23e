"""How a step is measured and recorded, once, for the lane race (runner.py) and a user's own loop (monitor.py).

- meters.py: the Meter interface (HostMeter: perf_counter; CudaMeter: events and pinned copies, no host sync);
- schedule.py: which steps measure memory, gradient norms, gradient statistics and layer amax;
- watch.py: what the optimizer tells (the LR it used, whether GradScaler let it step, a fused optimizer's flag);
- recorder.py: StepResult and the StepRecorder (in-flight queue, resolve, StepRecords and events);
- driver.py: the StepDriver (the timed window, plain or full steps, a full step's assembly, records to the recorder).

May import: probes (the sampled figures), records, config and torch_private. Never race/ or attach/, which
both drive it.
"""

from amp_core.telemetry.driver import StepDriver
from amp_core.telemetry.meters import CudaMeter, HostMeter, Meter, Window, meter_for
from amp_core.telemetry.recorder import MAX_IN_FLIGHT, LaneTrack, PlainStep, StepRecorder, StepResult, resolve_step
from amp_core.telemetry.schedule import SamplingSchedule
from amp_core.telemetry.watch import OptimizerWatch

__all__ = ["MAX_IN_FLIGHT", "CudaMeter", "HostMeter", "LaneTrack", "Meter", "OptimizerWatch", "PlainStep",
           "SamplingSchedule", "StepDriver", "StepRecorder", "StepResult", "Window", "meter_for", "resolve_step"]
