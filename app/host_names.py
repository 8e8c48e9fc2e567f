"""--allowed-hosts and --cors-origins items: checked and normalised once, at start.

A Host header is ``name[:port]``; an Origin is ``scheme://name[:port]`` with no
path, lower-cased and without the scheme's default port. Items written the way
a user copies them (``mybox.local:8080``, ``http://localhost:3000/``) match what
clients send instead of never matching.
"""

from __future__ import annotations

import re
from ipaddress import AddressValueError, IPv6Address, ip_address
from typing import NamedTuple

_NAME = re.compile(r"^(\*\.)?[a-z0-9_~%!$&'()+;=-]+(\.[a-z0-9_~%!$&'()+;=-]+)*\.?$")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
HOST_FORMS = "a host name or address, optionally with :port (mybox.local, mybox.local:8080, "
HOST_FORMS += "*.example.com, 192.168.1.5:8080, [::1]:8080)"


class HostPattern(NamedTuple):
    name: str  # lower case; an IPv6 address in brackets, as a Host header writes it
    port: int | None  # None: any port


def _port(text: str, item: str) -> int:
    if not text.isdecimal() or not 0 < int(text) < 65536:
        raise ValueError(f"{item!r}: {text!r} is no port; write {HOST_FORMS}")
    return int(text)


def host_pattern(item: str) -> HostPattern:
    """One --allowed-hosts item ("*" aside) as a name and an optional port;
    ValueError saying what to write instead."""
    text = item.strip().lower()
    if "://" in text or "/" in text:
        raise ValueError(f"{item!r} is a URL, not a Host header value; write {HOST_FORMS}")
    port: int | None = None
    if text.startswith("["):
        address, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{item!r}: write {HOST_FORMS}")
            port = _port(rest[1:], item)
    elif text.count(":") > 1:  # a bare IPv6 address: Host headers bracket it
        address = text
    else:
        name, sep, port_text = text.partition(":")
        if sep:
            port = _port(port_text, item)
        if not _NAME.match(name):
            raise ValueError(f"{item!r}: write {HOST_FORMS}")
        return HostPattern(name, port)
    try:
        IPv6Address(address)
    except AddressValueError:
        raise ValueError(f"{item!r}: {address!r} is no IPv6 address; write {HOST_FORMS}") from None
    return HostPattern(f"[{address}]", port)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` (a --host value) reaches this machine only: an
    address in 127.0.0.0/8 or ::1, an IPv4-mapped one too, or the name localhost
    in any case and with trailing dots. Compared as strings, LOCALHOST or
    127.0.0.2 dropped the DNS-rebinding guard and warned of an open server."""
    try:
        address = ip_address(host)
    except ValueError:
        return host.rstrip(".").lower() == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (not loopback before 3.13)
    return (mapped or address).is_loopback


def host_item(item: str) -> str:
    """An --allowed-hosts item as the server keeps it (checked, lower case)."""
    if item.strip() == "*":
        return "*"
    name, port = host_pattern(item)
    return name if port is None else f"{name}:{port}"


def host_matches(pattern: HostPattern, name: str, port: str | None) -> bool:
    """Whether a parsed Host header (``name`` lower case) is one ``pattern`` allows.
    A Host without a port was sent to its scheme's default one: behind a proxy
    the server cannot tell which, so 80 and 443 both match it."""
    if not (
        name == pattern.name or (pattern.name.startswith("*.") and name.endswith(pattern.name[1:]))
    ):
        return False
    if pattern.port is None:
        return True
    return int(port) == pattern.port if port is not None else pattern.port in (80, 443)


def origin_item(item: str) -> str:
    """A --cors-origins item as browsers send Origin: ``scheme://host[:port]``, lower
    case, no trailing ``/``, no default port ("*" and "null" as they are)."""
    text = item.strip()
    if text in ("*", "null"):
        return text
    scheme, sep, rest = text.partition("://")
    forms = "write scheme://host[:port], e.g. http://localhost:3000"
    if not sep or not scheme or not rest:
        raise ValueError(f"{item!r} is no web origin; {forms}")
    authority, slash, path = rest.partition("/")
    if path or "?" in authority or "#" in authority:  # a page, not an origin
        raise ValueError(f"{item!r} names a path; an origin has none: {forms}")
    scheme, authority = scheme.lower(), authority.lower()
    default = _DEFAULT_PORTS.get(scheme)
    if default is not None and authority.endswith(f":{default}"):
        authority = authority.removesuffix(f":{default}")
    if not authority:
        raise ValueError(f"{item!r} is no web origin; {forms}")
    return f"{scheme}://{authority}"
