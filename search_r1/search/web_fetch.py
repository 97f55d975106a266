"""Getting a web page whose URL a policy wrote (the `open` tool's `fetcher: direct` and `jina`):
the URL, every address it reaches and the time it takes are treated as hostile.

- The URL: http(s) only; the host is a DNS name (IDNA-encoded when not ASCII) or an IP literal,
  never percent-encoded (`127%2e0%2e0%2e1.x` would be checked as written and reached decoded), no
  credentials, a valid port; the path and query are percent-quoted (spaces, non-ASCII characters).
- Addresses: the host is resolved once; unless the operator allows private addresses, every address
  it resolves to must be public (`address_refused`: private, loopback, link-local / cloud metadata,
  shared, reserved, multicast or unspecified, and the IPv4 address inside an IPv4-mapped, NAT64
  (64:ff9b::/96, 64:ff9b:1::/48) or 6to4 (2002::/16) address judged as itself). The socket connects
  to an address that was checked (a second lookup could answer differently: DNS rebinding), and the
  peer it reached is checked again. HTTPS verifies the certificate against the host's name (SNI).
- Redirects are followed here (at most `MAX_REDIRECTS`), each hop checked the same way; the
  caller's extra headers (an API key) go to the first origin only.
- Time: one wall-clock deadline covers the lookup, the connection, TLS, the headers and the body.
  Every socket read waits only for the time left (a body sent a byte at a time cannot stretch it).
- Size: a body larger than `max_bytes` (announced or read) is refused; text types only.
Proxies from the environment are not used: the address check is about the address reached.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import re
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass

MAX_REDIRECTS = 5
TEXT_TYPES = ("application/xhtml+xml", "application/json")
_REDIRECT_CODES = (301, 302, 303, 307, 308)
_DNS_NAME = re.compile(r"^[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?$")
# RFC 3986 characters a path or query may hold as they are ('%' keeps escapes the URL already has)
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"
_QUERY_SAFE = _PATH_SAFE + "?"
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class FetchError(Exception):
    """A page that could not be fetched; the message is what the model reads."""


class _Late(Exception):
    """The fetch's deadline passed."""


@dataclass(frozen=True)
class Target:
    """A URL taken apart for one request: `host` is ASCII (IDNA), without brackets."""

    url: str
    scheme: str
    host: str
    port: int
    path: str

    @property
    def origin(self) -> tuple[str, str, int]:
        return self.scheme, self.host, self.port

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


@dataclass(frozen=True)
class Fetched:
    """A page's bytes as it came: the URL it came from (after redirects), its media type and charset."""

    url: str
    content_type: str
    charset: str | None
    body: bytes


def parse_url(url: str) -> Target:
    """`url` as a Target, or a FetchError naming what is wrong with it."""
    if not isinstance(url, str) or not re.match(r"^https?://", url.strip(), re.IGNORECASE):
        raise FetchError(f"only http:// and https:// URLs can be opened, got {url!r}")
    url = url.strip()
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise FetchError(f"the URL {url!r} is malformed ({err})") from None
    if parts.username is not None or parts.password is not None:
        raise FetchError(f"the URL {url!r} holds credentials (user@host); they are not sent")
    host = parts.hostname or ""
    if not host:
        raise FetchError(f"the URL {url!r} has no host")
    if "%" in host:
        raise FetchError(f"the URL {url!r} has a percent-encoded host or an IPv6 zone; write the host plainly")
    host = _ascii_host(host, url)
    scheme = parts.scheme.lower()
    path = urllib.parse.quote(parts.path or "/", safe=_PATH_SAFE)
    if parts.query:
        path += "?" + urllib.parse.quote(parts.query, safe=_QUERY_SAFE)
    return Target(url=url, scheme=scheme, host=host, port=port or (443 if scheme == "https" else 80), path=path)


