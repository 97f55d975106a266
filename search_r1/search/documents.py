"""Whole documents for the `open` tool: a corpus passage by id, or a web page by URL, as
cleaned text cut into pages of characters.

- `DocStore` finds a corpus passage by its id (the `id` a /retrieve hit carries); the map from
  id to row is built on the first lookup (one pass over the ids column).
- `fetch_url` gets a page through `search_r1.search.web_fetch` (one wall-clock deadline for the
  whole fetch and cleaning, a size limit on bytes read, text types only, redirects followed by hand)
  and turns HTML into text with the standard library's parser (`html_to_text`: scripts, styles and
  other non-content elements dropped, block elements on their own lines; at most `MAX_HTML_CHARS`
  characters parsed, stopped at the deadline). A page's declared charset is used only when it is a
  known text encoding (`decode_text`). A URL the model wrote must not reach the training cluster's
  own services: a host resolving to a private, loopback, link-local (cloud metadata), reserved or
  multicast address is refused, at every redirect too, and the connection goes to the address that
  was checked, unless `allow_private=True` (an operator's choice: a local test server).
- `paginate` cuts a text into pages of `page_size` characters; pages count from 1.
- `snippet` shortens a passage for search results (the retrieval server's `--snippet_chars`):
  its title line and the first line of its text, cut to a number of characters; /open still
  returns the whole passage, so an agent must open a result to read the rest.
"""

from __future__ import annotations

import codecs
import html.parser
import re
import time
from dataclasses import dataclass
from typing import Any

from search_r1.search import web_fetch
from search_r1.search.web_fetch import FetchError, blocked_address

DEFAULT_PAGE_SIZE = 2000
MAX_PAGE_SIZE = 20000
# HTML past this many characters is not parsed (html.parser runs at ~1-3 MB/s; the default max_bytes)
MAX_HTML_CHARS = 2_000_000
# the charsets a page may declare (as codecs.lookup names them); any other is read as UTF-8
TEXT_CHARSETS = frozenset(codecs.lookup(name).name for name in (
    "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "ascii", "latin-1", "iso-8859-2",
    "iso-8859-3", "iso-8859-4", "iso-8859-5", "iso-8859-6", "iso-8859-7", "iso-8859-8", "iso-8859-9",
    "iso-8859-10", "iso-8859-13", "iso-8859-14", "iso-8859-15", "iso-8859-16", "cp1250", "cp1251", "cp1252",
    "cp1253", "cp1254", "cp1255", "cp1256", "cp1257", "cp1258", "cp874", "koi8-r", "koi8-u", "mac-roman",
    "shift_jis", "cp932", "euc-jp", "iso-2022-jp", "gb2312", "gbk", "gb18030", "big5", "big5hkscs", "euc-kr",
    "cp949", "tis-620"))

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
    def __init__(self, deadline: float | None) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.title = ""
        self._in_title = False
        self.deadline = deadline

    def _on_time(self) -> None:
        # every token passes here, so the parser's slow paths (it rescans an unclosed "<a" to the end of
        # the text once per "<a" when closing: quadratic) stop within one rescan of the deadline
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeoutError("cleaning the page took too long")

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self._on_time()
        if tag in _SKIP:
            self.skip += 1
        if tag == "title":
            self._in_title = True
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        self._on_time()
        if tag in _SKIP and self.skip:
            self.skip -= 1
        if tag == "title":
            self._in_title = False
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        self._on_time()
        if self._in_title and not self.title:
            self.title = data.strip()
        if not self.skip:
            self.parts.append(data)


def html_to_text(markup: str, deadline: float | None = None) -> tuple[str, str]:
    """(title, text) of an HTML page: visible text, one block a line, runs of blanks collapsed. Only the
    first `MAX_HTML_CHARS` characters are parsed; past the monotonic `deadline` a TimeoutError."""
    parser = _TextExtractor(deadline)
    parser.feed(markup[:MAX_HTML_CHARS])
    parser.close()
    parser._on_time()
    lines = [re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in "".join(parser.parts).split("\n")]
    return parser.title, "\n".join(line for line in lines if line)


def decode_text(body: bytes, charset: str | None) -> str:
    """`body` as text in `charset` when it is a known text encoding (`TEXT_CHARSETS`), else as UTF-8;
    bytes that do not decode become U+FFFD. A page cannot pick a codec that is not a text encoding
    (punycode, idna, rot13, zlib: slow or not text at all)."""
    try:
        name = codecs.lookup(charset).name if charset else "utf-8"
    except (LookupError, TypeError, ValueError):
        name = "utf-8"
    return body.decode(name if name in TEXT_CHARSETS else "utf-8", errors="replace")


def fetch_url(url: str, timeout: float = 10.0, max_bytes: int = 2_000_000,
              headers: dict[str, str] | None = None, allow_private: bool = False) -> tuple[str, str]:
    """(title, text) of the page at `url` (search_r1.search.web_fetch: http/https only, a public address
    unless `allow_private`, redirects included, `headers` to the first origin only), fetched and cleaned
    within `timeout` seconds all told and read within `max_bytes` bytes; HTML is cleaned, other text
    types are kept as they are. Every failure is a FetchError."""
    deadline = time.monotonic() + timeout
    page = web_fetch.fetch(url, timeout, max_bytes, headers, allow_private, deadline=deadline)
    text = decode_text(page.body, page.charset)
    if page.content_type in ("text/html", "application/xhtml+xml"):
        try:
            return html_to_text(text, deadline)
        except TimeoutError:
            raise FetchError(f"the page at {url} could not be fetched: it took longer than {timeout} s to read "
                             "and clean") from None
    return "", text.strip()


__all__ = ["DEFAULT_PAGE_SIZE", "MAX_HTML_CHARS", "MAX_PAGE_SIZE", "TEXT_CHARSETS", "DocStore", "FetchError", "Page",
           "blocked_address", "decode_text", "fetch_url", "html_to_text", "paginate", "render_page"]
