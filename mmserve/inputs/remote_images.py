"""Remote `http(s)` image URLs: who may be fetched, and a fetch that cannot be turned against us.

Off unless `remote_images = true` in `[limits]`; the other `remote_image_*` keys there set the
policy (`LimitsConfig.remote_image_policy`). The rules, in the order they are applied:

1. **At parse time** (`check_url`, no I/O, before any model work): the URL must be printable
   ASCII, at most 8 KiB, `https://` (or `http://` with `remote_image_allow_http`), without
   credentials, with a well-formed host name or IP literal, and the host must be on
   `remote_image_hosts` (exact names or IP literals, or `*.example.com` = any subdomain of
   example.com, not example.com itself). An empty list allows nothing. Numeric forms a resolver
   would read as IPv4 (`2130706433`, `0x7f.1`, `127.1`) are not host names and are refused.
2. **At connect time** (`_VettingBackend`, for the first request and every redirect hop): the
   host is checked against the allow-list again, resolved *by us*, and **every** resolved address
   must pass `address_refusal` — unless `remote_image_allow_private`, only globally routable
   unicast is accepted (no loopback, private, link-local, CGNAT, unique-local, documentation,
   reserved, multicast or unspecified addresses, nor IPv6 forms that embed such an IPv4 address:
   IPv4-mapped, IPv4-compatible, 6to4, Teredo, NAT64). If any address is refused the host is
   refused; otherwise we connect to one of exactly those vetted addresses.

   This is what makes the fetch safe against DNS rebinding: the name is resolved once, the
   checked address is the one connected to, and nothing resolves it again behind our back. The
   HTTP client (httpcore: no proxy, no environment lookups) is given a network backend that
   receives the *host name* from the URL; it connects the TCP socket to the vetted IP itself,
   while TLS still runs on top with SNI and certificate verification against the host name
   (httpcore passes `server_hostname` = the URL's host to `start_tls`), and the `Host` header
   names the host.
3. **While fetching** (`fetch_image`): redirects (301/302/303/307/308) are followed by hand, at
   most `remote_image_max_redirects`, each target going through rules 1 and 2 again (so a
   redirect to a foreign host, to plain http, or to a private address is refused). A
   `Content-Length` above the byte cap is refused before reading; the body is streamed and dropped
   as soon as it passes the cap (with or without `Content-Length`). The whole fetch — DNS,
   connects, TLS, redirects, body — runs under one `remote_image_timeout_s` deadline.
   `Accept-Encoding: identity`: the cap counts bytes as sent, never a decompressed expansion.
   At most `remote_image_fetch_concurrency` downloads run at once across all requests.

The bytes then take the very path of a `data:` URL's bytes (`open_image`: format allow-list,
pixel-count check before decoding), and images are keyed by their decoded pixels, so a remote
image and the same image inline share their encoder-cache entry.

Statuses: disabled → 400 `remote_images_disabled`; malformed URL or refused scheme → 400
`invalid_image_url`; host not allow-listed → 403 `image_host_not_allowed`; a refused address →
403 `image_address_not_allowed`; larger than the cap → 413 `payload_too_large`; past the deadline
→ 400 `image_fetch_timeout`; unresolvable host, refused connection, TLS failure, a non-2xx answer,
too many redirects → 400 `image_fetch_failed`; bytes that are not an accepted image → 400
`invalid_image` (from `open_image`). Upstream failures are 4xx, not 5xx: the URL is the caller's
choice and retrying it unchanged will not help. A caller that goes away cancels the fetch.
"""

from __future__ import annotations

import functools
import ipaddress
import ssl
import time
import typing
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpcore
import trio

from mmserve.config.hosts import IPAddress, host_allowed, normalize_host
from mmserve.errors import BadRequest, Forbidden, MMServeError, PayloadTooLarge, UnprocessableImage

if typing.TYPE_CHECKING:
    from mmserve.config import LimitsConfig, RemoteImagesConfig


