"""bench.overhead compares plain steps: the steps it leaves out of the runner's medians as sampled are exactly those on
which the run took its probes or snapshots (their records' probe_ms), by the run's own schedule."""

from __future__ import annotations

from amp_core.config import RunConfig
from amp_core.race.runner import Run
from bench.overhead import sampled_steps


def test_the_sampled_steps_left_out_are_those_whose_records_carry_probe_time():
    config = RunConfig(workload="digits_mlp", modes=("32-true",), size="small", batch_size=16, steps=60,
                       device="cpu", intra_op_threads=1)
    run = Run(config).start()
    run.join()
    assert run.status == "finished"
    frame = run.frame()
    probed = {int(step) for step, probe_ms in zip(frame["step"], frame["probe_ms"], strict=True) if probe_ms > 0}
    assert sampled_steps(run, len(frame)) == probed == {0, 1, 25, 50}
