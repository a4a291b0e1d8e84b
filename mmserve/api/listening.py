"""The server's address, bound before anything else starts.

Bound first, an address already in use is one clear error (`CannotListen`) within milliseconds;
bound by hypercorn, it was an OSError inside three nested exception groups, and only after every
model had loaded. The bound sockets are then served by `api.connections.serve_capped`.
"""

from __future__ import annotations

import errno
import socket

from hypercorn.config import Config as HypercornConfig

from mmserve.errors import CannotListen


def bind(hc: HypercornConfig, host: str, port: int) -> list[socket.socket]:
    """Hypercorn's own sockets for `hc.bind` (its options: SO_REUSEADDR, TCP_NODELAY), bound but
    not listening; CannotListen saying why when the address cannot be had."""
    try:
        return hc.create_sockets().insecure_sockets
    except OSError as e:
        raise CannotListen(why_not(host, port, e)) from None


def why_not(host: str, port: int, err: OSError) -> str:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(err, socket.gaierror):
        reason = f"the host name {host!r} does not resolve ({err.strerror}); set --host or [server] host"
    elif err.errno == errno.EADDRINUSE:
        reason = (f"the address is already in use (another server on port {port}?); choose another port "
                  "with --port or [server] port, or 0 for a free one")
    elif err.errno == errno.EADDRNOTAVAIL:
        reason = f"{host} is not an address of this machine; set --host or [server] host"
    elif err.errno == errno.EACCES:
        reason = "permission denied (ports below 1024 need privileges)"
    else:
        reason = err.strerror or str(err)
    return f"cannot listen on {address}: {reason}"
