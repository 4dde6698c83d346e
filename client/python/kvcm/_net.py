"""Small network helpers shared by kvcm's Python services."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """Whether `host` (an IP address or "localhost") is reachable from this host only:
    127.0.0.0/8, ::1, localhost. A DNS name other than localhost is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
