"""Remote image URLs, the rules without the network: addresses, host names, the allow-list, URL
checks at parse time, and the `[limits.remote_images]` config."""

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.errors import BadRequest, Forbidden
from mmserve.config import Config, LimitsConfig, RemoteImagesConfig, config_from_dict
from mmserve.config.hosts import _NUMERIC_LABEL, host_allowed, normalize_host, normalize_host_pattern
from mmserve.inputs.remote_images import address_refusal, check_url
from mmserve.inputs.request import parse_chat_request

NON_PUBLIC_V4 = ["0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
                 "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24",
                 "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32"]
NON_PUBLIC_V6 = ["::/128", "::1/128", "fc00::/7", "fe80::/10", "ff00::/8", "2001:db8::/32", "::ffff:0:0/96"]
ALWAYS_REFUSED_V4 = ["0.0.0.0/32", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32"]


def in_network(cidr: str):
    net = ipaddress.ip_network(cidr)
    return st.integers(0, net.num_addresses - 1).map(lambda i: net.network_address + i)


non_public_v4 = st.sampled_from(NON_PUBLIC_V4).flatmap(in_network)
# drawn octet by octet, the first one below multicast: hypothesis favours an integer's bounds, and
# drawn as one 32-bit integer most of its examples (0.x, 255.x) were filtered out (a failed health check)
public_v4 = st.tuples(st.integers(1, 223), *[st.integers(0, 255)] * 3).map(
    lambda octets: ipaddress.IPv4Address(".".join(map(str, octets)))).filter(
    lambda ip: ip.is_global and not ip.is_multicast and not any(ip in ipaddress.ip_network(n) for n in NON_PUBLIC_V4))


def embeddings(v4: ipaddress.IPv4Address) -> list[ipaddress.IPv6Address]:
    """The IPv6 forms that carry an IPv4 address: mapped, compatible, 6to4, NAT64, Teredo."""
    n = int(v4)
    return [ipaddress.IPv6Address(f"::ffff:{v4}"), ipaddress.IPv6Address(n) if n > 1 else None,
            ipaddress.IPv6Address((0x2002 << 112) | (n << 80)), ipaddress.IPv6Address(f"64:ff9b::{v4}"),
            ipaddress.IPv6Address((0x20010000 << 96) | (n ^ 0xFFFFFFFF))]


@given(non_public_v4)
def test_every_non_public_ipv4_is_refused_and_so_is_any_ipv6_form_of_it(ip):
    assert address_refusal(ip) is not None
    assert address_refusal(str(ip)) is not None
    for v6 in embeddings(ip):
        if v6 is not None:
            assert address_refusal(v6) is not None, v6


@given(st.sampled_from(NON_PUBLIC_V6).flatmap(in_network))
def test_every_non_public_ipv6_is_refused(ip):
    assert address_refusal(ip) is not None


SIX_TO_FOUR = ipaddress.ip_network("2002::/16")


def _allowed_only_when_globally_routable_unicast(ip, non_public):
    if ip.version == 6 and ip in SIX_TO_FOUR:  # judged by its IPv4 host (Python's own flags for
        ip = ip.sixtofour                      # 2002::/16 differ between releases)
        non_public = NON_PUBLIC_V4
    if address_refusal(ip) is None:
        assert ip.is_global and not ip.is_multicast and not ip.is_private
    if any(ip in ipaddress.ip_network(n) for n in non_public) or not ip.is_global:
        assert address_refusal(ip) is not None


@pytest.mark.parametrize("address, reason", [
    ("2002:808:808::", None), ("2002:a00:1::", "private (6to4)"), ("2002:7f00:1::", "loopback (6to4)")])
def test_6to4_is_judged_by_its_ipv4_host_on_every_python(address, reason):
    assert address_refusal(address) == reason


@given(st.integers(0, 2**80 - 1).map(lambda low: ipaddress.IPv6Address((0x2002 << 112) | low)))
def test_6to4_addresses_allowed_only_for_a_public_ipv4_host(ip):
    _allowed_only_when_globally_routable_unicast(ip, NON_PUBLIC_V6)


@given(st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address))
@settings(max_examples=500)
def test_ipv4_allowed_only_when_globally_routable_unicast(ip):
    _allowed_only_when_globally_routable_unicast(ip, NON_PUBLIC_V4)


@given(st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address))
@settings(max_examples=500)
def test_ipv6_allowed_only_when_globally_routable_unicast(ip):
    _allowed_only_when_globally_routable_unicast(ip, NON_PUBLIC_V6)


@given(public_v4)
def test_public_addresses_pass_also_behind_6to4_and_nat64(ip):
    assert address_refusal(ip) is None
    assert address_refusal(embeddings(ip)[2]) is None  # 6to4
    assert address_refusal(embeddings(ip)[3]) is None  # NAT64


