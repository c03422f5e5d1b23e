"""The environment for a test's child process that runs torch beside the suite's other busy processes, where its
speed is not what the test checks.

OpenMP's threads spin after each parallel region before they sleep (libgomp's default wait policy): on a machine
whose cores are all taken (two pytest workers and their children on two cores) the spinning thread holds a core the
working one needs. Measured on this 2-core machine under the suite's load, the FP8 workshop scenario took 122
CPU-seconds with the default policy and 22 with PASSIVE, the same two threads doing the same work. PASSIVE changes
only how an idle thread waits: the thread count, the kernels and the numbers they compute stay the same. A test
whose point is a speed (the speed scenario, the compiled race) leaves the policy as the device has it.
"""

from __future__ import annotations

import os

QUIET_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}
"""OpenMP threads that sleep, not spin, between parallel regions (read once, when torch loads its OpenMP)."""


def quiet_torch_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (this process's environment when None) with OpenMP's idle threads asleep instead of spinning; a policy
    set there already is kept."""
    return {**QUIET_WAIT, **(os.environ if env is None else env)}
