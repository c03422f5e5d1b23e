"""A live view that does not rerun per session: one publisher per live run writes each tick's board (the lanes
table, the charts' new points) to files every browser fetches (amp_core.views.live_feed), for a real training run."""

from __future__ import annotations

import json
import threading
import time

import pytest

from amp_core.views import plots
from amp_core.views.chart_feed import figure_spec
from amp_core.views.live import lanes_table
from amp_core.views.live_feed import KEEP_UPDATES, WHOLE_EVERY, LiveFeeds, Publisher, feed_name
from amp_core.views.shared import LiveRoom
from tests.live_clock import Clock


def render(smoothing: float):
    """A board as the Train page makes one (its charts as specs, its table, its signal), for one loss smoothing."""
    def made(frame) -> dict:
        with plots.specs_only():
            figures = plots.train_figures(frame.series, smoothing=smoothing, bands=frame.bands)
        table = lanes_table(frame.info, frame.series)
        return {"charts": {name: figure_spec(figures[name]) for name in ("loss", "step_time")},
                "table": {"rows": table.astype(str).values.tolist()},
                "signal": [frame.info.status, [lane.status for lane in frame.info.lanes]]}
    return made


def read(folder, name: str) -> dict:
    return json.loads((folder / name).read_text())


def watch_all(feeds: LiveFeeds, manager, run_id: str, sessions: dict[str, float], frame=None) -> list:
    """Every session (name -> its loss smoothing) asks for its feed at once, each on its own thread."""
    out: list = []
    barrier = threading.Barrier(len(sessions))

    def one(session: str, smoothing: float) -> None:
        barrier.wait()
        out.append(feeds.watch(manager, run_id, ("board", smoothing), render(smoothing), session, frame))

    threads = [threading.Thread(target=one, args=item) for item in sessions.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return out


def test_sessions_on_one_live_run_share_one_board_per_tick_and_its_files(live_run, stepped_launches, tmp_path):
    manager, run = live_run
    clock = Clock()
    room = LiveRoom(share_s=0.5, clock=clock)
    feeds = LiveFeeds(tmp_path, room, tick_s=3600.0)  # ticked by the test, not by the thread
    try:
        frame = room.frame(manager, run.run_id)
        opened = watch_all(feeds, manager, run.run_id, {"a": 0.0, "b": 0.0}, frame)
        assert feeds.computed == {"board": 1}  # two sessions, one board
        assert {name for name, _ in opened} == {feed_name(run.run_id, ("board", 0.0))}
        folder = tmp_path / opened[0][0]
        first = read(folder, "0.json")
        assert read(folder, "latest.json") == {"seq": 0, "updates": [first]}
        assert first["seq"] == 0 and first["charts"]["loss"]["kind"] == "reset"
        assert read(folder, "whole.json")["charts"]["loss"]["figure"]["data"][0]["x"] == [0, 1]

        run.resume()  # the run trains on; the next tick reads the records since, once for both sessions
        run.wait_until(stepped_launches.parked)
        clock.now += 0.5
        frame = room.frame(manager, run.run_id)
        watch_all(feeds, manager, run.run_id, {"a": 0.0, "b": 0.0}, frame)
        assert feeds.computed == {"board": 2}
        update = read(folder, "1.json")
        assert (update["seq"], update["base"]) == (1, 0)
        assert read(folder, "latest.json") == {"seq": 1, "updates": [first, update]}  # a period's ticks, one fetch
        loss = update["charts"]["loss"]
        assert loss["kind"] == "extend" and not loss["replace"]
        # Only the new points: steps 2-4 of each lane, after the 2 it drew.
        assert [(item["keep"], item["points"]["x"]) for item in loss["extend"]] == [(2, [2, 3, 4]), (2, [2, 3, 4])]
        assert update["table"]["rows"][0][2] == "5 / 100,000"
        assert read(folder, "whole.json")["seq"] == 0  # written every WHOLE_EVERY updates: the board catches up
        assert not list(folder.glob("*.tmp")) and not list(folder.glob(".*"))  # written whole, nothing left over
    finally:
        feeds.close()


def test_a_session_with_its_own_choices_gets_its_own_feed(live_run, tmp_path):
    manager, run = live_run
    room = LiveRoom(share_s=0.5, clock=Clock())
    feeds = LiveFeeds(tmp_path, room, tick_s=3600.0)
    try:
        frame = room.frame(manager, run.run_id)
        names = {name for name, _ in watch_all(feeds, manager, run.run_id, {"a": 0.0, "b": 0.9}, frame)}
        assert len(names) == 2 and feeds.computed == {"board": 2}
        assert all((tmp_path / name / "whole.json").exists() for name in names)
    finally:
        feeds.close()


def test_the_publisher_ticks_on_its_own_and_stops_when_nobody_watches(live_run, stepped_launches, tmp_path):
    manager, run = live_run
    watching = {"a"}
    feeds = LiveFeeds(tmp_path, LiveRoom(share_s=0.05), tick_s=0.05, alive=lambda session: session in watching)
    try:
        name, seq = feeds.watch(manager, run.run_id, ("board", 0.0), render(0.0), "a")
        assert seq == 0 and feeds.running(run.run_id)
        run.resume()
        run.wait_until(stepped_launches.parked)
        folder = tmp_path / name
        deadline = time.monotonic() + 30
        while read(folder, "latest.json")["seq"] < 1:  # the thread's tick publishes what the run did since
            assert time.monotonic() < deadline, "the publisher did not tick"
            time.sleep(0.05)
        assert read(folder, "latest.json")["updates"][-1]["table"]["rows"][0][2] == "5 / 100,000"
        watching.clear()  # the session closed
        deadline = time.monotonic() + 30
        while feeds.running(run.run_id):
            assert time.monotonic() < deadline, "a feed nobody watches still ticks"
            time.sleep(0.05)
    finally:
        feeds.close()


def spec(points: int) -> dict:
    """A one-trace chart spec of `points` points."""
    return {"data": [{"type": "scatter", "x": list(range(points)), "y": [float(i) for i in range(points)]}],
            "layout": {"title": {"text": "Loss"}}, "template": {}}


def test_a_feed_keeps_its_last_updates_writes_nothing_unchanged_and_never_goes_back(tmp_path):
    publisher = Publisher(tmp_path, keep=KEEP_UPDATES, whole_every=WHOLE_EVERY)
    wholes = []
    for version, points in enumerate(range(2, 2 + KEEP_UPDATES + 3)):
        assert publisher.publish({"charts": {"loss": spec(points)}, "table": None, "signal": ["running"]}, version)
        wholes.append(read(tmp_path, "whole.json"))
    last = KEEP_UPDATES + 2
    # whole.json every WHOLE_EVERY updates, each chart as a reset at its seq: the updates kept since apply to it.
    assert [whole["seq"] for whole in wholes] == [seq - seq % WHOLE_EVERY for seq in range(last + 1)]
    whole = wholes[WHOLE_EVERY]["charts"]["loss"]
    assert whole["kind"] == "reset" and len(whole["figure"]["data"][0]["x"]) == 2 + WHOLE_EVERY
    assert read(tmp_path, f"{WHOLE_EVERY + 1}.json")["charts"]["loss"]["base"] == whole["seq"]
    assert sorted(int(path.stem) for path in tmp_path.glob("[0-9]*.json")) == list(range(last - KEEP_UPDATES + 1,
                                                                                         last + 1))
    same = {"charts": {"loss": spec(2 + last)}, "table": None, "signal": ["running"]}
    assert not publisher.publish(same, version=last + 1)  # a paused run: nothing new, nothing written
    older = {"charts": {"loss": spec(3)}, "table": None, "signal": ["running"]}
    assert not publisher.publish(older, version=1)  # a reading older than the one published
    assert publisher.written == last + 1 and read(tmp_path, "latest.json")["seq"] == last
    assert [update["seq"] for update in read(tmp_path, "latest.json")["updates"]] == [last - 1, last]
    moved = {"charts": {"loss": spec(2 + last)}, "table": None, "signal": ["paused"]}
    assert publisher.publish(moved, version=last + 2)
    update = read(tmp_path, "latest.json")["updates"][-1]
    assert update["charts"] == {} and update["signal"] == ["paused"]  # a chart that did not change is left out


def test_a_tick_must_have_a_length_and_a_feed_keep_what_follows_its_whole(tmp_path):
    with pytest.raises(ValueError, match="tick_s must be > 0"):
        LiveFeeds(tmp_path, LiveRoom(share_s=0.5), tick_s=0.0)
    with pytest.raises(ValueError, match=r"keep \(2\) must be >= whole_every \(4\)"):
        Publisher(tmp_path, keep=2, whole_every=4)