MAX_URL_CHARS = 8192
REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
# IANA special-purpose ranges that are not globally reachable, spelled out because `is_global` /
# `is_private` differ between Python patch releases; an address is public only if both agree.
_NON_PUBLIC = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
    "::/128", "::1/128", "::ffff:0:0/96", "64:ff9b:1::/48", "100::/64", "2001::/23", "2001:db8::/32",
    "3fff::/20", "5f00::/16", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


# -- addresses ------------------------------------------------------------------------------


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> tuple[str, ipaddress.IPv4Address] | None:
    if ip.ipv4_mapped is not None:
        return "IPv4-mapped", ip.ipv4_mapped
    if ip.sixtofour is not None:
        return "6to4", ip.sixtofour
    if ip.teredo is not None:
        return "Teredo", ip.teredo[1]
    for net in _NAT64:
        if ip in net:
            return "NAT64", ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in _IPV4_COMPATIBLE and int(ip) > 1:
        return "IPv4-compatible", ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_refusal(address: str | IPAddress, allow_private: bool = False) -> str | None:
    """Why connecting to `address` is refused ("loopback", "private", ...), or None if allowed.

    Always refused: unspecified, multicast, IPv4 reserved (240/4, broadcast) — nothing an image
    can come from. With `allow_private = false`, anything not globally routable is refused too.
    An IPv6 address that embeds an IPv4 one is judged by the IPv4 address as well; a 6to4 one by
    the IPv4 address alone. The answer is the same on every Python version.
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0]) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            kind, v4 = embedded
            reason = address_refusal(v4, allow_private)
            if reason is not None:
                return f"{reason} ({kind})"
            if kind == "6to4":  # what is reached is the IPv4 host; Python's flags for 2002::/16
                return None     # changed in 3.12.4 / 3.13 (is_private), so they must not decide
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv4Address) and ip.is_reserved:
        return "reserved"
    if ip.is_global and not ip.is_private and not any(ip in net for net in _NON_PUBLIC if net.version == ip.version):
        return None
    if allow_private:
        return None
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_private:
        return "private"
    if ip.is_reserved:
        return "reserved"
    return "not globally routable"


# -- URLs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A checked remote URL, in the parts the fetch needs."""

    scheme: str
    host: str  # normalized (see normalize_host)
    port: int
    target: str  # path and query, as sent

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.authority}{self.target}"

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def is_remote_url(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def check_url(url: str, cfg: "RemoteImagesConfig", where: str, *, redirect: bool = False) -> Target:
    """Checks a remote image URL against the config without any I/O (rule 1 of the module doc)."""
    via = "the image URL redirected to" if redirect else "image URL"
    if not cfg.enabled:
        raise BadRequest(
            f"{where}: remote image URLs are disabled on this server (an operator enables them with "
            "`remote_images = true` in the [limits] section of the config); send the image inline as a data: URL "
            "(data:image/png;base64,...)", param=where, code="remote_images_disabled")
    if len(url) > MAX_URL_CHARS:
        raise BadRequest(f"{where}: image URL is longer than {MAX_URL_CHARS} characters", param=where,
                         code="invalid_image_url")
    if not url.isascii() or any(c <= " " or c in "\\\x7f" for c in url):
        raise BadRequest(f"{where}: {via} a URL with spaces, control or non-ASCII characters; "
                         "percent-encode the path and punycode the host", param=where, code="invalid_image_url")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise BadRequest(f"{where}: {via} a malformed URL ({e})", param=where, code="invalid_image_url") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise BadRequest(f"{where}: {via} a {scheme or 'relative'!r} URL; only http(s) images are fetched",
                         param=where, code="invalid_image_url")
    if scheme == "http" and not cfg.allow_http:
        raise BadRequest(f"{where}: {via} a plain http:// URL; this server fetches https:// images only "
                         "(`remote_image_allow_http` in [limits])", param=where, code="invalid_image_url")
    if "@" in parts.netloc:
        raise BadRequest(f"{where}: credentials in image URLs are not accepted", param=where, code="invalid_image_url")
    host = normalize_host(parts.hostname or "")
    if host is None or port == 0:
        raise BadRequest(f"{where}: {via} a URL without a valid host name", param=where, code="invalid_image_url")
    if not cfg.allowed_hosts:
        raise Forbidden(f"{where}: no image host is allowed on this server ([limits] remote_image_hosts "
                        "is empty)", param=where, code="image_host_not_allowed")
    if not host_allowed(host, cfg.allowed_hosts):
        raise Forbidden(f"{where}: {via} host {host!r}, which is not on this server's image host "
                        "allow-list ([limits] remote_image_hosts)", param=where, code="image_host_not_allowed")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return Target(scheme, host, port or (443 if scheme == "https" else 80), target)


# -- fetching -------------------------------------------------------------------------------


class _FetchFailed(Exception):
    """Internal: an upstream failure, turned into a 400 with a short, non-revealing reason."""


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    import certifi

    ctx = ssl.create_default_context()
    ctx.load_verify_locations(certifi.where())
    return ctx


class _VettingBackend(httpcore.AsyncNetworkBackend):
    """Resolves the host itself, refuses it if any address is forbidden, connects to a vetted one."""

    def __init__(self, cfg: "RemoteImagesConfig", where: str, log):
        self.cfg = cfg
        self.where = where
        self.log = log
        self.inner = httpcore.TrioBackend()
        self.connected: str | None = None

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None, socket_options=None) -> httpcore.AsyncNetworkStream:
        name = normalize_host(host)
        if name is None or not host_allowed(name, self.cfg.allowed_hosts):  # never expected: check_url ran
            raise Forbidden(f"{self.where}: image host {host!r} is not allowed", param=self.where,
                            code="image_host_not_allowed")
        try:
            infos = await trio.socket.getaddrinfo(name, port, type=trio.socket.SOCK_STREAM)
        except OSError:
            raise _FetchFailed(f"host {name!r} could not be resolved") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        if not addresses:
            raise _FetchFailed(f"host {name!r} could not be resolved")
        for address in addresses:
            reason = address_refusal(address, self.cfg.allow_private)
            if reason is not None:
                self.log.info("image.fetch_refused", host=name, address=address, reason=reason)
                raise Forbidden(
                    f"{self.where}: image host {name!r} resolves to a {reason} address; this server only "
                    "fetches from public addresses (`remote_image_allow_private` in [limits])",
                    param=self.where, code="image_address_not_allowed")
        last: Exception | None = None
        for address in addresses:  # getaddrinfo's order (RFC 6724); the deadline bounds the attempts
            try:
                stream = await self.inner.connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                                      socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                last = e
                continue
            self.connected = address
            return stream
        raise _FetchFailed(f"could not connect to host {name!r}") from last

    async def connect_unix_socket(self, *args, **kwargs):  # never from a URL
        raise _FetchFailed("unix sockets are not used")

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1").strip()
    return None