def _ascii_host(host: str, url: str) -> str:
    """An IP literal as `ipaddress` writes it, or a DNS name in ASCII (IDNA for a non-ASCII name)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise FetchError(f"the host of {url!r} is not a valid domain name") from None
    if not _DNS_NAME.match(host) or len(host) > 253:
        raise FetchError(f"the host of {url!r} is not a valid domain name or IP address")
    return host


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if any(address in net for net in _NAT64):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_refused(address: _Address | str) -> bool:
    """True when `address` is not one the open tool may reach: not globally routable, multicast,
    reserved, or an IPv6 address wrapping such an IPv4 one (mapped, NAT64, 6to4)."""
    if isinstance(address, str):
        address = ipaddress.ip_address(address.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_ipv4(address)
        if inner is not None:
            return address_refused(inner)
        if address in _IPV4_COMPATIBLE or address.is_site_local:   # deprecated forms (::a.b.c.d, fec0::/10)
            return True
    return (not address.is_global or address.is_multicast or address.is_reserved or address.is_loopback
            or address.is_link_local or address.is_unspecified)


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Late
    return left


def _resolve(host: str, port: int, deadline: float) -> list[str]:
    """The addresses `host` resolves to, looked up once, within the deadline (a resolver that hangs is
    left behind in its daemon thread)."""
    answer: list = []

    def lookup() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as err:
            answer.append(err)

    worker = threading.Thread(target=lookup, name="open-dns", daemon=True)
    worker.start()
    worker.join(_time_left(deadline))
    if not answer:
        raise _Late
    if isinstance(answer[0], Exception):
        raise FetchError(f"the host {host} could not be resolved ({answer[0]})")
    addresses = []
    for info in answer[0]:
        address = info[4][0]
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise FetchError(f"the host {host} could not be resolved (no address)")
    return addresses


def _refuse_private(target: Target, address: str) -> FetchError:
    return FetchError(f"the page at {target.url} is on a private or local address ({address}); the open tool "
                      "reaches public addresses only (config allow_private_addresses: true to change it)")


def blocked_address(url: str) -> str | None:
    """The first address `url`'s host resolves to that the open tool may not reach, or None when
    every address is public."""
    target = parse_url(url)
    for address in _resolve(target.host, target.port, time.monotonic() + 30):
        if address_refused(address):
            return address.split("%")[0]
    return None


def _connect(target: Target, allow_private: bool, deadline: float) -> socket.socket:
    """A socket connected to one of the addresses `target.host` resolved to (each checked first), its
    peer checked again; TLS-wrapped for https."""
    addresses = _resolve(target.host, target.port, deadline)
    if not allow_private:
        for address in addresses:
            if address_refused(address):
                raise _refuse_private(target, address.split("%")[0])
    failure: OSError | None = None
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(_time_left(deadline))
            sock.connect((address, target.port))
            peer = sock.getpeername()[0]
        except TimeoutError:
            sock.close()
            raise _Late from None
        except OSError as err:
            sock.close()
            failure = err
            continue
        except BaseException:
            sock.close()
            raise
        if ipaddress.ip_address(peer.split("%")[0]) != ipaddress.ip_address(address.split("%")[0]) or (
                not allow_private and address_refused(peer)):
            sock.close()
            raise FetchError(f"the connection for {target.url} reached {peer}, not the checked address {address}; "
                             "refused")
        break
    else:
        raise FetchError(f"the page at {target.url} could not be fetched (no connection: {failure})")
    if target.scheme != "https":
        return sock
    try:
        sock.settimeout(_time_left(deadline))
        return ssl_context().wrap_socket(sock, server_hostname=target.host)   # the handshake is one deadline
    except BaseException:
        sock.close()
        raise


def ssl_context() -> ssl.SSLContext:
    """The TLS settings of a fetch: the system's trusted certificates, hostnames verified."""
    return ssl.create_default_context()


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes, each read waiting only for the time left before the deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.sock.settimeout(_time_left(self.deadline))
        return self.sock.recv_into(buffer)


