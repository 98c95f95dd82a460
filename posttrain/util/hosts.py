"""Which Host headers a local HTTP server answers (the viewer, the policy's OpenAI-compatible
endpoint): a page on another site that points a DNS name at 127.0.0.1 (DNS rebinding) would
otherwise reach it through the browser of whoever runs it."""

from __future__ import annotations

import ipaddress
import socket


def host_allowed(header: str, bound: str, port: int) -> bool:
    """Is `header` (a request's Host) a name of the address a local server (the viewer, the policy's endpoint) serves? Loopback names
    with its port; on a wildcard address (--host 0.0.0.0, on purpose) also any IP literal and
    this machine's own names, never another DNS name."""
    name, sep, given = header.rpartition(":") if not header.endswith("]") else (header, "", "")
    if not sep or given != str(port):
        return False
    name = name.strip("[]").lower()
    if name in ("localhost", "127.0.0.1", "::1", bound.lower()):
        return True
    if bound not in ("0.0.0.0", "::", ""):
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in (socket.gethostname().lower(), socket.getfqdn().lower())
