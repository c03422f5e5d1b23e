"""OpenMP's wait policy for the suite: idle threads asleep in every test process and child, except where a test judges
a speed, which runs on the device's own policy.

OpenMP's threads spin after each parallel region before they sleep (libgomp's default wait policy): on a machine
whose cores are all taken (two pytest workers and their children on two cores) the spinning thread holds a core the
working one needs. Measured on this 2-core machine under the suite's load, the FP8 workshop scenario took 122
CPU-seconds with the default policy and 22 with PASSIVE, the same two threads doing the same work. PASSIVE changes
only how an idle thread waits: the thread count, the kernels and the numbers they compute stay the same. libgomp reads
the policy once, when torch loads it, so tests/conftest.py sets it before anything imports torch; a test whose point
is a speed (the speed scenario's verdicts) runs in a process of its own with the policy as the device has it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WAIT_POLICY = "OMP_WAIT_POLICY"
SUITE_WAIT = "AMP_LAB_TEST_WAIT"
"""Who chose this process's wait policy: "suite" (PASSIVE, set by `quiet_the_suite`) or "device" (left as the device
has it, for a speed a test judges); unset where the suite never touched it (a policy the shell exported is kept)."""

ROOT = Path(__file__).resolve().parents[1]


def quiet_the_suite() -> None:
    """OpenMP's idle threads asleep in this process and every child it starts, unless a policy is set already (the
    shell's, or the device's for a timed test's process). Must run before torch is imported."""
    if WAIT_POLICY not in os.environ and SUITE_WAIT not in os.environ:
        os.environ[WAIT_POLICY] = "PASSIVE"
        os.environ[SUITE_WAIT] = "suite"


def quieted_here() -> bool:
    """Whether this process runs with the policy the suite set (not the device's own)."""
    return os.environ.get(SUITE_WAIT) == "suite"


def device_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (this process's environment when None) with OpenMP's wait policy as the device has it: the suite's
    PASSIVE taken out (a policy the shell exported is kept), and marked so that a pytest child keeps it so."""
    env = dict(os.environ if env is None else env)
    if env.get(SUITE_WAIT) == "suite":
        env.pop(WAIT_POLICY, None)
        env[SUITE_WAIT] = "device"
    return env


def run_on_device_policy(nodeid: str, timeout_s: float) -> None:
    """Runs the test `nodeid` alone in a pytest process on the device's own wait policy (where this process runs on
    the suite's), and fails with its output if it fails there."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", nodeid],
                          cwd=ROOT, env=device_env(), capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout, done.stdout[-2000:]
