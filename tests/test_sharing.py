"""Sharing a workshop: who may control the runs (amp_core.access), and every page's controls gated where they are
drawn — a visitor's session (under AppTest: no connection behind it, so an unknown address) draws none of them and one
line in their place; the presenter's draws them all. The real-address check, in a browser from another network
namespace, is tests/test_sharing_browser.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core import access, cli
from amp_core.access import CONTROL, SHARE_ENV, WATCH, Sharing, is_loopback, may_control, sharing, visitor_count
from amp_core.config import RunConfig
from tests.share_tour import READ_ONLY_BUTTONS

ROOT = Path(__file__).resolve().parents[1]
NOT_SHARED = Sharing(shared=False, remote_control=False)
SHARED = Sharing(shared=True, remote_control=False)


# --- the decision ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("peer", "local"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("198.51.100.2", False), ("192.0.2.2", False), ("fd00::2", False), ("fe80::1%eth0", False),
    ("::ffff:198.51.100.2", False), ("0.0.0.0", False), ("localhost", False), ("", False), (None, False),
    ("not an address", False),
])
def test_only_a_loopback_peer_is_this_machine(peer, local):
    assert is_loopback(peer) is local
    assert may_control(SHARED, peer, proxied=False) is local


def test_not_shared_everyone_controls_as_before_and_remote_control_opts_back_in():
    for peer in ("198.51.100.2", None, "garbage"):
        assert may_control(NOT_SHARED, peer, proxied=False)
        assert may_control(Sharing(shared=True, remote_control=True), peer, proxied=True)


def test_a_relayed_loopback_connection_is_a_visitor_a_header_never_gives_control():
    assert not may_control(SHARED, "127.0.0.1", proxied=True)  # a proxy on this machine relays someone else
    assert not may_control(SHARED, "198.51.100.2", proxied=False)
    assert access.was_proxied(["Host", "X-Forwarded-For"]) and access.was_proxied(["forwarded"])
    assert not access.was_proxied(["Host", "Cookie", "Origin"])


@pytest.mark.parametrize(("environ", "bind", "shared", "remote"), [
    ({}, "127.0.0.1", False, False), ({}, "localhost", False, False), ({}, "::1", False, False),
    ({}, "0.0.0.0", True, False), ({}, "", True, False), ({}, None, True, False), ({}, "::", True, False),
    ({}, "192.0.2.2", True, False),  # bound beyond loopback with no word from `amp-lab ui`: read-only for visitors
    ({SHARE_ENV: WATCH}, "0.0.0.0", True, False), ({SHARE_ENV: CONTROL}, "0.0.0.0", True, True),
    ({SHARE_ENV: WATCH}, "127.0.0.1", True, False),
])
def test_how_the_server_is_shared(environ, bind, shared, remote):
    share = sharing(environ, bind)
    assert (share.shared, share.remote_control, share.problem) == (shared, remote, "")


def test_a_share_value_it_does_not_take_leaves_visitors_watching_and_says_so():
    share = sharing({SHARE_ENV: "yes"}, "0.0.0.0")
    assert share.shared and not share.remote_control
    assert share.problem == f"{SHARE_ENV}='yes' is not one of watch, control: visitors only watch"


def test_visitors_are_counted_by_address_this_machine_left_out():
    peers = ["127.0.0.1", "::1", "198.51.100.2", "198.51.100.2", "198.51.100.6", None]
    assert visitor_count(peers) == (3, 4)  # two addresses and one unknown session; four tabs
    assert visitor_count(["127.0.0.1"]) == (0, 0)


def test_remote_control_without_share_is_refused(capsys):
    assert cli.main(["ui", "--remote-control"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --remote-control needs --share (or a --server.address beyond "
                                               "this machine)")


# --- every page, as a visitor and as the presenter -----------------------------------------------------------------
CONTROLS = {"pages/train.py": {"Launch", "Resume", "Stop", "Find the largest batch"},
            "pages/workshop.py": {"Launch"},
            "pages/overflow_debugger.py": {"Launch demo run", "Replay"},
            "pages/layer_numerics.py": {"Launch"}}
"""What each page draws for the presenter while a run of this server is paused (form submit buttons included)."""
LIVE_LANE = {"pages/op_inspector.py": ("opi_source", "Trace this lane now"),
             "pages/layer_numerics.py": ("lnum_source", "Probe this lane now")}
NOTE = "This machine's presenter controls the runs"


@pytest.fixture
def paused_run(stepped_launches, monkeypatch):
    """A real run of this server's RunManager, paused after two steps: the pages draw its pause/stop and probes."""
    from pages.common import get_manager

    monkeypatch.setattr(stepped_launches, "pause_after", frozenset({2}))
    run = get_manager().launch(RunConfig(workload="mlp_regression", modes=("32-true",), steps=40, batch_size=8))
    run.wait_until(lambda r: r.parked())
    return run


