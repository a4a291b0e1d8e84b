"""Host names and allow-list patterns, normalized (the config's `remote_image_hosts` and the
remote-image fetcher share these rules)."""

from __future__ import annotations

import ipaddress
import re
import typing

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
_NUMERIC_LABEL = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)$")


def ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def normalize_host(host: str) -> str | None:
    """The canonical form of a host name or IP literal (lower case, no trailing dot, IPv6 without
    brackets, compressed), or None when it is neither."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if "%" in host:  # IPv6 zone ids: never from a remote caller
        return None
    ip = ip_literal(host)
    if ip is not None:
        return str(ip)
    if host.endswith("."):
        host = host[:-1]
    if not host.isascii() or len(host) > 253 or not _HOSTNAME.match(host):
        return None
    if _NUMERIC_LABEL.match(host.rsplit(".", 1)[-1]):
        return None  # a resolver would read it as an IPv4 address (127.1, 2130706433, 0x7f.1)
    return host


def normalize_host_pattern(pattern: str, where: str = "remote_image_hosts") -> str:
    """An allow-list entry, normalized; raises ValueError naming a bad one."""
    p = pattern.strip().lower()
    if p.startswith("*."):
        rest = normalize_host(p[2:])
        if rest is not None and ip_literal(rest) is None and "." in rest:
            return "*." + rest
    elif "*" not in p:
        host = normalize_host(p)
        if host is not None:
            return host
    raise ValueError(
        f"{where}: entry {pattern!r} is not a host name, an IP literal or a '*.domain' "
        "pattern (no scheme, port or path; a wildcard needs at least two labels after '*.')")


def host_allowed(host: str, patterns: typing.Iterable[str]) -> bool:
    """Whether a normalized host matches an (already normalized) allow-list."""
    for p in patterns:
        if p.startswith("*."):
            if host.endswith(p[1:]) and ip_literal(host) is None:
                return True
        elif host == p:
            return True
    return False
