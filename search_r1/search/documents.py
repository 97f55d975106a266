"""Whole documents for the `open` tool: a corpus passage by id, or a web page by URL, as
cleaned text cut into pages of characters.

- `DocStore` finds a corpus passage by its id (the `id` a /retrieve hit carries); the map from
  id to row is built on the first lookup (one pass over the ids column).
- `fetch_url` gets a page with a time limit and a size limit (bytes read, not announced), keeps
  text types only, and turns HTML into text with the standard library's parser (`html_to_text`:
  scripts, styles and other non-content elements dropped, block elements on their own lines).
  A URL the model wrote must not reach the training cluster's own services: a host that resolves
  to a private, loopback, link-local (cloud metadata), reserved or multicast address is refused,
  at every redirect too, unless `allow_private=True` (an operator's choice: a local test server).
- `paginate` cuts a text into pages of `page_size` characters; pages count from 1.
- `snippet` shortens a passage for search results (the retrieval server's `--snippet_chars`):
  its title line and the first line of its text, cut to a number of characters; /open still
  returns the whole passage, so an agent must open a result to read the rest.
"""

from __future__ import annotations

import html.parser
import ipaddress
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

DEFAULT_PAGE_SIZE = 2000
MAX_PAGE_SIZE = 20000

_SKIP = {"script", "style", "noscript", "template", "svg", "head", "iframe", "object", "canvas"}
_BLOCK = {"p", "div", "br", "li", "ul", "ol", "tr", "table", "section", "article", "header", "footer",
          "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "title", "nav", "main", "dd", "dt", "hr"}


@dataclass(frozen=True)
class Page:
    """One page of a document's text."""

    text: str
    page: int
    num_pages: int

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "page": self.page, "num_pages": self.num_pages}


