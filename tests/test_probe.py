"""The pre-launch cost probe: a short race through the runner (real training), a time cap, costs relative to 32-true,
remembered, and replaced by a finished run's own figures when they disagree."""

from __future__ import annotations

import threading

import pytest

from amp_core import background
from amp_core.config import ConfigError, RunConfig
from amp_core.diagnostics.cost import (
    AGREEMENT,
    MIN_RUN_STEPS,
    ProbeBoard,
    ProbeResult,
    race,
    race_modes,
    relative_costs,
)
from amp_core.precision import MODES, availability

CPU_MODES = [mode for mode in MODES if availability(mode, "cpu")[0]]


def config(modes=("bf16-mixed",), **kwargs) -> RunConfig:
    return RunConfig(**{"workload": "mlp_regression", "batch_size": 16, "device": "cpu", "modes": modes, **kwargs})


def test_a_race_times_every_mode_after_its_warm_up():
    results = race(config(tuple(CPU_MODES)), warmup=3, steps=5, time_cap_s=120, min_timed_s=0)
    assert tuple(results) == race_modes(config(tuple(CPU_MODES))) == tuple(CPU_MODES)  # 32-true first
    for mode, result in results.items():
        assert isinstance(result, ProbeResult), result
        assert (result.mode, result.steps_timed, result.capped, result.source) == (mode, 5, False, "cost probe")
        assert 0 < result.ms_per_step < 30_000


def test_a_race_too_short_to_tell_races_again_for_longer():
    """5 steps of a small MLP last milliseconds: a moment of another process would move the figure. The race goes
    again, for as many steps as fill min_timed_s at the pace the short one showed."""
    results = race(config(), warmup=2, steps=5, time_cap_s=120, min_timed_s=0.5)
    (timed,) = {result.steps_timed for result in results.values()}  # both lanes, stepped in turn, to the end
    assert timed > 5 and not any(result.capped for result in results.values())
    long_enough = race(config(), warmup=2, steps=5, time_cap_s=120, min_timed_s=1e-9)
    assert {result.steps_timed for result in long_enough.values()} == {5}


def test_the_baseline_races_beside_the_chosen_modes():
    assert race_modes(config(("bf16-mixed", "32-true", "16-mixed"))) == ("32-true", "bf16-mixed", "16-mixed")


def test_a_race_stops_at_the_time_cap():
    # 10 million steps never finish; the cap leaves a busy machine time for the warm-up and a timed step or more.
    results = race(config(), warmup=2, steps=10_000_000, time_cap_s=3.0)
    for result in results.values():
        assert result.capped and 0 < result.steps_timed < 10_000_000 and result.ms_per_step > 0
    assert not [t for t in threading.enumerate() if t.name.startswith("amp-run-")]


def test_a_race_refuses_what_a_run_would():
    with pytest.raises(ConfigError, match="batch_size"):
        race(config(batch_size=0))
    with pytest.raises(ConfigError, match="tf32 cannot run"):
        race(config(("tf32",)))


def test_relative_costs_against_32_true():
    costs = relative_costs([ProbeResult("bf16-mixed", 2.0, 5, False), ProbeResult("32-true", 4.0, 5, False),
                            ProbeResult("16-mixed", 248.0, 1, True, "run x")]).set_index("mode")
    assert costs.loc["bf16-mixed", "time_vs_baseline"] == 0.5
    assert costs.loc["16-mixed", "time_vs_baseline"] == 62.0
    assert costs.loc["16-mixed", "source"] == "run x"
    assert costs["far_slower"].to_dict() == {"bf16-mixed": False, "32-true": False, "16-mixed": True}
    without = relative_costs([ProbeResult("bf16-mixed", 2.0, 5, False)])
    assert without["time_vs_baseline"].isna().all() and not without["far_slower"].any()


def test_board_measures_off_the_callers_thread_and_remembers():
    board = ProbeBoard(warmup=2, steps=3, time_cap_s=60, min_timed_s=0)
    good, bad = config(), config(("tf32",))
    assert board.get(good) is None and board.get(bad) is None  # queued, nobody waits
    assert board.wait(120)
    results = board.get(good)
    assert list(results) == ["32-true", "bf16-mixed"]
    assert all(isinstance(r, ProbeResult) and r.steps_timed == 3 for r in results.values())
    assert board.get(good) == results and board.known(good) == results
    assert "ConfigError" in board.get(bad)["tf32"] and "tf32 cannot run" in board.get(bad)["tf32"]
    assert board.known(config(("16-mixed",))) is None  # another mode set: not measured yet
    assert not [t for t in threading.enumerate() if t.name == "amp-probe"]


def test_a_stopped_board_keeps_nothing_half_measured_and_starts_again_when_asked():
    board = ProbeBoard(warmup=2, steps=10_000_000, time_cap_s=600)
    assert board.get(config()) is None
    board.stop()
    assert board.wait(60) and board.known(config()) is None
    assert background.running() == []
    board.steps = 3
    assert board.get(config()) is None and board.wait(120)
    assert board.known(config()) is not None


def test_a_finished_run_that_disagrees_replaces_the_probe():
    board = ProbeBoard(warmup=2, steps=3)
    assert board.get(config()) is None and board.wait(120)
    probe = board.known(config())
    base = probe["32-true"].ms_per_step
    agreeing = {"32-true": (base * (1 + AGREEMENT / 2), MIN_RUN_STEPS)}
    assert not board.learn_from_run(config(), agreeing, "near")
    assert board.known(config()) == probe
    short = {"32-true": (base * 3, MIN_RUN_STEPS - 1)}
    assert not board.learn_from_run(config(), short, "short")  # too few steps to teach anything
    far = {"32-true": (base * 3, 300), "bf16-mixed": (7.0, 300)}
    assert board.learn_from_run(config(lr=0.5), far, "run-1")  # the same cost, whatever the LR
    learned = board.known(config())
    assert learned == {"32-true": ProbeResult("32-true", base * 3, 300, False, "run run-1"),
                       "bf16-mixed": ProbeResult("bf16-mixed", 7.0, 300, False, "run run-1")}
