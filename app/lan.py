"""LAN mode: which names are this machine's own, the scheme DocTune serves, and whether a
request crossed the network unencrypted (every page then says so, see templates/base.html).

The decision looks at the name the browser used (the Host header), not at the address the
server is bound to or the client's address: docker-compose binds 0.0.0.0 inside the container
but publishes the port on the host's loopback only, and a browser that opened 127.0.0.1 there
sent nothing across a network."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from app.settings import settings

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def scheme() -> str:
    """"https" when DOCTUNE_TLS_CERTFILE and DOCTUNE_TLS_KEYFILE are set, else "http"."""
    return "https" if settings.tls else "http"


def is_loopback_name(name: str) -> bool:
    """A name that never leaves this machine: localhost, 127.0.0.0/8, ::1."""
    name = name.strip().lower().strip("[]").rstrip(".")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def crosses_network_unencrypted(request_scheme: str, host_header: str) -> bool:
    """True when a request came over plain http by a name that is not a loopback name: its
    passwords and documents were readable by anyone else on that network."""
    if request_scheme != "http":
        return False
    try:
        name = urlsplit("//" + host_header).hostname
    except ValueError:
        name = None
    return not (name and is_loopback_name(name))
