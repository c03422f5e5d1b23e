"""Who may control the runs of a shared dashboard: the presenter at this machine, never a visitor from elsewhere.

`amp-lab ui --share` listens on every interface for a workshop; a visitor's browser then gets a read-only dashboard
and only a connection from this machine (loopback) keeps the controls that start work or change a run. The decision
is taken here from the TCP peer address the server itself saw, never from anything a client writes; an address that
is not known (no connection behind the session, a value that does not parse) is a visitor's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SHARE_ENV = "AMP_LAB_SHARE"
"""Set by `amp-lab ui --share` for the server it starts: WATCH, or CONTROL with --remote-control."""
WATCH = "watch"
"""Visitors from other addresses watch: every page, no control that starts work or changes a run."""
CONTROL = "control"
"""Every visitor controls the runs (`--share --remote-control`: the behaviour before sharing was read-only)."""
SHARE_VALUES = (WATCH, CONTROL)
ALL_INTERFACES = ("", "0.0.0.0", "::")
"""Bind addresses that listen on every interface (Streamlit's empty default among them)."""
PROXY_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip")
"""Headers a proxy adds: a connection carrying one was relayed, so its loopback peer says nothing about the browser.
A header can only take control away here, never give it."""
PRESENTER_NOTE = "This machine's presenter controls the runs: you are watching, read-only."
"""The line drawn where a control would be, for a visitor."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sharing:
    """How this server is shared, read once from its environment and its own bind address."""

    shared: bool
    """The server is reachable from other machines (`--share`, or bound beyond loopback)."""
    remote_control: bool
    """Visitors from other addresses control the runs too (`--share --remote-control`)."""
    problem: str = ""
    """$AMP_LAB_SHARE held a value it does not take (then visitors only watch): said in the presenter's sidebar."""


def sharing(environ: Mapping[str, str], bind_address: str | None) -> Sharing:
    """The server's sharing from $AMP_LAB_SHARE and the address it listens on. A server bound beyond loopback with no
    word from `amp-lab ui` (e.g. `streamlit run app.py --server.address 0.0.0.0`) is shared read-only as well."""
    value = environ.get(SHARE_ENV, "").strip().lower()
    problem = ""
    if value and value not in SHARE_VALUES:
        problem = f"{SHARE_ENV}={value!r} is not one of {', '.join(SHARE_VALUES)}: visitors only watch"
    shared = bool(value) or not _is_loopback_bind(bind_address)
    return Sharing(shared=shared, remote_control=value == CONTROL, problem=problem)


def _is_loopback_bind(bind_address: str | None) -> bool:
    address = (bind_address or "").strip().strip("[]")
    if address in ALL_INTERFACES:
        return False
    if address == "localhost":
        return True
    return is_loopback(address)


def is_loopback(address: str | None) -> bool:
    """The peer is this machine: 127.0.0.0/8, ::1, or 127.x written as an IPv4-mapped IPv6 address. None or an address
    that does not parse is not."""
    if not isinstance(address, str) or not address:
        return False
    try:
        parsed = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone ("fe80::1%eth0") is no part of it
    except ValueError:
        return False
    mapped = getattr(parsed, "ipv4_mapped", None)
    return (mapped or parsed).is_loopback


def was_proxied(headers: Iterable[str]) -> bool:
    """The connection's handshake carried a proxy's header (names compared without case)."""
    return any(name.lower() in PROXY_HEADERS for name in headers)


def may_control(share: Sharing, peer: str | None, proxied: bool) -> bool:
    """May this connection start work or change a run? Not shared: yes, as ever. Shared: only from this machine,
    directly (a relayed connection is a visitor's whatever its peer), unless --remote-control gave it to everyone."""
    if not share.shared or share.remote_control:
        return True
    return is_loopback(peer) and not proxied


def visitor_count(peers: Iterable[str | None]) -> tuple[int, int]:
    """(visitors, their sessions): the distinct addresses other than this machine's, and the sessions (browser tabs)
    they hold. A session whose address is not known counts as a visitor of its own."""
    sessions = [peer for peer in peers if not is_loopback(peer)]
    addresses = {peer for peer in sessions if peer}
    return len(addresses) + sum(1 for peer in sessions if not peer), len(sessions)
