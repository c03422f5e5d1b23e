"""Work per refresh, not per viewer: sessions showing one live run share one reading of it per tick, and the live
views' redraw period is a setting."""

from __future__ import annotations

import json
import threading

import pytest

from amp_core.config import RunConfig
from amp_core.views import plots
from amp_core.views.live import lanes_table
from amp_core.views.shared import DEFAULT_REFRESH_S, REFRESH_ENV, LiveRoom, TickCache, live_refresh_s
from tests.live_clock import Clock


def session(room: LiveRoom, manager, run_id: str, smoothing: float, barrier: threading.Barrier, out: list) -> None:
    """What one session's timer redraw asks of the room: the tick's frame, its table, its figures (its choices)."""
    barrier.wait()  # every session asks at once
    frame = room.frame(manager, run_id)
    table = room.get(frame, ("lanes_table",), lambda: lanes_table(frame.info, frame.series))
    figures = room.get(frame, ("figures", smoothing), lambda: plots.train_figures(frame.series, smoothing=smoothing,
                                                                                   bands=frame.bands))
    out.append((frame, table, figures))


def redraw(room: LiveRoom, manager, run_id: str, choices: list[float]) -> list:
    """One redraw of every session (one per item of `choices`, its loss smoothing), each on its own thread."""
    out: list = []
    barrier = threading.Barrier(len(choices))
    threads = [threading.Thread(target=session, args=(room, manager, run_id, smoothing, barrier, out))
               for smoothing in choices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(out) == len(choices)
    return out


def test_two_sessions_on_one_live_run_share_one_reading_per_tick(live_run, stepped_launches):
    manager, run = live_run
    clock = Clock()
    room = LiveRoom(share_s=0.5, clock=clock)
    first = redraw(room, manager, run.run_id, [0.0, 0.0])
    assert room.cache.computed == {"frame": 1, "lanes_table": 1, "figures": 1}
    assert room.cache.asked == {"frame": 2, "lanes_table": 2, "figures": 2}
    (frame_a, table_a, figures_a), (frame_b, table_b, figures_b) = first
    assert frame_a is frame_b and table_a is table_b and figures_a is figures_b
    assert table_a["steps"].tolist() == ["2 / 100,000"] * 2

    run.resume()  # the run trains on; the sessions' next redraw is in the next tick
    run.wait_until(stepped_launches.parked)
    clock.now += 0.5
    second = redraw(room, manager, run.run_id, [0.0, 0.0])
    assert room.cache.computed == {"frame": 2, "lanes_table": 2, "figures": 2}
    assert second[0][0] is second[1][0] and second[0][0] is not frame_a
    assert second[0][1]["steps"].tolist() == ["5 / 100,000"] * 2  # the new tick read the records since


def test_a_session_with_its_own_choices_shares_the_reading_not_the_figures(live_run):
    manager, run = live_run
    room = LiveRoom(share_s=0.5, clock=Clock())
    (frame_a, _, figures_a), (frame_b, _, figures_b) = redraw(room, manager, run.run_id, [0.0, 0.9])
    assert frame_a is frame_b and figures_a is not figures_b
    assert room.cache.computed == {"frame": 1, "lanes_table": 1, "figures": 2}


def test_a_fresh_reading_replaces_the_ticks_for_everyone(live_run, stepped_launches):
    manager, run = live_run
    room = LiveRoom(share_s=0.5, clock=Clock())
    shared = room.frame(manager, run.run_id)
    run.resume()
    run.wait_until(stepped_launches.parked)
    assert room.frame(manager, run.run_id) is shared  # the same tick: shared
    fresh = room.frame(manager, run.run_id, fresh=True)  # a page drawn whole after its user acted
    assert fresh is not shared and room.frame(manager, run.run_id) is fresh
    assert [lane.steps_done for lane in fresh.info.lanes] == [5, 5]


def test_a_computation_that_raises_is_not_kept():
    cache = TickCache(1.0, clock=Clock())

    def broken():
        raise OSError("store away")

    with pytest.raises(OSError, match="store away"):
        cache.get("r", "frame", broken)
    assert cache.get("r", "frame", lambda: 7) == 7 and cache.computed == {"frame": 1}


def test_old_ticks_are_dropped_for_every_run():
    clock = Clock()
    cache = TickCache(1.0, clock=clock)
    cache.get("a", "frame", lambda: 1)
    clock.now = 5.0
    cache.get("b", "frame", lambda: 2)
    assert [key[0] for key in cache._entries] == ["b"]


def test_a_tick_must_have_a_length():
    with pytest.raises(ValueError, match="share_s must be > 0"):
        TickCache(0.0)


@pytest.mark.parametrize(("text", "seconds"), [(None, DEFAULT_REFRESH_S), ("", DEFAULT_REFRESH_S), ("2.5", 2.5),
                                               (" 0.5 ", 0.5)])
def test_the_refresh_setting_is_read(text, seconds):
    environ = {} if text is None else {REFRESH_ENV: text}
    assert live_refresh_s(environ) == (seconds, "")


@pytest.mark.parametrize("text", ["soon", "0", "0.1", "-1", "nan", "inf"])
def test_a_bad_refresh_setting_says_so_and_keeps_the_default(text):
    seconds, problem = live_refresh_s({REFRESH_ENV: text})
    assert seconds == DEFAULT_REFRESH_S
    assert problem.startswith(f"{REFRESH_ENV}={text!r} is not a number of seconds")


@pytest.mark.parametrize(("setting", "period", "warned"), [(None, 1.0, False), ("2.5", 2.5, False),
                                                           ("soon", 1.0, True)])
def test_the_train_pages_live_board_fetches_at_the_setting(stepped_launches, monkeypatch, fragment_timers, setting,
                                                           period, warned):
    from streamlit.testing.v1 import AppTest

    from pages.common import get_manager

    if setting is None:
        monkeypatch.delenv(REFRESH_ENV, raising=False)
    else:
        monkeypatch.setenv(REFRESH_ENV, setting)
    timers = fragment_timers
    monkeypatch.setattr(stepped_launches, "pause_after", frozenset({4}))
    run = get_manager().launch(RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), steps=100_000,
                                         batch_size=16))
    try:
        run.wait_until(stepped_launches.parked)
        at = AppTest.from_file("../pages/train.py", default_timeout=120)
        at.session_state["train_run_pick"] = run.run_id
        at.run()
        assert not at.exception
        boards = [json.loads(element.proto.json_args) for element in at.get("component_instance")
                  if element.proto.component_name.endswith("amp_live_chart")]
        assert [board["period_ms"] for board in boards] == [round(period * 1000)]  # the browser fetches this often
        assert boards[0]["names"][:2] == ["loss", "step_time"] and boards[0]["signal"][0] == "paused"
        # The live view's script does not rerun on a timer: the board asks for a rerun when its signal changes.
        assert timers["live_view"] is None
        assert any(w.value.startswith(f"{REFRESH_ENV}='soon'") for w in at.warning) is warned
    finally:
        run.stop()
        run.join()
