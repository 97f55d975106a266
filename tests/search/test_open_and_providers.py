"""The `open` tool by URL (a local HTTP server: HTML cleaning, pages, time and size limits, non-text
pages) and the web providers (Serper, Tavily, a Jina-style reader) against scripted local servers
that speak each provider's request and response formats; API keys come from the environment and
never show in a tool message, an error or a log."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from search_r1.llm_agent import tool_backends
from search_r1.llm_agent.tool_backends import OpenTool, SerperSearchTool, TavilySearchTool, run_call
from search_r1.search import documents

KEY = "sk-test-SECRET-0123456789"
PAGE = ("<html><head><title>Berlin facts</title><style>p {color: red}</style><script>var x = 'hidden';</script>"
        "</head><body><nav>Home</nav><h1>Berlin</h1><p>Berlin is the capital of  Germany.</p>"
        "<p>It lies on the &amp; river Spree.</p><noscript>enable js</noscript></body></html>")


@contextmanager
def scripted_server(handle) -> Iterator[tuple[str, list[dict]]]:
    """A local HTTP server whose every request goes to `handle(method, path, headers, body) ->
    (status, content_type, bytes, delay_s)`; yields (base URL, the requests it saw)."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            seen.append({"method": method, "path": self.path, "headers": dict(self.headers),
                         "json": json.loads(body) if body else None})
            status, kind, payload, delay = handle(method, self.path, self.headers, body)
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if delay:
                self.wfile.write(payload[:10])
                self.wfile.flush()
                time.sleep(delay)
                payload = payload[10:]
            try:
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def do_GET(self) -> None:  # noqa: N802
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def web(method, path, headers, body):
    if path == "/page.html":
        return 200, "text/html; charset=utf-8", PAGE.encode(), 0
    if path == "/notes.txt":
        return 200, "text/plain", ("line %d\n" * 3 % (1, 2, 3)).encode(), 0
    if path == "/image.png":
        return 200, "image/png", b"\x89PNG" + b"\x00" * 100, 0
    if path == "/big.html":
        return 200, "text/html", b"<p>" + b"x" * 5000 + b"</p>", 0
    if path == "/slow.html":
        return 200, "text/html", b"<p>" + b"y" * 200 + b"</p>", 3
    return 404, "text/plain", b"not here", 0


def result(text: str) -> str:
    return json.loads(text)["result"]


def test_html_is_cleaned_to_visible_text():
    title, text = documents.html_to_text(PAGE)
    assert title == "Berlin facts"
    assert text == "Home\nBerlin\nBerlin is the capital of Germany.\nIt lies on the & river Spree."


def test_open_by_url_pages_the_cleaned_text_and_reports_limits():
    with scripted_server(web) as (base, _):
        tool = OpenTool("open", {"fetcher": "direct", "page_size": 40, "timeout": 1, "max_bytes": 1000,
                                 "allow_private_addresses": True})   # the scripted site is on 127.0.0.1
        text = documents.html_to_text(PAGE)[1]
        first = result(tool.call({"url": f"{base}/page.html"}))
        assert len(text) == 75
        assert first == f"Berlin facts\n[{base}/page.html, page 1 of 2 (open page 2 for more)]\n{text[:40]}"
        assert result(tool.call({"url": f"{base}/page.html", "page": 2})) == (
            f"Berlin facts\n[{base}/page.html, page 2 of 2]\n{text[40:]}")
        assert result(tool.call({"url": f"{base}/notes.txt"})).endswith("]\nline 1\nline 2\nline 3")
        for path, why in (("/image.png", "is image/png, not text"), ("/big.html", "larger than the 1000-byte limit"),
                          ("/slow.html", "could not be fetched"), ("/missing", "answered HTTP 404")):
            text_, ok = run_call(tool, {"url": f"{base}{path}"})
            assert not ok and why in result(text_), path
        text_, ok = run_call(tool, {"url": f"{base}/page.html", "page": 3})
        assert not ok and "page must be an integer in [1, 2]" in result(text_)
        text_, ok = run_call(tool, {"url": "file:///etc/passwd"})
        assert not ok and "only http:// and https:// URLs" in result(text_)
    by_id_only = OpenTool("open", {"retrieval_service_url": "http://127.0.0.1:1/retrieve"})
    assert result(run_call(by_id_only, {"url": "http://x"})[0]) == "Error: this open tool reads documents by 'doc_id' only"


def test_urls_on_private_or_local_addresses_are_refused():
    """A URL the model wrote cannot reach the cluster's own services (a loopback port, the cloud metadata
    address, a private network). Redirects, DNS rebinding and other address forms:
    test_fetcher_hostile.py."""
    tool = OpenTool("open", {"fetcher": "direct", "timeout": 1})
    for url, address in (("http://127.0.0.1:9/x", "127.0.0.1"), ("http://localhost:9/", "127.0.0.1"),
                         ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
                         ("http://10.1.2.3/", "10.1.2.3"), ("http://[::1]:9/", "::1")):
        text, ok = run_call(tool, {"url": url})
        assert not ok and f"is on a private or local address ({address})" in result(text), (url, text)
    assert documents.blocked_address("http://8.8.8.8/") is None