async def fetch_image(url: str, limits: "LimitsConfig", where: str, log) -> bytes:
    """The bytes of a remote image, under every rule of the module docstring (else a typed error).

    Cancellation (the caller went away) propagates as `trio.Cancelled`; every socket is closed.
    """
    cfg = limits.remote_image_policy
    cap = cfg.max_bytes
    target = check_url(url, cfg, where)
    backend = _VettingBackend(cfg, where, log)
    t0 = time.monotonic()
    hops = 0
    try:
        with trio.move_on_after(cfg.timeout_s):
            async with httpcore.AsyncConnectionPool(ssl_context=_ssl_context(), max_connections=1, retries=0,
                                                    http1=True, http2=False, network_backend=backend) as pool:
                while True:
                    headers = [(b"Host", target.authority.encode()), (b"User-Agent", b"mmserve"),
                               (b"Accept", b"image/*"), (b"Accept-Encoding", b"identity")]
                    url_obj = httpcore.URL(scheme=target.scheme.encode(), host=target.host.encode(),
                                           port=target.port, target=target.target.encode())
                    async with pool.stream(b"GET", url_obj, headers=headers) as resp:
                        if resp.status in REDIRECTS:
                            location = _header(resp.headers, b"location")
                            if not location:
                                raise _FetchFailed(f"HTTP {resp.status} without a Location from {target.host!r}")
                            if hops >= cfg.max_redirects:
                                raise _FetchFailed(f"more than {cfg.max_redirects} redirects")
                            hops += 1
                            target = check_url(urljoin(target.url, location), cfg, where, redirect=True)
                            continue
                        if not 200 <= resp.status < 300:
                            raise _FetchFailed(f"HTTP {resp.status} from {target.host!r}")
                        body = await _read_capped(resp, cap, where)
                    log.info("image.fetched", host=target.host, address=backend.connected, bytes=len(body),
                             redirects=hops, fetch_s=round(time.monotonic() - t0, 6))
                    return body
        log.info("image.fetch_failed", host=target.host, reason="timeout", fetch_s=round(time.monotonic() - t0, 6))
        raise UnprocessableImage(f"{where}: could not fetch image: no complete answer from {target.host!r} within "
                                 f"{cfg.timeout_s:g}s", param=where, code="image_fetch_timeout")
    except _FetchFailed as e:
        log.info("image.fetch_failed", host=target.host, reason=str(e), fetch_s=round(time.monotonic() - t0, 6))
        raise UnprocessableImage(f"{where}: could not fetch image: {e}", param=where, code="image_fetch_failed") from None
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException, httpcore.UnsupportedProtocol,
            OSError) as e:
        reason = "TLS handshake failed" if _is_tls(e) else f"{type(e).__name__} talking to {target.host!r}"
        log.info("image.fetch_failed", host=target.host, reason=reason, error=repr(e),
                 fetch_s=round(time.monotonic() - t0, 6))
        raise UnprocessableImage(f"{where}: could not fetch image: {reason}", param=where,
                                 code="image_fetch_failed") from None
    except MMServeError as e:
        log.info("image.fetch_failed", host=target.host, reason=e.message, status=e.status,
                 fetch_s=round(time.monotonic() - t0, 6))
        raise