def paginate(text: str, page: int = 1, page_size: int = DEFAULT_PAGE_SIZE) -> Page:
    """Page `page` (from 1) of `text` cut into `page_size`-character pages; a bad page is a ValueError."""
    if not isinstance(page_size, int) or not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be an integer in [1, {MAX_PAGE_SIZE}], got {page_size!r}")
    num_pages = max(1, -(-len(text) // page_size))
    if not isinstance(page, int) or isinstance(page, bool) or not 1 <= page <= num_pages:
        raise ValueError(f"page must be an integer in [1, {num_pages}] (the document has {num_pages} pages), "
                         f"got {page!r}")
    return Page(text=text[(page - 1) * page_size: page * page_size], page=page, num_pages=num_pages)


def render_page(title: str, page: Page, source: str) -> str:
    """The `open` tool's text for one page: a header naming the page, then the page's text."""
    head = f"{title}\n" if title else ""
    more = f" (open page {page.page + 1} for more)" if page.page < page.num_pages else ""
    return f"{head}[{source}, page {page.page} of {page.num_pages}{more}]\n{page.text}"


def snippet(contents: str, max_chars: int) -> str:
    """`contents` ("\"Title\"\nbody", the corpus layout) as a search result's snippet: the title
    line as stored, then the body's first line cut to `max_chars` characters, with " ..." when
    anything was left out. A one-line passage (no title line) is that line, cut the same way."""
    if not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars < 1:
        raise ValueError(f"snippet max_chars must be an integer >= 1, got {max_chars!r}")
    first, sep, rest = contents.partition("\n")
    body = rest if sep else contents
    line, more, _ = body.partition("\n")
    cut = line[:max_chars].rstrip()
    if more or len(line) > max_chars:
        cut += " ..."
    return f"{first}\n{cut}" if sep else cut


class DocStore:
    """Corpus passages by id (`Corpus` rows: id, contents)."""

    def __init__(self, corpus: Any) -> None:
        self.corpus = corpus
        self._rows: dict[str, int] | None = None

    def _index(self) -> dict[str, int]:
        if self._rows is None:
            rows: dict[str, int] = {}
            row = 0
            for ids, _ in self.corpus.iter_batches():
                for doc_id in ids:
                    rows.setdefault(str(doc_id), row)
                    row += 1
            self._rows = rows
        return self._rows

    def get(self, doc_id: str) -> str | None:
        """The passage's contents, or None when no passage has that id."""
        row = self._index().get(str(doc_id))
        if row is None:
            return None
        return self.corpus.get_fields([row])[1][0]


class _TextExtractor(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in _SKIP:
            self.skip += 1
        if tag == "title":
            self._in_title = True
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP and self.skip:
            self.skip -= 1
        if tag == "title":
            self._in_title = False
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._in_title and not self.title:
            self.title = data.strip()
        if not self.skip:
            self.parts.append(data)


def html_to_text(markup: str) -> tuple[str, str]:
    """(title, text) of an HTML page: visible text, one block a line, runs of blanks collapsed."""
    parser = _TextExtractor()
    parser.feed(markup)
    parser.close()
    lines = [re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in "".join(parser.parts).split("\n")]
    return parser.title, "\n".join(line for line in lines if line)


class FetchError(Exception):
    """A page that could not be fetched; the message is what the model reads."""


def blocked_address(url: str) -> str | None:
    """The private, loopback, link-local, reserved, multicast or unspecified address `url`'s host
    resolves to (the first such), or None when every address it resolves to is public."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        infos = socket.getaddrinfo(host, parts.port or (443 if parts.scheme == "https" else 80),
                                   proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as err:
        raise FetchError(f"the host of {url} could not be resolved ({err})") from err
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not address.is_global or address.is_multicast:
            return str(address)
    return None


def _check_address(url: str, allow_private: bool) -> None:
    if allow_private:
        return
    address = blocked_address(url)
    if address is not None:
        raise FetchError(f"the page at {url} is on a private or local address ({address}); the open tool "
                         "reaches public addresses only (config allow_private_addresses: true to change it)")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an http(s) URL whose host passes the address check."""

    def __init__(self, allow_private: bool) -> None:
        self.allow_private = allow_private

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        if not re.match(r"^https?://", newurl):
            raise FetchError(f"the page at {req.full_url} redirects to {newurl!r}, not an http(s) URL")
        _check_address(newurl, self.allow_private)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_url(url: str, timeout: float = 10.0, max_bytes: int = 2_000_000,
              headers: dict[str, str] | None = None, allow_private: bool = False) -> tuple[str, str]:
    """(title, text) of the page at `url` (http/https only, a public address unless `allow_private`,
    redirects included), read within `timeout` seconds and `max_bytes` bytes; HTML is cleaned,
    other text types are kept as they are."""
    if not re.match(r"^https?://", url or ""):
        raise FetchError(f"only http:// and https:// URLs can be opened, got {url!r}")
    _check_address(url, allow_private)
    request = urllib.request.Request(url, headers={"User-Agent": "search-r1-open/1.0", **(headers or {})})
    opener = urllib.request.build_opener(_CheckedRedirects(allow_private))
    try:
        with opener.open(request, timeout=timeout) as response:  # scheme and address checked above
            kind = response.headers.get_content_type()
            if not (kind.startswith("text/") or kind in ("application/xhtml+xml", "application/json")):
                raise FetchError(f"the page at {url} is {kind}, not text")
            body = b""
            deadline = time.monotonic() + timeout
            while len(body) <= max_bytes:
                chunk = response.read(min(65536, max_bytes + 1 - len(body)))
                if not chunk:
                    break
                body += chunk
                if time.monotonic() > deadline:
                    raise FetchError(f"the page at {url} took longer than {timeout} s to read")
            charset = response.headers.get_content_charset() or "utf-8"
    except FetchError:
        raise
    except urllib.error.HTTPError as err:
        raise FetchError(f"the page at {url} answered HTTP {err.code}") from err
    except (urllib.error.URLError, TimeoutError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise FetchError(f"the page at {url} could not be fetched ({type(reason).__name__}: {reason})") from err
    if len(body) > max_bytes:
        raise FetchError(f"the page at {url} is larger than the {max_bytes}-byte limit")
    text = body.decode(charset, errors="replace")
    if kind in ("text/html", "application/xhtml+xml"):
        return html_to_text(text)
    return "", text.strip()


__all__ = ["DEFAULT_PAGE_SIZE", "MAX_PAGE_SIZE", "DocStore", "FetchError", "Page", "fetch_url", "html_to_text",
           "paginate", "render_page"]