def test_slow_drip_page_is_cut_at_the_time_limit():
    def drip(method, path, headers, body):
        return 200, "text/html", b"<p>" + b"z" * 300_000 + b"</p>", 2

    with scripted_server(drip) as (base, _):
        start = time.monotonic()
        with pytest.raises(documents.FetchError):
            documents.fetch_url(f"{base}/x", timeout=1, max_bytes=1_000_000, allow_private=True)
        assert time.monotonic() - start < 2.9


def test_a_page_read_in_time_per_chunk_but_not_in_total_is_cut_at_the_deadline():
    """Each chunk comes within the socket timeout; the whole read does not come within `timeout`."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def drip() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1400000\r\n\r\n")
        try:
            for _ in range(20):
                conn.sendall(b"a" * 70000)
                time.sleep(0.4)
        except OSError:
            pass
        conn.close()

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(documents.FetchError, match="took longer than 1.5 s to read"):
        documents.fetch_url(f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout=1.5, max_bytes=2_000_000,
                            allow_private=True)
    assert time.monotonic() - start < 3.0
    listener.close()


def serper(method, path, headers, body):
    if headers.get("X-API-KEY") != KEY:
        return 403, "application/json", json.dumps({"message": f"bad key {headers.get('X-API-KEY')}"}).encode(), 0
    q = json.loads(body)["q"]
    organic = [{"title": f"{q} {i}", "link": f"https://ex.com/{i}", "snippet": f"about {q} #{i}", "position": i}
               for i in range(1, 6)]
    return 200, "application/json", json.dumps({"searchParameters": {"q": q}, "organic": organic}).encode(), 0


def tavily(method, path, headers, body):
    if headers.get("Authorization") != f"Bearer {KEY}":
        return 401, "application/json", json.dumps({"detail": {"error": f"Unauthorized: {headers.get('Authorization')}"}}).encode(), 0
    q = json.loads(body)["query"]
    results = [{"title": f"T{i}", "url": f"https://t.org/{i}", "content": f"{q} content {i}", "score": 0.9}
               for i in range(json.loads(body)["max_results"])]
    return 200, "application/json", json.dumps({"query": q, "results": results, "response_time": 0.1}).encode(), 0


def test_serper_requests_and_rendering(monkeypatch):
    monkeypatch.setenv("MY_SERPER", KEY)
    with scripted_server(serper) as (base, seen):
        tool = SerperSearchTool("web_search", {"base_url": base, "api_key_env": "MY_SERPER", "topk": 2})
        text = result(tool.call({"query_list": ["berlin", "rome"]}))
    assert [r["json"] for r in seen] == [{"q": "berlin", "num": 2}, {"q": "rome", "num": 2}]
    assert seen[0]["path"] == "/search" and seen[0]["headers"]["X-API-KEY"] == KEY
    assert text.split("\n---\n")[0] == ("Doc 1 (Title: berlin 1)\nabout berlin #1\nURL: https://ex.com/1\n\n"
                                        "Doc 2 (Title: berlin 2)\nabout berlin #2\nURL: https://ex.com/2")


def test_tavily_requests_and_rendering(monkeypatch):
    monkeypatch.setenv("TAVILY_API_KEY", KEY)
    with scripted_server(tavily) as (base, seen):
        tool = TavilySearchTool("web_search", {"base_url": base, "topk": 1})
        text = result(tool.call({"query": "paris"}))
    assert seen[0]["json"] == {"query": "paris", "max_results": 1, "search_depth": "basic"}
    assert text == "Doc 1 (Title: T0)\nparis content 0\nURL: https://t.org/0"


def test_jina_reader_fetch_sends_the_key_and_pages_its_text(monkeypatch):
    monkeypatch.setenv("JINA_API_KEY", KEY)

    def reader(method, path, headers, body):
        assert headers.get("Authorization") == f"Bearer {KEY}"
        return 200, "text/plain", f"Title: page\n\nMarkdown of {path[1:]}".encode(), 0

    with scripted_server(reader) as (base, seen):
        tool = OpenTool("open", {"fetcher": "jina", "reader_url": base, "page_size": 500})
        text = result(tool.call({"url": "https://example.com/a"}))
    assert seen[0]["path"] == "/https://example.com/a"
    assert text == ("[https://example.com/a, page 1 of 1]\nTitle: page\n\nMarkdown of https://example.com/a")


def test_api_keys_never_show_in_messages_errors_or_logs(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "sk-wrong-SECRET-999"
    with scripted_server(serper) as (s_base, _), scripted_server(tavily) as (t_base, _):
        for cls, base, env in ((SerperSearchTool, s_base, "SERPER_API_KEY"), (TavilySearchTool, t_base, "TAVILY_API_KEY")):
            monkeypatch.setenv(env, wrong)      # the servers echo a wrong key back in their error bodies
            text, ok = run_call(cls("web_search", {"base_url": base}), {"query_list": ["q"]})
            assert not ok and "HTTP 40" in text and wrong not in text and "***" in text
            monkeypatch.delenv(env)
            text, ok = run_call(cls("web_search", {"base_url": base}), {"query_list": ["q"]})
            assert not ok and result(text) == f"Error: the API key is not set (environment variable {env})"
            monkeypatch.setenv(env, KEY)
            text, ok = run_call(cls("web_search", {"base_url": base}), {"query_list": ["q"]})
            assert ok and KEY not in text
    dead = SerperSearchTool("web_search", {"base_url": "http://127.0.0.1:1", "timeout": 1})
    text, ok = run_call(dead, {"query_list": ["q"]})
    assert not ok and KEY not in text and "ConnectionError" in text
    assert KEY not in caplog.text and wrong not in caplog.text


def test_a_key_echoed_past_the_cut_or_in_a_success_answer_never_shows(monkeypatch):
    """An error body is redacted whole and then cut (cut first, a key straddling character 200 left its
    prefix), and a 200 that echoes the request is redacted too, for every provider."""
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    monkeypatch.setenv("TAVILY_API_KEY", KEY)
    monkeypatch.setenv("JINA_API_KEY", KEY)

    def echo(method, path, headers, body):
        if path.startswith("/bad"):   # the key starts at character 190 of the body: a 200-cut splits it
            return 401, "application/json", json.dumps({"error": "x" * 174 + f" key={KEY} rejected"}).encode(), 0
        seen_key = headers.get("X-API-KEY") or headers.get("Authorization")
        if path == "/search":
            hit = {"title": f"echo {seen_key}", "snippet": f"you sent {seen_key}", "link": "https://e.com",
                   "url": "https://e.com", "content": f"you sent {seen_key}"}
            return 200, "application/json", json.dumps({"organic": [hit], "results": [hit]}).encode(), 0
        # a reader that echoes its request headers: the key at characters 59-84, across the boundary of
        # 60-character pages (redacted, the text is 62 characters: two pages still)
        return 200, "text/plain", ("y" * 36 + f" Authorization: {seen_key}").encode(), 0

    with scripted_server(echo) as (base, _):
        for cls in (SerperSearchTool, TavilySearchTool):
            text, ok = run_call(cls("web_search", {"base_url": f"{base}/bad"}), {"query_list": ["q"]})
            assert not ok and "SECRET" not in text and "sk-test" not in text and "key=***" in text, text
            text, ok = run_call(cls("web_search", {"base_url": base}), {"query_list": ["q"]})
            assert ok and "SECRET" not in text and "you sent " in text, text
        reader = OpenTool("open", {"fetcher": "jina", "reader_url": base, "page_size": 60})
        pages = [result(reader.call({"url": "https://example.com/a", "page": n})) for n in (1, 2)]
    assert all("SECRET" not in page and "sk-test" not in page for page in pages), pages
    assert "".join(page.split("\n", 1)[1] for page in pages).endswith("Authorization: Bearer ***")


def test_the_reader_key_does_not_follow_a_redirect_to_another_host(monkeypatch):
    """urllib forwarded `Authorization` to wherever the reader redirected."""
    monkeypatch.setenv("JINA_API_KEY", KEY)
    with scripted_server(lambda m, p, h, b: (200, "text/plain", f"page {h.get('Authorization')}".encode(), 0)
                         ) as (elsewhere, elsewhere_seen):
        class Redirect(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(302)
                self.send_header("Location", elsewhere.replace("127.0.0.1", "localhost") + "/landing")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        reader = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
        threading.Thread(target=reader.serve_forever, daemon=True).start()
        try:
            tool = OpenTool("open", {"fetcher": "jina", "reader_url": f"http://127.0.0.1:{reader.server_address[1]}"})
            text = result(tool.call({"url": "https://example.com/a"}))
        finally:
            reader.shutdown()
            reader.server_close()
    assert elsewhere_seen[0]["path"] == "/landing" and "Authorization" not in elsewhere_seen[0]["headers"]
    assert text.endswith("page None")


def test_provider_config_keys_are_checked():
    with pytest.raises(ValueError, match=r"w\.config: unknown keys \['api_key'\]"):
        tool_backends.check_config("search_r1.llm_agent.tool_backends.SerperSearchTool", {"api_key": KEY}, "w")
    with pytest.raises(ValueError, match=r"w\.config\.fetcher: one of"):
        tool_backends.check_config("search_r1.llm_agent.tool_backends.OpenTool", {"fetcher": "curl"}, "w")
