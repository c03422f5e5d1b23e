"""bench.race sizes its work to the workload: no round starts past --budget-s (one always runs), and it says how many
rounds it took before its figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.race import WARMUP, warmup_steps

ROOT = Path(__file__).resolve().parents[1]


def test_a_spent_budget_stops_the_rounds_after_the_first_and_says_so():
    done = subprocess.run([sys.executable, "-m", "bench.race", "--workload", "digits_mlp", "--modes", "32-true",
                           "--steps", "5", "--batch-size", "16", "--rounds", "3", "--budget-s", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rounds, lane, *last = done.stdout.splitlines()
    assert rounds.startswith("rounds=1 of 3 (5 steps per lane; the slowest round took ")
    assert rounds.endswith("--budget-s 0)")
    assert lane.split()[2] == "32-true" and "ms_per_step race=" in lane
    assert last[0].startswith("speedup_error_max=") and last[1].startswith("memory_change_max=")


def test_a_bare_loop_warms_up_a_tenth_of_its_steps_within_two_and_warmup():
    assert warmup_steps(200) == WARMUP  # the MLP default's 200 steps keep their whole warm-up
    assert warmup_steps(50) == 5
    assert warmup_steps(5) == 2
    assert warmup_steps(10_000) == WARMUP