@pytest.mark.parametrize("address, reason", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.10", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("fe80::1%eth0", "link-local"),
    ("fd00::1", "private"), ("0.0.0.0", "unspecified"), ("::", "unspecified"), ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"), ("255.255.255.255", "reserved"), ("100.64.0.1", "not globally routable"),
    ("::ffff:127.0.0.1", "loopback (IPv4-mapped)"), ("::ffff:10.0.0.1", "private (IPv4-mapped)"),
    ("2002:7f00:1::", "loopback (6to4)"), ("64:ff9b::a9fe:a9fe", "link-local (NAT64)"),
    ("::7f00:1", "loopback (IPv4-compatible)"),
    ("8.8.8.8", None), ("2606:4700:4700::1111", None), ("2a00:1450:4001:80b::200e", None),
])
def test_address_reasons(address, reason):
    assert address_refusal(address) == reason


@given(st.sampled_from(["127.0.0.0/8", "10.0.0.0/8", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10"]).flatmap(in_network))
def test_allow_private_admits_private_unicast(ip):
    assert address_refusal(ip, allow_private=True) is None
    assert address_refusal(ipaddress.IPv6Address(f"::ffff:{ip}"), allow_private=True) is None


@given(st.sampled_from(ALWAYS_REFUSED_V4).flatmap(in_network))
def test_allow_private_still_refuses_unspecified_multicast_reserved(ip):
    assert address_refusal(ip, allow_private=True) is not None
    assert address_refusal(ipaddress.IPv6Address(f"::ffff:{ip}"), allow_private=True) is not None


def test_allow_private_ipv6():
    assert address_refusal("::1", allow_private=True) is None
    assert address_refusal("fd12::1", allow_private=True) is None
    assert address_refusal("ff02::1", allow_private=True) == "multicast"
    assert address_refusal("::", allow_private=True) == "unspecified"


# -- host names and the allow-list --------------------------------------------------------------


@pytest.mark.parametrize("raw, norm", [
    ("Example.COM", "example.com"), ("example.com.", "example.com"), ("[::1]", "::1"), ("0:0::1", "::1"),
    ("127.0.0.1", "127.0.0.1"), ("a_b.example", "a_b.example"), ("xn--r8jz45g.jp", "xn--r8jz45g.jp"),
    ("127.1", None), ("2130706433", None), ("0x7f.1", None), ("0x7f000001", None), ("a..b", None),
    ("exa mple.com", None), ("ex%41.com", None), ("例え.jp", None), ("-a.com", None), ("", None),
    ("fe80::1%25eth0", None), ("a" * 64 + ".com", None), ("foo.123", None),
])
def test_normalize_host(raw, norm):
    assert normalize_host(raw) == norm


@pytest.mark.parametrize("bad", ["*", "*.com", "*.127.0.0.1", "https://x.com", "x.com:443", "x.com/a", "a.*.com",
                                 "*x.com", "", " ", "user@x.com"])
def test_bad_allow_list_entries_are_refused(bad):
    with pytest.raises(ValueError, match="is not a host name"):
        normalize_host_pattern(bad)
    with pytest.raises(ValueError, match=r"config \[limits\] remote_image_hosts: entry"):
        LimitsConfig(remote_image_hosts=(bad,))


label = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?\Z").filter(lambda s: not s.isdigit())
# a last label a resolver would read as a number (123, 0x7f) makes no host name: see normalize_host
top_label = label.filter(lambda s: not _NUMERIC_LABEL.match(s))
domain = st.tuples(st.lists(label, min_size=1, max_size=3), top_label).map(lambda p: ".".join([*p[0], p[1]]))


@given(domain, st.lists(label, min_size=1, max_size=3).map(".".join), label)
def test_wildcard_matches_strict_subdomains_only(dom, sub, prefix):
    patterns = (normalize_host_pattern("*." + dom),)
    assert host_allowed(f"{sub}.{dom}", patterns)
    assert not host_allowed(dom, patterns)
    assert not host_allowed(prefix + dom, patterns)  # no label boundary: evilexample.com
    other = f"{dom}.{prefix}"  # dom inside, not at the end (unless that is itself a subdomain)
    assert host_allowed(other, patterns) == other.endswith("." + dom)


@given(domain, domain)
def test_exact_entries_match_only_themselves(a, b):
    assert host_allowed(a, (a,))
    assert host_allowed(b, (a,)) == (a == b)
    assert not host_allowed(f"x.{a}", (a,))


def test_ip_literals_never_match_a_wildcard():
    assert not host_allowed("1.2.3.4", ("*.3.4",))
    assert host_allowed("::1", (normalize_host_pattern("[0::1]"),))


# -- URLs -----------------------------------------------------------------------------------------


def cfg(**kw) -> RemoteImagesConfig:
    return RemoteImagesConfig(**{"enabled": True, "allowed_hosts": ("images.example.com", "*.cdn.example", "::1"), **kw})


def test_disabled_names_the_config_key():
    with pytest.raises(BadRequest) as e:
        check_url("https://images.example.com/a.png", RemoteImagesConfig(), "w")
    assert e.value.code == "remote_images_disabled"
    assert "remote_images = true" in e.value.message and "[limits]" in e.value.message
    assert "data:" in e.value.message


def test_empty_allow_list_allows_nothing_and_says_so():
    with pytest.raises(Forbidden) as e:
        check_url("https://images.example.com/a.png", RemoteImagesConfig(enabled=True), "w")
    assert e.value.status == 403 and e.value.code == "image_host_not_allowed"
    assert "remote_image_hosts is empty" in e.value.message


@pytest.mark.parametrize("url, error, code", [
    ("https://other.example.com/a.png", Forbidden, "image_host_not_allowed"),
    ("https://cdn.example/a.png", Forbidden, "image_host_not_allowed"),
    ("https://images.example.com.evil.net/a.png", Forbidden, "image_host_not_allowed"),
    ("http://images.example.com/a.png", BadRequest, "invalid_image_url"),
    ("https://user:pw@images.example.com/a.png", BadRequest, "invalid_image_url"),
    ("https://images.example.com@evil.net/a.png", BadRequest, "invalid_image_url"),
    ("https://evil.net\\@images.example.com/a.png", BadRequest, "invalid_image_url"),
    ("https://images.example.com:0/a.png", BadRequest, "invalid_image_url"),
    ("https://images.example.com:99999/a.png", BadRequest, "invalid_image_url"),
    ("https://images.example.com/a b.png", BadRequest, "invalid_image_url"),
    ("https://images.example.com/\u00e9.png", BadRequest, "invalid_image_url"),
    ("https://images.example.com/a.png\r\nX: y", BadRequest, "invalid_image_url"),
    ("https:///a.png", BadRequest, "invalid_image_url"),
    ("https://2130706433/a.png", BadRequest, "invalid_image_url"),
    ("https://images.example.com/" + "a" * 9000, BadRequest, "invalid_image_url"),
])
def test_urls_refused_before_any_io(url, error, code):
    with pytest.raises(error) as e:
        check_url(url, cfg(), "w")
    assert e.value.code == code and e.value.param == "w"


def test_accepted_urls_are_taken_apart():
    t = check_url("HTTPS://Images.Example.COM./a/b.png?x=1&y=2#frag", cfg(), "w")
    assert (t.scheme, t.host, t.port, t.target) == ("https", "images.example.com", 443, "/a/b.png?x=1&y=2")
    assert t.authority == "images.example.com" and t.url == "https://images.example.com/a/b.png?x=1&y=2"
    t = check_url("https://a.b.cdn.example:8443", cfg(), "w")
    assert (t.host, t.port, t.target, t.authority) == ("a.b.cdn.example", 8443, "/", "a.b.cdn.example:8443")
    t = check_url("http://[::1]:8080/x.png", cfg(allow_http=True), "w")
    assert (t.host, t.port, t.authority) == ("::1", 8080, "[::1]:8080")


def test_redirect_refusals_say_so():
    with pytest.raises(Forbidden, match="redirected to host 'evil.net'"):
        check_url("https://evil.net/a.png", cfg(), "w", redirect=True)


def body(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What color is the shape?"}]}]}


def test_parser_checks_remote_urls_up_front():
    with pytest.raises(BadRequest) as e:
        parse_chat_request(body("https://images.example.com/a.png"), LimitsConfig(), "m")
    assert e.value.code == "remote_images_disabled"
    limits = LimitsConfig(remote_images=True, remote_image_hosts=("images.example.com",))
    req = parse_chat_request(body("https://images.example.com/a.png"), limits, "m")
    assert req.messages[0].images[0].url == "https://images.example.com/a.png"
    with pytest.raises(Forbidden):
        parse_chat_request(body("https://evil.net/a.png"), limits, "m")
    with pytest.raises(BadRequest, match="data: URL or an http"):
        parse_chat_request(body("ftp://images.example.com/a.png"), limits, "m")


# -- config ---------------------------------------------------------------------------------------


def test_config_keys_parse_validate_and_default():
    c = config_from_dict({"limits": {"max_image_bytes": 1000, "remote_images": True,
                                     "remote_image_hosts": ["Images.Example.com", "*.CDN.example"],
                                     "remote_image_timeout_s": 2}})
    policy = c.limits.remote_image_policy
    assert policy.enabled and policy.allowed_hosts == ("images.example.com", "*.cdn.example")
    assert policy.timeout_s == 2 and policy.max_bytes == 1000  # 0: max_image_bytes
    c2 = c.replace(limits={"remote_image_max_bytes": 10})
    assert c2.limits.remote_image_policy.max_bytes == 10 and c2.limits.max_image_bytes == 1000
    assert not Config().limits.remote_image_policy.enabled and Config().limits.remote_image_policy.allowed_hosts == ()
    for key, bad in (("remote_image_timeout_s", 0), ("remote_image_max_bytes", -1), ("remote_image_max_redirects", -1),
                     ("remote_images", "yes"), ("remote_image_hosts", "example.com"),
                     ("remote_image_fetch_concurrency", 0), ("remote_image_allow_private", 1)):
        with pytest.raises(ValueError, match=key):
            config_from_dict({"limits": {key: bad}})