def app_as(role: str, monkeypatch) -> AppTest:
    """The app as the presenter (not shared: as before) or as a visitor of a shared server (AppTest has no connection,
    so its address is unknown: read-only)."""
    if role == "visitor":
        monkeypatch.setenv(SHARE_ENV, WATCH)
    else:
        monkeypatch.delenv(SHARE_ENV, raising=False)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def labels(at: AppTest) -> set[str]:
    return {button.label for button in at.button}


def notes(at: AppTest) -> int:
    return sum(NOTE in caption.value for caption in at.main.caption)


def test_a_visitor_follows_no_launch_of_a_replaced_manager_and_the_page_ends(stepped_launches, monkeypatch):
    """The presenter's last scenario was launched through a RunManager the server has since replaced: a visitor's
    Workshop page says nothing is launched, and its script run ends (its follow timer once compared that launch with
    the None it showed and reran the page without end: the suite's sporadic 120 s AppTest timeout, after a workshop
    test in the same process)."""
    from pages import common

    presenter = app_as("presenter", monkeypatch)
    presenter.switch_page("pages/workshop.py").run()
    presenter.button(key="workshop_launch_spike-recovery").click().run()
    assert not presenter.exception
    assert presenter.session_state["workshop_launch"].wait(120)
    common.get_manager().stop_all()
    common.get_manager.clear()  # the server's manager replaced; the presented launch is still the old one's
    visitor = app_as("visitor", monkeypatch)
    visitor.switch_page("pages/workshop.py").run(timeout=60)
    assert not visitor.exception
    assert any("has not launched a scenario yet" in info.value for info in visitor.info)


@pytest.mark.parametrize("role", ["presenter", "visitor"])
def test_every_control_is_drawn_for_the_presenter_only(paused_run, monkeypatch, role):
    at = app_as(role, monkeypatch)
    sidebar = " ".join(block.value for block in at.sidebar.markdown)
    assert ("watching (read-only)" in sidebar) is (role == "visitor")
    every_control = set().union(*CONTROLS.values(), {name for _, name in LIVE_LANE.values()})
    for page in ("pages/train.py", "pages/workshop.py", "pages/compare.py", "pages/op_inspector.py",
                 "pages/layer_numerics.py", "pages/overflow_debugger.py", "pages/formats.py"):
        at.session_state["train_recipes_open"] = True  # Train's folded recipes section holds a control
        at.switch_page(page).run()
        assert not at.exception, (page, [e.value for e in at.exception])
        found = labels(at)
        if page in LIVE_LANE:  # a workload's probe takes recipe options, which may read a file (+plan:FILE) there
            boxes = {box.label for box in at.text_input}
            assert ("Recipe options" in boxes) is (role == "presenter"), (page, boxes)
        if page in LIVE_LANE:  # the probe of a live lane: behind the page's source picker
            key, button = LIVE_LANE[page]
            at.radio(key=key).set_value("A live lane").run()
            assert not at.exception, (page, [e.value for e in at.exception])
            found |= labels(at)
            assert (button in found) is (role == "presenter"), (page, found)
            assert notes(at) >= (role == "visitor"), page
        if role == "presenter":
            assert CONTROLS.get(page, set()) <= found, (page, found)
            assert notes(at) == 0, page
        else:
            assert not found & every_control, (page, found & every_control)
            assert found <= READ_ONLY_BUTTONS or page == "pages/compare.py", (page, found)
            if page in CONTROLS:
                assert notes(at) >= 1, page  # one line where the controls would be


def test_a_visitor_follows_the_presenters_scenario_and_launches_none(monkeypatch, stepped_launches):
    from amp_core.workshop import SCENARIOS

    presenter = app_as("presenter", monkeypatch)
    presenter.switch_page("pages/workshop.py").run()
    name = next(iter(SCENARIOS))
    presenter.button(key=f"workshop_launch_{name}").click().run()
    assert not presenter.exception and presenter.header[0].value == SCENARIOS[name].title
    visitor = app_as("visitor", monkeypatch)
    visitor.switch_page("pages/workshop.py").run()
    assert not visitor.exception, [e.value for e in visitor.exception]
    assert not labels(visitor) and notes(visitor) == 1
    assert visitor.header[0].value == SCENARIOS[name].title  # the presenter's scenario, drawn live for the room


def test_a_visitor_asks_nothing_of_an_attached_run(monkeypatch, fresh_store):
    import torch
    from torch import nn

    from amp_core.attach.monitor import Monitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with Monitor(model, optimizer, store=fresh_store, name="attached") as monitor:
        for _ in range(3):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            monitor.step(loss)
        for role in ("presenter", "visitor"):
            at = app_as(role, monkeypatch)
            at.switch_page("pages/op_inspector.py").run()
            at.radio(key="opi_source").set_value("An attached run").run()
            assert not at.exception, [e.value for e in at.exception]
            assert ("Trace the next step" in labels(at)) is (role == "presenter"), labels(at)
            assert notes(at) == (role == "visitor")
