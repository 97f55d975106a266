"""Wire types of the retrieval HTTP API (DESIGN §3.1), shared by every search server.

The request/response shapes are fixed by the original Search-R1 clients:

    POST /retrieve  {"queries": [str, ...], "topk": int?, "return_scores": bool?}
    ->              {"result": [[hit, ...], ...]}

With ``return_scores`` a hit is ``{"document": {"id", "contents"}, "score"}``; without
it a hit is the document object itself. ``contents`` is ``"\\"Title\\"\\nbody"``.

Request validation against a server's limits lives here (``validate_request``) so the
retrieval, rerank and online-search servers reject bad input the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict


class Document(BaseModel):
    """A corpus passage as it travels over HTTP."""

    model_config = ConfigDict(extra="allow")

    id: str
    contents: str


class ScoredHit(BaseModel):
    """A hit when the client asked for scores."""

    document: Document
    score: float


class RetrieveRequest(BaseModel):
    """Body of POST /retrieve.

    Types are checked loosely here (``queries`` is ``list[Any]``) on purpose: a wrong
    element type must produce *our* 4xx message naming the offending index, which
    ``validate_request`` does; pydantic's own coercion would e.g. accept numbers.
    """

    queries: list[Any]
    topk: int | None = None
    return_scores: bool = False


class OpenRequest(BaseModel):
    """Body of POST /open: one passage by its id, one page of `page_size` characters (pages from 1)."""

    doc_id: str
    page: int = 1
    page_size: int = 2000


class RetrieveResponse(BaseModel):
    """Body of the answer: one list per query, in query order, best hit first."""

    result: list[list[ScoredHit]] | list[list[Document]]


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of a server; anything beyond answers 4xx, except a long query.

    A query longer than ``max_query_chars`` is cut to that many characters, not refused: one
    over-long query (a model that rambles inside ``<search>``) must not fail the whole
    batch of a turn. The request as a whole stays bounded by ``max_body_bytes``.
    """

    # The original Search-R1 trainer POSTs all of a turn's queries at once: its GRPO recipe
    # (train_batch_size 512 x n_agent 5) sends up to 2,560. 4,096 also serves 512 prompts x 8.
    max_queries_per_request: int = 4096
    max_query_chars: int = 2048
    max_topk: int = 100
    # 4,096 queries of 2,048 ASCII characters (a query's longest useful length, the cut above) are
    # 8.4 MB of JSON; twice that. A real turn (2,560 queries of ~100 characters) is about 0.3 MB.
    max_body_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_queries_per_request", "max_query_chars", "max_topk", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerLimits.{name} must be >= 1, got {getattr(self, name)}")


# At most this many characters of a client's value go back in an error message (the rest is counted):
# a 15 MB unknown doc_id echoed whole made a 37.5 MB 404, and 20 at once added 625 MB to the server.
MAX_ECHO_CHARS = 200


def quote_id(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``value`` quoted for an error message, cut to ``limit`` characters:
    ``'abc'``, or ``'abcd...' (1048576 characters)`` when it is longer."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


class RequestError(ValueError):
    """A request the server refuses; ``status_code`` is the HTTP status to answer with."""

    def __init__(self, message: str, status_code: int = 422) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed ``validate_request``: topk resolved, queries known to be strings."""

    queries: list[str]
    topk: int
    return_scores: bool
    truncated: int = 0  # how many queries were cut to ``ServerLimits.max_query_chars``


def validate_request(request: RetrieveRequest, limits: ServerLimits, default_topk: int) -> ValidRequest:
    """Check ``request`` against ``limits``; raise ``RequestError`` naming the bad field.

    ``default_topk`` is used when the request leaves ``topk`` out (the server's --topk).
    A query over ``limits.max_query_chars`` is cut to that many characters (counted in
    ``ValidRequest.truncated``).
    """
    queries = request.queries
    if len(queries) == 0:
        raise RequestError("field 'queries' must be a non-empty list of strings")
    if len(queries) > limits.max_queries_per_request:
        raise RequestError(
            f"field 'queries' has {len(queries)} entries; this server accepts at most "
            f"{limits.max_queries_per_request} per request",
            status_code=413,
        )
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise RequestError(f"queries[{i}] must be a string, got {type(query).__name__}")
    cut = limits.max_query_chars
    truncated = sum(len(q) > cut for q in queries)
    topk = default_topk if request.topk is None else request.topk
    if topk < 1:
        raise RequestError(f"field 'topk' must be >= 1, got {topk}")
    if topk > limits.max_topk:
        raise RequestError(f"field 'topk' is {topk}; this server's cap is {limits.max_topk}")
    return ValidRequest(queries=[q[:cut] for q in queries], topk=topk, return_scores=request.return_scores,
                        truncated=truncated)


@dataclass(frozen=True)
class Hit:
    """One retrieved passage, with the title split out for rendering observations."""

    doc_id: str
    title: str
    text: str
    contents: str
    score: float

    @classmethod
    def from_contents(cls, doc_id: str, contents: str, score: float) -> Hit:
        """Split ``"\\"Title\\"\\nbody"``; a passage without a title line gets title ''."""
        first, sep, rest = contents.partition("\n")
        if sep and len(first) >= 2 and first.startswith('"') and first.endswith('"'):
            return cls(doc_id=doc_id, title=first[1:-1], text=rest, contents=contents, score=float(score))
        if sep:
            # Some corpora carry an unquoted title line; keep it as the title.
            return cls(doc_id=doc_id, title=first.strip('"'), text=rest, contents=contents, score=float(score))
        return cls(doc_id=doc_id, title="", text=contents, contents=contents, score=float(score))

    def to_document(self) -> Document:
        return Document(id=self.doc_id, contents=self.contents)

    def to_wire(self, return_scores: bool) -> dict[str, Any]:
        """The JSON shape of this hit in a /retrieve answer."""
        document = {"id": self.doc_id, "contents": self.contents}
        if return_scores:
            return {"document": document, "score": self.score}
        return document

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Hit:
        """Parse either wire shape (scored or bare document) back into a Hit."""
        if "document" in obj:
            doc = obj["document"]
            score = float(obj.get("score", 0.0))
        else:
            doc, score = obj, 0.0
        if "contents" not in doc:
            raise ValueError(f"hit has no 'contents' field: keys {sorted(doc)}")
        return cls.from_contents(str(doc.get("id", "")), doc["contents"], score)
