"""The pre-launch cost probe: real training steps per mode, a time cap, costs relative to 32-true."""

from __future__ import annotations

import threading

import pytest

from amp_core.config import ConfigError
from amp_core.precision import MODES, availability
from amp_core.probes.cost import ProbeBoard, ProbeResult, probe_mode, relative_costs

CPU_MODES = [mode for mode in MODES if availability(mode, "cpu")[0]]


@pytest.mark.parametrize("mode", CPU_MODES)
def test_probe_times_real_steps(mode):
    result = probe_mode("mlp_regression", "small", 32, mode, "cpu", steps=3, time_cap_s=30)
    assert result.mode == mode
    assert result.steps_timed == 3 and not result.capped
    assert 0 < result.ms_per_step < 30_000


def test_probe_stops_at_the_time_cap():
    result = probe_mode("digits_mlp", "small", 32, "32-true", "cpu", steps=50, time_cap_s=0.0)
    assert result.capped and result.steps_timed == 1 and result.ms_per_step > 0


def test_probe_refuses_what_a_run_would():
    with pytest.raises(ConfigError, match="batch_size"):
        probe_mode("digits_mlp", "small", 0, "32-true", "cpu")
    with pytest.raises(ConfigError, match="tf32 cannot run"):
        probe_mode("digits_mlp", "small", 8, "tf32", "cpu")


def test_relative_costs_against_32_true():
    costs = relative_costs([ProbeResult("bf16-mixed", 2.0, 5, False), ProbeResult("32-true", 4.0, 5, False),
                            ProbeResult("16-mixed", 248.0, 1, True)]).set_index("mode")
    assert costs.loc["bf16-mixed", "time_vs_baseline"] == 0.5
    assert costs.loc["16-mixed", "time_vs_baseline"] == 62.0
    assert costs["far_slower"].to_dict() == {"bf16-mixed": False, "32-true": False, "16-mixed": True}
    without = relative_costs([ProbeResult("bf16-mixed", 2.0, 5, False)])
    assert without["time_vs_baseline"].isna().all() and not without["far_slower"].any()


def test_board_measures_off_the_callers_thread_and_remembers():
    board = ProbeBoard(steps=2, time_cap_s=10)
    good = ("mlp_regression", "small", 16, "32-true", "cpu")
    bad = ("mlp_regression", "small", 16, "tf32", "cpu")
    assert board.get(good) is None and board.get(bad) is None  # queued, nobody waits
    assert board.wait(120)
    result = board.get(good)
    assert isinstance(result, ProbeResult) and result.steps_timed == 2
    assert board.get(good) is result
    assert "ConfigError" in board.get(bad) and "tf32 cannot run" in board.get(bad)
    assert not [t for t in threading.enumerate() if t.name == "amp-probe"]