class _DeadlineSocket:
    """What http.client needs of a socket (sendall, makefile, close), bounded by one deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def sendall(self, data: bytes) -> None:
        self.sock.settimeout(_time_left(self.deadline))
        self.sock.sendall(data)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self.sock, self.deadline))

    def close(self) -> None:
        pass   # http.client closes its socket once the headers say so, before the body is read; the fetch
        # closes the real socket when it is done with the response


def _request(target: Target, headers: dict[str, str], sock: socket.socket,
             deadline: float) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection(target.host, target.port)
    conn.sock = _DeadlineSocket(sock, deadline)   # already connected to the checked address
    conn.putrequest("GET", target.path, skip_host=True)
    for name, value in {"Host": target.host_header, "User-Agent": "search-r1-open/1.0", **headers}.items():
        conn.putheader(name, value)
    conn.endheaders()
    return conn, conn.getresponse()


def _read_body(response: http.client.HTTPResponse, target: Target, max_bytes: int) -> bytes:
    announced = response.getheader("Content-Length", "")
    if announced.strip().isdigit() and int(announced) > max_bytes:
        raise FetchError(f"the page at {target.url} is larger than the {max_bytes}-byte limit")
    body = bytearray()
    while len(body) <= max_bytes:
        chunk = response.read1(min(65536, max_bytes + 1 - len(body)))   # one socket read at most
        if not chunk:
            break
        body += chunk
    if len(body) > max_bytes:
        raise FetchError(f"the page at {target.url} is larger than the {max_bytes}-byte limit")
    return bytes(body)


def _one_hop(target: Target, headers: dict[str, str], allow_private: bool, max_bytes: int,
             deadline: float) -> Fetched | str:
    """The page at `target`, or the URL its redirect points to."""
    sock = _connect(target, allow_private, deadline)
    conn = None
    try:
        conn, response = _request(target, headers, sock, deadline)
        location = response.getheader("Location")
        if response.status in _REDIRECT_CODES and location:
            return urllib.parse.urljoin(target.url, location.strip())
        if not 200 <= response.status < 300:
            raise FetchError(f"the page at {target.url} answered HTTP {response.status}")
        kind = response.headers.get_content_type()
        if not (kind.startswith("text/") or kind in TEXT_TYPES):
            raise FetchError(f"the page at {target.url} is {kind}, not text")
        encoding = (response.getheader("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            raise FetchError(f"the page at {target.url} came compressed ({encoding}), which is not read")
        body = _read_body(response, target, max_bytes)
        try:
            charset = response.headers.get_content_charset()
        except (LookupError, ValueError):
            charset = None
        return Fetched(url=target.url, content_type=kind, charset=charset, body=body)
    finally:
        if conn is not None:
            conn.close()
        sock.close()


def fetch(url: str, timeout: float = 10.0, max_bytes: int = 2_000_000, headers: dict[str, str] | None = None,
          allow_private: bool = False, deadline: float | None = None) -> Fetched:
    """The page at `url` (redirects followed, each hop's address checked unless `allow_private`), all
    within `timeout` seconds (or by the monotonic `deadline`) and `max_bytes` bytes; `headers` go to
    the first origin only. Anything that goes wrong is a FetchError whose message names the URL."""
    deadline = time.monotonic() + timeout if deadline is None else deadline
    target = parse_url(url)
    first_origin = target.origin
    try:
        for _ in range(MAX_REDIRECTS + 1):
            sent = dict(headers or {}) if target.origin == first_origin else {}
            answer = _one_hop(target, sent, allow_private, max_bytes, deadline)
            if isinstance(answer, Fetched):
                return answer
            if not re.match(r"^https?://", answer, re.IGNORECASE):
                raise FetchError(f"the page at {target.url} redirects to {answer!r}, not an http(s) URL")
            target = parse_url(answer)
    except (_Late, TimeoutError):
        raise FetchError(f"the page at {url} could not be fetched: it took longer than {timeout} s to read") from None
    except ssl.SSLError as err:
        raise FetchError(f"the page at {url} could not be fetched (TLS: {err.reason or err})") from None
    except (OSError, http.client.HTTPException, ValueError, UnicodeError) as err:
        # a server's bad status line comes back whole in the exception (up to 64 KiB): cut
        raise FetchError(f"the page at {url} could not be fetched ({type(err).__name__}: {str(err)[:200]})") from None
    raise FetchError(f"the page at {url} redirects more than {MAX_REDIRECTS} times")


__all__ = ["MAX_REDIRECTS", "FetchError", "Fetched", "Target", "address_refused", "blocked_address", "fetch",
           "parse_url", "ssl_context"]
