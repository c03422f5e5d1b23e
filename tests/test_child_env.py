"""The suite's OpenMP wait policy (tests/child_env.py): torch's own OpenMP runtime in a child of a test idles asleep,
in a child made for a timed test it spins as the device has it, and a timed test's pytest process is not quieted
again by its conftest."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from child_env import SUITE_WAIT, WAIT_POLICY, device_env, quiet_the_suite, quieted_here

LOAD_TORCHS_OPENMP = ("import ctypes, glob, importlib.util as u; ctypes.CDLL(glob.glob(u.find_spec('torch')"
                      ".submodule_search_locations[0] + '/lib/libgomp*.so*')[0])")
"""Loads the OpenMP runtime torch ships (as `import torch` does, without the rest of torch)."""


def spin_count(env: dict[str, str]) -> int:
    """How long an idle thread of torch's OpenMP spins before it sleeps, in a process started with `env` (libgomp
    prints its settings as it loads when OMP_DISPLAY_ENV asks it to)."""
    done = subprocess.run([sys.executable, "-c", LOAD_TORCHS_OPENMP], env={**env, "OMP_DISPLAY_ENV": "VERBOSE"},
                          capture_output=True, text=True, timeout=60, check=True)
    return int(re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr).group(1))


def test_a_tests_child_idles_asleep_and_a_timed_ones_spins_as_the_device_does():
    if not quieted_here() and os.environ.get(SUITE_WAIT) != "device" and WAIT_POLICY in os.environ:
        pytest.skip(f"{WAIT_POLICY} was set before the suite started: the suite leaves it as it is")
    assert quieted_here(), "tests/conftest.py did not quiet the suite"
    assert spin_count(dict(os.environ)) == 0
    assert spin_count(device_env()) > 0  # libgomp's own default: spin a while, then sleep


def test_a_timed_tests_process_keeps_the_devices_policy_and_a_shells_policy_is_kept(monkeypatch):
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    monkeypatch.delenv(SUITE_WAIT, raising=False)
    quiet_the_suite()  # a suite started from a shell that set no policy
    assert os.environ[WAIT_POLICY] == "PASSIVE" and quieted_here()
    timed = device_env()
    assert WAIT_POLICY not in timed and timed[SUITE_WAIT] == "device"
    monkeypatch.setattr(os, "environ", timed)
    quiet_the_suite()  # the timed test's own pytest process: its conftest leaves the device's policy
    assert WAIT_POLICY not in timed and not quieted_here()
    shell = {WAIT_POLICY: "ACTIVE"}
    monkeypatch.setattr(os, "environ", shell)
    quiet_the_suite()  # a policy the shell set is the suite's
    assert shell == {WAIT_POLICY: "ACTIVE"} and device_env() == shell
