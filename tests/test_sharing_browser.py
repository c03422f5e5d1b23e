"""`amp-lab ui --share` seen from another address: a real Chromium in a network namespace (a veth pair on a /30 of
TEST-NET-2) watches the presenter's live run on every page and finds no control that starts or changes work; the same
pages from 127.0.0.1 have them. Both browsers run in this test's process; the visitor's Chromium is started inside
the namespace. Traffic goes only between the two ends of the veth pair (the namespace has no other
route), and the namespace and the pair are removed whatever happens."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import streamlit_server
from tests.share_tour import (
    CONTROLS,
    PAGES,
    PRESENTER_PAGES,
    READ_ONLY_BUTTONS,
    VIEWPORT,
    chromium_in,
    launch_run,
    pause_run,
    stop_run,
    visit,
)
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
TEST_NET_2 = ipaddress.ip_network("198.51.100.0/24")
"""Documentation addresses (RFC 5737): never routed anywhere, so a /30 of them reaches nothing but the namespace."""


TOUR_TIMEOUT_S = 540
"""A cap on one browser's tour, only reached when something hangs: a tour takes under a minute on a quiet 2-core
machine, and took up to 6 minutes on one shared by eight busy test sessions (pages loading in 10-90 s each)."""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(2 * TOUR_TIMEOUT_S + 120),  # the visitor's tour and the presenter's: far below
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"),
]


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def free_slash_30() -> ipaddress.IPv4Network | None:
    """The first /30 of TEST-NET-2 that overlaps no address and no route (the default route aside) this machine has."""
    taken = []
    for interface in json.loads(ip("-j", "addr").stdout or "[]"):
        for address in interface.get("addr_info", []):
            if address.get("family") == "inet":
                taken.append(ipaddress.ip_network(f"{address['local']}/{address['prefixlen']}", strict=False))
    for route in json.loads(ip("-j", "route").stdout or "[]"):
        if route.get("dst") not in (None, "default"):
            taken.append(ipaddress.ip_network(route["dst"], strict=False))
    return next((net for net in TEST_NET_2.subnets(new_prefix=30) if not any(net.overlaps(t) for t in taken)), None)


@pytest.fixture
def namespace(request):
    """A network namespace joined to this side by a veth pair: (namespace name, this side's address). Skipped where
    namespaces are not allowed; removed, with the pair, whatever happens."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace needs root and iproute2's `ip`")
    net = free_slash_30()
    if net is None:
        pytest.skip("every /30 of TEST-NET-2 overlaps an address or route of this machine")
    host_address, ns_address = (str(address) for address in net.hosts())
    name, tag = f"amp-share-{os.getpid()}", f"{os.getpid() % 100_000}"
    host_side, ns_side = f"ampsh{tag}", f"ampsn{tag}"  # interface names: 15 characters at most

    def remove() -> None:
        ip("link", "del", host_side)  # takes its peer with it
        ip("netns", "del", name)

    request.addfinalizer(remove)  # also when a step below fails half-way
    made = ip("netns", "add", name)
    if made.returncode:
        pytest.skip(f"this machine does not allow network namespaces: {made.stderr.strip()}")
    for step in (("link", "add", host_side, "type", "veth", "peer", "name", ns_side),
                 ("link", "set", ns_side, "netns", name),
                 ("addr", "add", f"{host_address}/30", "dev", host_side), ("link", "set", host_side, "up"),
                 ("-n", name, "addr", "add", f"{ns_address}/30", "dev", ns_side),
                 ("-n", name, "link", "set", ns_side, "up"), ("-n", name, "link", "set", "lo", "up")):
        done = ip(*step)
        if done.returncode:
            pytest.skip(f"`ip {' '.join(step)}` was refused here: {done.stderr.strip()}")
    try:
        yield name, host_address
    finally:
        remove()


def test_a_visitor_from_another_address_watches_and_this_machine_controls(namespace, tmp_path):
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    ns, host_address = namespace
    port = streamlit_server.free_port()
    server = streamlit_server.start_command(["-m", "amp_core", "ui", "--share", "--port", str(port),
                                             "--server.fileWatcherType", "none"], tmp_path / "runs.sqlite3")
    try:
        streamlit_server.wait_healthy(port, server)
        presenter_url, visitor_url = f"http://127.0.0.1:{port}", f"http://{host_address}:{port}"
        with sync_playwright() as playwright:
            browsers = [playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
                        for executable in (CHROMIUM, chromium_in(ns, tmp_path))]
            try:
                presenter_page, visitor_page = (browser.new_page(viewport=VIEWPORT) for browser in browsers)
                with pytest.raises(PlaywrightError, match="ERR_CONNECTION_REFUSED"):
                    visitor_page.goto(presenter_url)  # its browser is in the namespace: its loopback has no server
                # The presenter launches a long run first, so that every page has a live run to follow (and to
                # control); each browser watches it train, then the presenter pauses it (it stays live: its lanes
                # are listed, its controls drawn) while both tour the other pages, and stops it at the end.
                launch_run(presenter_page, presenter_url)
                visitor = {"train": visit(visitor_page, visitor_url, "train", tmp_path, "visitor")}
                presenter = {"train": visit(presenter_page, presenter_url, "train", tmp_path, "presenter")}
                pause_run(presenter_page, presenter_url)
                for name in PAGES:
                    if name != "train":
                        visitor[name] = visit(visitor_page, visitor_url, name, tmp_path, "visitor")
                for name in PRESENTER_PAGES:
                    if name != "train":
                        presenter[name] = visit(presenter_page, presenter_url, name, tmp_path, "presenter")
                stop_run(presenter_page, presenter_url)  # the control works here
            finally:
                for browser in browsers:
                    browser.close()
    finally:
        streamlit_server.stop(server)
    ARTIFACTS.mkdir(exist_ok=True)
    for shot in tmp_path.glob("*.png"):
        shutil.copy(shot, ARTIFACTS / f"sharing_{shot.name}")
    assert set(visitor) == set(PAGES) and set(presenter) == set(CONTROLS)
    for name in PAGES:  # every page, from another address: watching, no control that starts or changes work
        assert visitor[name]["exceptions"] == 0, name
        assert "watching (read-only)" in visitor[name]["sidebar"], name
        extra = {label for label in visitor[name]["buttons"]
                 if label not in READ_ONLY_BUTTONS and not label.startswith("download: ")}  # exports: theirs to take
        assert not extra, (name, extra)
    for name, controls in CONTROLS.items():  # where a control would be, one line says who controls the runs
        assert visitor[name]["notes"] >= 1, name
        # ... and from this machine, the same pages have the controls, and no such line.
        assert presenter[name]["exceptions"] == presenter[name]["notes"] == 0, name
        assert controls <= set(presenter[name]["buttons"]), (name, presenter[name]["buttons"])
        assert "watching (read-only)" not in presenter[name]["sidebar"], name
        assert "visitor" in presenter[name]["sidebar"] and "watching read-only" in presenter[name]["sidebar"], name
    # Both follow the presenter's run live: its loss chart drew later steps while each looked.
    for seen in (visitor, presenter):
        first, then = seen["train"]["last_step"]
        assert then > first > 0