def _is_tls(e: BaseException) -> bool:
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, ssl.SSLError):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


async def _read_capped(resp: httpcore.Response, cap: int, where: str) -> bytes:
    too_large = PayloadTooLarge(f"{where}: remote image is larger than the {cap} byte limit", param=where)
    length = _header(resp.headers, b"content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise too_large
    body = bytearray()
    async for chunk in resp.aiter_stream():
        body += chunk
        if len(body) > cap:
            raise too_large
    return bytes(body)


async def fetch_images(urls: dict, limits: "LimitsConfig", log, limiter: trio.CapacityLimiter | None = None) -> dict:
    """Fetches `{key: (url, where)}` concurrently; `{key: bytes}`, or the first error raised.

    `limiter` (shared by all requests) bounds the downloads in progress; `timeout_s` starts when a
    download gets its turn. One failure cancels the other fetches. An unexpected exception is not
    hidden: it propagates.
    """
    out: dict = {}
    errors: list[MMServeError] = []

    async def one(key, url: str, where: str, nursery: trio.Nursery) -> None:
        try:
            if limiter is None:
                out[key] = await fetch_image(url, limits, where, log)
            else:
                async with limiter:
                    out[key] = await fetch_image(url, limits, where, log)
        except MMServeError as e:
            errors.append(e)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for key, (url, where) in urls.items():
            nursery.start_soon(one, key, url, where, nursery)
    if errors:
        raise errors[0]
    return out
